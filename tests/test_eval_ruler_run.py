"""eval=ruler on the mesh: the predictions under u2r2, u4r1 and u1r4 (and dp replicas under torchrun) equal
single-process Hugging Face greedy generation on the same prompts, cut by the same EOS / stop-string rule;
decode's ``stop`` ends a generation early; the KV tokens per GPU are what the footprint says; and
``usp-eval eval=ruler`` writes the ``ruler`` entry of eval.json, both PNGs, a wandb run and the stdout table."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, GenerationConfig

from tests.mesh_cache import cached_sp_mesh
from usp.config import EvalConfig
from usp.model import apply_usp, load_causal_lm
from usp.tiny import build_tiny_llama

REPO = Path(__file__).resolve().parents[1]
LAYOUTS = [(2, 2), (4, 1), (1, 4)]
LAYOUT_IDS = ["u2r2", "u4r1", "u1r4"]
TASKS = ["niah_single_1", "niah_multikey_2", "vt", "fwe"]
LENGTHS = [768, 1024]  # multiples of 8 (2 x ring x ulysses); fwe needs 724 tokens of this tokenizer


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    return str(build_tiny_llama(tmp_path_factory.mktemp("ruler-run") / "llama"))


def _cfg() -> EvalConfig:
    cfg = EvalConfig(task="ruler")
    cfg.ruler.tasks, cfg.ruler.samples = list(TASKS), 1
    return cfg


def ruler_worker(model_dir: str, ulysses: int, ring: int) -> dict:
    """Worker: run_ruler on TASKS x LENGTHS, one decode stopped after 3 tokens, the cache sizes of one decode."""
    from usp.eval.decode import decode
    from usp.eval.footprint import eval_memory_per_gpu
    from usp.eval.ruler.run import prepare_ruler, run_ruler

    mesh = cached_sp_mesh(ulysses, ring, "zigzag", 1)
    model = apply_usp(load_causal_lm(model_dir, dtype=torch.float32).eval(), mesh)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    cfg = _cfg()
    builder = prepare_ruler(tokenizer, LENGTHS, cfg)
    result = run_ruler(model, tokenizer, mesh, builder, LENGTHS, cfg)
    ids = torch.tensor([builder.build("vt", 768, 0).input_ids])  # [1, S]
    short = decode(model, ids, mesh, 30, stop=lambda t: t.size(1) >= 3)
    full = decode(model, ids, mesh, 30)
    memory = eval_memory_per_gpu(
        model.config, ids.size(1), 30, ulysses_degree=ulysses, ring_degree=ring, dtype_bytes=4
    )
    return {
        "result": result,
        "short": short.tokens,
        "full": full.tokens,
        "kv": full.kv_tokens,
        "memory": memory,
    }


def _reference(model_dir: str) -> dict[tuple, dict]:
    """Every (task, length, index): HF greedy tokens on the same prompt, cut by run_ruler's stop rule."""
    from usp.eval.chat import stop_token_ids
    from usp.eval.ruler.run import _stopper, prediction_of, prepare_ruler, sample_keys
    from usp.eval.ruler.scoring import score

    model = load_causal_lm(model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    cfg = _cfg()
    builder = prepare_ruler(tokenizer, LENGTHS, cfg)
    stop_ids = stop_token_ids(tokenizer, model.generation_config)
    stop = _stopper(tokenizer, stop_ids)
    out = {}
    for key in sample_keys(cfg, LENGTHS):
        s = builder.build(*key)
        prompt = torch.tensor([s.input_ids])
        gen = GenerationConfig(
            max_new_tokens=s.max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0
        )
        tokens = model.generate(prompt, attention_mask=torch.ones_like(prompt), generation_config=gen)[
            :, prompt.size(1) :
        ]
        n = next(k for k in range(1, tokens.size(1) + 1) if k == tokens.size(1) or stop(tokens[:, :k]))
        prediction = prediction_of(tokenizer, tokens[0, :n].tolist(), stop_ids)
        out[key] = {
            "prompt": s.prompt,
            "references": s.references,
            "prediction": prediction,
            "new_tokens": n,
            "score": score(s.task, prediction, s.references),
            "tokens": tokens,
        }
    return out


def _check_trials(trials: list[dict], ref: dict[tuple, dict], where: str) -> None:
    assert [(t["task"], t["length"], t["index"]) for t in trials] == list(ref), where  # every key, in order
    for t in trials:
        r = ref[t["task"], t["length"], t["index"]]
        what = f"{where}: {t['task']} at {t['length']}"
        assert (t["prompt"], t["references"]) == (r["prompt"], r["references"]), what
        assert (t["prediction"], t["new_tokens"], t["score"]) == (
            r["prediction"],
            r["new_tokens"],
            r["score"],
        ), what


@pytest.fixture(scope="module")
def reference(tiny_model) -> dict[tuple, dict]:
    return _reference(tiny_model)


@pytest.mark.parametrize("ulysses, ring", LAYOUTS, ids=LAYOUT_IDS)
def test_ruler_predictions_match_single_process_greedy(dist_pools, tiny_model, reference, ulysses, ring):
    per_rank = dist_pools(4).run(ruler_worker, tiny_model, ulysses, ring)
    vt = reference["vt", 768, 0]["tokens"]
    for rank, got in enumerate(per_rank):
        where = f"u{ulysses}r{ring} rank {rank}"
        _check_trials(got["result"]["trials"], reference, where)
        assert set(got["result"]["tasks"]) == set(TASKS) and list(got["result"]["mean"]) == ["768", "1024"]
        assert torch.equal(got["short"], got["full"][:, :3]) and got["short"].shape == (1, 3), (
            where
        )  # stopped early
        assert torch.equal(got["full"], vt[:, :30]), where
        assert max(got["kv"]) <= got["memory"]["kv_tokens_per_gpu"] <= max(got["kv"]) + 1, (where, got["kv"])


@pytest.mark.slow  # one torchrun world of 4 with dp 2
def test_usp_eval_ruler_under_torchrun_with_dp_replicas(tiny_model, reference, tmp_path):
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
        f"model.path={tiny_model}",
        "eval=ruler",
        "parallel.ulysses_degree=2",
        "parallel.ring_degree=1",
        f"eval.lengths=[{','.join(map(str, LENGTHS))}]",
        f"eval.ruler.tasks=[{','.join(TASKS)}]",
        "eval.ruler.samples=1",
        "model.dtype=float32",
        "logging.wandb.mode=offline",
        f"hydra.run.dir={run_dir}",
    ]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    entry = json.loads((run_dir / "eval.json").read_text())["ruler"]
    assert entry["layout"]["dp_degree"] == 2 and entry["lengths"] == LENGTHS
    _check_trials(entry["result"]["trials"], reference, "torchrun u2r1 x dp2")
    result = entry["result"]
    for task in TASKS:
        for n in LENGTHS:
            assert result["tasks"][task][str(n)] == reference[task, n, 0]["score"]
    assert (
        set(result["mean"]) == {"768", "1024"}
        and "effective_length" in result
        and result["threshold"] == 0.85
    )
    assert set(entry["memory_per_gpu"]["1024"]) >= {"kv_cache_gib", "prefill_activations_gib", "weights_gib"}
    assert "ruler effective length:" in proc.stdout and "niah_multikey_2" in proc.stdout
    for name in ("ruler.png", "ruler_by_length.png"):
        assert (run_dir / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert list((run_dir / "wandb").glob("offline-run-*")), "no offline wandb run"
