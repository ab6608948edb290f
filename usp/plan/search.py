"""Rank the layouts a cluster allows: the fastest that fit first; when none fits, say why and what would.

The memory-saving tricks (checkpoint offload, MLP tiles, states on the host, ring head chunks) cost time or
nothing, never save it, so a layout using fewer of them goes first within the 2% throughput band: ``auto``
picks them only when needed (or when they are faster by more than the band). Costing one layout and
enumerating the candidates: :mod:`usp.plan.estimate`; what is costed: :mod:`usp.plan.layout`.

:func:`evaluate_layout`, :func:`enumerate_layouts` and :func:`plan_layouts` are the keyword forms (the public
API): :func:`usp.plan.layout.from_keywords` builds a :class:`Workload` and a :class:`Candidate` or a
:class:`SearchSpace` from their keywords, and the typed functions take those.
"""

from __future__ import annotations

from typing import Any

from usp.plan.advice import explain_no_fit
from usp.plan.estimate import (
    AC_CANDIDATES,
    HEAD_CHUNK_CANDIDATES,
    MLP_TILE_CANDIDATES,
    LayoutEstimate,
    enumerate_candidates,
    estimate_layout,
    head_chunk_candidates,
    split_layout,
)
from usp.plan.hardware import DeviceSpec
from usp.plan.layout import STATE_PLACEMENTS, Candidate, Layout, SearchSpace, Workload, from_keywords
from usp.plan.models import ModelSpec

TIE_TOLERANCE = 0.02


class NoFeasibleLayoutError(ValueError):
    """No layout fits; the message says why and what would (more GPUs, shorter sequence, offload...)."""


def _records(model: ModelSpec, layout: type[Layout], keywords: dict[str, Any]) -> tuple[Workload, Layout]:
    """:func:`usp.plan.layout.from_keywords` for the estimates and searches, which cost one sequence per micro
    step (``global_batch`` sets the accumulation)."""
    work, rest = from_keywords(model, layout, **keywords)
    if work.micro_batch_size != 1:
        raise ValueError(
            f"micro_batch_size={work.micro_batch_size}: the planner's estimates cost one sequence per micro step; "
            "set global_batch (sequences per optimizer step) instead."
        )
    return work, rest


def evaluate_layout(model: ModelSpec, device: DeviceSpec, **keywords: Any) -> LayoutEstimate:
    """Memory and time of one layout (:func:`usp.plan.estimate.estimate_layout`); ``keywords``: the fields of
    :class:`Workload` and :class:`Candidate` (:func:`usp.plan.layout.from_keywords`), e.g. ``seq_len``, the
    degrees, ``world_size``, ``node_size``, ``global_batch`` (sequences; default one per dp rank),
    ``compute_bytes`` (2 for bf16 compute, 4 for float32), ``headroom_gib`` (free device memory the fit
    requires; default :attr:`DeviceSpec.default_headroom_gib`), ``attn_head_chunks``
    (:func:`head_chunk_candidates`); ``states_on_host=True``: the sharded states and the optimizer step on the host
    (FSDP2 CPU offload)."""
    return estimate_layout(*_records(model, Candidate, keywords), device)


def enumerate_layouts(
    model: ModelSpec, device: DeviceSpec, **keywords: Any
) -> tuple[list[LayoutEstimate], list[str]]:
    """Every valid candidate, fitting or not, and the reasons the others were rejected before costing
    (:func:`usp.plan.estimate.enumerate_candidates`); ``keywords``: the fields of :class:`Workload` and
    :class:`SearchSpace` (the restrictions; ``None`` lets the planner choose). ``states`` default: on the
    device; ``states_on_host=True`` means ``("cpu_offload",)``."""
    return enumerate_candidates(*_records(model, SearchSpace, keywords), device)


def _check_search(work: Workload, space: SearchSpace) -> None:
    seq_len, world_size, node_size, global_batch = (
        work.seq_len,
        space.world_size,
        space.node_size,
        work.global_batch,
    )
    if seq_len < 1:
        raise ValueError(f"--seq-len={seq_len} must be >= 1.")
    if world_size < 1 or node_size < 1:
        raise ValueError(
            f"--nodes and --gpus-per-node must be >= 1 (got world {world_size}, node {node_size})."
        )
    if world_size % node_size:
        raise ValueError(f"world size {world_size} is not a multiple of the node size {node_size}.")
    if global_batch is not None and global_batch < 1:
        raise ValueError(f"--global-batch={global_batch} must be >= 1 (sequences per optimizer step).")
    for name, value in (("ulysses_degree", space.ulysses_degree), ("ring_degree", space.ring_degree)):
        if value is not None and (value < 1 or world_size % value):
            raise ValueError(f"--{name.replace('_', '-')}={value} must divide the world size {world_size}.")


def rank_layouts(layouts: list[LayoutEstimate], tie_tolerance: float = TIE_TOLERANCE) -> list[LayoutEstimate]:
    """Fastest first, in bands of ``tie_tolerance`` x the best throughput; inside a band, fewer memory-saving
    tricks first (:attr:`LayoutEstimate.tricks`: each costs time, host memory or PCIe traffic), then less
    memory (headroom against the model's own error)."""
    if not layouts:
        return []
    best = max(c.tokens_per_s_per_gpu for c in layouts)

    def key(c: LayoutEstimate) -> tuple[int, int, float, float]:
        band = int((best - c.tokens_per_s_per_gpu) / (tie_tolerance * best))
        return (band, c.tricks, c.mem_gib_per_gpu, -c.tokens_per_s_per_gpu)

    return sorted(layouts, key=key)


def plan_layouts(model: ModelSpec, device: DeviceSpec, **keywords: Any) -> list[LayoutEstimate]:
    """Layouts that fit, fastest first (:func:`search_layouts` of the :class:`Workload` and :class:`SearchSpace`
    these keywords build, as :func:`enumerate_layouts`'s): within 2% throughput, fewer tricks, less memory
    first. ``mlp_tiles`` and ``attn_head_chunks`` None are ``auto``; ``states`` the placements to try (default
    on the device); ``documents``: packed documents (``--doc-lengths``), attention over them.

    Raises :class:`NoFeasibleLayoutError` (a ``ValueError``) saying why nothing fits and what would.
    """
    return search_layouts(*_records(model, SearchSpace, keywords), device)


def search_layouts(work: Workload, space: SearchSpace, device: DeviceSpec) -> list[LayoutEstimate]:
    """:func:`plan_layouts` on a workload and a search space: the ranked fitting layouts, or
    :class:`NoFeasibleLayoutError` with :func:`usp.plan.advice.explain_no_fit`'s message. Checks the cluster
    and the pinned degrees first."""
    _check_search(work, space)
    candidates, rejected = enumerate_candidates(work, space, device)
    fitting = [c for c in candidates if c.fits]
    if fitting:
        return rank_layouts(fitting)
    raise NoFeasibleLayoutError(explain_no_fit(work, space, device, candidates, rejected))


__all__ = [
    "AC_CANDIDATES",
    "HEAD_CHUNK_CANDIDATES",
    "MLP_TILE_CANDIDATES",
    "STATE_PLACEMENTS",
    "LayoutEstimate",
    "NoFeasibleLayoutError",
    "enumerate_layouts",
    "evaluate_layout",
    "head_chunk_candidates",
    "plan_layouts",
    "rank_layouts",
    "search_layouts",
    "split_layout",
]
