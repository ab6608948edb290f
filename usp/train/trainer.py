"""``run(cfg)``: the whole training job from a validated, typed config.

Order (every rank runs all of it; each stage is collective where it says so):

1. process group (:mod:`usp.parallel.process_group`): reuse an initialized one (tests, notebooks), else the
   launcher's store from torchrun, else a one-process world; nccl on CUDA, gloo on CPU. Only a group created
   here is destroyed here.
2. the run dir, checked and locked on rank 0 (:mod:`usp.train.rundir`).
3. start-up (:func:`usp.train.job.start_job`): the tiny model built if asked; validation and resolution, once,
   before any weights or data (:func:`usp.train.checks.check_training_run`: the config's own rules, the model
   dir, the degrees (or the planner's choice for ``auto``) against the world, sequence length vs layout, heads
   vs Ulysses, the MLP tiles, optimizer and trainer settings, the resume path), giving a frozen
   :class:`usp.parallel.ParallelLayout` that every later stage reads (the config is never changed). A
   ``ValueError`` on any rank is raised on every rank (one all_gather of short strings,
   :func:`usp.parallel.agree.on_every_rank`), so no rank is left waiting in a collective.
4. still in :func:`~usp.train.job.start_job`: mesh, tokenizer, data loaders; the model built empty (meta
   device), then :func:`usp.train.parallelize.parallelize` (USP attention, activation checkpointing, FSDP2),
   then each rank's fp32 shards loaded from the checkpoint (rank 0 reads, broadcasts); AdamW + schedule,
   resume (RNG states: :mod:`usp.train.rng`).
5. the loop (:func:`_loop`, one small function per concern): ``grad_accum_steps`` micro-batches per
   optimizer step (:func:`usp.train.step.train_step`), metrics every step (rank 0 writes), validation every
   ``eval_every`` (:mod:`usp.train.validation`), a checkpoint every ``checkpoint_every`` steps and at the end,
   then (:func:`_finish`) the Hugging Face export. SIGTERM/SIGUSR1/SIGINT (Ctrl-C) on any rank
   stops every rank at the same step after a checkpoint (:mod:`usp.train.signals`; no export, result
   ``preempted``); a step watchdog fails a rank that stops progressing (:mod:`usp.train.watchdog`).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from usp.checkpoint import save_checkpoint
from usp.config import TrainConfig
from usp.model import parse_dtype
from usp.parallel import SPMesh
from usp.parallel.agree import on_every_rank
from usp.plan.compute import training_flops
from usp.startup import run_in_process_group
from usp.train.checks import keeps_states_on_host
from usp.train.dpo import dpo_step, dpo_validation
from usp.train.export import export_hf
from usp.train.export_lora import export_adapter
from usp.train.flops import attention_work_imbalance
from usp.train.guard import StepGuard, check_finite_weights
from usp.train.job import Job, ModelShape, start_job
from usp.train.metrics import MetricsLogger
from usp.train.resume import run_fingerprint
from usp.train.rng import rng_state
from usp.train.router_loss import is_moe, router_metrics
from usp.train.rundir import claim_run_dir
from usp.train.signals import REQUEUE_EXIT_CODE, StopRequest
from usp.train.step import StepResult, train_step
from usp.train.validation import validation_metrics
from usp.train.watchdog import build_watchdog

logger = logging.getLogger(__name__)


# --- one concern each, for the loop -----------------------------------------------------------------------
def _due(every: int, done: int) -> bool:
    """Whether a task run every ``every`` steps (0: never) runs after step ``done``."""
    return bool(every) and done % every == 0


def _step_flops(
    document_lengths: list[list[int]], shape: ModelShape, mesh: SPMesh, device: torch.device
) -> float:
    """The step's model FLOPs over every replica: each data-parallel replica counts its own documents, summed
    over the replicas (one all-reduce on the dp group when ``dp_degree > 1``). With LoRA only the trainable
    matmul weights count their weight gradients (``4 N + 2 N_trainable`` per token)."""
    flops = torch.tensor(
        training_flops(
            matmul_params=shape.matmul_params,
            num_layers=shape.num_layers,
            num_heads=shape.num_heads,
            head_dim=shape.head_dim,
            document_lengths=document_lengths,
            layer_attention=shape.layer_attention,
            trainable_matmul_params=shape.trainable_matmul_params,
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


# --- the job ------------------------------------------------------------------------------------------
def run(cfg: TrainConfig, *, save_final: bool = True) -> dict[str, Any]:
    """Train as ``cfg`` says; returns ``{"losses", "final_step", "run_dir", "layout", "checkpoint",
    "export_dir", "adapter_dir", "val_losses", "metrics", "preempted"}`` (the same on every rank; ``losses`` are this run's
    steps only; ``preempted``: stopped by a signal after saving the checkpoint at ``final_step``).

    ``save_final=False`` skips the checkpoint after the last step (a measurement that keeps nothing, e.g.
    ``usp.bench.maxlen``; periodic ``trainer.checkpoint_every`` saves and a signal's save still happen).

    Raises ``ValueError`` on every rank, before loading weights or data, for bad settings.
    """
    return run_in_process_group(
        cfg,
        lambda cfg, device: _run(cfg, device, save_final=save_final),
        cpu_offload=lambda device: keeps_states_on_host(cfg, device),
    )


def _run(cfg: TrainConfig, device: torch.device, *, save_final: bool) -> dict[str, Any]:
    """The run dir first (checked, locked for the job's life, on rank 0; its error raised on every rank), then
    the job. See :mod:`usp.train.rundir`."""
    rank = dist.get_rank()
    with on_every_rank(lambda: claim_run_dir(cfg, rank), "checking the run dir and the checkpoint dir"):
        job = start_job(cfg, device)
        loop = _loop(job, save_final=save_final)
        return _finish(job, loop)


@dataclasses.dataclass
class _LoopEnd:
    """What the loop leaves for the end of the run."""

    losses: list[float]
    val_losses: dict[int, float]
    records: list[dict[str, Any]]
    last_ckpt: Path | None
    done: int  # the last step run (``start_step`` when none ran)
    stopped_by: str | None  # the signal that stopped every rank, or None
    metrics_path: Path | None = None


def _log_start(job: Job) -> None:
    cfg, mesh, layout = job.cfg, job.mesh, job.layout
    logger.info(
        "training %s (%.1fM params, %d layers) on %d ranks: dp %d x ring %d (%s) x ulysses %d, node size %s, "
        "fsdp %s, activation checkpointing %s, mlp tiles %d, optimizer %s; seq_len %d, %d sequence(s)/step; "
        "steps %d -> %d; run dir %s",
        cfg.model.path,
        sum(p.numel() for p in job.model.parameters()) / 1e6,
        job.model_shape.num_layers,
        job.world,
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
        job.start_step,
        cfg.trainer.max_steps,
        job.run_dir,
    )
    if job.lora is not None:
        trainable = sum(p.numel() for p in job.model.parameters() if p.requires_grad)
        total = sum(p.numel() for p in job.model.parameters())
        logger.info(
            "LoRA rank %d, alpha %g, dropout %g on %s%s: %.2fM of %.1fM parameters train (%.2f%%), the rest frozen",
            job.lora.rank,
            job.lora.alpha,
            job.lora.dropout,
            ",".join(job.lora.target_modules or ()),
            " + embeddings and norms" if job.lora.train_embeddings_and_norms else "",
            trainable / 1e6,
            total / 1e6,
            100 * trainable / total,
        )
    if job.dpo is not None:
        logger.info(
            "objective dpo: loss %s, beta %g%s; reference %s",
            job.dpo.loss_type,
            job.dpo.beta,
            f", gamma {job.dpo.simpo_gamma:g}" if job.dpo.loss_type == "simpo" else "",
            "none (reference-free)"
            if job.reference is None
            else f"{cfg.trainer.dpo.reference_path or cfg.model.path} (log-probabilities {job.reference.path})",
        )
    router = getattr(job.loss_model, "router_aux", None)
    if is_moe(job.model):
        logger.info(
            "mixture of experts: experts computed by transformers' %r implementation; router loss %s",
            getattr(job.model.config, "_experts_implementation", None) or "eager",
            "none (the family's own loss has none)"
            if router is None
            else f"load balancing x {router.coef} (top-{router.top_k} of {router.num_experts} experts)",
        )


def _metrics_logger(job: Job) -> MetricsLogger:
    return MetricsLogger(
        job.run_dir,
        rank=job.rank,
        world_size=job.world,
        peak_flops=job.peak_flops,
        wandb_cfg=job.cfg.logging.wandb,
        config=dataclasses.asdict(job.cfg),
        layout=job.layout_info,
        total_steps=job.cfg.trainer.max_steps,
        progress_bar=job.cfg.logging.progress_bar,
        start_step=job.start_step,
        device=job.device,
    )


def _loop(job: Job, *, save_final: bool) -> _LoopEnd:
    """The optimizer steps from ``start_step`` to ``trainer.max_steps``: each step, then (every rank, in the
    same order) the stop agreement, the telemetry all-reduces, the guard, validation when due, the metrics
    line when due, and the checkpoint when due. A signal to any rank stops every rank after the step it agrees
    on, with a checkpoint."""
    cfg = job.cfg
    end = _LoopEnd(
        losses=[], val_losses={}, records=[], last_ckpt=job.resumed_from, done=job.start_step, stopped_by=None
    )
    if job.rank == 0:
        _log_start(job)
    metrics = _metrics_logger(job)
    end.metrics_path = metrics.path
    batches = iter(job.train_loader)
    step_fn = (
        train_step
        if job.dpo is None
        else functools.partial(dpo_step, spec=job.dpo, reference=job.reference)  # trainer.objective=dpo
    )
    guard = StepGuard(cfg.trainer.max_bad_steps, cfg.trainer.loss_spike_factor)
    with ExitStack() as guards:  # SIGTERM/SIGUSR1/SIGINT handlers, the step watchdog, the metrics file
        guards.callback(metrics.close)
        stop = guards.enter_context(StopRequest())
        watchdog = guards.enter_context(build_watchdog(cfg.trainer, job.rank))
        for step in range(job.start_step, cfg.trainer.max_steps):
            watchdog.begin_step(step)
            micro = [next(batches) for _ in range(cfg.trainer.grad_accum_steps)]
            res = step_fn(
                job.loss_model,
                job.optimizer,
                job.scheduler,
                micro,
                mesh=job.mesh,
                grad_clip=cfg.optim.grad_clip,
                device=job.device,
            )
            preempted = stop.agreed(job.device)  # every rank, every step: a signal to any rank stops all here
            flops = _step_flops(res.document_lengths, job.model_shape, job.mesh, job.device)
            watchdog.end_step()
            end.done = done = step + 1
            guard.update(
                done, loss=res.loss, grad_norm=res.grad_norm, skipped=res.skipped, no_targets=res.no_targets
            )
            extra = _step_extra(job, res, guard, done, end)
            if done % cfg.logging.log_every == 0 or done == cfg.trainer.max_steps:
                end.records.append(
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
            end.losses.append(res.loss)
            guard.stop_if_exhausted(end.last_ckpt)
            last = done == cfg.trainer.max_steps
            if _due(cfg.trainer.checkpoint_every, done) or (last and save_final) or preempted:
                end.last_ckpt = _save(job, done, end.last_ckpt)
                watchdog.beat()
            if preempted:
                end.stopped_by = stop.received.name if stop.received else "a signal"
                break
    return end


def _step_extra(job: Job, res: StepResult, guard: StepGuard, done: int, end: _LoopEnd) -> dict[str, Any]:
    """The step's metrics beyond loss/lr/throughput: targets, skipped steps, attention work imbalance, and
    the validation figures when ``trainer.eval_every`` is due (recorded in ``end.val_losses``). Collective."""
    extra: dict[str, Any] = {
        "num_targets": res.num_targets,
        "skipped_steps": guard.total,
        "attn_work_imbalance": _step_imbalance(res.document_lengths, job.mesh, job.device),
    }
    if res.preference is not None:  # DPO: the rewards of the step's pairs
        extra.update(res.preference)
    if res.aux_loss is not None:  # a MoE: its router loss and how evenly the routers spread the tokens
        extra.update(router_metrics(res.aux_loss, res.expert_tokens))
    if _due(job.cfg.trainer.eval_every, done) and job.val_loader is not None:
        if job.dpo is not None:  # the pair loss, reward accuracy and margin over the validation pairs
            extra.update(
                dpo_validation(
                    job.loss_model,
                    job.val_loader,
                    mesh=job.mesh,
                    spec=job.dpo,
                    reference=job.reference,
                    device=job.device,
                )
            )
        else:
            extra.update(validation_metrics(job.cfg, job.loss_model, job.val_loader, job.mesh, job.device))
        end.val_losses[done] = extra["val_loss"]
    return extra


def _save(job: Job, done: int, last_ckpt: Path | None) -> Path:
    """The checkpoint after step ``done``, refused (naming ``last_ckpt``) if a weight is not finite. Collective."""
    check_finite_weights(job.model, step=done, what=f"checkpoint step_{done}", last_checkpoint=last_ckpt)
    return save_checkpoint(
        job.ckpt_root,
        done,
        model=job.model,
        optimizer=job.optimizer,
        scheduler=job.scheduler,
        extra={
            "data": job.train_loader.state_dict(),
            "rng": rng_state(job.device),
            "fingerprint": run_fingerprint(job.cfg),
        },
        keep_last=job.cfg.trainer.keep_last,
    )


def _finish(job: Job, end: _LoopEnd) -> dict[str, Any]:
    """The result; after a full run the Hugging Face export (``trainer.export_hf``), after a signal none."""
    result = {
        "losses": end.losses,
        "start_step": job.start_step,
        "run_dir": str(job.run_dir),
        "layout": job.layout_info,
        "val_losses": end.val_losses,
        "metrics": end.records,
    }
    if end.stopped_by is not None:
        if job.rank == 0:
            logger.warning(
                "stopped by %s after step %d: checkpoint %s; exiting with status %d, requeue (or relaunch with "
                "the same run dir) to continue from it",
                end.stopped_by,
                end.done,
                end.last_ckpt,
                REQUEUE_EXIT_CODE,
            )
        return {
            **result,
            "final_step": end.done,
            "checkpoint": str(end.last_ckpt),
            "export_dir": None,
            "adapter_dir": None,
            "preempted": True,
        }
    final_step = max(job.start_step, job.cfg.trainer.max_steps)
    export_dir = adapter_dir = None
    if job.cfg.trainer.export_hf:
        check_finite_weights(
            job.model, step=final_step, what="the Hugging Face export", last_checkpoint=end.last_ckpt
        )
        if job.lora is not None:
            adapter_dir = export_adapter(
                job.model,
                job.lora,
                out_dir=job.run_dir / "adapter",
                base_path=str(Path(job.cfg.model.path).resolve()),
                tokenizer=job.tokenizer,
            )
        if job.lora is None or job.cfg.model.lora.export_merged:
            export_dir = export_hf(
                job.model,
                tokenizer=job.tokenizer,
                out_dir=job.run_dir / "hf",
                dtype=parse_dtype(job.cfg.model.dtype),
                merge_lora_scale=None if job.lora is None else job.lora.scale,
            )
    if job.rank == 0:
        steady = sorted(r["tokens_per_s"] for r in end.records[1:] or end.records)
        logger.info(
            "done: step %d, loss %s -> %s, median %s tok/s; metrics %s, checkpoint %s, export %s%s",
            final_step,
            f"{end.losses[0]:.4f}" if end.losses else "-",
            f"{end.losses[-1]:.4f}" if end.losses else "-",
            f"{steady[len(steady) // 2]:.0f}" if steady else "-",
            end.metrics_path,
            end.last_ckpt,
            export_dir,
            "" if adapter_dir is None else f", adapter {adapter_dir}",
        )
    return {
        **result,
        "final_step": final_step,
        "checkpoint": None if end.last_ckpt is None else str(end.last_ckpt),
        "export_dir": None if export_dir is None else str(export_dir),
        "adapter_dir": None if adapter_dir is None else str(adapter_dir),
        "preempted": False,
    }
