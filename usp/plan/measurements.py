"""Measurements the planner is calibrated against: ``usp-bench`` JSON and training run dirs.

- ``usp-bench`` JSON (any nesting; JSON or JSON lines): every object with an attention time (keys such as
  ``fwd_bwd_ms``, ``fwd+bwd_s``, ``fwd_ms``) and either its FLOPs (``fwd_bwd_flops``, or per-rank counts such as
  ``fwd_bwd_attention_flops_per_rank``, of which the busiest rank counts), an achieved rate
  (``fwd_bwd_tflops``, ``tflops``), or the shape (``seq_len``, ``num_heads``, ``head_dim``, ``batch``,
  ``causal``, ``ulysses``, ``ring``) to count the FLOPs from.
- a training run: ``metrics.jsonl`` (``step``, ``step_time_s``, ``peak_mem_gib``, ``tokens``...), ``layout.json``
  (the layout the trainer resolved) and the config next to it (``.hydra/config.yaml``, ``config.yaml``,
  ``resolved_config.yaml`` or ``config.json``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from statistics import median
from typing import Any

from usp.plan.compute import ATTN_BWD_OVER_FWD_HW
from usp.plan.lora import LoraPlan
from usp.plan.models import ModelSpec, load_model_spec
from usp.plan.request import PlanRequest

_UNITS = (
    ("_ms", 1e-3),
    ("ms", 1e-3),
    ("_us", 1e-6),
    ("_sec", 1.0),
    ("_s", 1.0),
    ("_time", 1.0),
    ("time", 1.0),
)
CONFIG_NAMES = (
    "config.yaml",
    "resolved_config.yaml",
    ".hydra/config.yaml",
    "config.json",
    "resolved_config.json",
)


# --- usp-bench ----------------------------------------------------------------------------------------------
@dataclass
class BenchRecord:
    kind: str
    """``fwd`` or ``fwd_bwd``."""
    seconds: float | None
    achieved_tflops: float


def _norm(key: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", key.lower()).strip("_")


def _kind(key: str) -> str | None:
    k = key.replace("forward", "fwd").replace("backward", "bwd").replace("_and_", "_")
    if "fwd_bwd" in k or "fwdbwd" in k:
        return "fwd_bwd"
    if k.startswith("fwd") and "bwd" not in k:
        return "fwd"
    return None


def _time_scale(key: str) -> float | None:
    if "flop" in key or "per_s" in key or "throughput" in key:
        return None
    for suffix, scale in _UNITS:
        if key.endswith(suffix):
            return scale
    return None


def _shape_flops(rec: dict[str, Any], kind: str) -> float | None:
    get = {_norm(k): v for k, v in rec.items()}
    seq = get.get("seq_len") or get.get("seqlen") or get.get("sequence_length")
    heads = get.get("num_heads") or get.get("heads") or get.get("nheads") or get.get("num_attention_heads")
    dim = get.get("head_dim") or get.get("headdim")
    if not all(isinstance(x, (int, float)) for x in (seq, heads, dim)):
        return None
    batch = get.get("batch") or get.get("batch_size") or 1
    # the shape is the whole sequence; one rank does 1 / (ulysses x ring) of it
    ranks = (get.get("ulysses") or get.get("ulysses_degree") or 1) * (
        get.get("ring") or get.get("ring_degree") or 1
    )
    fwd = 4.0 * seq * seq * heads * dim * batch * (0.5 if get.get("causal", True) else 1.0) / ranks
    return fwd * (1 + ATTN_BWD_OVER_FWD_HW) if kind == "fwd_bwd" else fwd


def _busiest(value: Any) -> float | None:
    """A FLOP count, or the largest of per-rank counts (the busiest rank sets the wall time)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, list) and value and all(isinstance(x, (int, float)) for x in value):
        return float(max(value))
    return None


def _records_in(obj: Any) -> list[BenchRecord]:
    found: list[BenchRecord] = []
    if isinstance(obj, list):
        for item in obj:
            found += _records_in(item)
        return found
    if not isinstance(obj, dict):
        return found
    norm = {_norm(k): v for k, v in obj.items()}
    for kind in ("fwd_bwd", "fwd"):
        times = [
            v * s
            for k, v in norm.items()
            if _kind(k) == kind and isinstance(v, (int, float)) and (s := _time_scale(k)) is not None
        ]
        rates = [
            v
            for k, v in norm.items()
            if _kind(k) == kind and k.endswith("tflops") and isinstance(v, (int, float))
        ]
        flops = [
            _busiest(v)
            for k, v in norm.items()
            if _kind(k) == kind and "flops" in k and not k.endswith("tflops") and "per_s" not in k
        ]
        flops = [f for f in flops if f]
        seconds = times[0] if times else None
        if seconds and flops:
            found.append(BenchRecord(kind, seconds, flops[0] / seconds / 1e12))
        elif rates:
            found.append(BenchRecord(kind, seconds, float(rates[0])))
        elif seconds and (f := _shape_flops(obj, kind)):
            found.append(BenchRecord(kind, seconds, f / seconds / 1e12))
    for v in obj.values():
        if isinstance(v, (dict, list)):
            found += _records_in(v)
    return found


def read_bench_json(path: str | Path) -> list[BenchRecord]:
    """Attention timings in a ``usp-bench`` output (JSON or JSON lines), wherever they are nested."""
    text = Path(path).read_text()
    try:
        data: Any = json.loads(text)
    except json.JSONDecodeError:
        data = [json.loads(line) for line in text.splitlines() if line.strip()]
    records = _records_in(data)
    if not records:
        raise ValueError(
            f"{path}: no attention timings found (expected keys like fwd_bwd_ms with flops or tflops)."
        )
    return records


@dataclass
class TrainingRun:
    """One run's layout and what was measured in it."""

    name: str
    model: ModelSpec
    seq_len: int
    ulysses_degree: int
    ring_degree: int
    world_size: int
    node_size: int
    fsdp_mode: str
    activation_checkpointing: str
    ac_every_k: int
    global_batch: int
    loss_chunk_size: int
    compute_bytes: int
    """2 for bf16 / fp16 runs, 4 for float32 (``model.dtype``)."""
    measured_step_s: float
    measured_mem_gib: float | None
    mlp_tiles: int = 1
    """``parallel.mlp_tiles`` as the trainer resolved it (``auto``: :func:`usp.mlp_tiles.resolve_mlp_tiles`)."""
    states_on_host: bool = False
    """Parameters, gradients and optimizer states in host memory (``optim.name`` / ``parallel.cpu_offload``)."""
    attn_head_chunks: int = 1
    """``parallel.attn_head_chunks`` of the run."""
    ring_layout: str = "zigzag"
    """``parallel.ring_layout`` of the run (a contiguous ring's causal imbalance is in its step time)."""
    lora: LoraPlan | None = None
    """The run's LoRA adapters (``model.lora``); ``None``: full training."""


def _load_config(run_dir: Path) -> dict[str, Any]:
    for name in CONFIG_NAMES:
        p = run_dir / name
        if p.is_file():
            if p.suffix == ".json":
                return json.loads(p.read_text())
            import yaml

            return yaml.safe_load(p.read_text()) or {}
    return {}


def _resolve_path(path: str, run_dir: Path) -> list[Path]:
    """Where a config path may point: as written, under the run dir, or with ``${...}`` taken as the run dir."""
    if "${" in path:  # an unresolved interpolation such as ${run_dir}/tiny-llama
        return [run_dir / path.rsplit("}", 1)[1].lstrip("/")]
    return [Path(path), run_dir / path]


def _model_from_config(cfg: dict[str, Any], run_dir: Path) -> ModelSpec:
    model = cfg.get("model", {})
    path = model.get("path")
    if path and path != "???":
        for candidate in _resolve_path(str(path), run_dir):
            if (candidate / "config.json").is_file():
                return load_model_spec(str(candidate))
    tiny = model.get("tiny_size") or {}
    if tiny:  # the trainer builds the tiny checkpoint from tiny_size (a Llama unless it names a model_type)
        from transformers import AutoConfig

        fields = dict(tiny)
        return load_model_spec(AutoConfig.for_model(fields.pop("model_type", "llama"), **fields).to_dict())
    raise ValueError(f"{run_dir}: cannot find the model shape (model.path/config.json or model.tiny_size).")


def read_training_run(
    path: str | Path,
    *,
    model_config: dict[str, Any] | None = None,
    model_spec: ModelSpec | None = None,
    seq_len: int | None = None,
    world_size: int | None = None,
    node_size: int | None = None,
    warmup_steps: int | None = None,
) -> TrainingRun:
    """A run dir (or its ``metrics.jsonl``) -> its layout and the median step time after warm-up.

    The layout comes from ``layout.json`` (what the trainer resolved, ``auto`` degrees included) over the
    config's ``parallel`` section; the model, ``seq_len`` and batch from the config. Explicit arguments win.
    """
    p = Path(path)
    metrics = p if p.is_file() else p / "metrics.jsonl"
    run_dir = metrics.parent
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if isinstance(r.get("step_time_s"), (int, float))]
    if not rows:
        raise ValueError(f"{metrics}: no rows with step_time_s.")
    skip = warmup_steps if warmup_steps is not None else (min(2, len(rows) - 1) if len(rows) > 2 else 0)
    steady = rows[skip:]
    cfg = _load_config(run_dir)
    layout_file = run_dir / "layout.json"
    layout = json.loads(layout_file.read_text()) if layout_file.is_file() else {}
    par = {**cfg.get("parallel", {}), **{k: v for k, v in layout.items() if v is not None}}
    trainer = cfg.get("trainer", {})
    if model_spec is not None:
        model = model_spec
    elif model_config:
        model = load_model_spec(model_config)
    else:
        model = _model_from_config(cfg, run_dir)

    def latest(key: str) -> Any:
        return next((r[key] for r in reversed(rows) if r.get(key) is not None), None)

    degrees = []
    for name in ("ulysses_degree", "ring_degree"):
        value = par.get(name, 1)
        if value == "auto":  # not in layout.json: maybe logged with the metrics
            value = latest(name)
        if not isinstance(value, int) or value < 1:
            raise ValueError(
                f"{run_dir}: parallel.{name}={par.get(name)!r} and no layout.json with the resolved value."
            )
        degrees.append(value)
    U, R = degrees
    ws = world_size or par.get("world_size") or cfg.get("world_size") or latest("world_size")
    per_gpu = [r for r in rows if r.get("tokens_per_s") and r.get("tokens_per_s_per_gpu")]
    if not ws and per_gpu:
        ws = round(per_gpu[-1]["tokens_per_s"] / per_gpu[-1]["tokens_per_s_per_gpu"])
    if not ws:
        dp = int(par.get("dp_degree", -1))
        if dp < 1:
            raise ValueError(f"{run_dir}: world size unknown (dp_degree=-1); pass world_size / --world-size.")
        ws = dp * U * R
    ws = int(ws)
    node = int(node_size or par.get("node_size") or ws)
    dp = ws // (U * R)
    seq_len = int(seq_len or trainer.get("seq_len", 0))
    if seq_len < 1:
        raise ValueError(f"{run_dir}: no trainer.seq_len in a config next to metrics.jsonl; pass seq_len.")
    batch = dp * int(trainer.get("micro_batch_size", 1)) * int(trainer.get("grad_accum_steps", 1))
    tokens = latest("tokens")
    if isinstance(tokens, (int, float)) and tokens % seq_len == 0:
        batch = int(tokens // seq_len)  # sequences per optimizer step, as measured
    mems = [r["peak_mem_gib"] for r in steady if isinstance(r.get("peak_mem_gib"), (int, float))]
    request = PlanRequest.from_dict(
        {**cfg, "parallel": par}, seq_len=seq_len, ulysses_degree=U, ring_degree=R
    )
    tiles = request.mlp_tiles
    if tiles == "auto":
        from usp.mlp_tiles import resolve_mlp_tiles  # the trainer's rule for auto

        tiles = resolve_mlp_tiles("auto", local_tokens=seq_len // (U * R), hidden_size=model.hidden_size)
    return TrainingRun(
        name=str(run_dir),
        model=model,
        seq_len=seq_len,
        ulysses_degree=U,
        ring_degree=R,
        world_size=ws,
        node_size=min(node, ws),
        fsdp_mode=str(request.fsdp_mode),
        activation_checkpointing=str(request.activation_checkpointing),
        ac_every_k=int(request.ac_every_k),
        global_batch=batch,
        loss_chunk_size=request.loss_chunk_size,
        compute_bytes=request.compute_bytes,
        measured_step_s=median(r["step_time_s"] for r in steady),
        measured_mem_gib=max(mems) if mems else None,
        mlp_tiles=int(tiles),
        states_on_host=request.states_on_host,
        attn_head_chunks=int(request.attn_head_chunks),
        ring_layout=str(request.ring_layout),
        lora=request.lora,
    )
