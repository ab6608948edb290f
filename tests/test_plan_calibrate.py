"""Calibration: reading usp-bench JSON and training runs, fitting efficiencies, predicted vs measured.

The training runs here are synthetic: their step times come from a hidden "true" CPU whose efficiencies differ
from the planner's defaults; the fit must find them again. (The end-to-end check against the real tiny CPU
trainer belongs with the trainer: see docs/planning.md, "Calibrating".)
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from usp.plan.calibrate import (
    Calibration,
    calibrate,
    fit_attention_efficiency,
    predict_run,
    read_bench_json,
    read_training_run,
)
from usp.plan.cli import main
from usp.plan.hardware import GPUS
from usp.plan.models import load_model_spec
from usp.plan.search import evaluate_layout

CPU = GPUS["cpu"]
TRUE_CPU = replace(CPU, dense_efficiency=0.1, attention_efficiency=0.02, layer_overhead_s=0.03)


def test_bench_reader_finds_timings_in_any_shape(tmp_path: Path):
    data = {
        "device": "h100",
        "results": [
            # FLOPs and time: 1e12 FLOPs in 10 ms = 100 TFLOP/s
            {
                "impl": "ulysses",
                "fwd_bwd_ms": 10.0,
                "fwd_bwd_flops": 1e12,
                "fwd_ms": 3.0,
                "fwd_flops": 2.5e11,
            },
            # an achieved rate only
            {
                "impl": "ring",
                "config": {"seq_len": 8192},
                "timing": {"fwd+bwd (s)": 0.02, "fwd+bwd tflops": 60.0},
            },
            # the shape only: causal 4 x 4096^2 x 8 heads x 64 / 2 = 1.718e10 FLOPs forward in 1 ms
            {"seq_len": 4096, "num_heads": 8, "head_dim": 64, "batch": 1, "causal": True, "fwd_s": 0.001},
        ],
    }
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(data))
    recs = read_bench_json(path)
    fwd_bwd = sorted(r.achieved_tflops for r in recs if r.kind == "fwd_bwd")
    fwd = sorted(r.achieved_tflops for r in recs if r.kind == "fwd")
    assert fwd_bwd == pytest.approx([60.0, 100.0])
    assert fwd == pytest.approx([4 * 4096**2 * 8 * 64 / 2 / 1e-3 / 1e12, 2.5e11 / 3e-3 / 1e12])
    # the fit prefers fwd+bwd timings: median of 60 and 100 = 80 TFLOP/s of a 200 TFLOP/s peak
    assert fit_attention_efficiency(recs, replace(CPU, peak_tflops=200.0)) == pytest.approx(0.4)
    # JSON lines work too; a file without timings is refused
    lines = tmp_path / "bench.jsonl"
    lines.write_text("\n".join(json.dumps(r) for r in data["results"]))
    assert len(read_bench_json(lines)) == len(recs)
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({"note": "nothing"}))
    with pytest.raises(ValueError, match="no attention timings"):
        read_bench_json(empty)


def test_bench_reader_on_usp_bench_records(tmp_path: Path):
    # the shape of a usp-bench result: per-rank FLOP counts (the busiest rank sets the time), a global shape
    rec = {
        "ulysses": 2,
        "ring": 2,
        "layout": "zigzag",
        "causal": True,
        "seq_len": 64,
        "num_heads": 4,
        "num_kv_heads": 1,
        "head_dim": 8,
        "batch": 1,
        "dtype": "float32",
        "fwd_ms": 2.0,
        "fwd_bwd_ms": 5.0,
        "fwd_bwd_attention_flops_per_rank": [10_000, 14_000, 12_000, 14_000],
        "bytes_by_kind": {"ring_kv": 1024},
    }
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"world_size": 4, "results": [rec], "skipped": []}))
    recs = {r.kind: r.achieved_tflops for r in read_bench_json(path)}
    assert recs["fwd_bwd"] == pytest.approx(14_000 / 5e-3 / 1e12)
    # forward from the shape: 4 x 64^2 x 4 heads x 8 / 2 (causal) / 4 ranks = 65,536 FLOPs in 2 ms
    assert recs["fwd"] == pytest.approx(65_536 / 2e-3 / 1e12)


def _write_run(
    root: Path,
    name: str,
    *,
    seq_len: int,
    ulysses: int,
    ring: int,
    world: int,
    ckpt: Path,
    ring_layout: str = "zigzag",
) -> Path:
    run = root / name
    (run / ".hydra").mkdir(parents=True)
    cfg = {
        "model": {"path": str(ckpt), "dtype": "float32"},
        "parallel": {
            "ulysses_degree": ulysses,
            "ring_degree": ring,
            "dp_degree": -1,
            "fsdp_mode": "full_shard",
            "activation_checkpointing": "none",
            "ac_every_k": 2,
            "ring_layout": ring_layout,
        },
        "trainer": {
            "seq_len": seq_len,
            "micro_batch_size": 1,
            "grad_accum_steps": 1,
            "loss_chunk_size": 4096,
        },
    }
    (run / ".hydra" / "config.yaml").write_text(yaml.safe_dump(cfg))
    truth = evaluate_layout(
        load_model_spec(str(ckpt)),
        TRUE_CPU,
        seq_len=seq_len,
        ulysses_degree=ulysses,
        ring_degree=ring,
        world_size=world,
        node_size=world,
        compute_bytes=4,
        ring_layout=ring_layout,
    )
    dp = world // (ulysses * ring)
    rows = []
    for step in range(1, 9):
        warm = 20.0 if step <= 2 else 1.0  # compile / allocator warm-up, must be skipped
        jitter = 1.0 + 0.01 * ((-1) ** step)  # +-1%: the median of the steady steps is the truth
        t = truth.step_time_s * warm * (jitter if step > 2 else 1.0)
        tokens = dp * seq_len
        rows.append(
            {
                "step": step,
                "loss": 5.0,
                "grad_norm": 1.0,
                "lr": 1e-4,
                "tokens": tokens,
                "tokens_per_s": tokens / t,
                "tokens_per_s_per_gpu": tokens / t / world,
                "tflops_per_gpu": 0.0,
                "mfu": 0.0,
                "peak_mem_gib": 0.5,
                "step_time_s": t,
            }
        )
    rows.append({"step": 9, "loss": 5.0, "step_time_s": truth.step_time_s})  # median stays the truth
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return run


@pytest.fixture
def runs(tmp_path: Path, tiny_config) -> list[Path]:
    ckpt = tmp_path / "tiny-ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps(tiny_config))
    layouts = [(256, 2, 1, 2), (1024, 2, 1, 2), (4096, 2, 2, 4), (2048, 1, 2, 2)]
    return [
        _write_run(tmp_path, f"run{i}", seq_len=s, ulysses=u, ring=r, world=w, ckpt=ckpt)
        for i, (s, u, r, w) in enumerate(layouts)
    ]


def test_read_training_run(runs: list[Path], tiny_config):
    run = read_training_run(runs[2])
    assert (run.seq_len, run.ulysses_degree, run.ring_degree) == (4096, 2, 2)
    assert run.world_size == 4  # from tokens_per_s / tokens_per_s_per_gpu, since dp_degree=-1
    assert run.global_batch == 1
    assert run.measured_mem_gib == 0.5
    assert run.compute_bytes == 4  # model.dtype=float32
    truth = evaluate_layout(
        load_model_spec(tiny_config),
        TRUE_CPU,
        seq_len=4096,
        ulysses_degree=2,
        ring_degree=2,
        world_size=4,
        node_size=4,
        compute_bytes=4,
    )
    assert run.measured_step_s == pytest.approx(truth.step_time_s)  # warm-up skipped, jitter cancels


def test_predict_run_costs_the_run_s_ring_layout(tmp_path: Path, tiny_config):
    """A contiguous ring's causal imbalance (the last rank holds the most work) is in the run's prediction."""
    ckpt = tmp_path / "tiny-ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps(tiny_config))
    kw = dict(seq_len=4096, ulysses=1, ring=4, world=4, ckpt=ckpt)
    zigzag = read_training_run(_write_run(tmp_path, "zigzag", **kw))
    contiguous = read_training_run(_write_run(tmp_path, "contiguous", ring_layout="contiguous", **kw))
    assert (zigzag.ring_layout, contiguous.ring_layout) == ("zigzag", "contiguous")
    for run in (zigzag, contiguous):
        truth = evaluate_layout(
            load_model_spec(tiny_config),
            CPU,
            seq_len=4096,
            ulysses_degree=1,
            ring_degree=4,
            world_size=4,
            node_size=4,
            compute_bytes=4,
            ring_layout=run.ring_layout,
        )
        assert predict_run(run, CPU).time_s == pytest.approx(truth.time_s, rel=1e-12)
    slow = predict_run(contiguous, CPU).time_s["attention_s"]
    assert slow > 1.5 * predict_run(zigzag, CPU).time_s["attention_s"]


def test_fit_recovers_the_hidden_efficiencies(runs: list[Path]):
    parsed = [read_training_run(r) for r in runs]
    cal, before = calibrate(CPU, parsed)
    # the defaults are off by a lot on this "machine"...
    assert max(abs(b["time_ratio"] - 1) for b in before) > 0.3
    # ...the fit finds the hidden figures and predicts every run within 2%
    assert cal.dense_efficiency == pytest.approx(TRUE_CPU.dense_efficiency, rel=0.05)
    assert cal.attention_efficiency == pytest.approx(TRUE_CPU.attention_efficiency, rel=0.05)
    assert cal.layer_overhead_s == pytest.approx(TRUE_CPU.layer_overhead_s, rel=0.05)
    for row in cal.runs:
        assert row["time_ratio"] == pytest.approx(1.0, abs=0.02)
        # fitted on the three other runs, each run is still predicted within 3% (out of sample)
        assert row["held_out_ratio"] == pytest.approx(1.0, abs=0.03)
    # one run: a single common scale, which still matches that run exactly
    cal1, _ = calibrate(CPU, parsed[:1])
    assert predict_run(parsed[0], cal1.apply(CPU)).step_time_s == pytest.approx(
        parsed[0].measured_step_s, rel=1e-6
    )


def test_bench_sets_attention_efficiency(tmp_path: Path, runs: list[Path]):
    bench = tmp_path / "b.json"
    bench.write_text(json.dumps([{"fwd_bwd_s": 1.0, "fwd_bwd_flops": 0.05e12}]))  # 0.05 of a 0.1 TFLOP/s peak
    cal, _ = calibrate(CPU, [], read_bench_json(bench))
    assert cal.attention_efficiency == pytest.approx(0.5)
    assert cal.dense_efficiency == CPU.dense_efficiency
    with pytest.raises(ValueError, match="at least one"):
        calibrate(CPU, [], [])


def test_cli_calibrate_then_plan_with_it(tmp_path: Path, runs: list[Path], capsys):
    out = tmp_path / "calib.json"
    argv = ["calibrate", "--gpu", "cpu", "--out", str(out)]
    for r in runs:
        argv += ["--run", str(r)]
    assert main(argv) == 0
    report = capsys.readouterr().out
    assert "ratio fit" in report and "held out" in report and "run2" in report
    cal = Calibration.load(out)
    assert cal.attention_efficiency == pytest.approx(TRUE_CPU.attention_efficiency, rel=0.05)
    # planning with the calibration predicts the measured step time of a run's own layout
    plan = [
        "--model",
        str(tmp_path / "tiny-ckpt"),
        "--seq-len",
        "4K",
        "--nodes",
        "1",
        "--gpus-per-node",
        "4",
        "--gpu",
        "cpu",
        "--calibration",
        str(out),
        "--ulysses-degree",
        "2",
        "--ring-degree",
        "2",
        "--json",
    ]
    assert main(plan) == 0
    layouts = json.loads(capsys.readouterr().out)
    measured = read_training_run(runs[2]).measured_step_s
    assert any(
        x["activation_checkpointing"] == "none" and x["step_time_s"] == pytest.approx(measured, rel=0.02)
        for x in layouts
    )


def test_read_run_with_auto_degrees_and_interpolated_model_path(
    tmp_path: Path, runs: list[Path], tiny_config
):
    # what usp-train leaves: .hydra/config.yaml unresolved (auto degrees, ${run_dir} paths) + layout.json
    run = runs[2]
    ckpt = run / "tiny-llama"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps(tiny_config | {"num_hidden_layers": 3}))
    cfg = yaml.safe_load((run / ".hydra" / "config.yaml").read_text())
    cfg["model"]["path"] = "${run_dir}/tiny-llama"
    cfg["parallel"].update(ulysses_degree="auto", ring_degree="auto")
    (run / ".hydra" / "config.yaml").write_text(yaml.safe_dump(cfg))
    with pytest.raises(ValueError, match="layout.json"):
        read_training_run(run)
    layout = {
        "world_size": 4,
        "dp_degree": 1,
        "ring_degree": 2,
        "ulysses_degree": 2,
        "node_size": 2,
        "ring_layout": "zigzag",
        "fsdp_mode": "full_shard",
        "activation_checkpointing": "full",
        "ac_every_k": 2,
        "reason": "planner: ...",
    }
    (run / "layout.json").write_text(json.dumps(layout))
    parsed = read_training_run(run)
    assert (parsed.ulysses_degree, parsed.ring_degree, parsed.world_size, parsed.node_size) == (2, 2, 4, 2)
    assert parsed.activation_checkpointing == "full"
    assert parsed.model.num_layers == 3  # the checkpoint under the run dir, not a guess
