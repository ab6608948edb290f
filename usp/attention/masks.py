"""Document segments -> per-row key ranges and dense masks, for small blocks on the kernels that take a mask.

Large segmented blocks never get here: :mod:`usp.attention.segmented` runs them one unmasked call per segment.

A segment list is int64 ``[n, 4]`` rows ``(q0, q1, k0, k1)``, sorted and disjoint: query rows ``[q0, q1)``
attend only to keys ``[k0, k1)`` (causal: each segment is its own aligned lower triangle). Rows outside every
segment attend to nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from usp.attention.segmented import to_device


@dataclass(frozen=True, eq=False)
class RowRanges:
    """A banded mask, one allowed key range per query row: row ``i`` attends to keys ``[lo[i], hi[i])``.

    Sliding windows and chunked attention (and documents under them) make bands that document segments
    cannot express (neighbouring rows' key ranges overlap). ``lo``, ``hi``: int64 ``[sq]`` on the CPU,
    relative to the block's key rows, non-decreasing (rows and keys rise in position); ``lo[i] >= hi[i]``
    means row ``i`` attends to nothing (``out = 0``, ``lse = -inf``). The dense kernels (math, CPU flash, SDPA)
    take it as a mask, one call per *tile*: rows ``[a, b)`` against the keys ``[k0, k1)`` they reach, at most
    :data:`~usp.attention.segmented.DENSE_MASK_MAX_ELEMENTS` mask elements each, so a 1024-token window over a
    128K-token block costs ``O(S * window)``, not ``O(S^2)``, in work and in mask memory. Everything is read
    on the host once, when the block is planned (:meth:`build`): a kernel call reads nothing back.
    """

    lo: torch.Tensor
    hi: torch.Tensor
    empty: tuple[tuple[int, int], ...] = ()
    """Row ranges ``[a, b)`` that attend to nothing."""
    num_pairs: int = 0
    tiles: tuple[tuple[int, int, int, int, RowRanges | None], ...] = ()
    """``(a, b, k0, k1, band)``: rows ``[a, b)`` against keys ``[k0, k1)``, the band relative to them (None
    inside a tile: the tile is one call). Empty for a single call over the whole block."""

    @classmethod
    def build(cls, lo: torch.Tensor, hi: torch.Tensor, max_elements: int | None = None) -> RowRanges:
        """The band of per-row key ranges ``[lo, hi)`` (host int64 tensors), with its empty rows, pair count
        and tiles of at most ``max_elements`` (default ``DENSE_MASK_MAX_ELEMENTS``) mask elements."""
        from usp.attention.segmented import DENSE_MASK_MAX_ELEMENTS

        limit = max_elements or DENSE_MASK_MAX_ELEMENTS
        sq = lo.numel()
        sk = int(hi.max()) if sq else 0
        band = cls(lo, hi, _empty_runs(hi <= lo), int((hi - lo).clamp(min=0).sum()))
        if sq * sk <= limit:
            return band
        widest = max(1, int((hi - lo).max()))
        # a tile of r rows over rising ranges reaches at most r - 1 + widest keys: r (r - 1 + widest) <= limit
        rows = max(1, min(sq, int((math.sqrt((widest - 1) ** 2 + 4 * limit) - (widest - 1)) / 2)))
        tiles = []
        for a in range(0, sq, rows):
            b = min(a + rows, sq)
            tlo, thi = lo[a:b], hi[a:b]
            live = thi > tlo
            if not bool(live.any()):
                continue  # no row of the tile attends: nothing to compute
            k0, k1 = int(tlo[live].min()), int(thi[live].max())
            sub_lo, sub_hi = (tlo - k0).clamp(min=0), (thi - k0).clamp(min=0, max=k1 - k0)
            sub = cls(sub_lo, sub_hi, _empty_runs(sub_hi <= sub_lo), 0)
            tiles.append((a, b, k0, k1, sub))
        return cls(lo, hi, band.empty, band.num_pairs, tuple(tiles))

    @classmethod
    def of_block(cls, sq: int, sk: int, causal: bool, segments: torch.Tensor | None) -> RowRanges:
        """The band of a causal / full / document-segmented block (to tile a block the kernels must mask
        anyway: softcapped scores run the materializing ``math`` kernel)."""
        if segments is not None:
            lo, hi = segment_key_ranges(segments, sq, causal)
        else:
            lo = torch.zeros(sq, dtype=torch.int64)
            hi = torch.arange(1, sq + 1) if causal else torch.full((sq,), sk, dtype=torch.int64)
        return cls.build(lo, hi)

    def pairs(self) -> int:
        """(query, key) pairs that attend (per batch row and head)."""
        return self.num_pairs

    def mask(self, sk: int, device: torch.device) -> torch.Tensor:
        """Boolean ``[sq, sk]`` (True = attend)."""
        cols = torch.arange(sk, device=device)
        lo, hi = to_device(self.lo, device), to_device(self.hi, device)
        return (cols[None, :] >= lo[:, None]) & (cols[None, :] < hi[:, None])

    def empty_rows(self) -> list[tuple[int, int]]:
        """Row ranges ``[a, b)`` that attend to nothing."""
        return list(self.empty)


def _empty_runs(flags: torch.Tensor) -> tuple[tuple[int, int], ...]:
    runs, start = [], None
    for i, e in enumerate([*flags.tolist(), False]):
        if e and start is None:
            start = i
        elif not e and start is not None:
            runs.append((start, i))
            start = None
    return tuple(runs)


def segment_key_ranges(segments: torch.Tensor, sq: int, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Per query row, the allowed key range ``[lo, hi)`` (int64 ``[sq]`` each; ``lo == hi``: no key)."""
    rows = torch.arange(sq, device=segments.device)
    q0, q1, k0, k1 = (c.contiguous() for c in segments.unbind(1))
    seg = torch.searchsorted(q0, rows, right=True) - 1  # last segment starting at or before the row
    valid = seg >= 0
    seg = seg.clamp(min=0)
    valid &= rows < q1[seg]
    lo = k0[seg]
    hi = lo + (rows - q0[seg]) + 1 if causal else k1[seg]
    zero = torch.zeros_like(lo)
    return torch.where(valid, lo, zero), torch.where(valid, hi, zero)


def segment_mask(segments: torch.Tensor, sq: int, sk: int, causal: bool) -> torch.Tensor:
    """Boolean ``[sq, sk]`` mask (True = attend) of a segment list."""
    lo, hi = segment_key_ranges(segments, sq, causal)
    cols = torch.arange(sk, device=segments.device)
    return (cols[None, :] >= lo[:, None]) & (cols[None, :] < hi[:, None])


def dense_mask(sq: int, sk: int, causal: bool, segments: torch.Tensor | None, device: torch.device):
    """Boolean mask for the dense kernels, or None when no mask is needed (plain full attention).

    ``segments``: a document segment list, or a :class:`RowRanges` band (then ``causal`` is ignored: the
    ranges say it all)."""
    if isinstance(segments, RowRanges):
        return segments.mask(sk, device)
    if segments is not None:
        return segment_mask(to_device(segments, device), sq, sk, causal)  # no host wait for CPU segments
    if causal:
        assert sq == sk, "causal blocks are square (same positions for q and k)"
        return torch.ones(sq, sk, dtype=torch.bool, device=device).tril()
    return None
