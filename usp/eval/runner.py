"""``run(cfg)``: one evaluation job (``eval.task``) from a validated, typed config.

Order (every rank runs all of it):

1. process group (as the trainer: reuse, ``env://`` from torchrun, or one process); nccl on CUDA, gloo on CPU;
2. checks, before any weight is read or any forward runs, shared by every rank (an error on one rank is
   raised on all, no rank left waiting): ``model.path`` (an HF dir or a training checkpoint), the layout
   resolved as for training (:func:`usp.startup.resolve_layout`: the same degrees, planner choice for
   ``auto`` and node size as ``usp-train`` gets for this config), the ``eval.*`` settings, every evaluated
   length against the sequence layout, heads vs Ulysses, the tokenizer, then the task's inputs (passkey
   prompts; ruler: every task fits the shortest length, the chat template, the haystack files; ppl documents
   read on rank 0 and broadcast);
3. the mesh, the model (whole on every rank, in ``model.dtype``), :func:`usp.model.apply_usp`;
4. the task; rank 0 writes ``eval.json``, the plot, wandb, and prints a summary.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from usp.checkpoint import is_complete_checkpoint, latest_checkpoint, load_checkpoint, read_saved_extra
from usp.config import EVAL_TASKS, TrainConfig
from usp.model import (
    apply_rope_overrides,
    check_model_dir,
    check_weight_headers,
    model_capabilities,
    parse_dtype,
)
from usp.parallel import ParallelLayout, sequence_multiple
from usp.parallel.agree import on_every_rank, on_rank0
from usp.startup import (
    build_mesh,
    check_model_for_degrees,
    resolve_layout,
    run_in_process_group,
)

logger = logging.getLogger(__name__)


@dataclass
class ModelSource:
    """Where the evaluated weights come from: an HF dir, or a training checkpoint plus its base model dir."""

    config_dir: Path
    """config.json and tokenizer files (the HF dir itself, or the base model the checkpoint was trained from)."""
    checkpoint: Path | None
    config: Any


def resolve_model_source(path: str) -> ModelSource:
    """``model.path`` -> :class:`ModelSource`. A training checkpoint (``step_N`` or a checkpoints dir) takes
    its architecture and tokenizer from the base model recorded in it. ``ValueError`` naming ``model.path``."""
    p = Path(path)
    is_ckpt = (
        p.is_dir()
        and not (p / "config.json").exists()
        and (is_complete_checkpoint(p) or latest_checkpoint(p) is not None)
    )
    if not is_ckpt:
        return ModelSource(p, None, check_model_dir(path, "forward"))
    ckpt = p if is_complete_checkpoint(p) else latest_checkpoint(p)
    assert ckpt is not None
    base = read_saved_extra(ckpt).get("fingerprint", {}).get("model_path")
    if base is None:
        raise ValueError(
            f"model.path={path!r} is a training checkpoint that does not record its base model (saved by an older "
            f"usp); point model.path at the run's hf/ export instead."
        )
    try:
        config = check_model_dir(base, "forward")
    except ValueError as e:
        raise ValueError(f"model.path={path!r} is a checkpoint of {base}, which cannot be used: {e}") from e
    return ModelSource(Path(base), ckpt, config)


def check_generation_support(config: Any, task: str) -> None:
    """``ValueError`` before any weight is read when ``task`` generates text (passkey, RULER) and the model has
    recurrent / convolution mixers: usp's decoding keeps softmax attention's K/V only, on any layout."""
    mixers = model_capabilities(config).mixers
    if mixers:
        raise ValueError(
            f"eval.task={task!r} generates text, and usp's decoding keeps softmax attention's K/V only; this "
            f"model's {', '.join(mixers)} layers carry a recurrent / convolution state it does not keep. Use "
            f"eval=ppl (perplexity by position runs sharded and exact for hybrid models)."
        )


def resolve_lengths(cfg: TrainConfig, layout: ParallelLayout | None = None) -> list[int]:
    """``eval.lengths``, or the default for the task (from ``trainer.seq_len``), rounded to the layout
    (``layout``: the resolved one; without it, the config's explicit degrees)."""
    if cfg.eval.lengths:
        return [int(x) for x in cfg.eval.lengths]
    s = cfg.trainer.seq_len
    if cfg.eval.task == "ppl":
        return [s]
    p = cfg.parallel
    ring, ulysses = (
        (layout.ring_degree, layout.ulysses_degree) if layout else (p.ring_degree, p.ulysses_degree)
    )
    m = sequence_multiple(int(ring), int(ulysses), p.ring_layout)
    return sorted({max(m, (x // m) * m) for x in (s // 4, s // 2, s, 2 * s)})


def check_eval_settings(cfg: TrainConfig, layout: ParallelLayout) -> list[int]:
    """Every ``eval.*`` setting and the evaluated lengths vs the resolved ``layout``; returns the lengths.
    ``ValueError`` naming the setting and the fix. Pure arithmetic (no files)."""
    e, p = cfg.eval, cfg.parallel
    if e.task not in EVAL_TASKS:
        raise ValueError(f"eval.task={e.task!r} is invalid; choose eval=ppl, eval=passkey or eval=ruler.")
    for name in ("micro_batch_size", "bucket_size", "num_documents"):
        if getattr(e, name) < 1:
            raise ValueError(f"eval.{name}={getattr(e, name)} is invalid: use an integer >= 1.")
    k = e.passkey
    if k.trials < 1 or k.max_new_tokens < 1 or not 1 <= k.digits <= 18:
        raise ValueError(
            f"eval.passkey: trials={k.trials} and max_new_tokens={k.max_new_tokens} must be >= 1, digits={k.digits} "
            f"in 1..18."
        )
    if not k.depths or any(not 0.0 <= d <= 1.0 for d in k.depths):
        raise ValueError(f"eval.passkey.depths={list(k.depths)} must be fractions in [0, 1], at least one.")
    if e.task == "ruler":
        from usp.eval.ruler.run import check_ruler_settings

        check_ruler_settings(e)
    lengths = resolve_lengths(cfg, layout)
    m = layout.sequence_multiple()
    bad = [x for x in lengths if x < 2 or x % m]
    if bad:
        fix = ", ".join(f"{x} -> {max(m, round(x / m) * m)}" for x in bad)
        raise ValueError(
            f"eval.lengths={lengths}: {bad} do not suit the layout (a multiple of {m} = "
            f"{'' if p.ring_layout == 'contiguous' else '2 x '}ring_degree {layout.ring_degree} x ulysses_degree "
            f"{layout.ulysses_degree}, {p.ring_layout}); use e.g. {fix}."
        )
    return lengths


def load_model(source: ModelSource, cfg: TrainConfig, device: torch.device) -> torch.nn.Module:
    """The whole model on ``device`` in ``model.dtype``, eval mode. Collective for a checkpoint (DCP load)."""
    from transformers import AutoModelForCausalLM

    from usp.model import load_causal_lm

    dtype = parse_dtype(cfg.model.dtype)
    if source.checkpoint is None:
        model = load_causal_lm(source.config_dir, dtype=dtype, config=source.config)
    else:
        model = AutoModelForCausalLM.from_config(
            source.config, dtype=torch.float32, attn_implementation="sdpa"
        )
        try:
            load_checkpoint(source.checkpoint, model=model, optimizer=None, scheduler=None)
        except ValueError as e:
            raise ValueError(f"model.path={str(source.checkpoint)!r}: {e}") from e
        model = model.to(dtype)
    return model.to(device).eval()


def original_context(cfg: TrainConfig, config: Any) -> int | None:
    if cfg.eval.original_context_length:
        return int(cfg.eval.original_context_length)
    scaling = getattr(config, "rope_scaling", None) or getattr(config, "rope_parameters", None) or {}
    return scaling.get("original_max_position_embeddings") or getattr(config, "max_position_embeddings", None)


def run(cfg: TrainConfig) -> dict[str, Any]:
    """Evaluate as ``cfg.eval`` says; returns the ``eval.json`` entry (the same on every rank).

    Raises ``ValueError`` on every rank, before reading weights or running a forward, for bad settings.
    """
    return run_in_process_group(cfg, _run)


def prepare(
    cfg: TrainConfig, world: int, device: torch.device
) -> tuple[list[int], ParallelLayout, ModelSource, Any]:
    """Every check before the model is read: ``(lengths, layout, source, tokenizer)``; ``ValueError`` naming
    the setting. The layout is :func:`usp.startup.resolve_layout`'s, as for training this config."""
    from transformers import AutoTokenizer

    source = resolve_model_source(cfg.model.path)
    apply_rope_overrides(
        source.config,
        rope_theta=cfg.model.rope_theta,
        rope_scaling=cfg.model.rope_scaling,
        max_position_embeddings=cfg.model.max_position_embeddings,
    )
    if source.checkpoint is None:
        check_weight_headers(cfg.model.path)
    layout = resolve_layout(cfg, source.config, world, device)
    lengths = check_eval_settings(cfg, layout)
    if cfg.eval.task == "ppl":
        from usp.eval.ppl import check_ppl_inputs

        check_ppl_inputs(cfg, source.config)
    else:
        check_generation_support(source.config, cfg.eval.task)
    check_model_for_degrees(source.config, layout)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(source.config_dir), local_files_only=True)
    except (OSError, ValueError) as e:
        raise ValueError(f"model.path={cfg.model.path!r}: no tokenizer at {source.config_dir} ({e}).") from e
    return lengths, layout, source, tokenizer


def _run(cfg: TrainConfig, device: torch.device) -> dict[str, Any]:
    from transformers.utils import logging as hf_logging

    from usp.eval import passkey as passkey_task
    from usp.eval import ppl as ppl_task
    from usp.eval import report
    from usp.model import apply_usp

    hf_logging.disable_progress_bar()  # one "Loading weights" bar per rank says nothing
    rank, world = dist.get_rank(), dist.get_world_size()
    run_dir = Path(cfg.run_dir)
    lengths, layout, source, tokenizer = on_every_rank(
        lambda: prepare(cfg, world, device), "eval config validation"
    )
    task = cfg.eval.task
    if task == "passkey":
        trials = on_every_rank(
            lambda: passkey_task.build_trials(tokenizer, lengths, cfg.eval), "passkey prompts"
        )
    elif task == "ruler":
        from usp.eval.ruler import run as ruler_task

        builder = on_every_rank(
            lambda: ruler_task.prepare_ruler(tokenizer, lengths, cfg.eval), "ruler prompts"
        )
    else:
        cache_dir = Path(cfg.data.cache_dir or run_dir / "data_cache")
        documents = on_rank0(
            lambda: ppl_task.read_documents(cfg, tokenizer, lengths, cache_dir), "reading eval.inputs"
        )

    mesh = build_mesh(cfg, layout, device)
    t0 = time.perf_counter()
    model = on_every_rank(lambda: load_model(source, cfg, device), "loading the model (model.path)")
    apply_usp(model, mesh, backend=cfg.model.attention_backend)
    load_s = time.perf_counter() - t0
    if rank == 0:
        logger.info(
            "evaluating %s (%s) on %d ranks: %s; lengths %s",
            cfg.model.path,
            task,
            world,
            mesh.describe(),
            lengths,
        )
    memory = None
    if task == "passkey":
        result = passkey_task.run_passkey(model, tokenizer, mesh, trials, cfg.eval)
    elif task == "ruler":
        memory = ruler_task.memory_per_length(
            source.config, lengths, mesh, parse_dtype(cfg.model.dtype).itemsize
        )
        if rank == 0:
            for n, m in memory.items():
                logger.info(
                    "ruler at %s tokens, per GPU (planner terms): KV cache %.3f GiB, prefill activations "
                    "%.3f GiB, weights %.3f GiB",
                    n,
                    m["kv_cache_gib"],
                    m["prefill_activations_gib"],
                    m["weights_gib"],
                )
        result = ruler_task.run_ruler(model, tokenizer, mesh, builder, lengths, cfg.eval)
    else:
        result = ppl_task.run_ppl(
            model, mesh, documents, batch_size=cfg.eval.micro_batch_size, bucket_size=cfg.eval.bucket_size
        )
    timing = {**result.pop("timing"), "load_s": load_s}
    entry = {
        "task": task,
        "model_path": str(cfg.model.path),
        "checkpoint": None if source.checkpoint is None else str(source.checkpoint),
        "lengths": lengths,
        "original_context_length": original_context(cfg, source.config),
        "layout": mesh.describe(),
        "config": dataclasses.asdict(cfg.eval),
        "timing": timing,
        "result": result,
    }
    if memory is not None:
        entry["memory_per_gpu"] = memory
    if rank == 0 and task == "ruler":
        run_dir.mkdir(parents=True, exist_ok=True)
        _report_ruler(cfg, run_dir, entry, report.write_json(run_dir, task, entry))
    elif rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        path = report.write_json(run_dir, task, entry)
        image = run_dir / report.PLOTS[task]
        if task == "ppl":
            report.plot_ppl(result, image, original_context=entry["original_context_length"])
        else:
            report.plot_passkey(result, image)
        report.log_wandb(cfg.logging.wandb, run_dir, task, entry, image, dataclasses.asdict(cfg))
        for line in report.summary_lines(task, entry):
            print(line, flush=True)
        print(f"usp-eval: wrote {path} and {image}", flush=True)
    dist.barrier()
    return entry


def _report_ruler(cfg: TrainConfig, run_dir: Path, entry: dict[str, Any], path: Path) -> None:
    from usp.eval.ruler import report as ruler_report

    result = entry["result"]
    images = [run_dir / name for name in ruler_report.PLOTS]
    ruler_report.plot_heatmap(result, images[0])
    ruler_report.plot_by_length(result, images[1], original_context=entry["original_context_length"])
    ruler_report.log_wandb(cfg.logging.wandb, run_dir, entry, images, dataclasses.asdict(cfg))
    for line in ruler_report.table_lines(result):
        print(line, flush=True)
    print(f"usp-eval: wrote {path}, {images[0]} and {images[1]}", flush=True)
