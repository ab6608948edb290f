"""usp-eval end to end and its checks: config composition, bad input on every rank before any forward,
the in-training ``val_ppl_by_position`` vs a single-process reference, and a generation-ready HF export.

The torchrun run of the passkey harness (JSON, PNG, wandb offline, stdout summary) is in
``test_usp_eval_passkey_under_torchrun``.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.test_train_run import fp32_run_tolerance
from tests.tolerance import assert_close_scaled
from usp.config import TrainConfig
from usp.config.compose import compose_eval_config

REPO = Path(__file__).resolve().parents[1]


# --- composition -----------------------------------------------------------------------------------------
def test_compose_eval_config_takes_recipes_and_the_eval_group(tmp_path):
    cfg = compose_eval_config(["recipe=tiny", "eval=passkey", "model.path=/x"], run_dir=str(tmp_path))
    assert cfg.eval.task == "passkey" and cfg.parallel.ulysses_degree == 2 and cfg.eval.bucket_size == 32
    # a real recipe: its prepared-data path may stay unset for evaluation, model.path may not
    cfg = compose_eval_config(["recipe=llama31_8b_128k", "model.path=/ckpt"])
    assert cfg.eval.task == "ppl" and cfg.trainer.seq_len == 131072 and cfg.parallel.ring_degree == 2
    with pytest.raises(ValueError, match="model.path="):
        compose_eval_config(["recipe=llama31_8b_128k"])
    for group in ("data=prepared", "data=jsonl", "data=hub"):  # their required paths (???) are not needed
        cfg = compose_eval_config([group, "model.path=/x"])
        assert cfg.data.prepared_path is None and cfg.data.inputs == []


def test_default_lengths_follow_the_task_and_the_layout():
    from usp.eval.runner import resolve_lengths

    cfg = compose_eval_config(["recipe=tiny", "model.path=/x"])
    assert resolve_lengths(cfg) == [512]
    cfg.eval.task = "passkey"
    assert resolve_lengths(cfg) == [128, 256, 512, 1024]


# --- bad input: ValueError on every rank, before any forward ----------------------------------------------
def _eval_cfg(model_dir: str, run_dir: str, **eval_fields) -> TrainConfig:
    cfg = compose_eval_config(["recipe=tiny", f"model.path={model_dir}"], run_dir=run_dir)
    for key, value in eval_fields.items():
        setattr(cfg.eval, key, value)
    return cfg


def eval_expecting_error(cfg: TrainConfig) -> str:
    """Worker: usp.eval.runner.run must raise ValueError here, without loading the model or running a forward."""
    import usp.eval.runner as runner

    def no_forward(*args, **kwargs):
        raise AssertionError("the model was loaded before the bad setting was reported")

    original, runner.load_model = runner.load_model, no_forward
    try:
        runner.run(cfg)
    except ValueError as e:
        return str(e)
    finally:
        runner.load_model = original
    raise AssertionError("usp.eval accepted a bad config")


@pytest.mark.slow  # five worlds of checks, one reading the tiny corpus; ~40 s on 2 idle cores
def test_bad_input_fails_on_every_rank_before_any_forward(dist_pools, tiny_llama, tmp_path):
    run_dir = str(tmp_path / "run")
    cases = [
        (_eval_cfg(tiny_llama, run_dir, lengths=[100]), r"eval.lengths=\[100\].*multiple of 8"),
        (
            _eval_cfg(tiny_llama, run_dir, lengths=[96, 4096]),
            r"eval.lengths.*no document.*4096 tokens or more",
        ),
        (
            _eval_cfg(tiny_llama, run_dir, inputs=[str(tmp_path / "missing.jsonl")]),
            r"eval.inputs=.*missing.jsonl",
        ),
        (_eval_cfg(str(tmp_path / "no-model"), run_dir), r"model.path=.*no-model"),
        (
            _eval_cfg(tiny_llama, run_dir, task="passkey", lengths=[32]),
            r"eval.lengths: 32 tokens cannot hold",
        ),
    ]
    for cfg, pattern in cases:
        messages = dist_pools(4).run(eval_expecting_error, cfg)
        for rank, message in enumerate(messages):
            assert re.search(pattern, message), (rank, pattern, message)
    assert not (Path(run_dir) / "eval.json").exists()


# --- during training: val_ppl_by_position ---------------------------------------------------------------
def train_worker(cfg: TrainConfig) -> dict:
    from usp.train.trainer import run

    out = run(cfg)
    return {"metrics": out["metrics"], "export_dir": out["export_dir"]}


def _reference_ppl_by_position(cfg: TrainConfig, export_dir: str, bucket: int) -> dict[str, float]:
    """The validation rows through the exported model, one document piece at a time (no sharding)."""
    from transformers import AutoTokenizer

    from usp.data import build_dataloaders
    from usp.model import load_causal_lm

    model = load_causal_lm(export_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(export_dir)
    _, val = build_dataloaders(
        cfg.data,
        tokenizer=tokenizer,
        seq_len=cfg.trainer.seq_len,
        mesh=None,
        micro_batch_size=1,
        seed=cfg.trainer.seed,
        cache_dir=cfg.data.cache_dir,
    )
    sums: dict[int, list[float]] = {}
    with torch.no_grad():
        for batch in val:
            cu = batch["cu_seqlens"].tolist()
            for a, b in zip(cu[:-1], cu[1:]):
                logits = model(
                    input_ids=batch["input_ids"][:, a:b], position_ids=batch["position_ids"][:, a:b]
                ).logits
                labels = batch["labels"][0, a:b]
                losses = torch.nn.functional.cross_entropy(
                    logits[0].float(), labels, ignore_index=-100, reduction="none"
                )
                for p, loss, y in zip(
                    batch["position_ids"][0, a:b].tolist(), losses.tolist(), labels.tolist()
                ):
                    if y != -100:
                        acc = sums.setdefault(p // bucket, [0.0, 0.0])
                        acc[0] += loss
                        acc[1] += 1
    return {str(k * bucket): math.exp(s / n) for k, (s, n) in sorted(sums.items())}


def test_eval_every_logs_val_ppl_by_position(dist_pools, tiny_llama, tmp_path):
    cfg = TrainConfig()
    cfg.model.path, cfg.model.dtype = tiny_llama, "float32"
    cfg.data.build_tiny_corpus, cfg.data.cache_dir, cfg.data.validation_fraction = (
        True,
        str(tmp_path / "cache"),
        0.1,
    )
    cfg.trainer.seq_len, cfg.trainer.max_steps, cfg.trainer.eval_every = 64, 2, 2
    cfg.trainer.loss_chunk_size, cfg.trainer.checkpoint_every, cfg.trainer.device = 24, 0, "cpu"
    cfg.parallel.ulysses_degree, cfg.parallel.ring_degree = 2, 2
    cfg.logging.progress_bar, cfg.cluster.gpu, cfg.run_dir = False, "cpu", str(tmp_path / "run")
    cfg.eval.bucket_size = 16
    out = dist_pools(4).run(train_worker, cfg)[0]
    logged = out["metrics"][-1]["val_ppl_by_position"]
    ref = _reference_ppl_by_position(cfg, out["export_dir"], 16)
    assert list(logged) == list(ref) and len(ref) >= 3
    # fp32 (the trainer's weights); the rule bounds the bucket's mean loss, log(ppl)
    log_ppl = {
        name: torch.tensor(list(d.values()), dtype=torch.float64).log()
        for name, d in (("u2r2", logged), ("ref", ref))
    }
    assert_close_scaled(
        log_ppl["u2r2"],
        log_ppl["ref"],
        fp32_run_tolerance(tiny_llama, cfg.trainer.seq_len),
        "in-training val_ppl_by_position vs one process: log ppl",
    )
    line = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert line["val_ppl_by_position"] == logged


# --- the HF export is ready for generation ---------------------------------------------------------------
def test_export_turns_the_kv_cache_back_on(tiny_llama, tmp_path):
    from usp.model import load_causal_lm
    from usp.train.export import export_hf

    model = load_causal_lm(tiny_llama, dtype=torch.float32)  # training setting: use_cache off
    model.generation_config.use_cache = False
    assert model.config.use_cache is False
    export_hf(model, tokenizer=None, out_dir=tmp_path / "hf")
    assert json.loads((tmp_path / "hf" / "config.json").read_text()).get("use_cache", True) is True
    assert json.loads((tmp_path / "hf" / "generation_config.json").read_text()).get("use_cache", True) is True
    assert model.config.use_cache is False  # the live model is left as it was


# --- the passkey harness under torchrun --------------------------------------------------------------------
@pytest.mark.slow
def test_usp_eval_passkey_under_torchrun(tiny_llama, tmp_path):
    run_dir = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", WANDB_SILENT="true")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "4",
        "-m",
        "usp.eval",
        "recipe=tiny",
        f"model.path={tiny_llama}",
        "eval=passkey",
        "eval.lengths=[128,256]",
        "eval.micro_batch_size=2",
        "eval.passkey.max_new_tokens=4",
        "logging.wandb.mode=offline",
        f"hydra.run.dir={run_dir}",
    ]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "passkey overall accuracy" in proc.stdout and "prefill:" in proc.stdout
    data = json.loads((run_dir / "eval.json").read_text())["passkey"]
    cells = data["result"]["cells"]
    assert [(c["length"], c["depth"]) for c in cells] == [(n, d) for n in (128, 256) for d in (0.0, 0.5, 1.0)]
    assert all(c["trials"] == 2 and 0.0 <= c["accuracy"] <= 1.0 for c in cells)
    assert len(data["result"]["trials"]) == 12 and data["layout"]["ring_degree"] == 2
    assert data["timing"]["prefill_tokens_per_s"] > 0 and data["timing"]["decode_tokens_per_s"] > 0
    assert (run_dir / "passkey.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert list((run_dir / "wandb").glob("offline-run-*")), "no offline wandb run"


# --- model.path: an HF export or a training checkpoint ---------------------------------------------------
def eval_worker(cfg: TrainConfig) -> dict:
    from usp.eval.runner import run

    return run(cfg)["result"]


def test_checkpoint_and_export_give_the_same_results(dist_pools, tiny_llama, tmp_path):
    from transformers import AutoTokenizer

    from usp.checkpoint import save_checkpoint
    from usp.model import load_causal_lm
    from usp.train.export import export_hf

    model = load_causal_lm(tiny_llama, dtype=torch.float32)
    with torch.no_grad():  # "trained" weights: neither the base checkpoint's nor each other's by accident
        for p in model.parameters():
            p.mul_(1.05)
    save_checkpoint(
        tmp_path / "checkpoints",
        3,
        model=model,
        optimizer=None,
        scheduler=None,
        keep_last=1,
        extra={"fingerprint": {"model_path": tiny_llama, "seq_len": 64}},
    )
    export_hf(model, tokenizer=AutoTokenizer.from_pretrained(tiny_llama), out_dir=tmp_path / "hf")
    results = {}
    for name, path in (
        ("checkpoint", tmp_path / "checkpoints"),
        ("export", tmp_path / "hf"),
        ("base", tiny_llama),
    ):
        cfg = _eval_cfg(str(path), str(tmp_path / name), lengths=[96], num_documents=2)
        cfg.parallel.ulysses_degree = cfg.parallel.ring_degree = 1
        cfg.parallel.node_size = None
        results[name] = dist_pools(1).run(eval_worker, cfg)[0]["lengths"]["96"]
    ppl = {name: torch.tensor([b["ppl"] for b in r["buckets"]]) for name, r in results.items()}
    torch.testing.assert_close(ppl["checkpoint"], ppl["export"], rtol=1e-6, atol=0)
    assert not torch.allclose(ppl["checkpoint"], ppl["base"], rtol=1e-3)


@pytest.mark.slow  # four evaluations at world 4
def test_dp_replicas_split_the_work_and_agree_with_one_replica(dist_pools, tiny_llama, tmp_path):
    """u2r1 x dp2 (documents and trials split over 2 replicas) gives what u2r2 (one replica) gives."""
    results = {}
    for name, (ulysses, ring) in {"dp2": (2, 1), "dp1": (2, 2)}.items():
        for task in ("ppl", "passkey"):
            cfg = _eval_cfg(tiny_llama, str(tmp_path / name), task=task, lengths=[128], num_documents=3)
            cfg.parallel.ulysses_degree, cfg.parallel.ring_degree = ulysses, ring
            cfg.eval.passkey.trials, cfg.eval.passkey.max_new_tokens = 3, 3
            results[name, task] = dist_pools(4).run(eval_worker, cfg)
    for task in ("ppl", "passkey"):
        assert all(
            r == results["dp2", task][0] for r in results["dp2", task][1:]
        )  # every rank has everything
    ppl = {
        name: torch.tensor([b["ppl"] for b in results[name, "ppl"][0]["lengths"]["128"]["buckets"]])
        for name in ("dp1", "dp2")
    }
    # fp32 evaluations of 128-token documents; the rule bounds the bucket's mean loss, log(ppl)
    assert_close_scaled(
        ppl["dp2"].double().log(),
        ppl["dp1"].double().log(),
        fp32_run_tolerance(tiny_llama, 128),
        "u2r1 x dp2 vs u2r2: log ppl",
    )
    assert results["dp2", "ppl"][0]["lengths"]["128"]["documents"] == 3
    answers = {
        name: [(t["passkey"], t["answer"]) for t in results[name, "passkey"][0]["trials"]]
        for name in ("dp1", "dp2")
    }
    assert answers["dp2"] == answers["dp1"] and len(answers["dp1"]) == 9
