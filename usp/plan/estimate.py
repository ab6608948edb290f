"""Cost one layout (:func:`estimate_layout`) and every layout of a search space (:func:`enumerate_candidates`).

A candidate is (ulysses_degree, ring_degree, dp_degree, fsdp_mode, activation_checkpointing, mlp_tiles,
attn_head_chunks) and where the states live (:class:`usp.plan.layout.Candidate`). A layout fits when its device
estimate plus a headroom (:data:`usp.plan.hardware.HEADROOM_FRAC` of the device by default) is within the
device, and its host bytes within the node's usable host memory. The layout rules (Ulysses inside a node,
degrees dividing the world, zigzag's sequence multiple ``2 x ring x ulysses``) come from
:class:`usp.parallel.ParallelLayout` and :func:`usp.parallel.sequence_multiple`; the head split rule from
:meth:`ModelSpec.ulysses_split_error`. Ranking and the advice when nothing fits: :mod:`usp.plan.search`,
:mod:`usp.plan.advice`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

from usp.attention.ring import head_chunk_options
from usp.parallel.layout import ParallelLayout, sequence_multiple
from usp.plan.comm import fsdp_comm, kv_block_bytes, mixer_comm, ring_comm, ulysses_comm
from usp.plan.compute import ATTN_BWD_OVER_FWD_HW, compute_time, mfu, model_flops_per_token
from usp.plan.hardware import GIB, DeviceSpec
from usp.plan.layout import STATE_PLACEMENTS, Candidate, SearchSpace, Workload
from usp.plan.lora import LoraPlan, adapter_params
from usp.plan.memory import check_moe_tiles, checkpointed_layers, peak_memory
from usp.plan.models import ModelSpec
from usp.plan.offload import OFFLOAD_OPTIMIZER, host_bytes, offload_seconds, usable_host_bytes
from usp.units import divisors

AC_CANDIDATES: tuple[tuple[str, int], ...] = (("none", 2), ("every_k", 2), ("full", 2), ("offload", 2))
MLP_TILE_CANDIDATES: tuple[int, ...] = (2, 4, 8, 16, 32, 64, 128, 256)
"""``mlp_tiles=auto`` tries these in order and keeps the first that fits (more tiles only save memory)."""


def mlp_tile_candidates(model: ModelSpec) -> tuple[int, ...]:
    """The tile counts ``mlp_tiles=auto`` tries for ``model``: :data:`MLP_TILE_CANDIDATES`, none for a
    mixture of experts (the trainer refuses MLP tiles there, :func:`usp.plan.memory.check_moe_tiles`) or a
    hybrid (not modelled, :func:`usp.plan.memory.check_hybrid`)."""
    return () if model.is_moe or model.mixer is not None else MLP_TILE_CANDIDATES


HEAD_CHUNK_CANDIDATES: tuple[int, ...] = (1, 2, 4, 8)
"""``parallel.attn_head_chunks`` the planner tries (those that fit the layout's heads), only when fewer do not
fit: more chunks only save ring buffers (in more, smaller messages)."""


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
    attn_head_chunks: int = 1
    """``parallel.attn_head_chunks``: groups of heads the ring runs over in turn (1 = off)."""
    layout: ParallelLayout | None = None
    """The layout costed, as the run's own type (its ``ring_layout`` the workload's): what
    :func:`usp.plan.auto_degrees` returns and start-up builds the mesh from."""
    lora: LoraPlan | None = None
    """The LoRA adapters costed (:attr:`usp.plan.layout.Workload.lora`); ``None``: full training."""
    mixer_scheme: str | None = None
    """A hybrid model's mixer layers run on ``heads`` or ``gather`` at this layout (:mod:`usp.plan.mixers`);
    ``None`` without mixer layers."""

    @property
    def tricks(self) -> int:
        """How many memory-saving tricks the layout uses (checkpoint offload, MLP tiles, offloaded states, head
        chunks)."""
        used = (
            self.activation_checkpointing == "offload",
            self.mlp_tiles > 1,
            self.states != "device",
            self.attn_head_chunks > 1,
        )
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
        if self.attn_head_chunks > 1:
            out.append(f"parallel.attn_head_chunks={self.attn_head_chunks}")
        if self.states == "cpu_offload":
            out.append(f"optim.name={OFFLOAD_OPTIMIZER}")
        if self.lora is not None:  # the plan assumed these adapters
            out += self.lora.overrides()
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
            "attn_head_chunks": self.attn_head_chunks,
            "states": self.states,
            "host_mem_gib_per_node": round(self.host_mem_gib_per_node, 3),
            "headroom_gib": round(self.headroom_gib, 3),
            **({} if self.layout is None else {"layout": self.layout.to_dict()}),
            **({} if self.lora is None else {"lora": asdict(self.lora)}),
            **({} if self.mixer_scheme is None else {"mixer_scheme": self.mixer_scheme}),
        }


def estimate_layout(work: Workload, cand: Candidate, device: DeviceSpec) -> LayoutEstimate:
    """Memory and time of one layout (validated here: degrees, heads, global batch). ``work.global_batch``
    in sequences; default one per dp rank."""
    model, seq_len, B = work.model, work.seq_len, work.compute_bytes
    U, R, world_size, node_size = cand.ulysses_degree, cand.ring_degree, cand.world_size, cand.node_size
    D = cand.dp_degree  # validated when the layout was made
    why = model.ulysses_split_error(U)
    if why:
        raise ValueError(f"parallel.ulysses_degree={U}: {why}.")
    batch = D if work.global_batch is None else work.global_batch
    if batch < 1 or batch % D:
        raise ValueError(f"global batch {batch} does not split over dp_degree={D}: use a multiple of {D}.")
    accum = batch // D
    mem = peak_memory(work, cand, device)
    L = model.num_layers
    n_ckpt = checkpointed_layers(L, cand.activation_checkpointing, cand.ac_every_k)
    comp = compute_time(
        model,
        device,
        seq_len=seq_len,
        ulysses_degree=U,
        ring_degree=R,
        ring_layout=work.ring_layout,
        recompute_layers=n_ckpt,
        mlp_recompute_layers=L if cand.mlp_tiles > 1 else 0,
        documents=work.documents,
        lora=work.lora,
    )
    host = host_bytes(work, cand)
    # One layer's forward (what a checkpoint's copy out hides behind) and its recompute + backward (the copy in)
    attn_fwd_layer = comp["attention_s"] / ((1 + ATTN_BWD_OVER_FWD_HW) * L + n_ckpt)
    layer_params = model.active_layer_params + adapter_params(model, work.lora) / L  # with its adapters
    layer_fwd = (  # a MoE layer: the parameters one token goes through
        2.0 * layer_params * seq_len / (U * R) / (device.peak_flops * device.dense_efficiency)
    )
    layer_fwd += attn_fwd_layer
    layer_bwd = max(0.0, (comp["dense_s"] + comp["attention_s"] + comp["mixer_s"]) / L - layer_fwd)
    off = offload_seconds(work, cand, device, layer_fwd_s=layer_fwd, layer_bwd_s=layer_bwd)
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
        model,
        device,
        world_size=world_size,
        node_size=node_size,
        fsdp_mode=cand.fsdp_mode,
        compute_bytes=B,
        lora=work.lora,
    )
    mix = mixer_comm(model, device, seq_len=seq_len, sp_degree=U * R, node_size=node_size, compute_bytes=B)
    busy = comp["dense_s"] + comp["attention_s"] + comp["mixer_s"]
    # all-gathers (and with CPU offload the parameter copies in) prefetch behind the previous layer's compute
    fsdp_exposed = max(0.0, fsdp["fsdp_s"] + off["fsdp_offload_s"] - busy)
    micro = busy + comp["overhead_s"] + uly["ulysses_s"] + ring["ring_exposed_s"] + fsdp_exposed
    micro += mix["mixer_comm_s"]
    micro += off["ckpt_offload_exposed_s"]
    step = micro * accum + off["host_adam_s"]
    tokens_per_gpu = batch * seq_len / step / world_size
    step_flops = model_flops_per_token(model, seq_len, work.documents, work.lora) * batch * seq_len
    _, step_mfu = mfu(step_flops, step, world_size, device.peak_flops)
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
    if model.mixer is not None:  # a hybrid's mixer layers (usp.plan.mixers): scan time, exchanges
        times["mixer_s"] = comp["mixer_s"] * accum
        times["mixer_comm_s"] = mix["mixer_comm_s"] * accum
    headroom = device.default_headroom_gib if work.headroom_gib is None else work.headroom_gib
    host_fits = host["node"] <= usable_host_bytes(device)
    return LayoutEstimate(
        ulysses_degree=U,
        ring_degree=R,
        dp_degree=D,
        fsdp_mode=cand.fsdp_mode,
        activation_checkpointing=cand.activation_checkpointing,
        ac_every_k=cand.ac_every_k,
        global_batch=batch,
        grad_accum_steps=accum,
        mem_gib_per_gpu=mem.total_gib,
        fits=mem.total_gib + headroom <= device.memory_gib and host_fits,
        step_time_s=step,
        tokens_per_s_per_gpu=tokens_per_gpu,
        mfu=step_mfu,
        memory_gib=mem.as_gib(),
        time_s=times,
        mlp_tiles=cand.mlp_tiles,
        states=cand.states,
        host_mem_gib_per_node=host["node"] / GIB,
        headroom_gib=headroom,
        host_fits=host_fits,
        attn_head_chunks=cand.attn_head_chunks,
        layout=cand if cand.ring_layout == work.ring_layout else cand.replace(ring_layout=work.ring_layout),
        lora=work.lora,
        mixer_scheme=None if model.mixer is None else model.mixer.scheme(U * R),
    )


def head_chunk_options_all_ranks(model: ModelSpec, ulysses_degree: int) -> list[int]:
    """Head chunk counts that split every Ulysses rank's heads (uneven heads: each rank's own counts)."""
    heads = model.ulysses_heads(ulysses_degree)
    ranks = {(heads.q_counts[j], heads.local_kv_heads(j)) for j in range(ulysses_degree)}
    options = [set(head_chunk_options(q, kv)) for q, kv in ranks]
    return sorted(set.intersection(*options))


def head_chunk_candidates(model: ModelSpec, ulysses_degree: int) -> list[int]:
    """The ``parallel.attn_head_chunks`` the planner tries for this Ulysses degree, fewest first: those of
    :data:`HEAD_CHUNK_CANDIDATES` that split the heads per rank into whole GQA groups (the trainer's rule,
    :func:`usp.attention.ring.head_chunk_options`)."""
    ok = head_chunk_options_all_ranks(model, ulysses_degree)
    return [c for c in HEAD_CHUNK_CANDIDATES if c in ok]


def head_chunks_to_try(
    model: ModelSpec, ulysses_degree: int, ring_degree: int, fixed: int | None
) -> list[int]:
    """Head chunk counts a search tries for this pair, fewest first: :func:`head_chunk_candidates` at every
    ring degree (without a ring the chunks still split the kernel's own buffers), or ``[fixed]``; ``[]`` when
    the fixed count does not split the pair's heads. ``ring_degree`` is kept for the callers."""
    if fixed is None:
        return head_chunk_candidates(model, ulysses_degree)
    U = ulysses_degree
    if fixed != 1 and fixed not in head_chunk_options_all_ranks(model, U):
        return []
    return [fixed]


def split_layout(
    model: ModelSpec, *, world_size: int, ulysses_degree: int, ring_degree: int, node_size: int
) -> tuple[ParallelLayout | None, str | None]:
    """``(dims, None)`` when the degrees fit the world, the nodes and the model's heads; else ``(None, why)``."""
    try:
        dims = ParallelLayout(
            world_size=world_size, ulysses_degree=ulysses_degree, ring_degree=ring_degree, node_size=node_size
        )
    except ValueError as e:
        return None, str(e)
    why = model.ulysses_split_error(ulysses_degree)
    return (None, why) if why else (dims, None)


def fsdp_modes_to_try(space: SearchSpace, node_size: int) -> tuple[str, ...]:
    """``space.fsdp_modes``, or by default ``full_shard`` and, across nodes, ``hybrid_shard``."""
    if space.fsdp_modes is not None:
        return space.fsdp_modes
    return ("full_shard", "hybrid_shard") if space.world_size // node_size > 1 else ("full_shard",)


def valid_pairs(
    model: ModelSpec, space: SearchSpace
) -> tuple[list[tuple[int, int, ParallelLayout]], list[str]]:
    """The ``(ulysses, ring, dims)`` of every pair of ``space`` (its fixed degrees, else every divisor of the
    world) that :func:`split_layout` accepts, in search order, and why each other pair was rejected."""
    pairs: list[tuple[int, int, ParallelLayout]] = []
    rejected: list[str] = []
    W = space.world_size
    for U in divisors(W) if space.ulysses_degree is None else [space.ulysses_degree]:
        for R in divisors(W // U) if space.ring_degree is None else [space.ring_degree]:
            dims, why = split_layout(
                model, world_size=W, ulysses_degree=U, ring_degree=R, node_size=space.node_size
            )
            if dims is None:
                rejected.append(f"ulysses={U} ring={R}: {why}")
            else:
                pairs.append((U, R, dims))
    return pairs, rejected


def base_candidates(space: SearchSpace, ulysses_degree: int, ring_degree: int) -> list[Candidate]:
    """Every FSDP mode x checkpointing mode (:data:`AC_CANDIDATES`, ``space.ac_every_k`` for ``every_k``) x
    state placement of ``space`` for one pair, in search order; one MLP tile and one head chunk (the search
    sets those)."""
    acs = [
        (m, k if space.ac_every_k is None or m != "every_k" else space.ac_every_k)
        for m, k in AC_CANDIDATES
        if space.ac_modes is None or m in space.ac_modes
    ]
    return [
        Candidate(
            ulysses_degree=ulysses_degree,
            ring_degree=ring_degree,
            world_size=space.world_size,
            node_size=space.node_size,
            fsdp_mode=fsdp_mode,
            activation_checkpointing=ac,
            ac_every_k=k,
            states=where,
        )
        for fsdp_mode in fsdp_modes_to_try(space, space.node_size)
        for ac, k in acs
        for where in space.states
    ]


def enumerate_candidates(
    work: Workload, space: SearchSpace, device: DeviceSpec
) -> tuple[list[LayoutEstimate], list[str]]:
    """Every valid candidate of ``space`` costed for ``work``, fitting or not, and the reasons the others were
    rejected before costing. ``space.mlp_tiles`` None (``auto``): 1, and when 1 does not fit the first of
    :data:`MLP_TILE_CANDIDATES` that fits, or the last one tried. ``space.attn_head_chunks`` None (``auto``):
    1, and when the layout does not fit otherwise the fewest of :func:`head_chunk_candidates` that fits, or
    the most tried."""
    bad = [x for x in space.states if x not in STATE_PLACEMENTS]
    if bad:
        raise ValueError(f"states={bad} are invalid; choose from {STATE_PLACEMENTS}.")
    model, seq_len = work.model, work.seq_len
    check_moe_tiles(model, space.mlp_tiles)
    out: list[LayoutEstimate] = []
    pairs, rejected = valid_pairs(model, space)
    for U, R, dims in pairs:
        tag = f"ulysses={U} ring={R}"
        m = sequence_multiple(R, U, work.ring_layout)
        if seq_len % m:
            rejected.append(f"{tag}: seq_len={seq_len} is not a multiple of {m} ({work.ring_layout} layout)")
            continue
        if work.global_batch is not None and work.global_batch % dims.dp_degree:
            rejected.append(
                f"{tag}: global batch {work.global_batch} does not split over dp_degree={dims.dp_degree}"
            )
            continue
        local = seq_len // (U * R)
        if space.mlp_tiles is not None and local % space.mlp_tiles:
            rejected.append(
                f"{tag}: parallel.mlp_tiles={space.mlp_tiles} does not divide {local} local tokens"
            )
            continue
        tiles = [t for t in mlp_tile_candidates(model) if local % t == 0] if space.mlp_tiles is None else []
        head_chunks = head_chunks_to_try(model, U, R, space.attn_head_chunks)
        if not head_chunks:
            rejected.append(
                f"{tag}: parallel.attn_head_chunks={space.attn_head_chunks} does not split its heads"
            )
            continue
        for base in base_candidates(space, U, R):
            cand = replace(base, mlp_tiles=space.mlp_tiles or 1, attn_head_chunks=head_chunks[0])
            est = estimate_layout(work, cand, device)
            out.append(est)
            for t in [] if est.fits else tiles:  # auto: tiles only when needed
                tiled = estimate_layout(work, replace(cand, mlp_tiles=t), device)
                if tiled.fits or t == tiles[-1]:
                    out.append(tiled)
                    est = tiled
                    break
            for c in [] if est.fits else head_chunks[1:]:  # head chunks only when still needed
                chunked = estimate_layout(
                    work, replace(cand, mlp_tiles=est.mlp_tiles, attn_head_chunks=c), device
                )
                if chunked.fits or c == head_chunks[-1]:
                    out.append(chunked)
                    break
    return out, rejected


__all__ = [
    "AC_CANDIDATES",
    "HEAD_CHUNK_CANDIDATES",
    "MLP_TILE_CANDIDATES",
    "LayoutEstimate",
    "base_candidates",
    "enumerate_candidates",
    "estimate_layout",
    "head_chunk_candidates",
    "mlp_tile_candidates",
    "split_layout",
    "valid_pairs",
]
