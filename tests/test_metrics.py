"""Metrics arithmetic checked by hand, metrics.jsonl contents, rank-0-only writing, wandb offline."""

from __future__ import annotations

import json
import logging
import math

import pytest

from usp.config import ClusterConfig, WandbConfig
from usp.plan.compute import mfu, training_flops
from usp.plan.models import ModelSpec, load_model_spec
from usp.train.flops import count_matmul_params
from usp.train.metrics import METRIC_FIELDS, MetricsLogger
from usp.train.peak_flops import PEAK_TFLOPS, peak_flops_per_device

DISABLED = WandbConfig(mode="disabled")


def test_training_flops_two_documents_by_hand():
    # one packed sequence of two documents (3 and 5 tokens) and a second sequence of one document (4 tokens)
    # dense: 6 * 1000 params * 12 tokens = 72_000
    # attention: 12 * L=2 * H=4 * D=8 = 768 per pair; causal pairs 3*4/2 + 5*6/2 + 4*5/2 = 6 + 15 + 10 = 31
    # (every key up to and including the query), all pairs 9 + 25 + 16 = 50
    kwargs = dict(matmul_params=1000, num_layers=2, num_heads=4, head_dim=8, document_lengths=[[3, 5], [4]])
    assert training_flops(**kwargs) == 72_000 + 768 * 31
    assert training_flops(**kwargs, causal=False) == 72_000 + 768 * 50


def test_packing_documents_costs_less_attention_than_one_long_document():
    common = dict(matmul_params=0, num_layers=1, num_heads=1, head_dim=1)
    # 8 * 9 / 2 = 36 causal pairs vs 2 * (4 * 5 / 2) = 20: two 4-token documents cost far less attention
    assert training_flops(**common, document_lengths=[[8]]) == 12 * 36
    assert training_flops(**common, document_lengths=[[4, 4]]) == 12 * 20


def test_training_flops_rejects_negative_lengths():
    with pytest.raises(ValueError, match="document lengths"):
        training_flops(matmul_params=1, num_layers=1, num_heads=1, head_dim=1, document_lengths=[[-1]])


def test_planner_and_trainer_count_the_same_flops():
    # the planner's per-token count is the trainer's count of one causal row, or of the packed rows
    from usp.plan.compute import DocumentWork, model_flops_per_token

    spec = load_model_spec("llama-3.1-8b")
    args = dict(
        matmul_params=spec.matmul_params,
        num_layers=spec.num_layers,
        num_heads=spec.num_heads,
        head_dim=spec.head_dim,
    )
    seq = 131072
    assert model_flops_per_token(spec, seq) * seq == training_flops(**args, document_lengths=[[seq]])
    docs = DocumentWork.from_spec("lognormal:mean=8192", seq, num_rows=4)
    per_row = training_flops(**args, document_lengths=docs.rows) / 4
    assert model_flops_per_token(spec, seq, docs) * seq == pytest.approx(per_row, rel=1e-12)
    assert model_flops_per_token(spec, seq, docs) < model_flops_per_token(spec, seq)
    assert mfu(8e12, 2.0, 4, 1e12) == (1e12, 1.0)


def test_peak_table_and_overrides():
    assert (
        PEAK_TFLOPS["h100-80g"] == 989.0
        and PEAK_TFLOPS["b200"] == 2250.0
        and PEAK_TFLOPS["a100-40g"] == 312.0
    )
    assert peak_flops_per_device(ClusterConfig(gpu="h200"), "cuda") == 989e12
    assert peak_flops_per_device(ClusterConfig(gpu="h100-80g"), "cpu") == PEAK_TFLOPS["cpu"] * 1e12
    assert peak_flops_per_device(ClusterConfig(gpu="h200", peak_tflops=500.0), "cuda") == 500e12
    with pytest.raises(ValueError, match="cluster.gpu='tpu'.*cluster.peak_tflops"):
        peak_flops_per_device(ClusterConfig(gpu="tpu"), "cuda")


def test_matmul_params_are_the_linear_weights_tied_or_not():
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = dict(
        hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, vocab_size=50
    )
    for tied in (False, True):
        model = LlamaForCausalLM(LlamaConfig(**shape, tie_word_embeddings=tied))
        total = sum(p.numel() for p in model.parameters())
        norms = (2 * 2 + 1) * 16  # two RMSNorms per layer and the final one
        embedding = 0 if tied else 50 * 16  # a tied LM head is the embedding table, counted once as the head
        assert count_matmul_params(model) == total - norms - embedding
        # the planner's count of the same shape (ModelSpec from the config)
        spec = ModelSpec.from_hf_config(model.config.to_dict())
        assert count_matmul_params(model) == spec.matmul_params


def _logger(run_dir, rank=0, world_size=4, peak=1e12, **kw):
    return MetricsLogger(
        run_dir,
        rank=rank,
        world_size=world_size,
        peak_flops=peak,
        wandb_cfg=kw.pop("wandb_cfg", DISABLED),
        config={"trainer": {"max_steps": 2}},
        layout={"ulysses_degree": 2, "ring_degree": 2},
        total_steps=2,
        progress_bar=kw.pop("progress_bar", False),
    )


def test_log_step_arithmetic_and_jsonl(tmp_path):
    with _logger(tmp_path, world_size=4, peak=1e12) as log:
        rec = log.log_step(1, loss=5.5, grad_norm=2.0, lr=1e-3, tokens=2048, flops=8e12, step_time_s=2.0)
        log.log_step(
            2, loss=5.0, grad_norm=1.5, lr=2e-3, tokens=2048, flops=8e12, step_time_s=4.0, extra={"x": 1}
        )
    assert rec["tokens_per_s"] == 1024.0 and rec["tokens_per_s_per_gpu"] == 256.0
    assert rec["tflops_per_gpu"] == pytest.approx(1.0)  # 8e12 / 2 s / 4 GPUs
    assert rec["mfu"] == pytest.approx(1.0)  # / peak 1e12
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2]
    for r in lines:
        assert set(METRIC_FIELDS) <= set(r)
        assert all(math.isfinite(r[k]) for k in METRIC_FIELDS)
        assert 0 < r["peak_mem_gib"] < 1024
    assert lines[1]["mfu"] == pytest.approx(0.5) and lines[1]["x"] == 1 and lines[1]["lr"] == 2e-3
    assert json.loads((tmp_path / "layout.json").read_text()) == {"ulysses_degree": 2, "ring_degree": 2}


def test_resumed_run_appends(tmp_path):
    for step in (1, 2):
        with _logger(tmp_path) as log:
            log.log_step(step, loss=1.0, grad_norm=1.0, lr=1.0, tokens=1, flops=1.0, step_time_s=1.0)
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2


def test_only_rank0_writes(tmp_path):
    with _logger(tmp_path, rank=1) as log:
        rec = log.log_step(1, loss=1.0, grad_norm=1.0, lr=1.0, tokens=10, flops=1.0, step_time_s=1.0)
    assert rec["tokens_per_s"] == 10.0  # every rank gets the numbers
    assert not any(tmp_path.iterdir())


def test_progress_bar_runs_on_rank0_on_a_terminal(tmp_path, capsys, caplog, monkeypatch):
    import usp.train.metrics as metrics

    monkeypatch.setattr(metrics, "stderr_is_terminal", lambda: True)
    with (
        caplog.at_level(logging.INFO, logger="usp.train.metrics"),
        _logger(tmp_path, progress_bar=True) as log,
    ):
        log.log_step(1, loss=3.25, grad_norm=1.0, lr=1.0, tokens=10, flops=1.0, step_time_s=1.0)
    assert "3.2500" in capsys.readouterr().err
    assert "step 1/2" not in caplog.text  # the bar, not log lines


def test_batch_job_logs_lines_instead_of_a_bar(tmp_path, capsys, caplog):
    """No TTY (a SLURM .out file; pytest's capture here): progress_bar=true draws no bar (no \\r-joined line)
    and rank 0 logs one line per logged step with step, loss, tokens/s, MFU and memory."""
    with (
        caplog.at_level(logging.INFO, logger="usp.train.metrics"),
        _logger(tmp_path, progress_bar=True) as log,
    ):
        for step in (1, 2):
            log.log_step(step, loss=3.25, grad_norm=1.0, lr=1.0, tokens=10, flops=5e11, step_time_s=1.0)
    assert "\r" not in capsys.readouterr().err
    lines = [r.getMessage() for r in caplog.records if r.name == "usp.train.metrics"]
    assert len(lines) == 2 and lines[0].startswith("step 1/2 loss 3.2500")
    for part in ("10 tok/s", "MFU 12.5%", "peak "):  # 5e11 FLOP / 1 s / 4 GPUs / 1e12 peak
        assert part in lines[1], lines[1]


def test_non_finite_values_are_written_as_null(tmp_path):
    with _logger(tmp_path) as log:
        rec = log.log_step(
            1,
            loss=float("nan"),
            grad_norm=float("inf"),
            lr=1.0,
            tokens=10,
            flops=1.0,
            step_time_s=1.0,
            extra={"val_loss": float("nan")},
        )
    assert math.isnan(rec["loss"])  # the caller still sees the float

    def reject(name):
        raise AssertionError(f"bare {name} in metrics.jsonl")

    written = json.loads((tmp_path / "metrics.jsonl").read_text(), parse_constant=reject)
    assert (written["loss"], written["grad_norm"], written["val_loss"]) == (None, None, None)


def test_wandb_offline_writes_a_run_dir(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = WandbConfig(mode="offline", project="usp-test", name="offline-check")
    with _logger(tmp_path, wandb_cfg=cfg) as log:
        log.log_step(1, loss=1.0, grad_norm=1.0, lr=1.0, tokens=10, flops=1.0, step_time_s=1.0)
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and any(runs[0].rglob("*.wandb"))


def test_wandb_missing_gives_a_clear_error(tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    with pytest.raises(ImportError, match="logging.wandb.mode=offline needs the wandb package"):
        _logger(tmp_path, wandb_cfg=WandbConfig(mode="offline"))


def test_resume_drops_records_after_the_checkpoint_step(tmp_path):
    """A crash after logging steps 1-5 with the last checkpoint at 3: the resumed run (start_step=3) drops
    steps 4-5 (and a torn last line) before logging 4, 5, ... again: every step appears once."""
    with _logger(tmp_path) as log:
        for step in range(1, 6):
            log.log_step(step, loss=1.0, grad_norm=1.0, lr=1.0, tokens=1, flops=1.0, step_time_s=1.0)
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "lo')  # cut short by the crash
    with MetricsLogger(
        tmp_path,
        rank=1,
        world_size=4,
        peak_flops=1.0,
        wandb_cfg=DISABLED,
        config={},
        layout={},
        total_steps=8,
        progress_bar=False,
        start_step=3,
    ):
        pass  # only rank 0 touches the file
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 6
    with MetricsLogger(
        tmp_path,
        rank=0,
        world_size=4,
        peak_flops=1.0,
        wandb_cfg=DISABLED,
        config={},
        layout={},
        total_steps=8,
        progress_bar=False,
        start_step=3,
    ) as log:
        for step in (4, 5):
            log.log_step(step, loss=2.0, grad_norm=1.0, lr=1.0, tokens=1, flops=1.0, step_time_s=1.0)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    assert [r["loss"] for r in records] == [1.0, 1.0, 1.0, 2.0, 2.0]


def _peak_mem_max_worker(run_dir: str) -> float:
    import torch.distributed as dist

    import usp.train.metrics as metrics

    rank = dist.get_rank()
    original = metrics.peak_memory_gib
    metrics.peak_memory_gib = lambda: 1.0 + 2.0 * rank  # rank 1 peaks higher than rank 0
    try:
        with _logger(run_dir, rank=rank, world_size=2) as log:
            rec = log.log_step(1, loss=1.0, grad_norm=1.0, lr=1.0, tokens=1, flops=1.0, step_time_s=1.0)
    finally:
        metrics.peak_memory_gib = original
    return rec["peak_mem_gib"]


def test_peak_memory_is_the_max_over_ranks(dist_pools, tmp_path):
    assert dist_pools(2).run(_peak_mem_max_worker, str(tmp_path)) == [3.0, 3.0]
    written = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert written["peak_mem_gib"] == 3.0
