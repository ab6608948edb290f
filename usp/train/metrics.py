"""The per-step metrics logger (:class:`MetricsLogger`): ``metrics.jsonl``, ``layout.json``, wandb and the progress bar.

FLOPs per step: :func:`usp.plan.compute.training_flops`; the peak FLOP/s table: :mod:`usp.train.peak_flops`;
MFU: :func:`usp.plan.compute.mfu`; memory
probes: :mod:`usp.train.peak_memory`; the ``metrics.jsonl`` file rules: :mod:`usp.train.metrics_file`; wandb:
:mod:`usp.train.wandb_run`.

Only rank 0 writes: one JSON object per logged step appended to ``<run_dir>/metrics.jsonl`` (stable field
names, see :data:`METRIC_FIELDS`), the wandb run and the progress bar. Every rank computes the same numbers
(``tokens`` and ``flops`` passed in are global totals; ``peak_mem_gib`` is all-reduced to the max over ranks),
so any rank may use the returned dict. A run resumed at step ``s`` (``start_step=s``) first drops the records
of steps after ``s`` (logged after the checkpoint, before the crash), so no step appears twice.

``metrics.jsonl`` is strict JSON: a NaN or infinite value (a step the trainer skipped) is written as ``null``.
The progress bar is drawn only when stderr is a terminal; in batch jobs (SLURM ``.out`` files, the Hydra log)
rank 0 logs one line per logged step instead (step, loss, grad norm, lr, tokens/s, TFLOP/s, MFU, memory).
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

from usp.atomic import write_text
from usp.config import WandbConfig
from usp.plan.compute import mfu
from usp.train.metrics_file import drop_records_after, json_safe
from usp.train.peak_memory import max_over_ranks, peak_memory_gib, peak_memory_reserved_gib, reset_peak_memory
from usp.train.wandb_run import init_wandb

logger = logging.getLogger(__name__)

METRIC_FIELDS: tuple[str, ...] = (
    "step",
    "loss",
    "grad_norm",
    "lr",
    "tokens",
    "tokens_per_s",
    "tokens_per_s_per_gpu",
    "tflops_per_gpu",
    "mfu",
    "peak_mem_gib",
    "step_time_s",
)
"""Fields of every ``metrics.jsonl`` record (stable names); ``extra`` keys passed to ``log_step`` follow."""

CUDA_METRIC_FIELDS: tuple[str, ...] = ("peak_mem_reserved_gib",)
"""Fields only CUDA runs record (absent on CPU): ``peak_mem_reserved_gib``, the max over ranks of the caching
allocator's peak reserved memory since the previous logged step (:func:`peak_memory_reserved_gib`)."""


def stderr_is_terminal() -> bool:
    """Whether a progress bar can be drawn: stderr is a TTY (not a SLURM output file or a pipe)."""
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False


class MetricsLogger:
    """Per-step metrics for one run: computes throughput/MFU on every rank, writes from rank 0 only.

    Args:
        run_dir: where ``metrics.jsonl`` (appended to, so a resumed run continues it) and wandb files go.
        rank, world_size: this process and the number of devices (the per-GPU divisor).
        peak_flops: dense peak FLOP/s of one device (:func:`peak_flops_per_device`).
        wandb_cfg: ``logging.wandb``; ``disabled`` writes nothing to wandb and never imports it.
        config: the run config as a plain dict (logged once to wandb).
        layout: the parallel layout (``SPMesh.describe()``), logged once to wandb and to ``layout.json``.
        total_steps: the progress bar's length (``trainer.max_steps``).
        progress_bar: show a tqdm bar on rank 0 when stderr is a terminal; otherwise (or with ``False``) log one
            line per logged step.
        start_step: the step this run starts from (the resumed checkpoint's); when given, records of later
            steps already in ``metrics.jsonl`` are dropped first. ``None`` (default) appends as is.
        device: where the per-step max-over-ranks of ``peak_mem_gib`` is reduced (this rank's CUDA device
            under nccl). With a process group of several ranks, :meth:`log_step` is collective.
    """

    def __init__(
        self,
        run_dir: str | os.PathLike,
        *,
        rank: int,
        world_size: int,
        peak_flops: float,
        wandb_cfg: WandbConfig,
        config: dict,
        layout: dict,
        total_steps: int,
        progress_bar: bool = True,
        start_step: int | None = None,
        device: Any = "cpu",
    ) -> None:
        if world_size < 1 or peak_flops <= 0:
            raise ValueError(
                f"MetricsLogger: world_size={world_size} must be >= 1, peak_flops={peak_flops} > 0"
            )
        self.run_dir = Path(run_dir)
        self.rank = rank
        self.world_size = world_size
        self.peak_flops = float(peak_flops)
        self.is_writer = rank == 0
        self.path = self.run_dir / "metrics.jsonl"
        self._file = None
        self._wandb = None
        self._bar = None
        self.total_steps = total_steps
        self.device = device
        if not self.is_writer:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if start_step is not None:
            dropped = drop_records_after(self.path, start_step)
            if dropped:
                logger.info(
                    "metrics.jsonl: dropped %d record(s) after step %d (resumed there)", dropped, start_step
                )
        write_text(self.run_dir / "layout.json", json.dumps(layout, indent=2, default=str) + "\n")
        if wandb_cfg.mode != "disabled":
            self._wandb = init_wandb(wandb_cfg, self.run_dir, config, layout)
        self._file = open(self.path, "a")  # closed in close()
        if progress_bar and stderr_is_terminal():
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, desc="train", unit="step", dynamic_ncols=True)

    def log_step(
        self,
        step: int,
        *,
        loss: float,
        grad_norm: float,
        lr: float,
        tokens: int,
        flops: float,
        step_time_s: float,
        extra: dict | None = None,
        trained_tokens: int | None = None,
    ) -> dict:
        """Compute the step's metrics from global ``tokens`` / ``flops`` and its wall time; rank 0 writes them.

        Collective under a multi-rank process group (call on every rank): ``peak_mem_gib`` is the max over
        ranks of :func:`peak_memory_gib` (CUDA: since the previous logged step, the window is reset here; CPU:
        the process peak RSS); on CUDA ``peak_mem_reserved_gib`` likewise (:data:`CUDA_METRIC_FIELDS`).
        Returns the record (the same on every rank): :data:`METRIC_FIELDS` (then the CUDA fields), then ``extra``.
        With ``trained_tokens`` (the step's target tokens, every rank and micro-batch: what the loss averages
        over), ``trained_tokens`` and ``trained_tokens_per_s`` follow ``tokens_per_s_per_gpu``.
        """
        if step_time_s <= 0:
            raise ValueError(f"step_time_s={step_time_s} must be > 0")
        peak_mem = max_over_ranks(peak_memory_gib(), self.device)
        reserved = peak_memory_reserved_gib()  # None on every rank of a CPU job, a number on every CUDA rank
        if reserved is not None:
            reserved = max_over_ranks(reserved, self.device)
        reset_peak_memory()
        flops_per_gpu_s, step_mfu = mfu(flops, step_time_s, self.world_size, self.peak_flops)
        record: dict[str, Any] = {
            "step": int(step),
            "loss": float(loss),
            "grad_norm": float(grad_norm),
            "lr": float(lr),
            "tokens": int(tokens),
            "tokens_per_s": tokens / step_time_s,
            "tokens_per_s_per_gpu": tokens / step_time_s / self.world_size,
            **(
                {}
                if trained_tokens is None
                else {
                    "trained_tokens": int(trained_tokens),
                    "trained_tokens_per_s": trained_tokens / step_time_s,
                }
            ),
            "tflops_per_gpu": flops_per_gpu_s / 1e12,
            "mfu": step_mfu,
            "peak_mem_gib": peak_mem,
            "step_time_s": float(step_time_s),
        }
        if reserved is not None:
            record["peak_mem_reserved_gib"] = reserved
        if extra:
            clash = set(extra) & set(record)
            assert not clash, f"extra metrics may not replace standard fields: {sorted(clash)}"
            record.update(extra)
        if self._file is not None:
            self._file.write(json.dumps(json_safe(record), allow_nan=False) + "\n")
            self._file.flush()
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in record.items() if k != "step"}, step=int(step))
        if self._bar is not None:
            self._bar.update(max(0, int(step) - self._bar.n))
            self._bar.set_postfix(
                loss=f"{record['loss']:.4f}",
                tok_s=f"{record['tokens_per_s']:.0f}",
                mfu=f"{record['mfu']:.1%}",
            )
        elif self.is_writer:  # no bar (logs of batch jobs): one line per logged step
            logger.info(
                "step %d/%d loss %.4f grad_norm %.3f lr %.3g | %.0f tok/s (%.0f /gpu) %.2f TFLOP/s/gpu MFU %.1f%% "
                "| %.3f s/step, peak %.2f GiB",
                record["step"],
                self.total_steps,
                record["loss"],
                record["grad_norm"],
                record["lr"],
                record["tokens_per_s"],
                record["tokens_per_s_per_gpu"],
                record["tflops_per_gpu"],
                100 * record["mfu"],
                record["step_time_s"],
                record["peak_mem_gib"],
            )
        return record

    def close(self) -> None:
        """Flush and close ``metrics.jsonl``, the progress bar and the wandb run (safe to call twice)."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
