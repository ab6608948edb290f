"""Document segments -> per-row key ranges and dense masks, for small blocks on the kernels that take a mask.

Large segmented blocks never get here: :mod:`usp.attention.segmented` runs them one unmasked call per segment.

A segment list is int64 ``[n, 4]`` rows ``(q0, q1, k0, k1)``, sorted and disjoint: query rows ``[q0, q1)``
attend only to keys ``[k0, k1)`` (causal: each segment is its own aligned lower triangle). Rows outside every
segment attend to nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from usp.attention.segmented import to_device


@dataclass(frozen=True, eq=False)
class RowRanges:
    """A banded mask, one allowed key range per query row: row ``i`` attends to keys ``[lo[i], hi[i])``.

    Sliding windows and chunked attention (and documents under them) make bands that document segments
    cannot express (neighbouring rows' key ranges overlap). ``lo``, ``hi``: int64 ``[sq]`` on the CPU,
    relative to the block's key rows; ``lo[i] >= hi[i]`` means row ``i`` attends to nothing (``out = 0``,
    ``lse = -inf``). The dense kernels (math, CPU flash, SDPA) take it as a ``[sq, sk]`` mask per block.
    """

    lo: torch.Tensor
    hi: torch.Tensor
    empty: tuple[tuple[int, int], ...] = ()
    """Row ranges ``[a, b)`` that attend to nothing, read on the host once (:meth:`build`)."""
    num_pairs: int = 0

    @classmethod
    def build(cls, lo: torch.Tensor, hi: torch.Tensor) -> RowRanges:
        """The band of per-row key ranges ``[lo, hi)`` (host tensors), with its empty rows and pair count read
        once, at planning: kernels then need no host read of the ranges (no device sync, nothing a fake-tensor
        mode must answer)."""
        flags = (hi <= lo).tolist()
        runs, start = [], None
        for i, e in enumerate([*flags, False]):
            if e and start is None:
                start = i
            elif not e and start is not None:
                runs.append((start, i))
                start = None
        return cls(lo, hi, tuple(runs), int((hi - lo).clamp(min=0).sum()))

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
