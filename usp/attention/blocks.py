"""Which part of each ring block is computed: layout rules for causal skipping, and document segments.

After the Ulysses all-to-all, ring rank ``r`` holds its whole *part* of the sequence (``L = S / R`` tokens):
``contiguous``: positions ``[r*L, (r+1)*L)``; ``zigzag``: chunks ``r`` and ``2R-1-r`` of ``c = L / 2`` tokens.
At ring step ``t`` it holds the K/V part of ring rank ``src = (r - t) mod R``. The block (queries of ``r``,
keys of ``src``) is reduced to the rectangle that can attend at all:

- non-causal: the whole block;
- causal, ``src == r`` (step 0): the diagonal block, causal (local order is increasing in position);
- causal contiguous: ``src < r`` whole block, ``src > r`` skipped;
- causal zigzag: ``src < r`` -> the *first half of K/V only* (chunk ``src``; chunk ``2R-1-src`` is in the
  future of both query chunks); ``src > r`` -> the *second half of Q only* (chunk ``2R-1-r`` sees both key
  chunks, chunk ``r`` sees neither). Every rank does the same work: balanced.

With document boundaries ``cu_seqlens`` the rectangle is further cut into per-document *segments*
(``(q0, q1, k0, k1)`` rows, see :mod:`usp.attention.kernels`): a block sharing no document is skipped, and a
block that is one document throughout needs no mask at all.

``balanced`` (placed from ``cu_seqlens``, :mod:`usp.parallel.balance`) has no fixed rule: each block is planned
from the positions themselves. Step 0 is the causal diagonal cut into documents, as above. Off the diagonal,
for each document both ranks hold, the rows that attend are the queries after the first key and the keys
attended are those before the last query; the layout nests the pieces of a shared document, so those rows and
keys form one full rectangle (checked), and the rectangles of successive documents rise in rows and keys.

A *shared prefix* (``shared_prefix[d] = n > 0``: document ``d`` also attends, fully, to the first ``n`` tokens of
document ``d - 1``; DPO's shared prompt, :mod:`usp.data.pack_preference`) adds one more block per step
(:func:`plan_prefix_blocks`): the rows of each linked document held by the queries' part against the prefix keys
held by the keys' part. Every prefix key precedes every row of its document, so each piece is one full
rectangle whatever the layout; the pieces of successive documents rise in rows and keys, so they form an
ordinary non-causal segment list. The ring computes it beside the document block of the same step and merges
both by their ``lse`` (a step's entry is then a tuple of blocks, :func:`step_blocks`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from usp.attention.masks import RowRanges
from usp.parallel import local_token_indices


@dataclass(frozen=True)
class BlockSpec:
    """The computed rectangle of one ring block: rows ``[q_start, q_end)`` x keys ``[k_start, k_end)``."""

    q_start: int
    q_end: int
    k_start: int
    k_end: int
    causal: bool
    segments: torch.Tensor | RowRanges | None = None
    """int64 ``[n, 4]`` document segments on the CPU, relative to the rectangle, or a banded
    :class:`~usp.attention.masks.RowRanges` (windows, chunks); None = no mask."""
    softcap: float | None = None
    """Attention logit softcapping ``c * tanh(s / c)`` of the block's scores (Gemma 2), or None."""

    @property
    def q_slice(self) -> slice:
        return slice(self.q_start, self.q_end)

    @property
    def k_slice(self) -> slice:
        return slice(self.k_start, self.k_end)

    def pairs(self) -> int:
        """(query, key) pairs that attend in this block (per batch row and head)."""
        if isinstance(self.segments, RowRanges):
            return self.segments.pairs()
        if self.segments is None:
            sq, sk = self.q_end - self.q_start, self.k_end - self.k_start
            return sq * (sq + 1) // 2 if self.causal else sq * sk
        rows = self.segments.tolist()  # host ints: no tensor op per block (and none a fake-tensor mode sees)
        if self.causal:
            return sum((q1 - q0) * (q1 - q0 + 1) // 2 for q0, q1, _, _ in rows)
        return sum((q1 - q0) * (k1 - k0) for q0, q1, k0, k1 in rows)


def part_positions(
    seq_len: int, ring_degree: int, ring_rank: int, layout: str, cu_seqlens: torch.Tensor | None = None
) -> torch.Tensor:
    """Global positions (int64 ``[S / R]``) of the part ring rank ``ring_rank`` holds after the all-to-all."""
    return local_token_indices(seq_len, ring_degree, 1, ring_rank, 0, layout, cu_seqlens, checked=True)


def _layout_block(rank: int, src: int, part_len: int, layout: str, causal: bool) -> BlockSpec | None:
    if not causal:
        return BlockSpec(0, part_len, 0, part_len, False)
    if src == rank:
        return BlockSpec(0, part_len, 0, part_len, True)
    if layout == "contiguous":
        return BlockSpec(0, part_len, 0, part_len, False) if src < rank else None
    assert layout == "zigzag", layout
    half = part_len // 2
    if src < rank:
        return BlockSpec(0, part_len, 0, half, False)  # first half of K/V only
    return BlockSpec(half, part_len, 0, part_len, False)  # second half of Q only


def _document_block(
    block: BlockSpec, q_pos: torch.Tensor, k_pos: torch.Tensor, cu_seqlens: torch.Tensor
) -> BlockSpec | None:
    """Cut ``block`` into per-document segments; None when no query and key share a document."""
    q_pos = q_pos[block.q_slice]
    k_pos = k_pos[block.k_slice]
    q_doc = torch.searchsorted(cu_seqlens, q_pos, right=True) - 1  # sorted, since positions are
    k_doc = torch.searchsorted(cu_seqlens, k_pos, right=True) - 1
    docs = torch.unique_consecutive(q_doc)
    docs = docs[torch.isin(docs, k_doc)]
    if docs.numel() == 0:
        return None
    seg = torch.stack(
        [
            torch.searchsorted(q_doc, docs),
            torch.searchsorted(q_doc, docs, right=True),
            torch.searchsorted(k_doc, docs),
            torch.searchsorted(k_doc, docs, right=True),
        ],
        dim=1,
    )  # [n, 4] (q0, q1, k0, k1)
    if block.causal:
        assert torch.equal(seg[:, :2], seg[:, 2:]), "a causal block has the same positions for q and k"
    q_off, k_off = int(seg[0, 0]), int(seg[0, 2])
    q_end, k_end = int(seg[-1, 1]), int(seg[-1, 3])
    seg = seg - torch.tensor([q_off, q_off, k_off, k_off])
    one_doc = seg.size(0) == 1
    return BlockSpec(
        block.q_start + q_off,
        block.q_start + q_end,
        block.k_start + k_off,
        block.k_start + k_end,
        block.causal,
        None if one_doc else seg,
    )


@lru_cache(maxsize=4)
def _balanced_parts(seq_len: int, ring_degree: int, cu_bytes: bytes) -> tuple[torch.Tensor, ...]:
    """Every ring rank's part positions under ``balanced`` (planning one rank's blocks needs all of them)."""
    cu = torch.from_numpy(np.frombuffer(cu_bytes, dtype=np.int64).copy())
    return tuple(part_positions(seq_len, ring_degree, r, "balanced", cu) for r in range(ring_degree))


def _placed_block(
    q_pos: torch.Tensor, k_pos: torch.Tensor, cu_seqlens: torch.Tensor, diagonal: bool, causal: bool
) -> BlockSpec | None:
    """The block of a position-placed layout (``balanced``): per shared document one rectangle (see above)."""
    n_q, n_k = q_pos.numel(), k_pos.numel()
    if diagonal or not causal:
        return _document_block(BlockSpec(0, n_q, 0, n_k, causal and diagonal), q_pos, k_pos, cu_seqlens)
    q_doc = torch.searchsorted(cu_seqlens, q_pos, right=True) - 1
    k_doc = torch.searchsorted(cu_seqlens, k_pos, right=True) - 1
    docs = torch.unique_consecutive(q_doc)
    docs = docs[torch.isin(docs, k_doc)]
    if docs.numel() == 0:
        return None
    q_end = torch.searchsorted(q_doc, docs, right=True)
    k0 = torch.searchsorted(k_doc, docs)
    k_end = torch.searchsorted(k_doc, docs, right=True)
    q0 = torch.maximum(torch.searchsorted(q_doc, docs), torch.searchsorted(q_pos, k_pos[k0], right=True))
    k1 = torch.minimum(k_end, torch.searchsorted(k_pos, q_pos[q_end - 1]))  # keys before the last query
    keep = (q0 < q_end) & (k0 < k1)
    if not bool(keep.any()):
        return None
    seg = torch.stack([q0, q_end, k0, k1], dim=1)[keep]  # [n, 4] (q0, q1, k0, k1)
    assert bool((k_pos[seg[:, 3] - 1] < q_pos[seg[:, 0]]).all()), "pieces of a shared document must nest"
    q_off, k_off = int(seg[0, 0]), int(seg[0, 2])
    q_last, k_last = int(seg[-1, 1]), int(seg[-1, 3])
    seg = seg - torch.tensor([q_off, q_off, k_off, k_off])
    return BlockSpec(q_off, q_last, k_off, k_last, False, None if seg.size(0) == 1 else seg)


def _banded_block(
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    cu_seqlens: torch.Tensor | None,
    window: int | None,
    chunk: int | None,
) -> BlockSpec | None:
    """The block of queries at global positions ``q_pos`` over keys at ``k_pos`` (both rising) under causal
    attention limited to a sliding ``window`` (``q - k < window``, transformers' rule), to the query's
    ``chunk`` (``chunk`` tokens from its document's start) and to its document: one key range per row. ``None`` when no pair
    attends (the ring computes nothing for it); else the rectangle of rows and keys that attend, with its
    :class:`RowRanges` (no mask when every row sees the whole rectangle)."""
    start = torch.zeros_like(q_pos)  # the query's document start
    if cu_seqlens is not None:
        start = cu_seqlens[torch.searchsorted(cu_seqlens, q_pos, right=True) - 1]
    lo_pos = start
    if window is not None:
        lo_pos = torch.maximum(lo_pos, q_pos - window + 1)
    if chunk is not None:  # chunks count from the document's start, as transformers' packed-sequence masks do
        lo_pos = torch.maximum(lo_pos, start + (q_pos - start) // chunk * chunk)
    lo = torch.searchsorted(k_pos, lo_pos)  # first key at or after the earliest allowed position
    hi = torch.searchsorted(k_pos, q_pos, right=True)  # keys up to the query itself
    rows = torch.nonzero(hi > lo).flatten()
    if rows.numel() == 0:
        return None
    q0, q1 = int(rows[0]), int(rows[-1]) + 1
    lo, hi = lo[q0:q1], hi[q0:q1]
    k0, k1 = int(lo[hi > lo].min()), int(hi.max())
    lo, hi = (lo - k0).clamp(min=0), (hi - k0).clamp(min=0)
    full = bool(((lo == 0) & (hi == k1 - k0)).all())
    return BlockSpec(q0, q1, k0, k1, False, None if full else RowRanges.build(lo, hi))


def plan_banded_blocks(
    seq_len: int,
    ring_degree: int,
    ring_rank: int,
    layout: str,
    cu_seqlens: torch.Tensor | None,
    window: int | None,
    chunk: int | None,
) -> list[BlockSpec | None]:
    """:func:`plan_ring_blocks` for causal attention under a sliding window and/or chunks: every block is cut
    to the pairs that attend, and a block with none is skipped (no kernel call; when the skipped steps are the
    last ones for every rank, no K/V travels for them either, :func:`ring_steps_needed`)."""
    cu = cu_seqlens.detach().to("cpu", torch.int64) if cu_seqlens is not None else None
    if layout == "balanced" and (cu is None or ring_degree == 1):
        layout = "zigzag"
    if layout == "balanced":
        parts = _balanced_parts(seq_len, ring_degree, cu.numpy().tobytes())
    else:
        parts = tuple(part_positions(seq_len, ring_degree, r, layout) for r in range(ring_degree))
    q_pos = parts[ring_rank]
    return [
        _banded_block(q_pos, parts[(ring_rank - t) % ring_degree], cu, window, chunk)
        for t in range(ring_degree)
    ]


def plan_ring_blocks(
    seq_len: int,
    ring_degree: int,
    ring_rank: int,
    layout: str,
    causal: bool,
    cu_seqlens: torch.Tensor | None = None,
    device: torch.device | None = None,
) -> list[BlockSpec | None]:
    """The block to compute at each ring step (``None`` = skipped), for ring rank ``ring_rank``.

    ``cu_seqlens``: int ``[num_docs + 1]`` boundaries of the global sequence (validated by the caller); the
    ``balanced`` layout is placed from them (zigzag without).
    Segments stay on the CPU whatever ``device`` is (the argument is kept for callers and unused): kernels
    read them as Python ints, which costs no device sync, and copy what they need without blocking.
    """
    part_len = seq_len // ring_degree
    cu = cu_seqlens.detach().to("cpu", torch.int64) if cu_seqlens is not None else None
    if layout == "balanced" and cu is not None and ring_degree > 1:
        parts = _balanced_parts(seq_len, ring_degree, cu.numpy().tobytes())
        return [
            _placed_block(parts[ring_rank], parts[(ring_rank - t) % ring_degree], cu, t == 0, causal)
            for t in range(ring_degree)
        ]
    if layout == "balanced":
        layout = "zigzag"  # without boundaries balanced is zigzag
    q_pos = part_positions(seq_len, ring_degree, ring_rank, layout) if cu is not None else None
    plans: list[BlockSpec | None] = []
    for step in range(ring_degree):
        src = (ring_rank - step) % ring_degree
        block = _layout_block(ring_rank, src, part_len, layout, causal)
        if block is not None and cu is not None:
            k_pos = part_positions(seq_len, ring_degree, src, layout)
            block = _document_block(block, q_pos, k_pos, cu)
        plans.append(block)
    return plans


def _prefix_block(
    q_pos: torch.Tensor, k_pos: torch.Tensor, cu: torch.Tensor, prefix: torch.Tensor
) -> BlockSpec | None:
    """The rows of each linked document (``prefix[d] > 0``) against its shared prefix (the first ``prefix[d]``
    tokens of document ``d - 1``), full rectangles (module docstring); None when this pair of parts holds none."""
    docs = torch.nonzero(prefix > 0).flatten()
    if docs.numel() == 0:
        return None
    p0 = cu[docs - 1]
    seg = torch.stack(
        [
            torch.searchsorted(q_pos, cu[docs]),
            torch.searchsorted(q_pos, cu[docs + 1]),
            torch.searchsorted(k_pos, p0),
            torch.searchsorted(k_pos, p0 + prefix[docs]),
        ],
        dim=1,
    )
    seg = seg[(seg[:, 0] < seg[:, 1]) & (seg[:, 2] < seg[:, 3])]
    if seg.size(0) == 0:
        return None
    q_off, k_off = int(seg[0, 0]), int(seg[0, 2])
    q_last, k_last = int(seg[-1, 1]), int(seg[-1, 3])
    seg = seg - torch.tensor([q_off, q_off, k_off, k_off])
    return BlockSpec(q_off, q_last, k_off, k_last, False, None if seg.size(0) == 1 else seg)


def plan_prefix_blocks(
    seq_len: int,
    ring_degree: int,
    ring_rank: int,
    layout: str,
    cu_seqlens: torch.Tensor,
    shared_prefix: torch.Tensor,
) -> list[BlockSpec | None]:
    """The shared-prefix block at each ring step (``None``: none), for ring rank ``ring_rank`` (module
    docstring). ``shared_prefix``: int ``[num_docs]``, validated by the caller (``shared_prefix[0] == 0``, each at
    most the previous document's length)."""
    cu = cu_seqlens.detach().to("cpu", torch.int64)
    prefix = shared_prefix.detach().to("cpu", torch.int64)
    if layout == "balanced" and ring_degree > 1:
        parts = _balanced_parts(seq_len, ring_degree, cu.numpy().tobytes())
    else:
        layout = "zigzag" if layout == "balanced" else layout
        parts = tuple(part_positions(seq_len, ring_degree, r, layout) for r in range(ring_degree))
    q_pos = parts[ring_rank]
    return [
        _prefix_block(q_pos, parts[(ring_rank - t) % ring_degree], cu, prefix) for t in range(ring_degree)
    ]


StepBlocks = BlockSpec | tuple[BlockSpec, ...] | None
"""A ring step's entry in a plan: one block, several (merged by ``lse``: a document block and its shared-prefix
block), or None (nothing computed)."""


def step_blocks(entry: StepBlocks) -> tuple[BlockSpec, ...]:
    """The blocks of a ring step's entry, in the order they are computed."""
    if entry is None:
        return ()
    return entry if isinstance(entry, tuple) else (entry,)


def join_steps(main: list[BlockSpec | None], extra: list[BlockSpec | None]) -> list[StepBlocks]:
    """Per step, ``main``'s block and ``extra``'s (a tuple when both compute something)."""
    out: list[StepBlocks] = []
    for a, b in zip(main, extra, strict=True):
        blocks = tuple(x for x in (a, b) if x is not None)
        out.append(None if not blocks else blocks[0] if len(blocks) == 1 else blocks)
    return out


def ring_steps_needed(plans_by_rank: list[list[BlockSpec | None]]) -> int:
    """Ring steps worth running: up to the last step at which *any* ring rank computes a block.

    K/V parts forwarded after that step would only be passed on, never used, so the ring stops there. Every
    ring rank derives the same value from the same global inputs (layout and ``cu_seqlens``), so the
    transfers stay matched. Without documents it is ``R`` for every causal or non-causal layout.
    """
    return 1 + max(t for plans in plans_by_rank for t, block in enumerate(plans) if block is not None)
