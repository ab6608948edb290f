"""Rank the layouts a cluster allows: the fastest that fit first; when none fits, say why and what would.

The memory-saving tricks (checkpoint offload, MLP tiles, states on the host, ring head chunks) cost time or
nothing, never save it, so a layout using fewer of them goes first within the 2% throughput band: ``auto``
picks them only when needed (or when they are faster by more than the band). Costing one layout and
enumerating the candidates: :mod:`usp.plan.estimate`; what is costed: :mod:`usp.plan.layout`.

:func:`evaluate_layout`, :func:`enumerate_layouts` and :func:`plan_layouts` are the keyword forms (the public
API); each builds a :class:`Workload`, a :class:`Candidate` or a :class:`SearchSpace` and hands it on.
"""

from __future__ import annotations

from usp.plan.advice import explain_no_fit
from usp.plan.compute import DocumentWork
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
from usp.plan.layout import STATE_PLACEMENTS, Candidate, SearchSpace, Workload
from usp.plan.models import ModelSpec

TIE_TOLERANCE = 0.02


class NoFeasibleLayoutError(ValueError):
    """No layout fits; the message says why and what would (more GPUs, shorter sequence, offload...)."""


def evaluate_layout(
    model: ModelSpec,
    device: DeviceSpec,
    *,
    seq_len: int,
    ulysses_degree: int,
    ring_degree: int,
    world_size: int,
    node_size: int,
    fsdp_mode: str = "full_shard",
    activation_checkpointing: str = "none",
    ac_every_k: int = 2,
    global_batch: int | None = None,
    ring_layout: str = "zigzag",
    loss_chunk_size: int = 4096,
    overhead_frac: float = 0.05,
    offload: bool = False,
    compute_bytes: int = 2,
    mlp_tiles: int = 1,
    headroom_gib: float | None = None,
    documents: DocumentWork | None = None,
    attn_head_chunks: int = 1,
) -> LayoutEstimate:
    """Memory and time of one layout (:func:`usp.plan.estimate.estimate_layout`). ``global_batch`` in sequences;
    default one per dp rank. ``compute_bytes``: 2 for bf16 compute (``model.dtype``), 4 for float32.
    ``offload``: the sharded states and the optimizer step on the host (FSDP2 CPU offload); ``headroom_gib``:
    free device memory the fit requires (default :attr:`DeviceSpec.default_headroom_gib`);
    ``attn_head_chunks``: ``parallel.attn_head_chunks`` (:func:`head_chunk_candidates`)."""
    work = Workload(
        model,
        seq_len,
        global_batch=global_batch,
        compute_bytes=compute_bytes,
        loss_chunk_size=loss_chunk_size,
        ring_layout=ring_layout,
        documents=documents,
        overhead_frac=overhead_frac,
        headroom_gib=headroom_gib,
    )
    cand = Candidate(
        ulysses_degree,
        ring_degree,
        world_size=world_size,
        node_size=node_size,
        fsdp_mode=fsdp_mode,
        activation_checkpointing=activation_checkpointing,
        ac_every_k=ac_every_k,
        mlp_tiles=mlp_tiles,
        attn_head_chunks=attn_head_chunks,
        states="cpu_offload" if offload else "device",
    )
    return estimate_layout(work, cand, device)


def enumerate_layouts(
    model: ModelSpec,
    device: DeviceSpec,
    *,
    seq_len: int,
    world_size: int,
    node_size: int,
    global_batch: int | None = None,
    ring_layout: str = "zigzag",
    ulysses_degree: int | None = None,
    ring_degree: int | None = None,
    ac_modes: tuple[str, ...] | None = None,
    offload: bool = False,
    loss_chunk_size: int = 4096,
    overhead_frac: float = 0.05,
    compute_bytes: int = 2,
    fsdp_modes: tuple[str, ...] | None = None,
    ac_every_k: int | None = None,
    mlp_tiles: int | None = None,
    states: tuple[str, ...] | None = None,
    headroom_gib: float | None = None,
    documents: DocumentWork | None = None,
    attn_head_chunks: int | None = None,
) -> tuple[list[LayoutEstimate], list[str]]:
    """Every valid candidate, fitting or not, and the reasons the others were rejected before costing
    (:func:`usp.plan.estimate.enumerate_candidates`; the restrictions are :class:`SearchSpace`'s fields).
    ``states`` default: on the device; ``offload=True`` means ``("cpu_offload",)``."""
    if states is None:
        states = ("cpu_offload",) if offload else ("device",)
    work = Workload(
        model,
        seq_len,
        global_batch=global_batch,
        compute_bytes=compute_bytes,
        loss_chunk_size=loss_chunk_size,
        ring_layout=ring_layout,
        documents=documents,
        overhead_frac=overhead_frac,
        headroom_gib=headroom_gib,
    )
    space = SearchSpace(
        world_size,
        node_size,
        ulysses_degree=ulysses_degree,
        ring_degree=ring_degree,
        fsdp_modes=fsdp_modes,
        ac_modes=ac_modes,
        ac_every_k=ac_every_k,
        mlp_tiles=mlp_tiles,
        attn_head_chunks=attn_head_chunks,
        states=states,
    )
    return enumerate_candidates(work, space, device)


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


def plan_layouts(
    model: ModelSpec,
    device: DeviceSpec,
    *,
    seq_len: int,
    world_size: int,
    node_size: int,
    global_batch: int | None = None,
    ring_layout: str = "zigzag",
    ulysses_degree: int | None = None,
    ring_degree: int | None = None,
    ac_modes: tuple[str, ...] | None = None,
    loss_chunk_size: int = 4096,
    overhead_frac: float = 0.05,
    compute_bytes: int = 2,
    fsdp_modes: tuple[str, ...] | None = None,
    ac_every_k: int | None = None,
    mlp_tiles: int | None = None,
    states: tuple[str, ...] | None = None,
    headroom_gib: float | None = None,
    documents: DocumentWork | None = None,
    attn_head_chunks: int | None = None,
) -> list[LayoutEstimate]:
    """Layouts that fit, fastest first (:func:`rank_layouts`: within 2% throughput, fewer tricks, less memory
    first). ``mlp_tiles`` and ``attn_head_chunks`` None are ``auto``; ``states`` the placements to try (default
    on the device); ``documents``: packed documents (``--doc-lengths``), attention over them.

    Raises :class:`NoFeasibleLayoutError` (a ``ValueError``) saying why nothing fits and what would.
    """
    work = Workload(
        model,
        seq_len,
        global_batch=global_batch,
        compute_bytes=compute_bytes,
        loss_chunk_size=loss_chunk_size,
        ring_layout=ring_layout,
        documents=documents,
        overhead_frac=overhead_frac,
        headroom_gib=headroom_gib,
    )
    space = SearchSpace(
        world_size,
        node_size,
        ulysses_degree=ulysses_degree,
        ring_degree=ring_degree,
        fsdp_modes=fsdp_modes,
        ac_modes=ac_modes,
        ac_every_k=ac_every_k,
        mlp_tiles=mlp_tiles,
        attn_head_chunks=attn_head_chunks,
        states=("device",) if states is None else states,
    )
    return search_layouts(work, space, device)


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
