"""Where each ring rank's tokens sit, as position ranges ("pieces"), and the document-aware ``balanced`` layout.

Causal attention inside packed documents costs, per query token at position ``p`` of a document starting at
``s``, ``w(p) = p - s + 1`` (query, key) pairs. A ring rank's attention work is the sum of ``w`` over the
queries it holds, whatever the ring does with the keys, so balancing work is placing tokens so that every ring
rank holds ``P = S / R`` tokens and ``W / R`` of the total ``W = sum_i d_i (d_i + 1) / 2``.

``balanced`` does that with few cuts:

1. A document of length ``d`` has mean weight ``rho = (d + 1) / 2``; call it *light* when ``rho`` is below
   the row's mean ``W / S`` (short documents) and *heavy* otherwise (long ones).
2. Each document is consumed from the outside in, as zigzag consumes a sequence: a slice of ``2m`` tokens is a
   head piece of ``m`` tokens and the matching tail piece of ``m``; its work is exactly ``2m * rho``. Light
   documents form one stream (shortest first), heavy ones another (longest first). The balance holds for any
   order; sorted streams give each rank documents of similar lengths, which measured faster kernels than
   position order (log-normal row at ring 4: slowest rank 99 ms sorted vs 119 ms in position order, on CPU).
3. Ring rank ``k`` takes the next slice of each stream, sized so its ``P`` tokens carry exactly ``W / R``
   work: cumulatively, ``L_k + H_k = k P`` tokens and ``F_light(L_k) + F_heavy(H_k) = k W / R``. The light
   stream is below the mean and the heavy one above, so the excess ``rho_mean L - F_light(L)`` and
   ``F_heavy(H) - rho_mean H`` both rise monotonically and the cut points are where they meet; they come from
   one interpolation over the documents' breakpoints (vectorized, no loop over documents).

So most short documents stay whole on one rank (at most two documents per rank boundary are cut), long ones are
cut into nested head/tail pieces spread over consecutive ranks, no padding is added, and with one document
(no boundaries) the pieces are exactly zigzag's chunks ``r`` and ``2R-1-r``. The work of every rank is
``W / R`` up to the rounding of a cut point to a whole token (one token's weight, at most the longest
document's length).

Nesting matters for the ring: a rank holds at most one head and one tail piece of each document, and the
pieces of the ranks sharing a document nest (outer ranks hold the outer pieces), so for any two ranks the
(query, key) pairs of one document form a single rectangle (see :mod:`usp.attention.blocks`).
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch


def _as_boundaries(seq_len: int, cu_seqlens: torch.Tensor | np.ndarray | None) -> np.ndarray:
    if cu_seqlens is None:
        return np.array([0, seq_len], dtype=np.int64)
    cu = np.asarray(cu_seqlens.detach().cpu() if isinstance(cu_seqlens, torch.Tensor) else cu_seqlens)
    return cu.astype(np.int64, copy=False)


def check_boundaries(
    cu_seqlens: torch.Tensor | np.ndarray, seq_len: int, setting: str = "cu_seqlens"
) -> np.ndarray:
    """``cu_seqlens`` as int64 numpy, or ``ValueError`` if it is not ``0 .. seq_len`` and non-decreasing."""
    cu = _as_boundaries(seq_len, cu_seqlens)
    if cu.ndim != 1 or cu.size < 2 or not np.issubdtype(cu.dtype, np.integer):
        raise ValueError(
            f"{setting} must be a 1-D integer tensor [num_docs + 1] of document boundaries, got {cu.dtype} {cu.shape}."
        )
    if cu[0] != 0 or cu[-1] != seq_len or bool((cu[1:] < cu[:-1]).any()):
        head = cu[:8].tolist()
        raise ValueError(
            f"{setting} must rise from 0 to the GLOBAL sequence length {seq_len} and cover the whole row, got "
            f"{head}{'...' if cu.size > 8 else ''} ending at {int(cu[-1])}; pass the boundaries of the whole packed "
            "row (identical on every rank), not this rank's slice."
        )
    return cu


def _zigzag_pieces(seq_len: int, ring_degree: int) -> list[np.ndarray]:
    c = seq_len // (2 * ring_degree)
    return [
        np.array(
            [[r * c, (r + 1) * c], [(2 * ring_degree - 1 - r) * c, (2 * ring_degree - r) * c]], dtype=np.int64
        )
        for r in range(ring_degree)
    ]


def _inverse(e: np.ndarray, knots_e: np.ndarray, knots_x: np.ndarray) -> np.ndarray:
    """``x`` at excess ``e`` on a nondecreasing piecewise-linear excess curve (leftmost ``x`` on flat parts)."""
    i = np.clip(np.searchsorted(knots_e, e, side="left"), 1, len(knots_e) - 1)
    e0, e1 = knots_e[i - 1], knots_e[i]
    x0, x1 = knots_x[i - 1], knots_x[i]
    span = e1 - e0
    frac = np.where(span > 0, (e - e0) / np.where(span > 0, span, 1.0), 0.0)
    return np.where(e <= knots_e[0], knots_x[0], x0 + np.clip(frac, 0.0, 1.0) * (x1 - x0))


def _stream_pieces(
    starts: np.ndarray, lengths: np.ndarray, order: np.ndarray, cuts: np.ndarray, split: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Pieces (rank, start, end: int64 arrays) of the ``split`` documents of a stream (documents ``order``, in
    stream order) cut at ``cuts`` (``R + 1`` stream offsets, ``0 .. total``, delimiting each rank's slice).

    A slice ``[a, b)`` of a document (document-relative stream offsets) is its head ``[ceil(a/2), ceil(b/2))``
    and tail ``[d - floor(b/2), d - floor(a/2))``, one piece when they touch (the innermost slice).
    """
    prefix = np.concatenate([[0], np.cumsum(lengths[order])])
    cut_docs = np.flatnonzero(split[order])  # stream positions of the documents a cut falls inside
    if cut_docs.size == 0:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty
    lo_doc, hi_doc = prefix[cut_docs], prefix[cut_docs + 1]
    inner = cuts[(cuts > lo_doc.min()) & (cuts < hi_doc.max())]
    bounds = np.union1d(np.concatenate([lo_doc, hi_doc]), inner)
    lo, hi = bounds[:-1], bounds[1:]
    at = np.searchsorted(prefix, lo, side="right") - 1
    keep = split[order][at]  # slices of the cut documents only (not the whole ones in between)
    lo, hi, at = lo[keep], hi[keep], at[keep]
    rank = np.searchsorted(cuts, lo, side="right") - 1
    doc = order[at]
    a, b = lo - prefix[at], hi - prefix[at]
    d, s = lengths[doc], starts[doc]
    h0, h1 = s + (a + 1) // 2, s + (b + 1) // 2
    t0, t1 = s + d - b // 2, s + d - a // 2
    touch = h1 == t0  # head and tail meet: one piece
    tail = ~touch & (t1 > t0)
    return (
        np.concatenate([rank, rank[tail]]),
        np.concatenate([h0, t0[tail]]),
        np.concatenate([np.where(touch, t1, h1), t1[tail]]),
    )


def _doc_ranks(lengths: np.ndarray, order: np.ndarray, cuts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For a stream (documents ``order``, in stream order) cut at ``cuts``: each document's rank (the one holding
    its first token) and whether a cut falls inside it, both indexed by document (scattered back)."""
    prefix = np.cumsum(lengths[order])
    first = np.searchsorted(cuts, prefix - lengths[order], side="right") - 1
    last = np.searchsorted(cuts, prefix - 1, side="right") - 1
    rank = np.empty(len(lengths), dtype=np.int64)
    split = np.zeros(len(lengths), dtype=bool)
    rank[order], split[order] = first, last != first
    return rank, split


def _group(rank: np.ndarray, start: np.ndarray, end: np.ndarray, ring_degree: int) -> list[np.ndarray]:
    """Per rank, its pieces (given sorted by start), adjacent ones merged: ``[n_r, 2]`` each."""
    order = np.argsort(rank.astype(np.int16), kind="stable")  # a radix sort: keeps the start order per rank
    rank, start, end = rank[order], start[order], end[order]
    new = np.ones(len(rank), dtype=bool)
    new[1:] = (rank[1:] != rank[:-1]) | (start[1:] != end[:-1])
    first = np.flatnonzero(new)
    last = np.append(first[1:], len(rank)) - 1
    merged = np.stack([start[first], end[last]], axis=1)
    split = np.searchsorted(rank[first], np.arange(ring_degree + 1))
    return [merged[split[r] : split[r + 1]] for r in range(ring_degree)]


def balanced_cuts(
    lengths: np.ndarray, ring_degree: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The light and heavy streams (document indices, in stream order) and their ``R + 1`` cut offsets.

    See the module docstring; ``lengths`` are the (positive) document lengths of one row.
    """
    seq_len = int(lengths.sum())
    part = seq_len // ring_degree
    work = lengths * (lengths + 1) // 2
    total = int(work.sum())
    by_length = np.argsort(lengths)
    is_light = (lengths[by_length] + 1) * seq_len < 2 * total
    light, heavy = by_length[is_light], by_length[~is_light][::-1]  # shortest first / longest first
    mean = total / seq_len

    def knots(order: np.ndarray, sign: float) -> tuple[np.ndarray, np.ndarray]:
        tok = np.concatenate([[0], np.cumsum(lengths[order])]).astype(np.float64)
        wrk = np.concatenate([[0], np.cumsum(work[order])]).astype(np.float64)
        return np.maximum.accumulate(sign * (mean * tok - wrk)), tok  # excess, rounding-safe nondecreasing

    e_light, x_light = knots(light, 1.0)
    e_heavy, x_heavy = knots(heavy, -1.0)
    # vertices of the path (L, H) along which the two excesses are equal: both knot lists are sorted by excess,
    # so merging them (no sort) orders the vertices along the path, which rises in both L and H
    at_light = np.searchsorted(e_heavy, e_light, side="left") + np.arange(len(e_light))
    at_heavy = np.searchsorted(e_light, e_heavy, side="right") + np.arange(len(e_heavy))
    lv = np.empty(len(e_light) + len(e_heavy))
    hv = np.empty_like(lv)
    lv[at_light], hv[at_light] = x_light, _inverse(e_light, e_heavy, x_heavy)
    lv[at_heavy], hv[at_heavy] = _inverse(e_heavy, e_light, x_light), x_heavy
    lv, hv = np.maximum.accumulate(lv), np.maximum.accumulate(hv)
    tokens = lv + hv
    targets = part * np.arange(1, ring_degree, dtype=np.float64)
    cut_l = np.rint(np.interp(targets, tokens, lv)).astype(np.int64)
    n_light, n_heavy = int(x_light[-1]), int(x_heavy[-1])
    cut_l = np.clip(
        cut_l,
        np.maximum(0, targets.astype(np.int64) - n_heavy),
        np.minimum(targets.astype(np.int64), n_light),
    )
    cut_l = np.maximum.accumulate(cut_l)
    cuts_light = np.concatenate([[0], cut_l, [n_light]])
    cuts_heavy = np.concatenate([[0], targets.astype(np.int64) - cut_l, [n_heavy]])
    return light, heavy, cuts_light, cuts_heavy


def balanced_placement(seq_len: int, ring_degree: int, cu: np.ndarray) -> list[np.ndarray]:
    """Per ring rank, the pieces ``[n_r, 2]`` of the ``balanced`` layout for boundaries ``cu`` (int64, valid);
    uncached (:func:`ring_pieces` caches)."""
    starts, lengths = cu[:-1], np.diff(cu)
    keep = lengths > 0
    starts, lengths = starts[keep], lengths[keep]
    if lengths.size <= 1:
        return _zigzag_pieces(seq_len, ring_degree)
    light, heavy, cuts_light, cuts_heavy = balanced_cuts(lengths, ring_degree)
    # most documents sit whole on one rank: those are kept in position order without any sort; only the few
    # a cut falls inside (at most two per rank boundary, plus long documents spread over ranks) are sliced
    rank = np.empty(len(lengths), dtype=np.int64)
    split = np.empty(len(lengths), dtype=bool)
    for order, cuts in ((light, cuts_light), (heavy, cuts_heavy)):
        r, sp = _doc_ranks(lengths, order, cuts)
        rank[order], split[order] = r[order], sp[order]
    whole = ~split
    r, a, b = rank[whole], starts[whole], starts[whole] + lengths[whole]  # in position order
    cut = [
        _stream_pieces(starts, lengths, o, c, split) for o, c in ((light, cuts_light), (heavy, cuts_heavy))
    ]
    cr, ca, cb = (np.concatenate(x) for x in zip(*cut))
    nonempty = cb > ca
    cr, ca, cb = cr[nonempty], ca[nonempty], cb[nonempty]
    few = np.argsort(ca)  # the cut documents' pieces: a few per rank boundary
    at = np.searchsorted(a, ca[few])  # merged into the whole documents' position order
    r, a, b = np.insert(r, at, cr[few]), np.insert(a, at, ca[few]), np.insert(b, at, cb[few])
    out = _group(r, a, b, ring_degree)
    part = seq_len // ring_degree
    assert all(int((p[:, 1] - p[:, 0]).sum()) == part for p in out), "every ring rank holds S / R tokens"
    return out


@lru_cache(maxsize=8)
def _balanced_cached(seq_len: int, ring_degree: int, cu_bytes: bytes) -> tuple[np.ndarray, ...]:
    cu = np.frombuffer(cu_bytes, dtype=np.int64)
    return tuple(balanced_placement(seq_len, ring_degree, cu))


def ring_pieces(
    seq_len: int, ring_degree: int, ring_layout: str, cu_seqlens: torch.Tensor | np.ndarray | None = None
) -> list[np.ndarray]:
    """Per ring rank, the position ranges ``[n_r, 2]`` (start, end; int64, sorted, disjoint) of its part.

    ``zigzag`` and ``contiguous`` ignore ``cu_seqlens``; ``balanced`` places tokens from them (zigzag without
    them). The caller validates ``seq_len`` against the layout and ``cu_seqlens`` (see :func:`check_boundaries`).
    """
    if ring_layout == "contiguous":
        p = seq_len // ring_degree
        return [np.array([[r * p, (r + 1) * p]], dtype=np.int64) for r in range(ring_degree)]
    if ring_layout == "zigzag" or cu_seqlens is None or ring_degree == 1:
        if ring_degree == 1:
            return [np.array([[0, seq_len]], dtype=np.int64)]
        return _zigzag_pieces(seq_len, ring_degree)
    assert ring_layout == "balanced", ring_layout
    cu = np.ascontiguousarray(_as_boundaries(seq_len, cu_seqlens), dtype=np.int64)
    return list(_balanced_cached(seq_len, ring_degree, cu.tobytes()))


def pieces_to_positions(pieces: np.ndarray) -> np.ndarray:
    """Concatenated ``arange(start, end)`` of every piece (int64)."""
    lengths = pieces[:, 1] - pieces[:, 0]
    offsets = np.repeat(pieces[:, 0] - (np.cumsum(lengths) - lengths), lengths)
    return np.arange(int(lengths.sum()), dtype=np.int64) + offsets


def causal_pairs_below(x: np.ndarray, cu: np.ndarray) -> np.ndarray:
    """``C(x) = sum_{p < x} w(p)``: causal in-document (query, key) pairs of the queries before position ``x``."""
    lengths = np.diff(cu)
    done = np.concatenate([[0], np.cumsum(lengths * (lengths + 1) // 2)])
    doc = np.clip(np.searchsorted(cu, x, side="right") - 1, 0, len(lengths) - 1)
    t = x - cu[doc]
    return done[doc] + t * (t + 1) // 2


def ring_rank_pairs(
    seq_len: int, ring_degree: int, ring_layout: str, cu_seqlens: torch.Tensor | np.ndarray | None = None
) -> list[int]:
    """Exact causal in-document (query, key) pairs each ring rank computes (per head and batch row).

    Closed form over the pieces, ``O(pieces)``: equal to what the ring's block plans count, for any layout.
    """
    cu = _as_boundaries(seq_len, cu_seqlens)
    out = []
    for pieces in ring_pieces(seq_len, ring_degree, ring_layout, cu_seqlens):
        out.append(int((causal_pairs_below(pieces[:, 1], cu) - causal_pairs_below(pieces[:, 0], cu)).sum()))
    return out
