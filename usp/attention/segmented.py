"""Document segments on dense kernels without a dense mask: one unmasked kernel call per segment.

A segment list (``(q0, q1, k0, k1)`` rows, see :mod:`usp.attention.kernels`) says query rows ``[q0, q1)``
attend only to keys ``[k0, k1)``: causally on the square diagonal pieces of a causal block (same global
positions for q and k), fully on off-diagonal pieces (the whole key range precedes the query range). A
dense ``[Sq, Sk]`` mask or bias for that is ``Sq * Sk`` elements per call (32 GiB in bf16 for a 128K-token
block), so above :data:`DENSE_MASK_MAX_ELEMENTS` the dense backends (torch SDPA on CUDA, torch CPU flash)
run each segment as its own unmasked block instead (consecutive short segments grouped into rectangles of at
most that size, with a small mask): memory ``O(block)``, exact, rows outside every segment keep ``out = 0``,
``lse = -inf``. The backward uses the *global* ``lse`` of each segment's rows, like any
other block.

Segments are read on the host (Python ints). Ring plans keep them on the CPU, so no call here waits for the
GPU; the small index tensors a kernel needs on the device are copied from pinned memory without blocking.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

Segment = tuple[int, int, int, int]

DENSE_MASK_MAX_ELEMENTS = 1 << 22
"""Largest block (``Sq * Sk``) that still runs with a dense mask (one call); larger ones go per segment."""


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of ``lse`` and of the out/lse merge and gradient accumulators for inputs of ``dtype``: fp32, or
    fp64 for fp64 inputs (so a float64 run, the exactness tests' dtype, rounds nowhere to fp32)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


DenseForward = Callable[..., tuple[torch.Tensor, torch.Tensor]]
DenseBackward = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def host_segments(segments: torch.Tensor) -> list[Segment]:
    """The segment rows as Python ints: free for CPU segments (as plans hold them), a device sync otherwise."""
    return [tuple(row) for row in segments.tolist()]


SPARSE_FILL = 0.5
"""A masked call over a rectangle whose segments cover less than this fraction of it wastes the rest: such
blocks (and groups) are split, so the time of a block follows the pairs it attends, whatever the layout."""

SMALL_CALL_ELEMENTS = 1 << 16
"""Rectangles up to this size run as one masked call whatever their fill (a call costs more than the waste)."""


def _covered(segments) -> int:
    """Work of the segments' own calls: a rectangle, or half of a square on the diagonal (a causal piece)."""
    rows = segments.tolist() if isinstance(segments, torch.Tensor) else segments
    return sum(
        (q1 - q0) * (q1 - q0 + 1) // 2 if (q0, q1) == (k0, k1) else (q1 - q0) * (k1 - k0)
        for q0, q1, k0, k1 in rows
    )


def per_segment_calls(sq: int, sk: int, segments=None) -> bool:
    """Whether a dense backend runs a segmented ``[sq, sk]`` block per segment (group) instead of one masked
    call: blocks above :data:`DENSE_MASK_MAX_ELEMENTS`, and (given its ``segments``) sparse blocks whose
    segments fill less than :data:`SPARSE_FILL` of it."""
    area = sq * sk
    if area > DENSE_MASK_MAX_ELEMENTS:
        return True
    return segments is not None and area > SMALL_CALL_ELEMENTS and _covered(segments) < SPARSE_FILL * area


def uncovered_rows(segments: list[Segment], sq: int) -> list[tuple[int, int]]:
    """Row ranges ``[a, b)`` outside every segment (they attend to nothing); segments are sorted, disjoint."""
    gaps, pos = [], 0
    for q0, q1, _, _ in segments:
        if q0 > pos:
            gaps.append((pos, q0))
        pos = q1
    if pos < sq:
        gaps.append((pos, sq))
    return gaps


def clear_uncovered_rows_(out: torch.Tensor, lse: torch.Tensor, segments: list[Segment]) -> None:
    """In place: ``out = 0`` and ``lse = -inf`` on the query rows outside every segment (they attend to
    nothing), whatever a kernel wrote there. ``out [B, Sq, h, D]``, ``lse [B, h, Sq]``; the ranges come from the
    host list: no device sync, no ``[Sq]`` mask."""
    for a, b in uncovered_rows(segments, out.size(1)):
        out[:, a:b] = 0.0
        lse[:, :, a:b] = float("-inf")


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Copy a small host tensor to ``device``; to CUDA through pinned memory, so the host does not wait.

    Pinning needs a CUDA runtime: without one (fake CUDA tensors in the CPU test tier) it is a plain copy.
    """
    if t.device == device:
        return t
    if device.type == "cuda" and t.device.type == "cpu" and torch.cuda.is_available():
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def group_segments(segments: list[Segment], max_elements: int) -> list[tuple[Segment, torch.Tensor | None]]:
    """Consecutive segments packed into rectangles of at most ``max_elements`` (``Sq * Sk``) each.

    Returns ``(rect, inner)`` pairs: ``rect = (q0, q1, k0, k1)`` in block coordinates and ``inner`` the
    group's segments relative to ``rect`` (int64 CPU ``[n, 4]``), or None when the group is one segment (an
    unmasked call). A single segment larger than ``max_elements`` is a group of its own. Grouping keeps many
    short documents to a few kernel calls while no mask exceeds ``max_elements`` elements, and a group above
    :data:`SMALL_CALL_ELEMENTS` stays at least :data:`SPARSE_FILL` full (segments far apart are not joined). Segments are
    sorted and increase in both rows and keys (documents are ordered in both parts).
    """
    groups: list[list[Segment]] = []
    for prev, seg in zip(segments, segments[1:]):
        assert prev[1] <= seg[0] and prev[3] <= seg[2], f"segments out of order: {prev}, {seg}"
    covered = 0
    for seg in segments:
        own = _covered([seg])
        if groups:
            first = groups[-1][0]
            area = (seg[1] - first[0]) * (seg[3] - first[2])
            dense = area <= SMALL_CALL_ELEMENTS or covered + own >= SPARSE_FILL * area
            if area <= max_elements and dense:
                groups[-1].append(seg)
                covered += own
                continue
        groups.append([seg])
        covered = own
    out = []
    for group in groups:
        (q0, _, k0, _), (_, q1, _, k1) = group[0], group[-1]
        inner = None
        if len(group) > 1:
            inner = torch.tensor(group, dtype=torch.int64) - torch.tensor([q0, q0, k0, k0])
        out.append(((q0, q1, k0, k1), inner))
    return out


def segmentwise_forward(
    dense_forward: DenseForward,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    scale: float,
    segments: list[Segment],
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [B, Sq, Hq, D], lse [B, Hq, Sq] fp32, fp64 for fp64 inputs)`` with one ``dense_forward`` call per group of segments.

    ``dense_forward(q, k, v, causal, scale, inner_segments_or_None)`` runs on the group's rectangle; groups
    are at most :data:`DENSE_MASK_MAX_ELEMENTS` large when they need a mask. Rows outside every segment end
    with ``out = 0``, ``lse = -inf``.
    """
    b, sq, hq, _ = q.shape
    out = q.new_zeros(q.shape)
    lse = torch.full((b, hq, sq), float("-inf"), dtype=accumulation_dtype(q.dtype), device=q.device)
    for (q0, q1, k0, k1), inner in group_segments(segments, DENSE_MASK_MAX_ELEMENTS):
        assert inner is not None or not causal or q1 - q0 == k1 - k0, "causal segments are square"
        o, l_seg = dense_forward(q[:, q0:q1], k[:, k0:k1], v[:, k0:k1], causal, scale, inner)
        out[:, q0:q1] = o
        lse[:, :, q0:q1] = l_seg
    clear_uncovered_rows_(out, lse, segments)  # gaps inside a group got whatever the kernel wrote
    return out, lse


def segmentwise_backward(
    dense_backward: DenseBackward,
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    scale: float,
    segments: list[Segment],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` with ``dense_backward(dout, q, k, v, out, lse, causal, scale, inner)`` per group.

    ``out``/``lse`` are the merged (global) results, so each group's gradients are exact pieces; rows and keys
    outside every segment get zero gradients (masked out inside a group, never touched outside).
    """
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for (q0, q1, k0, k1), inner in group_segments(segments, DENSE_MASK_MAX_ELEMENTS):
        qs, ks = slice(q0, q1), slice(k0, k1)
        gq, gk, gv = dense_backward(
            dout[:, qs], q[:, qs], k[:, ks], v[:, ks], out[:, qs], lse[:, :, qs], causal, scale, inner
        )
        dq[:, qs] = gq
        dk[:, ks] += gk  # groups cover disjoint key ranges; += keeps it exact regardless
        dv[:, ks] += gv
    return dq, dk, dv
