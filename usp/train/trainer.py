"""``run(cfg)``: the whole training job from a validated, typed config.

Order (every rank runs all of it; each stage is collective where it says so):

1. process group (:mod:`usp.parallel.process_group`): reuse an initialized one (tests, notebooks), else the
   launcher's store from torchrun, else a one-process world; nccl on CUDA, gloo on CPU. Only a group created
   here is destroyed here.
2. the run dir, checked and locked on rank 0 (:mod:`usp.train.rundir`); the tiny model built if asked.
3. validation and resolution, once, before any weights or data (:func:`usp.train.checks.check_training_run`): the
   config's own rules, the model dir (``model.path``), the degrees (or the planner's choice for ``auto``) against the
   world, sequence length vs layout, heads vs Ulysses, the MLP tiles, optimizer and trainer settings, the
   resume path. The result is a frozen :class:`usp.startup.ResolvedDegrees` that every later stage reads; the
   config is never changed. A ``ValueError`` on any rank is raised on every rank (one all_gather of short
   strings, :func:`usp.parallel.agree.on_every_rank`), so no rank is left waiting in a collective.
4. mesh, tokenizer, data loaders; the model built empty (meta device), then
   :func:`usp.train.parallelize.parallelize` (USP attention, activation checkpointing, FSDP2), then each
   rank's fp32 shards loaded from the checkpoint (rank 0 reads, broadcasts); AdamW + schedule, resume
   (RNG states: :mod:`usp.train.rng`).
5. the loop: ``grad_accum_steps`` micro-batches per optimizer step (:func:`usp.train.step.train_step`),
   metrics every step (rank 0 writes), validation every ``eval_every``, a checkpoint every
   ``checkpoint_every`` steps and at the end, then the Hugging Face export. SIGTERM/SIGUSR1/SIGINT (Ctrl-C) on any rank
   stops every rank at the same step after a checkpoint (:mod:`usp.train.signals`; no export, result
   ``preempted``); a step watchdog fails a rank that stops progressing (:mod:`usp.train.watchdog`).
"""

from __future__ import annotations

import dataclasses
import logging
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from transformers import AutoTokenizer

from usp.checkpoint import load_checkpoint, save_checkpoint
from usp.config import TrainConfig
from usp.data import build_dataloaders
from usp.eval.losses import val_ppl_by_position
from usp.model import build_empty_causal_lm, load_sharded_weights, parse_dtype, weight_devices
from usp.parallel import SPMesh
from usp.parallel.agree import on_every_rank
from usp.plan.compute import training_flops
from usp.plan.models import head_dim_of
from usp.startup import build_mesh, run_in_process_group
from usp.train.checks import build_tiny_if_asked, check_training_run, fsdp_cpu_offload, start_up_warnings
from usp.train.export import export_hf
from usp.train.flops import attention_work_imbalance, count_matmul_params
from usp.train.guard import StepGuard, check_finite_weights
from usp.train.loss import IGNORE_INDEX
from usp.train.metrics import MetricsLogger
from usp.train.optim import build_optimizer, reapply_schedule
from usp.train.parallelize import decoder_layers, parallelize
from usp.train.peak_flops import peak_flops_per_device
from usp.train.resume import choose_resume, run_fingerprint
from usp.train.rng import rng_state, seed_everything, set_rng_state
from usp.train.rundir import checkpoint_root, claim_run_dir
from usp.train.signals import REQUEUE_EXIT_CODE, StopRequest
from usp.train.step import train_step
from usp.train.watchdog import build_watchdog

logger = logging.getLogger(__name__)


@torch.no_grad()
def evaluate(loss_model: torch.nn.Module, loader: Any, mesh: SPMesh, device: torch.device) -> float:
    """The validation loss: token-weighted mean over one pass of ``loader`` (all ranks together)."""
    total = torch.zeros(2, dtype=torch.float64, device=device)  # [loss sum, targets]
    for batch in loader:
        labels = batch["labels"].to(device)
        cu = batch.get("cu_seqlens")
        loss_sum = loss_model(
            batch["input_ids"].to(device),
            labels,
            position_ids=batch["position_ids"].to(device),
            cu_seqlens=None if cu is None else cu.to(dtype=torch.int32),
            num_targets=1.0,  # host-side
        )
        total[0] += loss_sum.double()
        total[1] += (labels != IGNORE_INDEX).sum()
    dist.all_reduce(total, group=mesh.group("fsdp"))
    return float(total[0] / total[1].clamp(min=1))


# --- one concern each, for the loop -----------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _ModelShape:
    """What a step's model FLOPs depend on (:func:`usp.plan.compute.training_flops`)."""

    matmul_params: int
    num_layers: int
    num_heads: int
    head_dim: int


def _due(every: int, done: int) -> bool:
    """Whether a task run every ``every`` steps (0: never) runs after step ``done``."""
    return bool(every) and done % every == 0


def _step_flops(
    document_lengths: list[list[int]], shape: _ModelShape, mesh: SPMesh, device: torch.device
) -> float:
    """The step's model FLOPs over every replica: each data-parallel replica counts its own documents, summed
    over the replicas (one all-reduce on the dp group when ``dp_degree > 1``)."""
    flops = torch.tensor(
        training_flops(
            matmul_params=shape.matmul_params,
            num_layers=shape.num_layers,
            num_heads=shape.num_heads,
            head_dim=shape.head_dim,
            document_lengths=document_lengths,
        ),
        dtype=torch.float64,
        device=device,
    )
    if mesh.dp_degree > 1:
        dist.all_reduce(flops, group=mesh.dp_group)
    return float(flops)


def _step_imbalance(document_lengths: list[list[int]], mesh: SPMesh, device: torch.device) -> float:
    """``attn_work_imbalance``: the slowest replica's attention work max / mean over its ring ranks (a MAX
    all-reduce on the dp group when ``dp_degree > 1``)."""
    imbalance = torch.tensor(
        attention_work_imbalance(document_lengths, mesh.ring_degree, mesh.ring_layout),
        dtype=torch.float64,
        device=device,
    )
    if mesh.dp_degree > 1:
        dist.all_reduce(imbalance, op=dist.ReduceOp.MAX, group=mesh.dp_group)
    return float(imbalance)


def _validation(
    cfg: TrainConfig, loss_model: torch.nn.Module, val_loader: Any, mesh: SPMesh, device: torch.device
) -> dict[str, Any]:
    """``val_loss`` (:func:`evaluate`) and, with ``trainer.eval_ppl_by_position``, ``val_ppl_by_position``
    (:func:`usp.eval.losses.val_ppl_by_position`: mean loss per bucket of document positions). Collective."""
    out: dict[str, Any] = {"val_loss": evaluate(loss_model, val_loader, mesh, device)}
    if cfg.trainer.eval_ppl_by_position:
        out["val_ppl_by_position"] = val_ppl_by_position(
            loss_model,
            val_loader,
            mesh,
            device,
            bucket_size=cfg.eval.bucket_size,
            chunk_size=cfg.trainer.loss_chunk_size,
        )
    return out


# --- the job ------------------------------------------------------------------------------------------
def run(cfg: TrainConfig) -> dict[str, Any]:
    """Train as ``cfg`` says; returns ``{"losses", "final_step", "run_dir", "layout", "checkpoint",
    "export_dir", "val_losses", "metrics", "preempted"}`` (the same on every rank; ``losses`` are this run's
    steps only; ``preempted``: stopped by a signal after saving the checkpoint at ``final_step``).

    Raises ``ValueError`` on every rank, before loading weights or data, for bad settings.
    """
    return run_in_process_group(cfg, _run, cpu_offload=lambda device: fsdp_cpu_offload(cfg, device))


def _run(cfg: TrainConfig, device: torch.device) -> dict[str, Any]:
    """The run dir first (checked, locked for the job's life, on rank 0; its error raised on every rank), then
    the job. See :mod:`usp.train.rundir`."""
    rank = dist.get_rank()
    with on_every_rank(lambda: claim_run_dir(cfg, rank), "checking the run dir and the checkpoint dir"):
        return _train(cfg, device)


def _train(cfg: TrainConfig, device: torch.device) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    run_dir = Path(cfg.run_dir)
    on_every_rank(lambda: build_tiny_if_asked(cfg, rank), "building the tiny model (model.build_tiny)")
    model_config, layout = on_every_rank(lambda: check_training_run(cfg, world, device), "config validation")
    if rank == 0:
        for warning in start_up_warnings(cfg):
            logger.warning(warning)
    host_states = fsdp_cpu_offload(cfg, device)  # FSDP2 shards and optimizer states in host memory
    peak_flops = on_every_rank(lambda: peak_flops_per_device(cfg.cluster, device.type), "cluster settings")
    ckpt_root = checkpoint_root(cfg)
    resume_from = choose_resume(cfg, ckpt_root)  # verified; never another run's checkpoints
    seed_everything(cfg.trainer.seed)

    mesh = build_mesh(cfg, layout, device)
    tokenizer = on_every_rank(
        lambda: AutoTokenizer.from_pretrained(cfg.model.path, local_files_only=True), "loading the tokenizer"
    )
    cache_dir = cfg.data.cache_dir or str(run_dir / "data_cache")
    train_loader, val_loader = on_every_rank(
        lambda: build_dataloaders(
            cfg.data,
            tokenizer=tokenizer,
            seq_len=cfg.trainer.seq_len,
            mesh=mesh,
            micro_batch_size=cfg.trainer.micro_batch_size,
            seed=cfg.trainer.seed,
            cache_dir=cache_dir,
        ),
        "building the data loaders",
    )

    # fp32 master weights, never whole on any rank: an empty (meta) model is sharded, then filled (the RoPE
    # overrides were applied to model_config by validate)
    model = build_empty_causal_lm(model_config)
    matmul_params = count_matmul_params(model)
    loss_model = parallelize(
        model,
        mesh,
        attention_backend=cfg.model.attention_backend,
        fsdp_mode=layout.fsdp_mode,
        node_size=layout.node_size,
        activation_checkpointing=layout.activation_checkpointing,
        ac_every_k=layout.ac_every_k,
        param_dtype=parse_dtype(cfg.model.dtype),
        reduce_dtype=parse_dtype(cfg.parallel.reduce_dtype, "parallel.reduce_dtype"),
        loss_chunk_size=cfg.trainer.loss_chunk_size,
        cpu_offload=host_states,
        mlp_tiles=layout.mlp_tiles,
        attn_head_chunks=layout.attn_head_chunks,
    )
    param_device, _ = weight_devices(device, cpu_offload=host_states)  # offload: shards on the CPU
    load_sharded_weights(model, cfg.model.path, device=device, param_device=param_device)
    optimizer, scheduler = build_optimizer(loss_model, cfg.optim, max_steps=cfg.trainer.max_steps)

    start_step = 0
    if resume_from is not None:
        state = load_checkpoint(
            resume_from, model=model, optimizer=optimizer, scheduler=scheduler, verify=False
        )
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
    model_shape = _ModelShape(matmul_params, layers, hf_config.num_attention_heads, head_dim_of(hf_config))
    layout_info = {**mesh.describe(), **dataclasses.asdict(layout)}
    metrics = MetricsLogger(
        run_dir,
        rank=rank,
        world_size=world,
        peak_flops=peak_flops,
        wandb_cfg=cfg.logging.wandb,
        config=dataclasses.asdict(cfg),
        layout=layout_info,
        total_steps=cfg.trainer.max_steps,
        progress_bar=cfg.logging.progress_bar,
        start_step=start_step,
        device=device,
    )
    if rank == 0:
        logger.info(
            "training %s (%.1fM params, %d layers) on %d ranks: dp %d x ring %d (%s) x ulysses %d, node size %s, "
            "fsdp %s, activation checkpointing %s, mlp tiles %d, optimizer %s; seq_len %d, %d sequence(s)/step; steps %d -> %d; run dir %s",
            cfg.model.path,
            sum(p.numel() for p in model.parameters()) / 1e6,
            layers,
            world,
            mesh.dp_degree,
            mesh.ring_degree,
            mesh.ring_layout,
            mesh.ulysses_degree,
            layout.node_size,
            layout.fsdp_mode,
            layout.activation_checkpointing,
            layout.mlp_tiles,
            cfg.optim.name,
            cfg.trainer.seq_len,
            mesh.dp_degree * cfg.trainer.micro_batch_size * cfg.trainer.grad_accum_steps,
            start_step,
            cfg.trainer.max_steps,
            run_dir,
        )
    losses: list[float] = []
    val_losses: dict[int, float] = {}
    records: list[dict[str, Any]] = []
    last_ckpt: Path | None = Path(resume_from) if resume_from is not None else None
    batches = iter(train_loader)
    fingerprint = run_fingerprint(cfg)
    guard = StepGuard(cfg.trainer.max_bad_steps, cfg.trainer.loss_spike_factor)
    guards = ExitStack()  # SIGTERM/SIGUSR1/SIGINT handlers and the step watchdog, for the loop's lifetime
    stop = guards.enter_context(StopRequest())
    watchdog = guards.enter_context(build_watchdog(cfg.trainer, rank))
    preempted = False
    try:
        for step in range(start_step, cfg.trainer.max_steps):
            watchdog.begin_step(step)
            micro = [next(batches) for _ in range(cfg.trainer.grad_accum_steps)]
            res = train_step(
                loss_model,
                optimizer,
                scheduler,
                micro,
                mesh=mesh,
                grad_clip=cfg.optim.grad_clip,
                device=device,
            )
            preempted = stop.agreed(device)  # every rank, every step: a signal to any rank stops all here
            flops = _step_flops(res.document_lengths, model_shape, mesh, device)
            watchdog.end_step()
            done = step + 1
            guard.update(
                done, loss=res.loss, grad_norm=res.grad_norm, skipped=res.skipped, no_targets=res.no_targets
            )
            extra: dict[str, Any] = {
                "num_targets": res.num_targets,
                "skipped_steps": guard.total,
                "attn_work_imbalance": _step_imbalance(res.document_lengths, mesh, device),
            }
            if _due(cfg.trainer.eval_every, done) and val_loader is not None:
                extra.update(_validation(cfg, loss_model, val_loader, mesh, device))
                val_losses[done] = extra["val_loss"]
            if done % cfg.logging.log_every == 0 or done == cfg.trainer.max_steps:
                records.append(
                    metrics.log_step(
                        done,
                        loss=res.loss,
                        grad_norm=res.grad_norm,
                        lr=res.lr,
                        tokens=res.tokens,
                        flops=flops,
                        step_time_s=max(res.step_time_s, 1e-9),
                        extra=extra,
                        trained_tokens=res.num_targets,
                    )
                )
            losses.append(res.loss)
            guard.stop_if_exhausted(last_ckpt)
            if _due(cfg.trainer.checkpoint_every, done) or done == cfg.trainer.max_steps or preempted:
                check_finite_weights(
                    model, step=done, what=f"checkpoint step_{done}", last_checkpoint=last_ckpt
                )
                last_ckpt = save_checkpoint(
                    ckpt_root,
                    done,
                    model=model,
                    optimizer=optimizer,
                    scheduler=scheduler,
                    extra={
                        "data": train_loader.state_dict(),
                        "rng": rng_state(device),
                        "fingerprint": fingerprint,
                    },
                    keep_last=cfg.trainer.keep_last,
                )
                watchdog.beat()
            if preempted:
                break
    finally:
        guards.close()
        metrics.close()

    result = {
        "losses": losses,
        "start_step": start_step,
        "run_dir": str(run_dir),
        "layout": layout_info,
        "val_losses": val_losses,
        "metrics": records,
    }
    if preempted:
        if rank == 0:
            logger.warning(
                "stopped by %s after step %d: checkpoint %s; exiting with status %d, requeue (or relaunch with "
                "the same run dir) to continue from it",
                stop.received.name if stop.received else "a signal",
                done,
                last_ckpt,
                REQUEUE_EXIT_CODE,
            )
        return {
            **result,
            "final_step": done,
            "checkpoint": str(last_ckpt),
            "export_dir": None,
            "preempted": True,
        }
    export_dir = None
    if cfg.trainer.export_hf:
        check_finite_weights(
            model,
            step=max(start_step, cfg.trainer.max_steps),
            what="the Hugging Face export",
            last_checkpoint=last_ckpt,
        )
        export_dir = export_hf(
            model, tokenizer=tokenizer, out_dir=run_dir / "hf", dtype=parse_dtype(cfg.model.dtype)
        )
    if rank == 0:
        steady = sorted(r["tokens_per_s"] for r in records[1:] or records)
        logger.info(
            "done: step %d, loss %s -> %s, median %s tok/s; metrics %s, checkpoint %s, export %s",
            max(start_step, cfg.trainer.max_steps),
            f"{losses[0]:.4f}" if losses else "-",
            f"{losses[-1]:.4f}" if losses else "-",
            f"{steady[len(steady) // 2]:.0f}" if steady else "-",
            metrics.path,
            last_ckpt,
            export_dir,
        )
    return {
        **result,
        "final_step": max(start_step, cfg.trainer.max_steps),
        "checkpoint": None if last_ckpt is None else str(last_ckpt),
        "export_dir": None if export_dir is None else str(export_dir),
        "preempted": False,
    }
