"""``run(cfg)``: the whole training job from a validated, typed config.

Order (every rank runs all of it; each stage is collective where it says so):

1. process group: reuse an initialized one (tests, notebooks), else ``env://`` from torchrun, else a
   one-process world; nccl on CUDA, gloo on CPU. Only a group created here is destroyed here.
2. validation, before any weights or data: checkpoint dir (or build the tiny one on rank 0), degrees (or the
   planner's choice for ``auto``), world size, sequence length vs layout, heads vs Ulysses, optimizer and
   trainer settings, resume path. A ``ValueError`` on any rank is raised on every rank (one all_gather of
   short strings), so no rank is left waiting in a collective.
3. mesh, tokenizer, data loaders; the model built empty (meta device), then
   :func:`usp.train.parallelize.parallelize` (USP attention, activation checkpointing, FSDP2), then each
   rank's fp32 shards loaded from the checkpoint (rank 0 reads, broadcasts); AdamW + schedule, resume.
4. the loop: ``grad_accum_steps`` micro-batches per optimizer step (:func:`usp.train.step.train_step`),
   metrics every step (rank 0 writes), validation every ``eval_every``, a checkpoint every
   ``checkpoint_every`` steps and at the end, then the Hugging Face export. SIGTERM/SIGUSR1 on any rank
   stops every rank at the same step after a checkpoint (:mod:`usp.train.signals`; no export, result
   ``preempted``); a step watchdog fails a rank that stops progressing (:mod:`usp.train.watchdog`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import random
from contextlib import ExitStack
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch
import torch.distributed as dist

from usp.attention import check_attn_head_chunks, resolve_backend
from usp.config import TrainConfig, states_on_host
from usp.model import (
    apply_rope_overrides,
    build_empty_causal_lm,
    check_heads,
    check_model_dir,
    check_rope_for_sequence_parallel,
    load_sharded_weights,
    parse_dtype,
    weight_devices,
)
from usp.parallel import ParallelDims, SPMesh, check_sequence_length, init_sp_mesh
from usp.parallel.agree import on_every_rank
from usp.parallel.mesh import launched_world
from usp.train.elastic import launcher_store
from usp.train.loss import IGNORE_INDEX
from usp.train.offload import check_host_memory
from usp.train.optim import build_optimizer, check_optim_config
from usp.train.parallelize import AC_MODES, FSDP_MODES, decoder_layers, parallelize
from usp.train.resume import check_auto_resume, choose_resume, run_fingerprint  # noqa: F401 - public here too
from usp.train.signals import REQUEUE_EXIT_CODE, StopRequest
from usp.train.step import train_step
from usp.train.tiling import check_tiling_available, resolve_mlp_tiles
from usp.train.watchdog import build_watchdog

logger = logging.getLogger(__name__)
T = TypeVar("T")


# --- process group and agreement ----------------------------------------------------------------------
def resolve_device(setting: str) -> torch.device:
    """``trainer.device``: ``auto`` -> this rank's CUDA device if there is one, else CPU."""
    if setting not in ("auto", "cuda", "cpu"):
        raise ValueError(f"trainer.device={setting!r} is invalid; choose auto, cuda or cpu.")
    if setting == "cuda" and not torch.cuda.is_available():
        raise ValueError("trainer.device=cuda but no CUDA device is visible; use trainer.device=cpu or auto.")
    if setting == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())


def init_distributed(
    device: torch.device, backend: str | None = None, *, timeout_minutes: int = 60, cpu_offload: bool = False
) -> bool:
    """Initialize torch.distributed unless it already is; returns whether this call created the group.

    ``timeout_minutes`` (``parallel.timeout_minutes``) bounds every collective wait: long enough for rank 0's
    start-up data preparation and a large checkpoint save, short enough that a dead peer ends the job.
    ``cpu_offload`` (``parallel.cpu_offload``) with nccl adds gloo for CPU tensors (``cpu:gloo,cuda:nccl``): the
    offloaded shards are CPU tensors in the weight broadcast and the gradient-norm all-reduce.
    Under a launcher the group meets in :func:`usp.train.elastic.launcher_store` (the launcher's store, keys
    private to each ``torchrun --max-restarts`` attempt), not ``env://``, whose keys a restart would reuse.
    """
    if dist.is_initialized():
        return False
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = backend or ("nccl" if device.type == "cuda" else "gloo")
    if cpu_offload and backend == "nccl":
        backend = "cpu:gloo,cuda:nccl"
    timeout = timedelta(minutes=timeout_minutes)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # a launcher; keys private to this restart
        store = launcher_store(timeout)
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    else:  # one process, no launcher
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    return True


# --- validation ---------------------------------------------------------------------------------------
@dataclasses.dataclass
class Layout:
    """The resolved parallel layout of a run (explicit degrees, or the planner's choice)."""

    ulysses_degree: int
    ring_degree: int
    dp_degree: int
    node_size: int
    fsdp_mode: str
    activation_checkpointing: str
    ac_every_k: int
    mlp_tiles: int = 1
    """Resolved ``parallel.mlp_tiles`` (a divisor of the local tokens; 1 = off)."""
    attn_head_chunks: int = 1
    """``parallel.attn_head_chunks`` (checked against the heads per rank; 1 = off)."""
    reason: str = "set in the config"


def _node_size(cfg: TrainConfig, world_size: int) -> int:
    if cfg.parallel.node_size is not None:
        return int(cfg.parallel.node_size)
    return launched_world()[1] or world_size


def _planner_constraints(cfg: TrainConfig) -> dict[str, Any]:
    """What the user fixed for :func:`usp.plan.auto_degrees`: a degree that is not ``auto``; ``fsdp_mode`` and
    ``activation_checkpointing`` when they differ from their defaults (``full_shard``, ``none``: at the default
    the planner chooses); the compute dtype, ring layout, loss chunk, MLP tiles (``auto``: the planner's
    choice), the attention head chunks, where the states live and the host memory of the run."""
    p, defaults = cfg.parallel, type(cfg.parallel)()
    out: dict[str, Any] = {
        "compute_bytes": 4 if cfg.model.dtype == "float32" else 2,
        "ring_layout": p.ring_layout,
        "loss_chunk_size": cfg.trainer.loss_chunk_size,
        "mlp_tiles": p.mlp_tiles,
        "attn_head_chunks": p.attn_head_chunks,
        "cpu_offload": states_on_host(cfg.optim.name, p.cpu_offload),
        "host_mem_gib": cfg.cluster.host_mem_gib,
    }
    for name in ("ulysses_degree", "ring_degree"):
        value = getattr(p, name)
        if value != "auto":
            out[name] = int(value)
    if p.fsdp_mode != defaults.fsdp_mode:
        out["fsdp_mode"] = p.fsdp_mode
    if p.activation_checkpointing != defaults.activation_checkpointing:
        out["activation_checkpointing"] = p.activation_checkpointing
        out["ac_every_k"] = p.ac_every_k
    return out


def resolve_layout(cfg: TrainConfig, model_config: Any, world_size: int, device: torch.device) -> Layout:
    """Explicit degrees, or ``auto`` -> :func:`usp.plan.auto_degrees`.

    With ``auto`` the planner keeps what the user fixed (:func:`_planner_constraints`): the other degree when
    only one is ``auto``, and ``fsdp_mode`` / ``activation_checkpointing`` unless they are at their defaults
    (``full_shard`` / ``none``), which leave the choice to the planner.
    """
    p = cfg.parallel
    node_size = _node_size(cfg, world_size)
    if "auto" in (p.ulysses_degree, p.ring_degree):
        from usp.plan import auto_degrees

        gpu = cfg.cluster.gpu if device.type == "cuda" else "cpu"
        plan = auto_degrees(
            model_config.to_dict(), seq_len=cfg.trainer.seq_len, world_size=world_size, node_size=node_size,
            gpu=gpu, memory_gib=cfg.cluster.memory_gib, **_planner_constraints(cfg),
        )  # fmt: skip
        return Layout(
            ulysses_degree=int(plan["ulysses_degree"]),
            ring_degree=int(plan["ring_degree"]),
            dp_degree=int(plan["dp_degree"]),
            node_size=node_size,
            fsdp_mode=plan.get("fsdp_mode", p.fsdp_mode),
            activation_checkpointing=plan.get("activation_checkpointing", p.activation_checkpointing),
            ac_every_k=int(plan.get("ac_every_k", p.ac_every_k)),
            mlp_tiles=plan.get("mlp_tiles", p.mlp_tiles),
            attn_head_chunks=int(plan.get("attn_head_chunks", p.attn_head_chunks)),
            reason=f"planner: {plan.get('reason', '')}",
        )
    for name in ("ulysses_degree", "ring_degree"):
        value = getattr(p, name)
        if isinstance(value, str) and value.isdigit():
            setattr(p, name, int(value))
        elif not isinstance(getattr(p, name), int):
            raise ValueError(f"parallel.{name}={value!r} is invalid: use a positive integer or auto.")
    return Layout(
        ulysses_degree=p.ulysses_degree,
        ring_degree=p.ring_degree,
        dp_degree=p.dp_degree,
        node_size=node_size,
        fsdp_mode=p.fsdp_mode,
        activation_checkpointing=p.activation_checkpointing,
        ac_every_k=p.ac_every_k,
        mlp_tiles=p.mlp_tiles,
        attn_head_chunks=p.attn_head_chunks,
    )


def fsdp_cpu_offload(cfg: TrainConfig, device: torch.device) -> bool:
    """Whether FSDP2 keeps the sharded parameters, gradients and optimizer states in host memory: on CUDA when
    :func:`usp.config.states_on_host` says so (``parallel.cpu_offload`` or an ``optim.name`` that steps on the
    host); never on a CPU device, where they are in host memory already."""
    return device.type == "cuda" and states_on_host(cfg.optim.name, cfg.parallel.cpu_offload)


def _check_memory_tricks(cfg: TrainConfig, model_config: Any, layout: Layout, world_size: int) -> None:
    """Resolve ``parallel.mlp_tiles`` into ``layout.mlp_tiles`` and check it; check the host memory that
    ``activation_checkpointing=offload`` takes on a node (``ValueError`` naming the setting)."""
    local_tokens = cfg.trainer.seq_len // (layout.ulysses_degree * layout.ring_degree)
    layout.mlp_tiles = resolve_mlp_tiles(layout.mlp_tiles, local_tokens=local_tokens, hidden_size=model_config.hidden_size)
    check_tiling_available(layout.mlp_tiles)
    hq = model_config.num_attention_heads
    check_attn_head_chunks(
        layout.attn_head_chunks, hq, getattr(model_config, "num_key_value_heads", None) or hq, layout.ulysses_degree
    )
    if layout.activation_checkpointing == "offload":
        check_host_memory(
            num_layers=model_config.num_hidden_layers, local_tokens=local_tokens * cfg.trainer.micro_batch_size,
            hidden_size=model_config.hidden_size, compute_bytes=parse_dtype(cfg.model.dtype).itemsize,
            ranks_per_node=min(layout.node_size, world_size),
        )  # fmt: skip


def _check_trainer(cfg: TrainConfig) -> None:
    t = cfg.trainer
    for name in ("max_steps", "seq_len", "micro_batch_size", "grad_accum_steps", "loss_chunk_size", "keep_last",
                 "max_bad_steps"):  # fmt: skip
        value = getattr(t, name)
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"trainer.{name}={value!r} must be an integer >= 1.")
    for name in ("checkpoint_every", "eval_every"):
        value = getattr(t, name)
        if not isinstance(value, int) or value < 0:
            raise ValueError(f"trainer.{name}={value!r} must be an integer >= 0 (0 = off).")
    if t.eval_every and not cfg.data.validation_fraction:
        raise ValueError(
            f"trainer.eval_every={t.eval_every} needs validation data: set data.validation_fraction > 0 "
            f"(e.g. 0.01), or trainer.eval_every=0."
        )
    if cfg.data.document_masking and t.micro_batch_size > 1:
        raise ValueError(
            f"data.document_masking=true needs trainer.micro_batch_size=1 (got {t.micro_batch_size}): document "
            f"boundaries (cu_seqlens) describe one packed row, so with several rows attention would cross "
            f"documents. Keep micro_batch_size=1 and raise trainer.grad_accum_steps (or the data-parallel "
            f"degree), or set data.document_masking=false."
        )
    if t.resume not in (None, "auto") and not Path(t.resume).exists():
        raise ValueError(
            f"trainer.resume={t.resume!r} does not exist. Point it at a step_<N> checkpoint dir (or a checkpoint "
            f"root), use trainer.resume=auto (latest in the checkpoint dir, if any), or null to start fresh."
        )


def validate(cfg: TrainConfig, world_size: int, device: torch.device) -> tuple[Any, Layout]:
    """Every check that needs no weights, data or collectives; returns ``(model_config, layout)``.

    Raises ``ValueError`` naming the setting and the fix.
    """
    model_config = check_model_dir(cfg.model.path)
    apply_rope_overrides(  # the RoPE the run will train with: the planner and the checks below see it
        model_config, rope_theta=cfg.model.rope_theta, rope_scaling=cfg.model.rope_scaling,
        max_position_embeddings=cfg.model.max_position_embeddings,
    )  # fmt: skip
    compute_dtype = parse_dtype(cfg.model.dtype, "model.dtype")
    try:
        head_dim = getattr(model_config, "head_dim", None) or (
            model_config.hidden_size // model_config.num_attention_heads
        )
        resolve_backend(cfg.model.attention_backend, device, compute_dtype, head_dim=head_dim)
    except ValueError as e:
        raise ValueError(f"model.attention_backend={cfg.model.attention_backend!r}: {e}") from e
    parse_dtype(cfg.parallel.reduce_dtype, "parallel.reduce_dtype")
    _check_trainer(cfg)
    check_optim_config(cfg.optim, cfg.trainer.max_steps)
    layout = resolve_layout(cfg, model_config, world_size, device)
    if layout.fsdp_mode not in FSDP_MODES:
        raise ValueError(f"parallel.fsdp_mode={layout.fsdp_mode!r} is invalid; choose one of {FSDP_MODES}.")
    if layout.activation_checkpointing not in AC_MODES:
        raise ValueError(
            f"parallel.activation_checkpointing={layout.activation_checkpointing!r} is invalid; choose one of "
            f"{AC_MODES}."
        )
    if layout.ac_every_k < 1:
        raise ValueError(f"parallel.ac_every_k={layout.ac_every_k} must be >= 1.")
    if cfg.parallel.cpu_offload and device.type != "cuda":
        raise ValueError(
            "parallel.cpu_offload=true needs CUDA devices (it moves FSDP2 shards between GPU and host); "
            "set parallel.cpu_offload=false for CPU runs."
        )
    dims = ParallelDims(
        world_size=world_size,
        ulysses_degree=layout.ulysses_degree,
        ring_degree=layout.ring_degree,
        dp_degree=layout.dp_degree,
        node_size=cfg.parallel.node_size,
        allow_cross_node_ulysses=cfg.parallel.allow_cross_node_ulysses,
    )
    layout.dp_degree = dims.dp_degree
    check_sequence_length(cfg.trainer.seq_len, layout.ring_degree, layout.ulysses_degree, cfg.parallel.ring_layout)
    check_heads(model_config, layout.ulysses_degree)
    check_rope_for_sequence_parallel(model_config, layout.ulysses_degree * layout.ring_degree)
    if layout.fsdp_mode == "hybrid_shard" and world_size % layout.node_size != 0:
        raise ValueError(
            f"parallel.fsdp_mode=hybrid_shard needs the node size ({layout.node_size}) to divide the world size "
            f"{world_size}; set parallel.node_size or use parallel.fsdp_mode=full_shard."
        )
    _check_memory_tricks(cfg, model_config, layout, world_size)
    return model_config, layout


# --- state for checkpoints ----------------------------------------------------------------------------
def rng_state(device: torch.device) -> dict[str, Any]:
    """This rank's RNG states as plain data (tensors, ints, tuples), so a checkpoint loads with
    ``weights_only=True``: numpy's ``(name, uint32 keys, pos, has_gauss, cached_gaussian)`` keeps its keys as
    an int64 tensor."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": (str(name), torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)),
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (1 << 32))
    torch.manual_seed(seed)


# --- validation loss ----------------------------------------------------------------------------------
@torch.no_grad()
def evaluate(loss_model: torch.nn.Module, loader: Any, mesh: SPMesh, device: torch.device) -> float:
    """Token-weighted mean loss over one pass of ``loader`` (all ranks together)."""
    total = torch.zeros(2, dtype=torch.float64, device=device)  # [loss sum, targets]
    for batch in loader:
        labels = batch["labels"].to(device)
        cu = batch.get("cu_seqlens")
        loss_sum = loss_model(
            batch["input_ids"].to(device), labels, position_ids=batch["position_ids"].to(device),
            cu_seqlens=None if cu is None else cu.to(dtype=torch.int32), num_targets=1.0,  # host-side
        )  # fmt: skip
        total[0] += loss_sum.double()
        total[1] += (labels != IGNORE_INDEX).sum()
    dist.all_reduce(total, group=mesh.group("fsdp"))
    return float(total[0] / total[1].clamp(min=1))


# --- the job ------------------------------------------------------------------------------------------
def run(cfg: TrainConfig) -> dict[str, Any]:
    """Train as ``cfg`` says; returns ``{"losses", "final_step", "run_dir", "layout", "checkpoint",
    "export_dir", "val_losses", "metrics", "preempted"}`` (the same on every rank; ``losses`` are this run's
    steps only; ``preempted``: stopped by a signal after saving the checkpoint at ``final_step``).

    Raises ``ValueError`` on every rank, before loading weights or data, for bad settings.
    """
    device = resolve_device(cfg.trainer.device)
    created = init_distributed(
        device, cfg.parallel.backend, timeout_minutes=cfg.parallel.timeout_minutes,
        cpu_offload=fsdp_cpu_offload(cfg, device),
    )  # fmt: skip
    try:
        return _run(cfg, device)
    finally:
        if created:
            dist.destroy_process_group()


def _build_tiny_if_asked(cfg: TrainConfig, rank: int) -> None:
    if not cfg.model.build_tiny:
        return
    path = Path(cfg.model.path)
    if rank == 0 and not (path / "config.json").exists():
        from usp.tiny import build_tiny_llama

        build_tiny_llama(path, seed=cfg.trainer.seed, **dict(cfg.model.tiny_size))


def _run(cfg: TrainConfig, device: torch.device) -> dict[str, Any]:
    """The run dir first (checked, locked for the job's life, on rank 0; its error raised on every rank), then
    the job. See :mod:`usp.train.rundir`."""
    from usp.train.rundir import claim_run_dir

    rank = dist.get_rank()
    with on_every_rank(lambda: claim_run_dir(cfg, rank), "checking the run dir (hydra.run.dir)"):
        return _train(cfg, device)


def _train(cfg: TrainConfig, device: torch.device) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from usp.data import build_dataloaders
    from usp.train.checkpoint import load_checkpoint, save_checkpoint
    from usp.train.export import export_hf
    from usp.train.guard import StepGuard, check_finite_weights
    from usp.train.metrics import (
        MetricsLogger,
        attention_work_imbalance,
        count_dense_params,
        peak_flops_per_device,
        training_flops,
    )
    from usp.train.optim import reapply_schedule
    from usp.train.rundir import checkpoint_root

    rank, world = dist.get_rank(), dist.get_world_size()
    run_dir = Path(cfg.run_dir)
    on_every_rank(lambda: _build_tiny_if_asked(cfg, rank), "building the tiny model (model.build_tiny)")
    model_config, layout = on_every_rank(lambda: validate(cfg, world, device), "config validation")
    peak_flops = on_every_rank(lambda: peak_flops_per_device(cfg.cluster, device.type), "cluster settings")
    ckpt_root = checkpoint_root(cfg)
    resume_from = choose_resume(cfg, ckpt_root)  # verified; never another run's checkpoints
    seed_everything(cfg.trainer.seed)

    mesh = init_sp_mesh(
        layout.ulysses_degree, layout.ring_degree, dp_degree=layout.dp_degree, node_size=cfg.parallel.node_size,
        ring_layout=cfg.parallel.ring_layout, allow_cross_node_ulysses=cfg.parallel.allow_cross_node_ulysses,
        device_type=device.type, timeout=timedelta(minutes=cfg.parallel.timeout_minutes),
    )  # fmt: skip
    tokenizer = on_every_rank(
        lambda: AutoTokenizer.from_pretrained(cfg.model.path, local_files_only=True), "loading the tokenizer"
    )
    cache_dir = cfg.data.cache_dir or str(run_dir / "data_cache")
    train_loader, val_loader = on_every_rank(
        lambda: build_dataloaders(
            cfg.data, tokenizer=tokenizer, seq_len=cfg.trainer.seq_len, mesh=mesh,
            micro_batch_size=cfg.trainer.micro_batch_size, seed=cfg.trainer.seed, cache_dir=cache_dir,
        ),
        "building the data loaders",
    )  # fmt: skip

    # fp32 master weights, never whole on any rank: an empty (meta) model is sharded, then filled (the RoPE
    # overrides were applied to model_config by validate)
    model = build_empty_causal_lm(model_config)
    dense_params = count_dense_params(model)
    loss_model = parallelize(
        model, mesh, attention_backend=cfg.model.attention_backend, fsdp_mode=layout.fsdp_mode,
        node_size=layout.node_size, activation_checkpointing=layout.activation_checkpointing,
        ac_every_k=layout.ac_every_k, param_dtype=parse_dtype(cfg.model.dtype),
        reduce_dtype=parse_dtype(cfg.parallel.reduce_dtype, "parallel.reduce_dtype"),
        loss_chunk_size=cfg.trainer.loss_chunk_size, cpu_offload=fsdp_cpu_offload(cfg, device),
        mlp_tiles=layout.mlp_tiles,
        attn_head_chunks=layout.attn_head_chunks,
    )  # fmt: skip
    param_device, _ = weight_devices(device, cpu_offload=fsdp_cpu_offload(cfg, device))  # offload: shards on the CPU
    load_sharded_weights(model, cfg.model.path, device=device, param_device=param_device)
    optimizer, scheduler = build_optimizer(
        loss_model, cfg.optim, max_steps=cfg.trainer.max_steps, host_states=fsdp_cpu_offload(cfg, device)
    )

    start_step = 0
    if resume_from is not None:
        state = load_checkpoint(resume_from, model=model, optimizer=optimizer, scheduler=scheduler, verify=False)
        reapply_schedule(optimizer, scheduler, cfg.optim.lr)  # this run's schedule from its first step
        start_step = state["step"]
        extra = state["extra"]
        train_loader.load_state_dict(extra["data"])
        if state.get("extra_rank", rank) == rank:
            set_rng_state(extra["rng"], device)
        if rank == 0:
            logger.info("resumed from %s at step %d", state.get("path", resume_from), start_step)

    hf_config = model.config
    layers = len(decoder_layers(model))
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    layout_info = {**mesh.describe(), **dataclasses.asdict(layout)}
    metrics = MetricsLogger(
        run_dir, rank=rank, world_size=world, peak_flops=peak_flops, wandb_cfg=cfg.logging.wandb,
        config=dataclasses.asdict(cfg), layout=layout_info, total_steps=cfg.trainer.max_steps,
        progress_bar=cfg.logging.progress_bar, start_step=start_step, device=device,
    )  # fmt: skip
    if rank == 0:
        logger.info(
            "training %s (%.1fM params, %d layers) on %d ranks: dp %d x ring %d (%s) x ulysses %d, node size %s, "
            "fsdp %s, activation checkpointing %s, mlp tiles %d, optimizer %s; seq_len %d, %d sequence(s)/step; steps %d -> %d; run dir %s",
            cfg.model.path, sum(p.numel() for p in model.parameters()) / 1e6, layers, world, mesh.dp_degree,
            mesh.ring_degree, mesh.ring_layout, mesh.ulysses_degree, layout.node_size, layout.fsdp_mode,
            layout.activation_checkpointing, layout.mlp_tiles, cfg.optim.name, cfg.trainer.seq_len,
            mesh.dp_degree * cfg.trainer.micro_batch_size * cfg.trainer.grad_accum_steps, start_step,
            cfg.trainer.max_steps, run_dir,
        )  # fmt: skip
    losses: list[float] = []
    val_losses: dict[int, float] = {}
    records: list[dict[str, Any]] = []
    last_ckpt: Path | None = Path(resume_from) if resume_from is not None else None
    batches = iter(train_loader)
    fingerprint = run_fingerprint(cfg)
    guard = StepGuard(cfg.trainer.max_bad_steps, cfg.trainer.loss_spike_factor)
    guards = ExitStack()  # SIGTERM/SIGUSR1 handlers and the step watchdog, for the loop's lifetime
    stop = guards.enter_context(StopRequest())
    watchdog = guards.enter_context(build_watchdog(cfg.trainer, rank))
    preempted = False
    try:
        for step in range(start_step, cfg.trainer.max_steps):
            watchdog.begin_step(step)
            micro = [next(batches) for _ in range(cfg.trainer.grad_accum_steps)]
            res = train_step(
                loss_model, optimizer, scheduler, micro, mesh=mesh, grad_clip=cfg.optim.grad_clip, device=device
            )
            preempted = stop.agreed(device)  # every rank, every step: a signal to any rank stops all here
            flops = torch.tensor(
                training_flops(
                    dense_params=dense_params, num_layers=layers, num_heads=hf_config.num_attention_heads,
                    head_dim=head_dim, document_lengths=res.document_lengths,
                ),  # fmt: skip
                dtype=torch.float64,
                device=device,
            )
            if mesh.dp_degree > 1:  # each replica counted its own documents
                dist.all_reduce(flops, group=mesh.dp_group)
            watchdog.end_step()
            done = step + 1
            guard.update(done, loss=res.loss, grad_norm=res.grad_norm, skipped=res.skipped)
            imbalance = torch.tensor(  # the slowest replica's attention work max/mean over its ring ranks
                attention_work_imbalance(res.document_lengths, mesh.ring_degree, mesh.ring_layout),
                dtype=torch.float64, device=device,
            )  # fmt: skip
            if mesh.dp_degree > 1:
                dist.all_reduce(imbalance, op=dist.ReduceOp.MAX, group=mesh.dp_group)
            extra: dict[str, Any] = {
                "num_targets": res.num_targets, "skipped_steps": guard.total, "attn_work_imbalance": float(imbalance)
            }  # fmt: skip
            if cfg.trainer.eval_every and val_loader is not None and done % cfg.trainer.eval_every == 0:
                val_losses[done] = extra["val_loss"] = evaluate(loss_model, val_loader, mesh, device)
                if cfg.trainer.eval_ppl_by_position:  # usp.eval: mean loss per bucket of document positions
                    from usp.eval.losses import val_ppl_by_position

                    extra["val_ppl_by_position"] = val_ppl_by_position(
                        loss_model, val_loader, mesh, device, bucket_size=cfg.eval.bucket_size,
                        chunk_size=cfg.trainer.loss_chunk_size,
                    )  # fmt: skip
            if done % cfg.logging.log_every == 0 or done == cfg.trainer.max_steps:
                records.append(
                    metrics.log_step(
                        done, loss=res.loss, grad_norm=res.grad_norm, lr=res.lr, tokens=res.tokens,
                        flops=float(flops), step_time_s=max(res.step_time_s, 1e-9), extra=extra,
                    )  # fmt: skip
                )
            losses.append(res.loss)
            guard.stop_if_exhausted(last_ckpt)
            periodic = cfg.trainer.checkpoint_every and done % cfg.trainer.checkpoint_every == 0
            if periodic or done == cfg.trainer.max_steps or preempted:
                check_finite_weights(model, step=done, what=f"checkpoint step_{done}", last_checkpoint=last_ckpt)
                last_ckpt = save_checkpoint(
                    ckpt_root, done, model=model, optimizer=optimizer, scheduler=scheduler,
                    extra={"data": train_loader.state_dict(), "rng": rng_state(device), "fingerprint": fingerprint},
                    keep_last=cfg.trainer.keep_last,
                )  # fmt: skip
                watchdog.beat()
            if preempted:
                break
    finally:
        guards.close()
        metrics.close()

    if preempted:
        if rank == 0:
            logger.warning(
                "stopped by %s after step %d: checkpoint %s; exiting with status %d, requeue (or relaunch with "
                "the same run dir) to continue from it", stop.received.name if stop.received else "a signal",
                done, last_ckpt, REQUEUE_EXIT_CODE,
            )  # fmt: skip
        return {
            "losses": losses, "final_step": done, "start_step": start_step, "run_dir": str(run_dir),
            "layout": layout_info, "checkpoint": str(last_ckpt), "export_dir": None, "val_losses": val_losses,
            "metrics": records, "preempted": True,
        }  # fmt: skip
    export_dir = None
    if cfg.trainer.export_hf:
        check_finite_weights(model, step=max(start_step, cfg.trainer.max_steps), what="the Hugging Face export",
                             last_checkpoint=last_ckpt)  # fmt: skip
        export_dir = export_hf(
            model, tokenizer=tokenizer, out_dir=run_dir / "hf", dtype=parse_dtype(cfg.model.dtype)
        )
    if rank == 0:
        steady = sorted(r["tokens_per_s"] for r in records[1:] or records)
        logger.info(
            "done: step %d, loss %s -> %s, median %s tok/s; metrics %s, checkpoint %s, export %s",
            max(start_step, cfg.trainer.max_steps),
            f"{losses[0]:.4f}" if losses else "-", f"{losses[-1]:.4f}" if losses else "-",
            f"{steady[len(steady) // 2]:.0f}" if steady else "-", metrics.path, last_ckpt, export_dir,
        )  # fmt: skip
    return {
        "losses": losses,
        "final_step": max(start_step, cfg.trainer.max_steps),
        "start_step": start_step,
        "run_dir": str(run_dir),
        "layout": layout_info,
        "checkpoint": None if last_ckpt is None else str(last_ckpt),
        "export_dir": None if export_dir is None else str(export_dir),
        "val_losses": val_losses,
        "metrics": records,
        "preempted": False,
    }
