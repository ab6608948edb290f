"""Enumerate the layouts a cluster allows, predict memory and step time for each, rank the ones that fit.

A candidate is (ulysses_degree, ring_degree, dp_degree, fsdp_mode, activation_checkpointing, mlp_tiles) and
where the states live (device, optimizer offloaded, FSDP CPU offload: the last two only when asked). The
memory-saving tricks (checkpoint offload, MLP tiles, offloaded states) cost time or nothing, never save it, so a
layout using fewer of them goes first within the 2% throughput band: ``auto`` picks them only when needed (or
when they are faster by more than the band). A layout fits when its device estimate plus a headroom
(:data:`usp.plan.hardware.HEADROOM_FRAC` of the device by default) is within the device, and its host bytes
within the node's usable host memory. The layout rules
(Ulysses inside a node, degrees dividing the world, zigzag's sequence multiple ``2 x ring x ulysses``) come
from :class:`usp.parallel.ParallelDims` and :func:`usp.parallel.sequence_multiple`; the head split rule from
:meth:`ModelSpec.ulysses_split_error`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from usp.parallel.mesh import ParallelDims, sequence_multiple
from usp.plan.comm import fsdp_comm, kv_block_bytes, ring_comm, ulysses_comm
from usp.plan.compute import ATTN_BWD_OVER_FWD_HW, DocumentWork, compute_time, model_flops_per_token
from usp.plan.hardware import GIB, DeviceSpec
from usp.plan.memory import checkpointed_layers, training_memory
from usp.plan.models import ModelSpec
from usp.plan.offload import OFFLOAD_OPTIMIZER, host_memory, offload_time, usable_host_bytes

TIE_TOLERANCE = 0.02
AC_CANDIDATES: tuple[tuple[str, int], ...] = (("none", 2), ("every_k", 2), ("full", 2), ("offload", 2))
MLP_TILE_CANDIDATES: tuple[int, ...] = (2, 4, 8, 16, 32, 64, 128, 256)
"""``mlp_tiles=auto`` tries these in order and keeps the first that fits (more tiles only save memory)."""
STATE_PLACEMENTS: tuple[str, ...] = ("device", "cpu_offload")
"""Where the sharded states live: on the device, or on the host with the optimizer step there
(``optim.name=deepspeed_cpu_adam``: FSDP2 CPU offload, :func:`usp.config.states_on_host`)."""


@dataclass
class LayoutEstimate:
    """One layout and what the cost model predicts for it (per rank, per optimizer step)."""

    ulysses_degree: int
    ring_degree: int
    dp_degree: int
    fsdp_mode: str
    activation_checkpointing: str
    ac_every_k: int
    global_batch: int
    grad_accum_steps: int
    mem_gib_per_gpu: float
    fits: bool
    step_time_s: float
    tokens_per_s_per_gpu: float
    mfu: float
    memory_gib: dict[str, float] = field(default_factory=dict)
    time_s: dict[str, float] = field(default_factory=dict)
    mlp_tiles: int = 1
    states: str = "device"
    """One of :data:`STATE_PLACEMENTS`."""
    host_mem_gib_per_node: float = 0.0
    """Pinned checkpoints and offloaded states of all ranks of one node."""
    headroom_gib: float = 0.0
    """Free device memory the fit required on top of ``mem_gib_per_gpu``."""
    host_fits: bool = True

    @property
    def tricks(self) -> int:
        """How many memory-saving tricks the layout uses (checkpoint offload, MLP tiles, offloaded states)."""
        used = (self.activation_checkpointing == "offload", self.mlp_tiles > 1, self.states != "device")
        return sum(used)

    def overrides(self) -> list[str]:
        """Hydra overrides that select this layout in ``usp-train``."""
        out = [
            f"parallel.ulysses_degree={self.ulysses_degree}",
            f"parallel.ring_degree={self.ring_degree}",
            f"parallel.dp_degree={self.dp_degree}",
            f"parallel.fsdp_mode={self.fsdp_mode}",
            f"parallel.activation_checkpointing={self.activation_checkpointing}",
        ]
        if self.activation_checkpointing == "every_k":
            out.append(f"parallel.ac_every_k={self.ac_every_k}")
        if self.mlp_tiles > 1:
            out.append(f"parallel.mlp_tiles={self.mlp_tiles}")
        if self.states == "cpu_offload":
            out.append(f"optim.name={OFFLOAD_OPTIMIZER}")
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "ulysses_degree": self.ulysses_degree,
            "ring_degree": self.ring_degree,
            "dp_degree": self.dp_degree,
            "fsdp_mode": self.fsdp_mode,
            "activation_checkpointing": self.activation_checkpointing,
            "ac_every_k": self.ac_every_k,
            "global_batch": self.global_batch,
            "grad_accum_steps": self.grad_accum_steps,
            "mem_gib_per_gpu": round(self.mem_gib_per_gpu, 3),
            "fits": self.fits,
            "step_time_s": self.step_time_s,
            "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu,
            "mfu": round(self.mfu, 4),
            "memory_gib": {k: round(v, 3) for k, v in self.memory_gib.items()},
            "time_s": self.time_s,
            "overrides": self.overrides(),
            "mlp_tiles": self.mlp_tiles,
            "states": self.states,
            "host_mem_gib_per_node": round(self.host_mem_gib_per_node, 3),
            "headroom_gib": round(self.headroom_gib, 3),
        }


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
    overhead_frac: float = 0.08,
    offload: bool = False,
    compute_bytes: int = 2,
    mlp_tiles: int = 1,
    headroom_gib: float | None = None,
    documents: DocumentWork | None = None,
) -> LayoutEstimate:
    """Memory and time of one (already validated) layout. ``global_batch`` in sequences; default one per dp
    rank. ``compute_bytes``: 2 for bf16 compute (``model.dtype``), 4 for float32. ``offload``: the sharded
    states and the optimizer step on the host (FSDP2 CPU offload); ``headroom_gib``: free device
    memory the fit requires (default :attr:`DeviceSpec.default_headroom_gib`)."""
    U, R = ulysses_degree, ring_degree
    D = ParallelDims(world_size=world_size, ulysses_degree=U, ring_degree=R, node_size=node_size).dp_degree
    why = model.ulysses_split_error(U)
    if why:
        raise ValueError(f"parallel.ulysses_degree={U}: {why}.")
    batch = D if global_batch is None else global_batch
    if batch < 1 or batch % D:
        raise ValueError(f"global batch {batch} does not split over dp_degree={D}: use a multiple of {D}.")
    accum = batch // D
    mem = training_memory(
        model,
        device,
        seq_len=seq_len,
        ulysses_degree=U,
        ring_degree=R,
        world_size=world_size,
        node_size=node_size,
        fsdp_mode=fsdp_mode,
        activation_checkpointing=activation_checkpointing,
        ac_every_k=ac_every_k,
        loss_chunk_size=loss_chunk_size,
        overhead_frac=overhead_frac,
        offload=offload,
        compute_bytes=compute_bytes,
        mlp_tiles=mlp_tiles,
    )
    L = model.num_layers
    n_ckpt = checkpointed_layers(L, activation_checkpointing, ac_every_k)
    comp = compute_time(
        model,
        device,
        seq_len=seq_len,
        ulysses_degree=U,
        ring_degree=R,
        ring_layout=ring_layout,
        recompute_layers=n_ckpt,
        mlp_recompute_layers=L if mlp_tiles > 1 else 0,
        documents=documents,
    )
    placement = dict(
        seq_len=seq_len, ulysses_degree=U, ring_degree=R, world_size=world_size, node_size=node_size,
        fsdp_mode=fsdp_mode, activation_checkpointing=activation_checkpointing, offload=offload,
        compute_bytes=compute_bytes,
    )  # fmt: skip
    host = host_memory(model, **placement)
    # One layer's forward (what a checkpoint's copy out hides behind) and its recompute + backward (the copy in)
    attn_fwd_layer = comp["attention_s"] / ((1 + ATTN_BWD_OVER_FWD_HW) * L + n_ckpt)
    layer_fwd = 2.0 * model.layer_params * seq_len / (U * R) / (device.peak_flops * device.dense_efficiency)
    layer_fwd += attn_fwd_layer
    layer_bwd = max(0.0, (comp["dense_s"] + comp["attention_s"]) / L - layer_fwd)
    off = offload_time(model, device, layer_fwd_s=layer_fwd, layer_bwd_s=layer_bwd, **placement)
    B = compute_bytes
    uly = ulysses_comm(model, device, seq_len=seq_len, ulysses_degree=U, ring_degree=R, compute_bytes=B)
    ring = ring_comm(
        model,
        device,
        seq_len=seq_len,
        ulysses_degree=U,
        ring_degree=R,
        node_size=node_size,
        attention_s=comp["attention_s"],
        compute_bytes=B,
    )
    fsdp = fsdp_comm(
        model, device, world_size=world_size, node_size=node_size, fsdp_mode=fsdp_mode, compute_bytes=B
    )
    busy = comp["dense_s"] + comp["attention_s"]
    # all-gathers (and with CPU offload the parameter copies in) prefetch behind the previous layer's compute
    fsdp_exposed = max(0.0, fsdp["fsdp_s"] + off["fsdp_offload_s"] - busy)
    micro = busy + comp["overhead_s"] + uly["ulysses_s"] + ring["ring_exposed_s"] + fsdp_exposed
    micro += off["ckpt_offload_exposed_s"]
    step = micro * accum + off["host_adam_s"]
    tokens_per_gpu = batch * seq_len / step / world_size
    mfu = model_flops_per_token(model, seq_len, documents) * tokens_per_gpu / device.peak_flops
    times = {
        "dense_s": comp["dense_s"] * accum,
        "attention_s": comp["attention_s"] * accum,
        "overhead_s": comp["overhead_s"] * accum,
        "ulysses_s": uly["ulysses_s"] * accum,
        "ring_exposed_s": ring["ring_exposed_s"] * accum,
        "fsdp_exposed_s": fsdp_exposed * accum,
        "ring_step_comm_s": ring["ring_step_comm_s"],
        "ring_block_gb": kv_block_bytes(model, seq_len, U, R, B) / 1e9 if R > 1 else 0.0,
        "ckpt_offload_exposed_s": off["ckpt_offload_exposed_s"] * accum,
        "host_adam_s": off["host_adam_s"],
    }
    headroom = device.default_headroom_gib if headroom_gib is None else headroom_gib
    host_fits = host["node"] <= usable_host_bytes(device)
    return LayoutEstimate(
        ulysses_degree=U,
        ring_degree=R,
        dp_degree=D,
        fsdp_mode=fsdp_mode,
        activation_checkpointing=activation_checkpointing,
        ac_every_k=ac_every_k,
        global_batch=batch,
        grad_accum_steps=accum,
        mem_gib_per_gpu=mem.total_gib,
        fits=mem.total_gib + headroom <= device.memory_gib and host_fits,
        step_time_s=step,
        tokens_per_s_per_gpu=tokens_per_gpu,
        mfu=mfu,
        memory_gib=mem.as_gib(),
        time_s=times,
        mlp_tiles=mlp_tiles,
        states="cpu_offload" if offload else "device",
        host_mem_gib_per_node=host["node"] / GIB,
        headroom_gib=headroom,
        host_fits=host_fits,
    )


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def split_layout(
    model: ModelSpec, *, world_size: int, ulysses_degree: int, ring_degree: int, node_size: int
) -> tuple[ParallelDims | None, str | None]:
    """``(dims, None)`` when the degrees fit the world, the nodes and the model's heads; else ``(None, why)``."""
    try:
        dims = ParallelDims(
            world_size=world_size, ulysses_degree=ulysses_degree, ring_degree=ring_degree, node_size=node_size
        )
    except ValueError as e:
        return None, str(e)
    why = model.ulysses_split_error(ulysses_degree)
    return (None, why) if why else (dims, None)


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
    overhead_frac: float = 0.08,
    compute_bytes: int = 2,
    fsdp_modes: tuple[str, ...] | None = None,
    ac_every_k: int | None = None,
    mlp_tiles: int | None = None,
    states: tuple[str, ...] | None = None,
    headroom_gib: float | None = None,
    documents: DocumentWork | None = None,
) -> tuple[list[LayoutEstimate], list[str]]:
    """Every valid candidate, fitting or not, and the reasons the others were rejected before costing.

    ``fsdp_modes`` / ``ac_modes`` restrict the FSDP and checkpointing modes tried (default: all;
    ``hybrid_shard`` only across nodes); ``ac_every_k`` replaces the ``every_k`` candidate's k.
    ``mlp_tiles``: a fixed tile count, or None for ``auto`` (1, and when 1 does not fit the first of
    :data:`MLP_TILE_CANDIDATES` that fits, or the last one tried). ``states``: placements of
    :data:`STATE_PLACEMENTS` to try (default: on the device; ``offload=True`` means ``("cpu_offload",)``)."""
    if states is None:
        states = ("cpu_offload",) if offload else ("device",)
    bad = [x for x in states if x not in STATE_PLACEMENTS]
    if bad:
        raise ValueError(f"states={bad} are invalid; choose from {STATE_PLACEMENTS}.")
    rejected: list[str] = []
    out: list[LayoutEstimate] = []
    nodes = world_size // node_size
    if fsdp_modes is None:
        fsdp_modes = ("full_shard", "hybrid_shard") if nodes > 1 else ("full_shard",)
    acs = [
        (m, k if ac_every_k is None or m != "every_k" else ac_every_k)
        for m, k in AC_CANDIDATES
        if ac_modes is None or m in ac_modes
    ]
    for U in _divisors(world_size) if ulysses_degree is None else [ulysses_degree]:
        for R in _divisors(world_size // U) if ring_degree is None else [ring_degree]:
            tag = f"ulysses={U} ring={R}"
            dims, why = split_layout(model, world_size=world_size, ulysses_degree=U, ring_degree=R, node_size=node_size)
            if dims is None:
                rejected.append(f"{tag}: {why}")
                continue
            m = sequence_multiple(R, U, ring_layout)
            if seq_len % m:
                rejected.append(f"{tag}: seq_len={seq_len} is not a multiple of {m} ({ring_layout} layout)")
                continue
            if global_batch is not None and global_batch % dims.dp_degree:
                rejected.append(
                    f"{tag}: global batch {global_batch} does not split over dp_degree={dims.dp_degree}"
                )
                continue
            local = seq_len // (U * R)
            if mlp_tiles is not None and local % mlp_tiles:
                rejected.append(f"{tag}: parallel.mlp_tiles={mlp_tiles} does not divide {local} local tokens")
                continue
            tiles = [t for t in MLP_TILE_CANDIDATES if local % t == 0] if mlp_tiles is None else []
            for fsdp_mode in fsdp_modes:
                for ac, k in acs:
                    for where in states:
                        kw = dict(
                            seq_len=seq_len, ulysses_degree=U, ring_degree=R, world_size=world_size,
                            node_size=node_size, fsdp_mode=fsdp_mode, activation_checkpointing=ac, ac_every_k=k,
                            global_batch=global_batch, ring_layout=ring_layout, loss_chunk_size=loss_chunk_size,
                            overhead_frac=overhead_frac, offload=where == "cpu_offload", compute_bytes=compute_bytes,
                            headroom_gib=headroom_gib, documents=documents,
                        )  # fmt: skip
                        est = evaluate_layout(model, device, mlp_tiles=mlp_tiles or 1, **kw)
                        out.append(est)
                        for t in [] if est.fits else tiles:  # auto: tiles only when needed
                            tiled = evaluate_layout(model, device, mlp_tiles=t, **kw)
                            if tiled.fits or t == tiles[-1]:
                                out.append(tiled)
                                break
    return out, rejected


def _check_cluster(seq_len: int, world_size: int, node_size: int, global_batch: int | None) -> None:
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
    overhead_frac: float = 0.08,
    compute_bytes: int = 2,
    fsdp_modes: tuple[str, ...] | None = None,
    ac_every_k: int | None = None,
    mlp_tiles: int | None = None,
    states: tuple[str, ...] | None = None,
    headroom_gib: float | None = None,
    documents: DocumentWork | None = None,
) -> list[LayoutEstimate]:
    """Layouts that fit, fastest first (:func:`rank_layouts`: within 2% throughput, fewer tricks, less memory
    first). ``mlp_tiles`` None is ``auto``; ``states`` the placements to try (default on the device).

    Raises :class:`NoFeasibleLayoutError` (a ``ValueError``) saying why nothing fits and what would.
    """
    _check_cluster(seq_len, world_size, node_size, global_batch)
    for name, value in (("ulysses_degree", ulysses_degree), ("ring_degree", ring_degree)):
        if value is not None and (value < 1 or world_size % value):
            raise ValueError(f"--{name.replace('_', '-')}={value} must divide the world size {world_size}.")
    kw: dict[str, Any] = dict(
        seq_len=seq_len,
        world_size=world_size,
        node_size=node_size,
        global_batch=global_batch,
        ring_layout=ring_layout,
        ulysses_degree=ulysses_degree,
        ring_degree=ring_degree,
        ac_modes=ac_modes,
        loss_chunk_size=loss_chunk_size,
        overhead_frac=overhead_frac,
        compute_bytes=compute_bytes,
    )
    if fsdp_modes is not None:  # only when given: the no-fit advice re-searches with these keywords
        kw["fsdp_modes"] = fsdp_modes
    if ac_every_k is not None:
        kw["ac_every_k"] = ac_every_k
    for name, value in (("mlp_tiles", mlp_tiles), ("states", states), ("headroom_gib", headroom_gib)):
        if value is not None:
            kw[name] = value
    if documents is not None:  # packed documents (--doc-lengths): attention over them, not one sequence
        kw["documents"] = documents
    candidates, rejected = enumerate_layouts(model, device, **kw)
    fitting = [c for c in candidates if c.fits]
    if fitting:
        return rank_layouts(fitting)
    from usp.plan.advice import explain_no_fit  # it searches again (more GPUs, shorter sequences...)

    raise NoFeasibleLayoutError(explain_no_fit(model, device, candidates, rejected, kw))


__all__ = [
    "LayoutEstimate",
    "NoFeasibleLayoutError",
    "enumerate_layouts",
    "evaluate_layout",
    "plan_layouts",
    "rank_layouts",
]
