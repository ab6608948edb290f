"""Throughput and utilisation metrics: FLOP counting, MFU, ``metrics.jsonl``, wandb and the progress bar.

FLOPs of one forward + backward over a batch of packed sequences (what :func:`training_flops` returns)::

    6 * dense_params * tokens  +  12 * L * Hq * D * sum_i s_i^2   (attention term halved when causal)

``dense_params`` is every parameter except the input embedding table (a lookup, not a matmul; a tied output
head *is* a matmul and is counted); ``tokens`` is the number of tokens; ``s_i`` runs over the packed
documents (attention never crosses a document boundary, so a 128K sequence of 32 4K documents costs far less
attention than one 128K document). Per layer the attention matmuls are ``QK^T`` and ``PV``, each
``2 * s^2 * Hq * D`` FLOPs forward, and backward costs twice forward: ``3 * 2 * 2 = 12``.

MFU = achieved FLOP/s per device / the device's dense bf16 peak (:data:`PEAK_TFLOPS`, or
``cluster.peak_tflops``). Recomputation under activation checkpointing is not counted (model FLOPs, not
hardware FLOPs).

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

import hashlib
import json
import logging
import math
import os
import sys
from pathlib import Path
from typing import Any

from usp.atomic import write_text
from usp.config import ClusterConfig, WandbConfig
from usp.plan.hardware import GPUS

logger = logging.getLogger(__name__)

GIB = 1024**3

PEAK_TFLOPS: dict[str, float] = {name: spec.peak_tflops for name, spec in GPUS.items()}
"""Dense bf16 peak TFLOP/s per device (no sparsity), from the planner's device table
(:data:`usp.plan.hardware.GPUS`), so MFU and the planner use one set of figures. The ``cpu`` entry is nominal
(a few cores of fp32 eager PyTorch): CPU MFU is only a relative figure."""

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


def gpu_from_device_name(name: str) -> str | None:
    """Map a CUDA device name (``NVIDIA H100 80GB HBM3``) to a :data:`PEAK_TFLOPS` key, if recognisable."""
    n = name.lower()
    for key, marker in (("b200", "b200"), ("h200", "h200"), ("h100-80g", "h100")):
        if marker in n:
            return key
    if "a100" in n:
        return "a100-40g" if "40gb" in n else "a100-80g"
    return None


def peak_flops_per_device(cluster: ClusterConfig, device_type: str) -> float:
    """Dense peak FLOP/s of one device, the MFU denominator.

    ``cluster.peak_tflops`` wins when set. On CPU (``device_type == "cpu"``) the nominal ``cpu`` entry is used.
    On CUDA, ``cluster.gpu`` is looked up; if it is ``cpu`` (a CPU cluster group on a GPU run) the GPU is
    recognised from ``torch.cuda.get_device_name()`` when possible.
    """
    if cluster.peak_tflops is not None:
        if cluster.peak_tflops <= 0:
            raise ValueError(f"cluster.peak_tflops={cluster.peak_tflops} must be > 0 (dense bf16 TFLOP/s).")
        return float(cluster.peak_tflops) * 1e12
    if device_type == "cpu":
        return PEAK_TFLOPS["cpu"] * 1e12
    key = cluster.gpu.lower().replace("_", "-")
    if key == "cpu" and device_type == "cuda":
        import torch

        detected = gpu_from_device_name(torch.cuda.get_device_name())
        if detected is None:
            raise ValueError(
                f"cluster.gpu=cpu on a CUDA run with an unrecognised GPU ({torch.cuda.get_device_name()}): "
                f"choose cluster=<one of {sorted(PEAK_TFLOPS)}> or set cluster.peak_tflops=<dense bf16 TFLOP/s>."
            )
        key = detected
    if key not in PEAK_TFLOPS:
        raise ValueError(
            f"cluster.gpu={cluster.gpu!r} has no peak FLOP/s entry; choose one of {sorted(PEAK_TFLOPS)} or set "
            "cluster.peak_tflops=<dense bf16 TFLOP/s per device>."
        )
    return PEAK_TFLOPS[key] * 1e12


def training_flops(
    *,
    dense_params: int,
    num_layers: int,
    num_heads: int,
    head_dim: int,
    document_lengths: list[list[int]],
    causal: bool = True,
) -> float:
    """Model FLOPs of one forward + backward over ``document_lengths`` (per sequence, its packed documents).

    ``6 * dense_params * tokens + 12 * num_layers * num_heads * head_dim * sum(s_i^2)``, the attention term
    halved when ``causal``. ``num_heads`` counts query heads (GQA shares K/V, not the score matmuls).
    """
    if min(dense_params, num_layers, num_heads, head_dim) < 0:
        raise ValueError("training_flops: dense_params, num_layers, num_heads and head_dim must be >= 0")
    lengths = [s for seq in document_lengths for s in seq]
    if any(s < 0 for s in lengths):
        raise ValueError(f"training_flops: document lengths must be >= 0, got {document_lengths}")
    tokens = sum(lengths)
    attention = 12.0 * num_layers * num_heads * head_dim * sum(float(s) * s for s in lengths)
    if causal:
        attention /= 2
    return 6.0 * dense_params * tokens + attention


def attention_work_imbalance(document_lengths: list[list[int]], ring_degree: int, ring_layout: str) -> float:
    """``attn_work_imbalance`` of a step: max / mean over ring ranks of the causal in-document (query, key) pairs
    each computes, summed over the step's samples (per sample, its packed document lengths).

    Exact pair counts from the layout (:func:`usp.parallel.ring_rank_pairs`); 1.0 = every ring rank does the
    same attention work. The slowest rank sets the step time, so ``1 / imbalance`` is the attention time a
    perfectly balanced layout would need.
    """
    import numpy as np

    from usp.parallel import ring_rank_pairs

    if ring_degree == 1:
        return 1.0
    work = np.zeros(ring_degree)
    for lengths in document_lengths:
        cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        work += np.asarray(ring_rank_pairs(int(cu[-1]), ring_degree, ring_layout, cu), dtype=np.float64)
    mean = work.mean()
    return float(work.max() / mean) if mean > 0 else 1.0


def count_dense_params(model: Any) -> int:
    """Parameters that do matmuls: all (global numel, also under FSDP2) minus the input embedding table,
    which is kept when it is tied to the output head."""
    total = sum(p.numel() for p in model.parameters())
    embedding = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    if head is not None and head.weight is embedding:
        return int(total)
    return int(total - embedding.numel())


def peak_memory_gib() -> float:
    """Peak memory of this process: CUDA max allocated since the last :func:`reset_peak_memory` when CUDA is in
    use, else the process's peak resident set since it started (CPU runs: not reset per step)."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.max_memory_allocated() / GIB
    import resource

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / GIB if sys.platform == "darwin" else rss * 1024 / GIB  # bytes on macOS, KiB on Linux


def peak_memory_reserved_gib() -> float | None:
    """CUDA: peak bytes reserved by the caching allocator since the last :func:`reset_peak_memory`, in GiB
    (allocated plus cached free blocks: what an out-of-memory error depends on). ``None`` without CUDA."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.max_memory_reserved() / GIB
    return None


def reset_peak_memory() -> None:
    """Start a new CUDA peak-memory window (no-op without CUDA: the CPU figure is the process peak RSS)."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.reset_peak_memory_stats()


def max_over_ranks(value: float, device: Any = "cpu") -> float:
    """``value`` all-reduced with MAX over every rank (one float64 all_reduce on ``device``; nccl needs the
    rank's CUDA device); ``value`` itself without a multi-rank process group."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return float(value)
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def json_safe(record: dict[str, Any]) -> dict[str, Any]:
    """``record`` with NaN / inf floats replaced by ``None``, so ``json.dumps(..., allow_nan=False)`` holds."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}


def stderr_is_terminal() -> bool:
    """Whether a progress bar can be drawn: stderr is a TTY (not a SLURM output file or a pipe)."""
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False


def drop_records_after(path: str | os.PathLike, step: int) -> int:
    """Rewrite ``metrics.jsonl`` at ``path`` without records of steps after ``step`` (and without a torn last
    line), atomically (temp file + rename). Returns the number of lines dropped; a missing file is fine."""
    path = Path(path)
    if not path.is_file():
        return 0
    kept: list[str] = []
    dropped = 0
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # a line cut short by the crash
            dropped += 1
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] > step:
            dropped += 1
        else:
            kept.append(line)
    if dropped:
        write_text(path, "".join(line + "\n" for line in kept))
    return dropped


def wandb_run_id(run_dir: str | os.PathLike) -> str:
    """The wandb run id of a run dir: a hash of its absolute path, so a requeued, resubmitted or relaunched
    job that continues in the same run dir continues the same wandb run (``resume="allow"``)."""
    return "usp-" + hashlib.sha256(str(Path(run_dir).resolve()).encode()).hexdigest()[:16]


def _init_wandb(cfg: WandbConfig, run_dir: Path, config: dict, layout: dict) -> Any:
    try:
        import wandb
    except ImportError as err:
        raise ImportError(
            f"logging.wandb.mode={cfg.mode} needs the wandb package: pip install 'usp[wandb]', "
            "or set logging.wandb.mode=disabled."
        ) from err
    return wandb.init(
        project=cfg.project,
        entity=cfg.entity,
        name=cfg.name,
        tags=list(cfg.tags) or None,
        mode=cfg.mode,
        dir=str(run_dir),  # offline runs land in <run_dir>/wandb/offline-run-*
        id=wandb_run_id(run_dir),  # one wandb run per run dir, across requeues and resumes
        resume="allow",
        config={**config, "layout": layout},
    )


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
                logger.info("metrics.jsonl: dropped %d record(s) after step %d (resumed there)", dropped, start_step)
        write_text(self.run_dir / "layout.json", json.dumps(layout, indent=2, default=str) + "\n")
        if wandb_cfg.mode != "disabled":
            self._wandb = _init_wandb(wandb_cfg, self.run_dir, config, layout)
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
        flops_per_gpu_s = flops / step_time_s / self.world_size
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
                else {"trained_tokens": int(trained_tokens), "trained_tokens_per_s": trained_tokens / step_time_s}
            ),
            "tflops_per_gpu": flops_per_gpu_s / 1e12,
            "mfu": flops_per_gpu_s / self.peak_flops,
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
                record["step"], self.total_steps, record["loss"], record["grad_norm"], record["lr"],
                record["tokens_per_s"], record["tokens_per_s_per_gpu"], record["tflops_per_gpu"],
                100 * record["mfu"], record["step_time_s"], record["peak_mem_gib"],
            )  # fmt: skip
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
