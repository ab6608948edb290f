"""Enumerate the layouts a cluster allows, predict memory and step time for each, rank the ones that fit.

A candidate is (ulysses_degree, ring_degree, dp_degree, fsdp_mode, activation_checkpointing). The layout rules
(Ulysses inside a node, degrees dividing the world, zigzag's sequence multiple ``2 x ring x ulysses``) come
from :class:`usp.parallel.ParallelDims` and :func:`usp.parallel.sequence_multiple`; the head split rule from
:meth:`ModelSpec.ulysses_split_error`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from usp.parallel.mesh import ParallelDims, sequence_multiple
from usp.plan.comm import fsdp_comm, kv_block_bytes, ring_comm, ulysses_comm
from usp.plan.compute import DocumentWork, compute_time, model_flops_per_token
from usp.plan.hardware import DeviceSpec
from usp.plan.memory import checkpointed_layers, training_memory
from usp.plan.models import ModelSpec

TIE_TOLERANCE = 0.02
AC_CANDIDATES: tuple[tuple[str, int], ...] = (("none", 2), ("every_k", 2), ("full", 2))


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
    documents: DocumentWork | None = None,
) -> LayoutEstimate:
    """Memory and time of one (already validated) layout. ``global_batch`` in sequences; default one per dp
    rank. ``compute_bytes``: 2 for bf16 compute (``model.dtype``), 4 for float32."""
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
    )
    n_ckpt = checkpointed_layers(model.num_layers, activation_checkpointing, ac_every_k)
    comp = compute_time(
        model,
        device,
        seq_len=seq_len,
        ulysses_degree=U,
        ring_degree=R,
        ring_layout=ring_layout,
        recompute_layers=n_ckpt,
        documents=documents,
    )
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
    fsdp_exposed = max(0.0, fsdp["fsdp_s"] - busy)  # all-gathers prefetch behind the previous layer's compute
    micro = busy + comp["overhead_s"] + uly["ulysses_s"] + ring["ring_exposed_s"] + fsdp_exposed
    step = micro * accum
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
    }
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
        fits=mem.total <= device.memory_bytes,
        step_time_s=step,
        tokens_per_s_per_gpu=tokens_per_gpu,
        mfu=mfu,
        memory_gib=mem.as_gib(),
        time_s=times,
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
    documents: DocumentWork | None = None,
) -> tuple[list[LayoutEstimate], list[str]]:
    """Every valid candidate, fitting or not, and the reasons the others were rejected before costing.

    ``fsdp_modes`` / ``ac_modes`` restrict the FSDP and checkpointing modes tried (default: all;
    ``hybrid_shard`` only across nodes); ``ac_every_k`` replaces the ``every_k`` candidate's k."""
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
            for fsdp_mode in fsdp_modes:
                for ac, k in acs:
                    out.append(
                        evaluate_layout(
                            model,
                            device,
                            seq_len=seq_len,
                            ulysses_degree=U,
                            ring_degree=R,
                            world_size=world_size,
                            node_size=node_size,
                            fsdp_mode=fsdp_mode,
                            activation_checkpointing=ac,
                            ac_every_k=k,
                            global_batch=global_batch,
                            ring_layout=ring_layout,
                            loss_chunk_size=loss_chunk_size,
                            overhead_frac=overhead_frac,
                            offload=offload,
                            compute_bytes=compute_bytes,
                            documents=documents,
                        )
                    )
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
    """Fastest first, in bands of ``tie_tolerance`` x the best throughput; inside a band, less memory first
    (headroom against the model's own error)."""
    if not layouts:
        return []
    best = max(c.tokens_per_s_per_gpu for c in layouts)

    def key(c: LayoutEstimate) -> tuple[int, float, float]:
        band = int((best - c.tokens_per_s_per_gpu) / (tie_tolerance * best))
        return (band, c.mem_gib_per_gpu, -c.tokens_per_s_per_gpu)

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
    documents: DocumentWork | None = None,
) -> list[LayoutEstimate]:
    """Layouts that fit, fastest first (:func:`rank_layouts`: within 2% throughput, less memory first).

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
    if documents is not None:  # packed documents (--doc-lengths): attention over them, not one sequence
        kw["documents"] = documents
    candidates, rejected = enumerate_layouts(model, device, **kw)
    fitting = [c for c in candidates if c.fits]
    if fitting:
        return rank_layouts(fitting)
    from usp.plan.advice import explain_no_fit  # it searches again (more GPUs, shorter sequences...)

    raise NoFeasibleLayoutError(explain_no_fit(model, device, candidates, rejected, kw))


def auto_degrees(
    model_config: dict[str, Any],
    *,
    seq_len: int,
    world_size: int,
    node_size: int,
    gpu: str | None = None,
    memory_gib: float | None = None,
    ulysses_degree: int | None = None,
    ring_degree: int | None = None,
    fsdp_mode: str | None = None,
    activation_checkpointing: str | None = None,
    ac_every_k: int | None = None,
    compute_bytes: int = 2,
    ring_layout: str = "zigzag",
    loss_chunk_size: int = 4096,
) -> dict[str, Any]:
    """The planner's choice for ``parallel.ulysses_degree=auto`` and/or ``parallel.ring_degree=auto``.

    ``model_config`` is an HF config dict; ``gpu`` a name from :data:`usp.plan.hardware.GPUS` (default
    ``h100-80g``; ``cpu`` for CPU runs); ``memory_gib`` overrides the device memory. The optional keywords are
    constraints the user fixed: a degree (``ulysses_degree=4`` with ``ring_degree`` left to the planner), the
    FSDP mode, the checkpointing mode (and its ``ac_every_k``); ``None`` lets the planner choose.
    ``compute_bytes`` (2 for bf16/fp16 ``model.dtype``, 4 for float32), ``ring_layout`` and ``loss_chunk_size``
    describe the run for the cost model. Returns ``{"ulysses_degree", "ring_degree", "dp_degree", "fsdp_mode",
    "activation_checkpointing", "reason"}`` (plus ``ac_every_k`` when checkpointing is ``every_k``). Raises
    ``ValueError`` when nothing fits.
    """
    from usp.plan.hardware import get_device
    from usp.plan.models import load_model_spec

    model = load_model_spec(model_config)
    device = get_device(gpu or "h100-80g", memory_gib=memory_gib)
    node = min(node_size, world_size)
    layouts = plan_layouts(
        model, device, seq_len=seq_len, world_size=world_size, node_size=node, ring_layout=ring_layout,
        ulysses_degree=ulysses_degree, ring_degree=ring_degree,
        ac_modes=None if activation_checkpointing is None else (activation_checkpointing,),
        fsdp_modes=None if fsdp_mode is None else (fsdp_mode,), ac_every_k=ac_every_k,
        loss_chunk_size=loss_chunk_size, compute_bytes=compute_bytes,
    )  # fmt: skip
    best = layouts[0]
    fixed = {
        k: v
        for k, v in (("ulysses_degree", ulysses_degree), ("ring_degree", ring_degree), ("fsdp_mode", fsdp_mode),
                     ("activation_checkpointing", activation_checkpointing))
        if v is not None
    }  # fmt: skip
    reason = (
        f"fastest of {len(layouts)} layouts that fit {device.name} ({device.memory_gib:g} GiB) at seq_len={seq_len} "
        f"on {world_size} ranks ({node} per node)"
        + (f" with {', '.join(f'{k}={v}' for k, v in fixed.items())} fixed" if fixed else "")
        + f": predicted {best.mem_gib_per_gpu:.2f} GiB/rank, "
        f"{best.step_time_s:.3g} s/step, {best.tokens_per_s_per_gpu:.4g} tokens/s/rank"
    )
    out: dict[str, Any] = {
        "ulysses_degree": best.ulysses_degree,
        "ring_degree": best.ring_degree,
        "dp_degree": best.dp_degree,
        "fsdp_mode": best.fsdp_mode,
        "activation_checkpointing": best.activation_checkpointing,
        "reason": reason,
    }
    if best.activation_checkpointing == "every_k":
        out["ac_every_k"] = best.ac_every_k
    return out


__all__ = [
    "LayoutEstimate",
    "NoFeasibleLayoutError",
    "auto_degrees",
    "enumerate_layouts",
    "evaluate_layout",
    "plan_layouts",
    "rank_layouts",
]
