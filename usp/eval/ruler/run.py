"""``eval=ruler`` on the mesh: checks, prompts, sharded decoding, scores.

Every (task, length, index) sample is a key; the dp replicas split the keys (:mod:`usp.eval.replicas`) and
each builds the prompts of its own share, just before decoding them (every rank of a replica builds the same
prompt: :mod:`usp.eval.ruler.fit` is deterministic). Prompts of one (task, length) with the same token count go
``eval.micro_batch_size`` at a time through :func:`usp.eval.decode.decode`: sharded prefill, greedy decoding
with the distributed KV cache, stopped once every row has an EOS token (the tokenizer's or the generation
config's) or a stop string (:data:`usp.eval.ruler.scoring.STOP_STRINGS`), at most the task's
``max_new_tokens``. Rank 0 logs each (task, length) as its replica finishes it.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

import torch
from torch import nn

from usp.config import RULER_TASKS, EvalConfig
from usp.eval.chat import stop_token_ids
from usp.eval.decode import decode
from usp.eval.footprint import eval_memory_per_gpu
from usp.eval.replicas import decode_timing, gather_shares, gather_timing, my_share
from usp.eval.ruler.fit import PromptBuilder, Sample
from usp.eval.ruler.scoring import clean_prediction, effective_length, score, stopped, summarize
from usp.eval.ruler.tasks import TASKS
from usp.parallel import SPMesh

logger = logging.getLogger(__name__)


def check_ruler_settings(cfg: EvalConfig) -> None:
    """``eval.ruler.*`` (pure: the haystack files are read by :func:`prepare_ruler`). ``ValueError`` naming
    the setting."""
    r = cfg.ruler
    unknown = [t for t in r.tasks if t not in TASKS]
    if unknown or not r.tasks or len(set(r.tasks)) != len(r.tasks):
        raise ValueError(
            f"eval.ruler.tasks={list(r.tasks)}: {'unknown ' + str(unknown) if unknown else 'empty or repeated'}; "
            f"choose among {', '.join(RULER_TASKS)}."
        )
    if isinstance(r.samples, bool) or r.samples < 1:
        raise ValueError(
            f"eval.ruler.samples={r.samples} is invalid: use an integer >= 1 (prompts per task and length)."
        )
    if not 0.0 < r.threshold <= 1.0:
        raise ValueError(
            f"eval.ruler.threshold={r.threshold} must be in (0, 1] (a fraction of the shortest length's mean)."
        )


def prepare_ruler(tokenizer: Any, lengths: list[int], cfg: EvalConfig) -> PromptBuilder:
    """The prompt builder, once every task is known to fit the shortest length (``ValueError`` naming
    ``eval.lengths``), the chat template and the haystack files usable."""
    check_ruler_settings(cfg)
    builder = PromptBuilder(tokenizer, cfg)
    for task in cfg.ruler.tasks:
        builder.build(task, min(lengths), 0)
    return builder


def sample_keys(cfg: EvalConfig, lengths: list[int]) -> list[tuple[str, int, int]]:
    """Every ``(task, length, index)``, tasks outermost, then lengths, then the sample index."""
    return [(t, n, i) for t in cfg.ruler.tasks for n in lengths for i in range(cfg.ruler.samples)]


def memory_per_length(config: Any, lengths: list[int], mesh: SPMesh, dtype_bytes: int) -> dict[str, dict]:
    longest_answer = max(spec.max_new_tokens for spec, _ in TASKS.values())
    return {
        str(n): eval_memory_per_gpu(
            config,
            n,
            longest_answer,
            ulysses_degree=mesh.ulysses_degree,
            ring_degree=mesh.ring_degree,
            dtype_bytes=dtype_bytes,
        )
        for n in lengths
    }


def _stopper(tokenizer: Any, stop_ids: set[int]):
    def stop(tokens: torch.Tensor) -> bool:
        for row in tokens.tolist():
            if not any(t in stop_ids for t in row) and not stopped(
                tokenizer.decode(row, skip_special_tokens=True)
            ):
                return False
        return True

    return stop


def prediction_of(tokenizer: Any, row: list[int], stop_ids: set[int]) -> str:
    """The decoded answer up to the first EOS token, cut at a stop string (:func:`clean_prediction`)."""
    for i, t in enumerate(row):
        if t in stop_ids:
            row = row[:i]
            break
    return clean_prediction(tokenizer.decode(row, skip_special_tokens=True))


def run_ruler(
    model: nn.Module,
    tokenizer: Any,
    mesh: SPMesh,
    builder: PromptBuilder,
    lengths: list[int],
    cfg: EvalConfig,
) -> dict[str, Any]:
    """Decode and score every sample. Returns ``{"tasks": {task: {str(length): score}}, "mean": {str(length):
    score}, "average", "effective_length", "threshold", "threshold_score", "trials": [{task, length, index,
    prompt, references, prediction, score, prompt_tokens, new_tokens}], "timing": {...}}`` (same on every rank)."""
    device = next(model.parameters()).device
    stop_ids = stop_token_ids(tokenizer, getattr(model, "generation_config", None))
    stop = _stopper(tokenizer, stop_ids)
    keys = sample_keys(cfg, lengths)
    mine = my_share(keys, mesh)
    results: list[dict[str, Any]] = []
    prefill_tokens = decode_tokens = 0
    prefill_s = decode_s = build_s = 0.0
    t0 = cell_t0 = time.perf_counter()
    pending: Sample | None = None
    i = 0
    while i < len(mine) or pending is not None:
        group: list[Sample] = []
        while len(group) < cfg.micro_batch_size and (pending is not None or i < len(mine)):
            if pending is None:
                tb = time.perf_counter()
                pending = builder.build(*mine[i])
                build_s += time.perf_counter() - tb
                i += 1
            head = group[0] if group else pending
            if (pending.task, pending.length, len(pending.input_ids)) != (
                head.task,
                head.length,
                len(head.input_ids),
            ):
                break
            group.append(pending)
            pending = None
        ids = torch.tensor(
            [s.input_ids for s in group], dtype=torch.long, device=device
        )  # [B, prompt tokens]
        res = decode(model, ids, mesh, group[0].max_new_tokens, stop=stop)
        prefill_tokens += res.prefill_tokens
        prefill_s += res.prefill_s
        decode_tokens += res.decode_steps * len(group)
        decode_s += res.decode_s
        for s, row in zip(group, res.tokens.tolist()):
            prediction = prediction_of(tokenizer, row, stop_ids)
            results.append(
                {
                    "task": s.task,
                    "length": s.length,
                    "index": s.index,
                    "prompt": s.prompt,
                    "references": s.references,
                    "prediction": prediction,
                    "score": score(s.task, prediction, s.references),
                    "prompt_tokens": len(s.input_ids),
                    "new_tokens": len(row),
                }
            )
        last = group[-1]
        upcoming = (
            (pending.task, pending.length) if pending is not None else mine[i][:2] if i < len(mine) else None
        )
        if upcoming != (last.task, last.length):
            _log_cell(results, last.task, last.length, mesh, time.perf_counter() - cell_t0)
            cell_t0 = time.perf_counter()
    results = gather_shares(results, mesh)
    prefill_s, prefill_tokens = gather_timing(prefill_s, prefill_tokens, mesh)
    decode_s, decode_tokens = gather_timing(decode_s, decode_tokens, mesh)
    build_s, _ = gather_timing(build_s, 0, mesh)
    table, mean = summarize(results, cfg.ruler.tasks, lengths)
    effective, bar = effective_length(mean, cfg.ruler.threshold)
    return {
        "tasks": table,
        "mean": mean,
        "average": sum(mean.values()) / len(mean),
        "effective_length": effective,
        "threshold": cfg.ruler.threshold,
        "threshold_score": bar,
        "trials": results,
        "timing": {
            "prompt_build_s": build_s,
            **decode_timing(prefill_tokens, prefill_s, decode_tokens, decode_s, t0),
        },
    }


def _log_cell(results: list[dict], task: str, length: int, mesh: SPMesh, seconds: float) -> None:
    if mesh.dp_rank != 0 or mesh.sp_rank != 0:
        return
    scores = [r["score"] for r in results if r["task"] == task and r["length"] == length]
    where = f" (replica 0 of {mesh.dp_degree})" if mesh.dp_degree > 1 else ""
    mean = sum(scores) / len(scores) if scores else math.nan
    logger.info(
        "ruler %s at %d tokens: %d samples%s, score %.3f, %.1f s",
        task,
        length,
        len(scores),
        where,
        mean,
        seconds,
    )
