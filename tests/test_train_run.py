"""``usp.train.trainer.run`` end to end on the tiny model and corpus: resume, layouts, bad input.

- 6 steps straight == 3 steps + resume + 3 steps (same losses, exactly: same code, same layout);
- resuming the world-1 step-3 checkpoint under (u2,r2) and (u1,r4) on 4 ranks continues with the same
  losses - this also checks run() itself (real loader, document masking, cu_seqlens) across layouts. The
  trainer keeps fp32 master weights (``usp.model.build_empty_causal_lm``), so these runs are fp32 and agree to
  the rounding rule (:func:`fp32_run_tolerance`); the float64 exactness of the same layouts is
  ``tests/test_train_layouts.py``;
- bad settings raise ValueError on every rank before any training step.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.run_errors import run_expecting_error
from tests.tolerance import assert_close_scaled, rounding_tolerance
from usp.config import TrainConfig
from usp.tiny import build_tiny_llama
from usp.train.trainer import run

MAX_STEPS = 6


def make_config(model_dir: str, run_dir: str, cache_dir: str, **parallel) -> TrainConfig:
    cfg = TrainConfig()
    cfg.model.path = model_dir
    cfg.model.dtype = "float32"
    cfg.data.build_tiny_corpus = True
    cfg.data.cache_dir = cache_dir
    cfg.data.validation_fraction = 0.1
    cfg.trainer.eval_every = 3
    cfg.trainer.seq_len = 64
    cfg.trainer.max_steps = MAX_STEPS
    cfg.trainer.grad_accum_steps = 2
    cfg.trainer.loss_chunk_size = 24
    cfg.trainer.checkpoint_every = 3
    cfg.trainer.device = "cpu"
    cfg.optim.lr = 3e-3
    cfg.optim.warmup_steps = 2
    cfg.logging.progress_bar = False
    cfg.cluster.gpu = "cpu"
    cfg.run_dir = run_dir
    for k, v in parallel.items():
        setattr(cfg.parallel, k, v)
    return cfg


def fp32_run_tolerance(model_dir: str, tokens: int) -> float:
    """``tests.tolerance.rounding_tolerance`` for the losses of two fp32 runs (training or evaluation) that
    differ in summation order (layout, kernels): the longest reduction behind a loss is the sum over the
    ``tokens`` it averages (a step's, a document's) or the softmax over the vocabulary (the tiny model's hidden
    64 and intermediate 128 are shorter)."""
    vocab = json.loads(Path(model_dir, "config.json").read_text())["vocab_size"]
    return rounding_tolerance(torch.float32, max(tokens, vocab))


def run_worker(cfg: TrainConfig) -> dict:
    out = run(cfg)
    keys = ("losses", "final_step", "start_step", "checkpoint", "export_dir", "layout", "val_losses")
    return {k: out[k] for k in keys}


def run_counting_fsdp(cfg: TrainConfig, force_fsdp: bool = False) -> dict:
    """:func:`run_worker`, counting the FSDP2 wraps (``fsdp_calls``); ``force_fsdp``: wrap even where
    :func:`usp.train.parallelize.needs_fsdp` says no (today's world-1 fp32 path before it skipped FSDP2)."""
    from usp.train import parallelize as recipe

    calls: list[int] = []
    originals = recipe.apply_fsdp, recipe.needs_fsdp

    def counted(*args, **kwargs):
        calls.append(1)
        return originals[0](*args, **kwargs)

    recipe.apply_fsdp = counted
    if force_fsdp:
        recipe.needs_fsdp = lambda *args, **kwargs: True
    try:
        out = run_worker(cfg)
    finally:
        recipe.apply_fsdp, recipe.needs_fsdp = originals
    return out | {"fsdp_calls": len(calls)}


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("train_run")
    model_dir = str(build_tiny_llama(root / "model"))
    return {"root": str(root), "model": model_dir, "cache": str(root / "data_cache")}


@pytest.fixture(scope="module")
def straight(dist_pools, setup) -> dict:
    cfg = make_config(setup["model"], f"{setup['root']}/straight", setup["cache"])
    return dist_pools(1).run(run_counting_fsdp, cfg)[0]


def test_run_world1_trains_checkpoints_and_exports(straight, setup):
    assert straight["final_step"] == MAX_STEPS and len(straight["losses"]) == MAX_STEPS
    assert straight["losses"][-1] < straight["losses"][0]
    run_dir = Path(setup["root"]) / "straight"
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_3", "step_6"]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, MAX_STEPS + 1))
    assert [r["loss"] for r in records] == pytest.approx(straight["losses"])
    assert all(r["tokens"] == 2 * 64 and r["mfu"] > 0 for r in records)
    val = straight["val_losses"]
    assert sorted(val) == [3, 6] and val[6] < val[3] < 10  # validation every 3 steps, and it learns
    assert [r.get("val_loss") for r in records if "val_loss" in r] == [val[3], val[6]]
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(straight["export_dir"], local_files_only=True)
    assert exported.config.num_hidden_layers == 2


def test_world1_fp32_skips_fsdp2_with_the_same_numbers(dist_pools, setup, straight):
    """One rank, fp32: the plain module trains (no FSDP2 wrap) and gives bit for bit the losses, validation
    losses and exported weights of the same run through FSDP2 (which at world 1 only copies)."""
    from safetensors.torch import load_file

    cfg = make_config(setup["model"], f"{setup['root']}/through_fsdp", setup["cache"])
    wrapped = dist_pools(1).run(run_counting_fsdp, cfg, True)[0]
    assert straight["fsdp_calls"] == 0 and wrapped["fsdp_calls"] == 1
    assert wrapped["losses"] == straight["losses"]
    assert wrapped["val_losses"] == straight["val_losses"]
    plain, sharded = (load_file(Path(r["export_dir"]) / "model.safetensors") for r in (straight, wrapped))
    assert plain.keys() == sharded.keys()
    for name, tensor in plain.items():
        torch.testing.assert_close(sharded[name], tensor, rtol=0, atol=0, msg=name)


def run_keeping_nothing(cfg: TrainConfig) -> dict:
    out = run(cfg, save_final=False)
    return {k: out[k] for k in ("final_step", "checkpoint", "export_dir", "losses")}


def test_save_final_false_writes_no_checkpoint(dist_pools, setup, tmp_path):
    """``run(cfg, save_final=False)`` (what ``usp.bench.maxlen`` runs): the steps run, nothing is saved."""
    cfg = make_config(setup["model"], str(tmp_path / "run"), setup["cache"])
    cfg.trainer.max_steps, cfg.trainer.checkpoint_every, cfg.trainer.export_hf = 2, 0, False
    out = dist_pools(1).run(run_keeping_nothing, cfg)[0]
    assert out["final_step"] == 2 and len(out["losses"]) == 2
    assert out["checkpoint"] is None and out["export_dir"] is None
    ckpt_dir = tmp_path / "run" / "checkpoints"
    assert not ckpt_dir.exists() or not any(ckpt_dir.iterdir())


def test_resume_gives_identical_losses(dist_pools, setup, straight):
    run_dir = f"{setup['root']}/interrupted"
    cfg = make_config(setup["model"], run_dir, setup["cache"])
    cfg.trainer.export_hf = False
    first = dist_pools(1).run(run_worker, cfg)[0]
    shutil.rmtree(Path(run_dir) / "checkpoints" / "step_6")  # as if the job had died after step 3
    second = dist_pools(1).run(run_worker, cfg)[0]
    assert second["start_step"] == 3
    assert first["losses"] == straight["losses"]
    assert second["losses"] == straight["losses"][3:]
    records = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, MAX_STEPS + 1))  # steps 4-6 of the first run dropped
    assert [r["loss"] for r in records] == pytest.approx(straight["losses"])


@pytest.mark.slow
@pytest.mark.parametrize(
    "ulysses, ring, fsdp_mode",
    [(2, 2, "full_shard"), (1, 4, "full_shard"), (2, 2, "hybrid_shard")],
    ids=["u2r2", "u1r4", "u2r2-hsdp"],
)
def test_resume_into_another_layout(dist_pools, setup, straight, ulysses, ring, fsdp_mode):
    ckpt = Path(setup["root"]) / "straight" / "checkpoints" / "step_3"
    cfg = make_config(
        setup["model"],
        f"{setup['root']}/relayout_u{ulysses}r{ring}{fsdp_mode}",
        setup["cache"],
        ulysses_degree=ulysses,
        ring_degree=ring,
        fsdp_mode=fsdp_mode,
        node_size=2,
    )
    cfg.trainer.resume = str(ckpt)
    cfg.trainer.export_hf = False
    out = dist_pools(4).run(run_worker, cfg)
    assert all(o["losses"] == out[0]["losses"] for o in out)  # every rank reports the global loss
    assert out[0]["start_step"] == 3 and out[0]["layout"]["ring_degree"] == ring
    tol = fp32_run_tolerance(setup["model"], cfg.trainer.seq_len * cfg.trainer.grad_accum_steps)
    where = f"resume u{ulysses}r{ring} {fsdp_mode} vs world 1"
    val, val_ref = out[0]["val_losses"][6], straight["val_losses"][6]
    assert_close_scaled(
        torch.tensor([val], dtype=torch.float64),
        torch.tensor([val_ref], dtype=torch.float64),
        tol,
        f"{where}: validation loss",
    )
    losses, expected = (
        torch.tensor(out[0]["losses"], dtype=torch.float64),
        torch.tensor(straight["losses"][3:], dtype=torch.float64),
    )
    assert_close_scaled(losses, expected, tol, f"{where}: losses")


def _bad_configs(setup) -> list[tuple[TrainConfig, str]]:
    root = setup["root"]

    def cfg(**kw) -> TrainConfig:
        c = make_config(setup["model"], f"{root}/bad", setup["cache"])
        for key, value in kw.items():
            section, name = key.split("__")
            setattr(getattr(c, section), name, value)
        return c

    malformed = Path(root) / "malformed"
    malformed.mkdir(exist_ok=True)
    (malformed / "config.json").write_text("{not json")
    return [
        (cfg(model__path=f"{root}/no_such_model"), "model.path="),
        (cfg(model__path=str(malformed)), "config.json could not be read"),
        (cfg(trainer__seq_len=60), "trainer.seq_len = 56 or 64"),
        (cfg(parallel__ulysses_degree=3), "parallel.ulysses_degree=3"),
        (cfg(parallel__dp_degree=3), "parallel.dp_degree=3"),
        (cfg(trainer__resume=f"{root}/no_such_ckpt"), "trainer.resume="),
        (cfg(model__dtype="float8"), "model.dtype="),
        (cfg(data__build_tiny_corpus=False), "data.inputs"),
        (cfg(trainer__micro_batch_size=2), "data.document_masking=true needs trainer.micro_batch_size=1"),
        (cfg(data__validation_fraction=0.0), "trainer.eval_every=3 needs validation data"),
        (cfg(model__attention_backend="sdpa_cudnn"), "model.attention_backend='sdpa_cudnn'"),
        (cfg(parallel__cpu_offload=True), "parallel.cpu_offload=true needs CUDA"),
    ]


@pytest.mark.slow
def test_bad_input_raises_on_every_rank(dist_pools, setup):
    for cfg, match in _bad_configs(setup):
        cfg.parallel.ulysses_degree = cfg.parallel.ulysses_degree if cfg.parallel.ulysses_degree != 1 else 2
        cfg.parallel.ring_degree = 2
        messages = dist_pools(4).run(run_expecting_error, cfg)
        for m in messages:
            assert match in m, (match, m)
    assert not (Path(setup["root"]) / "bad" / "metrics.jsonl").exists()  # nothing ran


def test_heads_not_divisible_raises(dist_pools, setup, tmp_path):
    # uneven splits work (tests/test_ulysses_uneven.py); more Ulysses ranks than query heads cannot
    model_dir = str(
        build_tiny_llama(tmp_path / "two_heads", hidden_size=64, num_attention_heads=2, num_key_value_heads=2)
    )
    cfg = make_config(model_dir, str(tmp_path / "run"), setup["cache"], ulysses_degree=4, ring_degree=1)
    messages = dist_pools(4).run(run_expecting_error, cfg)
    assert all(
        "parallel.ulysses_degree=4 does not fit num_heads=2: every Ulysses rank needs at least one query head"
        in m
        for m in messages
    ), messages


def test_auto_degrees_ask_the_planner(dist_pools, setup, tmp_path):
    cfg = make_config(
        setup["model"], str(tmp_path / "auto"), setup["cache"], ulysses_degree="auto", ring_degree="auto"
    )
    cfg.trainer.max_steps = 1
    cfg.trainer.export_hf = False
    out = dist_pools(1).run(run_worker, cfg)[0]
    layout = out["layout"]
    assert layout["reason"].startswith("planner:")
    assert layout["ulysses_degree"] * layout["ring_degree"] * layout["dp_degree"] == 1
    assert len(out["losses"]) == 1


def _fail_on_rank_one() -> str:
    import torch.distributed as dist

    from usp.parallel.agree import on_every_rank

    def check() -> int:
        if dist.get_rank() == 1:
            raise ValueError("trainer.seq_len=7 is bad on this rank only")
        return 0

    try:
        on_every_rank(check, "config validation")
    except ValueError as e:
        return str(e)
    return "no error"


def test_error_on_one_rank_raises_on_every_rank(dist_pools):
    messages = dist_pools(4).run(_fail_on_rank_one)
    assert all("trainer.seq_len=7 is bad on this rank only" in m for m in messages)
    assert "failed on rank 1" in messages[0]


def test_timeout_minutes_reaches_init_process_group(monkeypatch):
    """parallel.timeout_minutes -> init_process_group(timeout=...), with and without a launcher."""
    from datetime import timedelta

    import torch.distributed as dist

    from usp.parallel import process_group

    calls: list[dict] = []
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **kw: calls.append(kw))
    monkeypatch.setattr(
        process_group, "launcher_store", lambda timeout: dist.HashStore()
    )  # no TCPStore on a port
    for key in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    assert process_group.init_distributed(torch.device("cpu"), timeout_minutes=90)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert process_group.init_distributed(torch.device("cpu"))
    assert [c["timeout"] for c in calls] == [timedelta(minutes=90), timedelta(minutes=60)]
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **kw: calls.append({"backend": a[0]}))
    process_group.init_distributed(
        torch.device("cuda", 0), cpu_offload=True
    )  # CPU shards need gloo next to nccl
    process_group.init_distributed(torch.device("cuda", 0))
    assert [c["backend"] for c in calls[2:]] == ["cpu:gloo,cuda:nccl", "nccl"]
    cfg = TrainConfig()
    assert cfg.parallel.timeout_minutes == 60
    cfg.model.path, cfg.data.build_tiny_corpus, cfg.parallel.timeout_minutes = "/m", True, 0
    from usp.config import validate_choices

    with pytest.raises(ValueError, match="parallel.timeout_minutes=0"):
        validate_choices(cfg)


def test_run_passes_timeout_minutes(monkeypatch, tmp_path):
    from usp.startup import shell
    from usp.train import trainer

    seen: dict = {}

    def fake_init(device, backend=None, *, timeout_minutes=60, cpu_offload=False):
        seen["timeout_minutes"] = timeout_minutes
        return False

    monkeypatch.setattr(shell, "init_distributed", fake_init)
    monkeypatch.setattr(trainer, "_run", lambda cfg, device, **kw: {"ok": True})
    cfg = make_config("/m", str(tmp_path), str(tmp_path))
    cfg.parallel.timeout_minutes = 123
    assert trainer.run(cfg) == {"ok": True}
    assert seen["timeout_minutes"] == 123


def test_auto_for_one_degree_keeps_the_users_other_settings(setup, tmp_path):
    """ulysses_degree=2 ring_degree=auto: the planner keeps u=2 and the non-default fsdp / checkpointing modes
    (unconstrained, it picks u1 r1 dp4 full_shard none for this model)."""
    from usp.model import check_model_dir
    from usp.startup import resolve_layout

    cfg = make_config(
        setup["model"],
        str(tmp_path),
        setup["cache"],
        ulysses_degree=2,
        ring_degree="auto",
        fsdp_mode="hybrid_shard",
        activation_checkpointing="every_k",
        ac_every_k=1,
        node_size=2,
    )
    layout = resolve_layout(cfg, check_model_dir(setup["model"]), 4, torch.device("cpu"))
    assert layout.ulysses_degree == 2 and layout.ring_degree * layout.dp_degree == 2
    assert (layout.fsdp_mode, layout.activation_checkpointing, layout.ac_every_k) == (
        "hybrid_shard",
        "every_k",
        1,
    )
    assert layout.reason.startswith("planner:") and "fixed" in layout.reason
    cfg.parallel.ulysses_degree, cfg.parallel.ring_degree = "auto", 2
    cfg.parallel.fsdp_mode, cfg.parallel.activation_checkpointing = (
        "full_shard",
        "none",
    )  # defaults: planner's
    layout = resolve_layout(cfg, check_model_dir(setup["model"]), 4, torch.device("cpu"))
    assert layout.ring_degree == 2 and layout.ulysses_degree * layout.dp_degree == 2


def test_auto_resume_refuses_another_runs_checkpoint(setup, tmp_path):
    """resume=auto only continues a checkpoint of the same model.path and seq_len (fingerprint in extra)."""
    from usp.checkpoint import save_checkpoint
    from usp.train.resume import check_auto_resume, run_fingerprint

    cfg = make_config(setup["model"], str(tmp_path), setup["cache"])
    root = tmp_path / "checkpoints"
    assert check_auto_resume(cfg, root) is None  # nothing to resume
    model = torch.nn.Linear(2, 2)
    save_checkpoint(
        root,
        3,
        model=model,
        optimizer=None,
        scheduler=None,
        extra={"fingerprint": run_fingerprint(cfg)},
        keep_last=2,
    )
    assert check_auto_resume(cfg, root) == root / "step_3"
    longer = make_config(setup["model"], str(tmp_path), setup["cache"])
    longer.trainer.seq_len = 128
    with pytest.raises(
        ValueError, match=r"trainer.resume=auto .*trainer.seq_len 64 there, 128 now.*hydra.run.dir"
    ):
        check_auto_resume(longer, root)
    other = make_config(str(tmp_path / "other-model"), str(tmp_path), setup["cache"])
    with pytest.raises(ValueError, match="model.path"):
        check_auto_resume(other, root)
    save_checkpoint(root, 4, model=model, optimizer=None, scheduler=None, extra={}, keep_last=2)
    assert check_auto_resume(longer, root) == root / "step_4"  # no fingerprint (older checkpoint): accepted


def test_checkpoints_carry_the_run_fingerprint(setup, straight):
    from usp.checkpoint import read_saved_extra
    from usp.train.resume import run_fingerprint

    cfg = make_config(setup["model"], f"{setup['root']}/straight", setup["cache"])
    saved = read_saved_extra(Path(setup["root"]) / "straight" / "checkpoints")
    assert saved["fingerprint"] == run_fingerprint(cfg)


def test_dynamic_rope_under_sequence_parallelism_passes_validation(setup, tmp_path):
    """check_training_run() (per rank, before any weights) applies the RoPE overrides; dynamic scaling at sp 4
    is no longer refused: apply_usp picks its frequencies from the whole row (tests/test_global_positions.py)."""
    from usp.train.checks import check_training_run

    cfg = make_config(setup["model"], str(tmp_path), setup["cache"], ulysses_degree=2, ring_degree=2)
    cfg.model.rope_scaling = {"rope_type": "dynamic", "factor": 2.0}
    _, layout = check_training_run(cfg, 4, torch.device("cpu"))
    assert (layout.ulysses_degree, layout.ring_degree) == (2, 2)
