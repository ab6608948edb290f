"""Fit the device efficiencies to measurements and report predicted vs measured (the planner's honesty figure).

Measurements come from :mod:`usp.plan.measurements` (``usp-bench`` JSON, training run dirs). For a training run
the median step time after warm-up is compared with :func:`usp.plan.estimate.estimate_layout` for its layout.

Fit: a step is ``dense_flops / (peak * e_dense) + attn_work / (peak * e_attn) + layers * c + comm``. Least squares
on relative error over the richest set of unknowns whose solution is positive: ``1/e_dense, 1/e_attn, c`` (three
or more runs), the two efficiencies, one compute scale and ``c`` (two runs), one common scale (one run). A bench
file fixes ``e_attn`` to the median achieved attention rate over the peak first.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from statistics import median
from typing import Any

import numpy as np

from usp.plan.estimate import LayoutEstimate, estimate_layout
from usp.plan.hardware import DeviceSpec
from usp.plan.layout import Candidate, Workload
from usp.plan.measurements import BenchRecord, TrainingRun, read_bench_json, read_training_run

__all__ = [
    "BenchRecord",
    "Calibration",
    "TrainingRun",
    "calibrate",
    "fit_attention_efficiency",
    "format_report",
    "predict_run",
    "read_bench_json",
    "read_training_run",
]


def fit_attention_efficiency(records: list[BenchRecord], device: DeviceSpec) -> float:
    """Median achieved rate over peak, preferring fwd+bwd timings (what training runs)."""
    use = [r for r in records if r.kind == "fwd_bwd"] or records
    return median(r.achieved_tflops for r in use) / device.peak_tflops


# --- training runs ------------------------------------------------------------------------------------------


def predict_run(run: TrainingRun, device: DeviceSpec) -> LayoutEstimate:
    """What the cost model says about the run's layout (micro batch 1 x accumulation as the global batch)."""
    work = Workload(
        run.model,
        run.seq_len,
        global_batch=run.global_batch,
        compute_bytes=run.compute_bytes,
        loss_chunk_size=run.loss_chunk_size,
        ring_layout=run.ring_layout,
        lora=run.lora,
    )
    cand = Candidate(
        ulysses_degree=run.ulysses_degree,
        ring_degree=run.ring_degree,
        world_size=run.world_size,
        node_size=run.node_size,
        fsdp_mode=run.fsdp_mode,
        activation_checkpointing=run.activation_checkpointing,
        ac_every_k=run.ac_every_k,
        mlp_tiles=run.mlp_tiles,
        attn_head_chunks=run.attn_head_chunks,
        states="cpu_offload" if run.states_on_host else "device",
    )
    return estimate_layout(work, cand, device)


@dataclass
class Calibration:
    """Fitted device figures and the predicted-vs-measured table they give."""

    device: str
    dense_efficiency: float
    attention_efficiency: float
    layer_overhead_s: float
    runs: list[dict[str, Any]] = field(default_factory=list)

    def apply(self, device: DeviceSpec) -> DeviceSpec:
        return replace(
            device,
            dense_efficiency=self.dense_efficiency,
            attention_efficiency=self.attention_efficiency,
            layer_overhead_s=self.layer_overhead_s,
        )

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=2))

    @classmethod
    def load(cls, path: str | Path) -> Calibration:
        data = json.loads(Path(path).read_text())
        return cls(
            **{
                k: data[k] for k in ("device", "dense_efficiency", "attention_efficiency", "layer_overhead_s")
            },
            runs=data.get("runs", []),
        )


def _terms(run: TrainingRun, device: DeviceSpec) -> tuple[float, float, float, float]:
    """(dense work, attention work, layer count, fixed seconds) of a step: time = a/e_d + b/e_a + c*L + fixed."""
    est = predict_run(run, device)
    t = est.time_s
    dense = t["dense_s"] * device.dense_efficiency
    attn = t["attention_s"] * device.attention_efficiency
    layers = (
        t["overhead_s"] / device.layer_overhead_s
        if device.layer_overhead_s
        else run.model.num_layers * est.grad_accum_steps
    )
    fixed = est.step_time_s - t["dense_s"] - t["attention_s"] - t["overhead_s"]
    return dense, attn, layers, fixed


def _table(runs: list[TrainingRun], device: DeviceSpec) -> list[dict[str, Any]]:
    rows = []
    for run in runs:
        est = predict_run(run, device)
        rows.append(
            {
                "run": run.name,
                "layout": f"u{run.ulysses_degree} r{run.ring_degree} dp{est.dp_degree} {run.activation_checkpointing}",
                "seq_len": run.seq_len,
                "predicted_step_s": est.step_time_s,
                "measured_step_s": run.measured_step_s,
                "time_ratio": run.measured_step_s / est.step_time_s,
                "predicted_mem_gib": est.mem_gib_per_gpu,
                "measured_mem_gib": run.measured_mem_gib,
                "mem_ratio": (run.measured_mem_gib / est.mem_gib_per_gpu) if run.measured_mem_gib else None,
            }
        )
    return rows


def _fit_scales(
    runs: list[TrainingRun], device: DeviceSpec, e_attn: float, attention_fixed: bool
) -> tuple[float, float, float]:
    """Least squares on relative error over the richest set of unknowns with a physical answer (efficiencies
    in (0, 1], overhead >= 0); one common scale of the compute and overhead as the last resort."""
    e_dense, overhead = device.dense_efficiency, device.layer_overhead_s
    base = replace(device, attention_efficiency=e_attn)
    rows = [_terms(r, base) for r in runs]
    y = np.array([r.measured_step_s - t[3] for r, t in zip(runs, rows)])
    w = 1.0 / np.array([r.measured_step_s for r in runs])
    a, b, L = (np.array(col) for col in list(zip(*rows))[:3])
    compute = a / e_dense + b / e_attn

    def solve(*cols: np.ndarray) -> np.ndarray:
        X = np.stack(cols, axis=1)
        return np.linalg.lstsq(X * w[:, None], y * w, rcond=None)[0]

    options: list[tuple[float, float, float]] = []
    if len(runs) >= 3 and not attention_fixed:
        c = solve(a, b, L)
        if c[0] > 0 and c[1] > 0:
            options.append((1 / c[0], 1 / c[1], float(c[2])))
    if len(runs) >= 2 and not attention_fixed:
        c = solve(a, b)
        if c[0] > 0 and c[1] > 0:
            options.append((1 / c[0], 1 / c[1], overhead))
    if len(runs) >= 2:
        c = solve(compute, L)
        if c[0] > 0:
            options.append((e_dense / c[0], e_attn / c[0], float(c[1])))
    for fit in options:
        if fit[0] <= 1 and fit[1] <= 1 and fit[2] >= 0:
            return fit
    scale = float(solve(compute + L * overhead)[0])
    if scale <= 0:
        raise ValueError(
            "calibration failed: the measured step times are shorter than the communication alone."
        )
    return e_dense / scale, e_attn / scale, overhead * scale


def calibrate(
    device: DeviceSpec, runs: list[TrainingRun], bench: list[BenchRecord] | None = None
) -> tuple[Calibration, list[dict[str, Any]]]:
    """Fit the efficiencies; returns the calibration (with its after-fit table) and the before-fit table.

    With two or more runs each row of the after-fit table also carries ``held_out_ratio``: measured over
    predicted by a fit on the *other* runs (the out-of-sample honesty figure).
    """
    if not runs and not bench:
        raise ValueError("calibrate needs at least one training run (--run) or usp-bench file (--bench).")
    before = _table(runs, device)
    e_attn = fit_attention_efficiency(bench, device) if bench else device.attention_efficiency
    e_dense, overhead = device.dense_efficiency, device.layer_overhead_s
    if runs:
        e_dense, e_attn, overhead = _fit_scales(runs, device, e_attn, attention_fixed=bool(bench))
    assert all(math.isfinite(x) for x in (e_dense, e_attn, overhead))
    cal = Calibration(device.name, float(e_dense), float(e_attn), float(overhead))
    cal.runs = _table(runs, cal.apply(device))
    if len(runs) >= 2:
        for i, row in enumerate(cal.runs):
            others = runs[:i] + runs[i + 1 :]
            e_attn_i = fit_attention_efficiency(bench, device) if bench else device.attention_efficiency
            fit = _fit_scales(others, device, e_attn_i, attention_fixed=bool(bench))
            held = Calibration(device.name, *fit).apply(device)
            row["held_out_ratio"] = runs[i].measured_step_s / predict_run(runs[i], held).step_time_s
    return cal, before


def format_report(before: list[dict[str, Any]], cal: Calibration) -> str:
    """Predicted vs measured (ratio = measured / predicted): with the default figures, with the fit, and with a
    fit on the other runs only (held out)."""
    lines = [
        f"calibration for {cal.device}: dense_efficiency={cal.dense_efficiency:.4g} "
        f"attention_efficiency={cal.attention_efficiency:.4g} layer_overhead_s={cal.layer_overhead_s:.4g}",
        f"{'run':<28} {'layout':<22} {'seq':>8} {'pred s (default)':>16} {'pred s (fit)':>12} {'measured s':>11} "
        f"{'ratio default':>13} {'ratio fit':>9} {'held out':>8} {'mem pred/meas GiB':>18}",
    ]
    for b, a in zip(before, cal.runs):
        mem = f"{a['predicted_mem_gib']:.3f}/" + (
            f"{a['measured_mem_gib']:.3f}" if a["measured_mem_gib"] else "-"
        )
        held = f"{a['held_out_ratio']:.3f}" if "held_out_ratio" in a else "-"
        lines.append(
            f"{Path(a['run']).name[:28]:<28} {a['layout']:<22} {a['seq_len']:>8} {b['predicted_step_s']:>16.4g} "
            f"{a['predicted_step_s']:>12.4g} {a['measured_step_s']:>11.4g} {b['time_ratio']:>13.3f} "
            f"{a['time_ratio']:>9.3f} {held:>8} {mem:>18}"
        )
    return "\n".join(lines)
