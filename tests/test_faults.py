"""Faults a long run meets, each reproduced on the tiny model (CPU, gloo) and checked for what the user sees:

- a fresh start over an earlier run's checkpoints is refused, the old checkpoints untouched;
- a run dir locked by another job is refused on every rank (holder's pid in the message); a second launch is
  refused while the first runs, and the lock goes when the first is killed (slow: real processes);
- a NaN/inf loss or gradient skips the step on every rank, too many in a row stop the run with an error, and
  neither a checkpoint nor the export is written from non-finite weights; metrics.jsonl stays strict JSON;
- corrupted checkpoint files (truncated, empty, 256 bytes overwritten) are caught by their checksums:
  ``resume=auto`` falls back to the newest intact checkpoint, an explicit path is an error naming the file;
- a crafted pickle in meta.pt, rank_0.pt or DCP's .metadata is refused without running;
- a run dir holding someone else's files, or a foreign ``hf/``, is refused before any work;
- a resume with a larger ``trainer.max_steps`` follows the new schedule from its first step.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import math
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.test_train_run import make_config
from usp.config import TrainConfig
from usp.tiny import build_tiny_llama
from usp.train.trainer import run

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("faults")
    return {"model": str(build_tiny_llama(root / "model")), "cache": str(root / "data_cache")}


def config(setup: dict, run_dir: Path, **trainer) -> TrainConfig:
    cfg = make_config(setup["model"], str(run_dir), setup["cache"])
    cfg.trainer.eval_every = 0
    cfg.trainer.export_hf = False
    for key, value in trainer.items():
        setattr(cfg.trainer, key, value)
    return cfg


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def run_reporting(cfg: TrainConfig) -> dict:
    """Worker: run() -> {"out", "error": (type, message) or None, "warnings": [logged warnings]}."""
    handler = _Collect()
    logging.getLogger("usp").addHandler(handler)
    try:
        out = run(cfg)
        keep = ("losses", "start_step", "checkpoint", "export_dir", "metrics")
        return {"out": {k: out[k] for k in keep}, "error": None, "warnings": handler.messages}
    except Exception as e:  # noqa: BLE001 - the test checks the type and the message
        return {"out": None, "error": (type(e).__name__, str(e)), "warnings": handler.messages}
    finally:
        logging.getLogger("usp").removeHandler(handler)


def _strict_records(run_dir: Path) -> list[dict]:
    def reject(name: str) -> None:
        raise AssertionError(f"metrics.jsonl holds a bare {name}: not strict JSON")

    return [
        json.loads(line, parse_constant=reject)
        for line in (run_dir / "metrics.jsonl").read_text().splitlines()
    ]


def _snapshot(ckpt_root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(ckpt_root)): p.read_bytes() for p in sorted(ckpt_root.rglob("*")) if p.is_file()
    }


# --- 1. a fresh start never mixes with an earlier run ------------------------------------------------------
def test_fresh_start_over_an_earlier_run_is_refused(dist_pools, setup, tmp_path):
    run_dir = tmp_path / "run"
    first = dist_pools(1).run(run_reporting, config(setup, run_dir, max_steps=4, checkpoint_every=2))[0]
    assert first["error"] is None, first
    ckpts = run_dir / "checkpoints"
    before = _snapshot(ckpts)
    fresh = dist_pools(1).run(
        run_reporting, config(setup, run_dir, max_steps=4, checkpoint_every=2, resume=None)
    )[0]
    assert fresh["error"] is not None and fresh["error"][0] == "ValueError", fresh
    assert "step_4" in fresh["error"][1] and f"mv {run_dir} {run_dir}.old-" in fresh["error"][1]
    assert _snapshot(ckpts) == before  # nothing pruned, nothing added


def test_which_checkpoints_a_run_may_share_its_dir_with(tmp_path):
    from usp.train.resume import check_checkpoints_of_other_runs

    root = tmp_path / "checkpoints"
    check_checkpoints_of_other_runs(root, None)  # nothing there: fresh is fine
    for step in (2, 4):
        (root / f"step_{step}").mkdir(parents=True)
    check_checkpoints_of_other_runs(root, root / "step_4")  # continuing the newest
    with pytest.raises(ValueError, match="a fresh start would share"):
        check_checkpoints_of_other_runs(root, None)
    with pytest.raises(ValueError, match=r"step_4\).*mv"):  # branching from step_2 while step_4 exists
        check_checkpoints_of_other_runs(root, root / "step_2")
    with pytest.raises(ValueError, match="resuming from"):  # a stage from elsewhere into a used dir
        check_checkpoints_of_other_runs(root, tmp_path / "elsewhere" / "step_9")


# --- 2. one run per directory ------------------------------------------------------------------------------
def test_locked_run_dir_is_refused_on_every_rank(dist_pools, setup, tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    with open(run_dir / ".usp.lock", "w") as held:  # another job holds the run dir
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        held.write(json.dumps({"host": "node-17", "pid": 4242, "since": "2026-01-01T00:00:00"}))
        held.flush()
        results = dist_pools(2).run(run_reporting, config(setup, run_dir, max_steps=1), timeout=120)
    for r in results:
        assert r["error"] is not None and r["error"][0] == "ValueError", r
        assert "is in use by another run" in r["error"][1] and "pid 4242 on host node-17" in r["error"][1]
    assert not (run_dir / "metrics.jsonl").exists()  # refused before any work
    after = dist_pools(2).run(
        run_reporting, config(setup, run_dir, max_steps=1, checkpoint_every=0), timeout=120
    )
    assert all(r["error"] is None for r in after), after  # the holder let go: the dir is free again


def test_dir_lock_names_its_holder_and_is_released(tmp_path):
    import socket

    from usp.train.dir_lock import DirLock

    with DirLock(tmp_path / "ckpts", "trainer.checkpoint_dir").acquire():
        with pytest.raises(
            ValueError,
            match=rf"trainer.checkpoint_dir=.* is in use by another run \(held by pid "
            rf"{os.getpid()} on host {socket.gethostname()} since",
        ):
            DirLock(tmp_path / "ckpts", "trainer.checkpoint_dir").acquire()
    DirLock(tmp_path / "ckpts").acquire().release()  # free again once released
    assert (tmp_path / "ckpts" / ".usp.lock").read_text() == ""  # no stale holder left behind


def test_two_run_dirs_sharing_a_checkpoint_dir_are_refused(setup, tmp_path):
    from usp.train.rundir import claim_run_dir

    shared = tmp_path / "shared-checkpoints"
    first, second = (config(setup, tmp_path / name, checkpoint_dir=str(shared)) for name in ("a", "b"))
    with claim_run_dir(first, rank=0):
        with pytest.raises(ValueError, match=r"trainer.checkpoint_dir=.*shared-checkpoints.* is in use"):
            claim_run_dir(second, rank=0)
        assert not (tmp_path / "b" / ".usp.lock").read_text()  # b's own lock was let go again
    with claim_run_dir(second, rank=0):
        assert (tmp_path / "b" / "usp-run.json").is_file()


def _lock_pid(run_dir: Path) -> int | None:
    try:
        return int(json.loads((run_dir / ".usp.lock").read_text())["pid"])
    except (OSError, ValueError, KeyError):
        return None


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_second_launch_refused_and_a_killed_holder_frees_the_dir(tmp_path):
    """Two real launches on one run dir: the second fails at once naming the first's pid; after the first is
    killed (SIGKILL: no cleanup runs) a third launch takes the dir and finishes."""
    run_dir = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    base = [
        sys.executable,
        "-m",
        "usp.train",
        f"hydra.run.dir={run_dir}",
        "logging.progress_bar=false",
        "trainer.export_hf=false",
        "trainer.checkpoint_every=0",
        "trainer.seq_len=64",
    ]
    with open(tmp_path / "first.log", "w") as log:
        first = subprocess.Popen(
            [*base, "trainer.max_steps=1000000"], env=env, cwd=tmp_path, stdout=log, stderr=log
        )
    try:
        deadline = time.monotonic() + 300
        while _lock_pid(run_dir) != first.pid:
            assert first.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the first launch never took the lock"
            time.sleep(0.5)
        second = subprocess.run(
            [*base, "trainer.max_steps=1"], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300
        )
        assert second.returncode != 0
        assert "is in use by another run" in second.stderr and f"pid {first.pid}" in second.stderr, (
            second.stderr[-3000:]
        )
        assert first.poll() is None  # the refused launch did not disturb the running one
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=60)
    third = subprocess.run(
        [*base, "trainer.max_steps=2"], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert third.returncode == 0, third.stderr[-3000:]
    assert [r["step"] for r in _strict_records(run_dir)] == [1, 2]


# --- 3. NaN / inf ------------------------------------------------------------------------------------------
def _dcp_tensors_finite(ckpt: Path, scratch: Path) -> bool:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = scratch / f"{ckpt.name}.pt"
    dcp_to_torch_save(ckpt / "dcp", out)
    state = torch.load(out, weights_only=True)
    tensors = [v for v in state["model"].values() if torch.is_tensor(v) and v.is_floating_point()]
    return bool(tensors) and all(bool(torch.isfinite(t).all()) for t in tensors)


def test_nan_training_stops_and_writes_no_nan(dist_pools, setup, tmp_path):
    """A huge learning rate: the first update makes the weights ~1e29, the next gradients are NaN."""
    run_dir = tmp_path / "run"
    cfg = config(setup, run_dir, max_steps=6, checkpoint_every=1, max_bad_steps=2, export_hf=True)
    cfg.optim.lr = 1e30
    result = dist_pools(1).run(run_reporting, cfg)[0]
    assert result["error"] is not None and result["error"][0] == "NonFiniteTrainingError", result
    assert "2 consecutive steps (up to step 3) had a non-finite loss or gradient norm" in result["error"][1]
    assert "trainer.max_bad_steps=2" in result["error"][1]
    assert not (run_dir / "hf").exists(), "exported after a NaN run"
    records = _strict_records(run_dir)  # parses strictly: no bare NaN
    assert [r["grad_norm"] is None for r in records] == [False, True, True]  # NaN written as null
    assert [r["skipped_steps"] for r in records] == [0, 1, 2]
    ckpts = sorted((run_dir / "checkpoints").glob("step_*"))
    assert [c.name for c in ckpts] == ["step_1", "step_2"]  # step 2 skipped: step 1's weights, finite
    assert all(_dcp_tensors_finite(c, tmp_path) for c in ckpts)
    assert sum("optimizer step skipped" in w for w in result["warnings"]) == 2


def _run_with_inf_weights_after(cfg: TrainConfig, bad_step: int) -> dict:
    """Worker: optimizer step ``bad_step`` leaves an inf in one weight (an overflowing update)."""
    original, calls = torch.optim.AdamW.step, [0]

    def overflowing(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        calls[0] += 1
        if calls[0] == bad_step:
            p = self.param_groups[0]["params"][0]
            local = p.to_local() if hasattr(p, "to_local") else p
            with torch.no_grad():
                local.view(-1)[0] = float("inf")
        return out

    torch.optim.AdamW.step = overflowing
    try:
        return run_reporting(cfg)
    finally:
        torch.optim.AdamW.step = original


def test_non_finite_weights_are_never_checkpointed_or_exported(dist_pools, setup, tmp_path):
    run_dir = tmp_path / "run"
    cfg = config(setup, run_dir, max_steps=4, checkpoint_every=1, export_hf=True)
    result = dist_pools(1).run(_run_with_inf_weights_after, cfg, 2)[0]
    assert result["error"] is not None and result["error"][0] == "NonFiniteTrainingError", result
    assert (
        "the weights are not finite after step 2: refusing to write checkpoint step_2" in result["error"][1]
    )
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step_*")) == ["step_1"]
    assert _dcp_tensors_finite(run_dir / "checkpoints" / "step_1", tmp_path)
    assert not (run_dir / "hf").exists()
    from usp.train.guard import NonFiniteTrainingError, check_finite_weights

    model = torch.nn.Linear(3, 3)
    check_finite_weights(model, step=4, what="the Hugging Face export", last_checkpoint=None)
    with torch.no_grad():
        model.bias[1] = float("nan")
    with pytest.raises(
        NonFiniteTrainingError, match="after step 4: refusing to write the Hugging Face export"
    ):
        check_finite_weights(model, step=4, what="the Hugging Face export", last_checkpoint=None)


def _run_with_nan_gradients_at(cfg: TrainConfig, bad_step: int) -> dict:
    """Worker: the gradients of optimizer step ``bad_step`` (1-based) turn NaN on the last rank only."""
    import torch.distributed as dist

    import usp.train.step as step_mod

    original, calls = step_mod.clip_grad_norm, [0]

    def poisoned(parameters, max_norm):
        parameters = list(parameters)
        calls[0] += 1
        if calls[0] == bad_step and dist.get_rank() == dist.get_world_size() - 1:
            for p in parameters:
                if p.grad is not None:
                    p.grad.fill_(float("nan"))
        return original(parameters, max_norm)

    step_mod.clip_grad_norm = poisoned
    try:
        return run_reporting(cfg)
    finally:
        step_mod.clip_grad_norm = original


def test_one_bad_step_is_skipped_on_every_rank_and_training_goes_on(dist_pools, setup, tmp_path):
    cfg = config(setup, tmp_path / "run", max_steps=5, checkpoint_every=0)
    cfg.parallel.ulysses_degree = 2
    results = dist_pools(2).run(_run_with_nan_gradients_at, cfg, 3)
    for r in results:
        assert r["error"] is None, r
        losses = r["out"]["losses"]
        assert all(math.isfinite(x) for x in losses), losses
        assert [m["skipped_steps"] for m in r["out"]["metrics"]] == [0, 0, 1, 1, 1]
        assert math.isnan(r["out"]["metrics"][2]["grad_norm"])  # both ranks saw the NaN of rank 1
    assert results[0]["out"]["losses"] == results[1]["out"]["losses"]
    assert _strict_records(tmp_path / "run")[2]["grad_norm"] is None


def test_step_guard_counts_stops_and_warns_about_spikes(caplog):
    from usp.train.guard import NonFiniteTrainingError, StepGuard

    guard = StepGuard(max_bad_steps=2, spike_factor=3.0)
    with caplog.at_level(logging.WARNING, logger="usp.train.guard"):
        for step in range(1, 13):
            guard.update(step, loss=2.0 + 0.01 * step, grad_norm=1.0, skipped=False)
        assert not caplog.records
        guard.update(13, loss=7.5, grad_norm=1.0, skipped=False)  # > 3 x median (~2.07)
        assert "loss spike" in caplog.text and guard.spikes == 1
        guard.update(14, loss=float("nan"), grad_norm=float("nan"), skipped=True)
        guard.stop_if_exhausted("ckpt")  # one in a row: go on
        guard.update(15, loss=2.0, grad_norm=1.0, skipped=False)  # a good step resets the run of bad ones
        guard.update(16, loss=float("inf"), grad_norm=1.0, skipped=True)
        guard.stop_if_exhausted("ckpt")
        guard.update(17, loss=float("nan"), grad_norm=1.0, skipped=True)
    with pytest.raises(
        NonFiniteTrainingError, match=r"2 consecutive steps \(up to step 17\).*last checkpoint is ck"
    ):
        guard.stop_if_exhausted("ckpt")
    assert guard.total == 3


# --- 7. corrupted checkpoints ------------------------------------------------------------------------------
def _corrupt(ckpt: Path, kind: str) -> str:
    """Damage one file of ``ckpt`` as a crash, a full disk or a bad disk would; returns its name."""
    distcp = next((ckpt / "dcp").glob("*.distcp"))
    if kind == "truncated_distcp":
        os.truncate(distcp, distcp.stat().st_size // 2)
        return distcp.name
    if kind == "empty_metadata":
        (ckpt / "dcp" / ".metadata").write_bytes(b"")
        return ".metadata"
    if kind == "truncated_meta":
        os.truncate(ckpt / "meta.pt", 100)
        return "meta.pt"
    if kind == "empty_rank_file":
        (ckpt / "rank_0.pt").write_bytes(b"")
        return "rank_0.pt"
    assert kind == "overwritten_256_bytes"
    with open(distcp, "r+b") as f:  # same size, different bytes: only a checksum sees it
        f.seek(distcp.stat().st_size // 2)
        f.write(os.urandom(256))
    return distcp.name


def _small_checkpoints(root: Path, steps: tuple[int, ...]):
    from usp.checkpoint import save_checkpoint

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))
    opt = torch.optim.AdamW(model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    for step in steps:
        model(torch.randn(4, 64)).sum().backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        save_checkpoint(
            root, step, model=model, optimizer=opt, scheduler=sched, extra={"s": step}, keep_last=5
        )
    return model, opt, sched


@pytest.mark.parametrize(
    "kind",
    ["truncated_distcp", "empty_metadata", "truncated_meta", "empty_rank_file", "overwritten_256_bytes"],
)
def test_corrupted_checkpoint_is_caught(setup, tmp_path, caplog, kind):
    from usp.checkpoint import load_checkpoint
    from usp.train.resume import check_auto_resume

    root = tmp_path / "checkpoints"
    model, opt, sched = _small_checkpoints(root, (1, 2))
    damaged = _corrupt(root / "step_2", kind)
    cfg = config(setup, tmp_path)
    with caplog.at_level(logging.WARNING):
        assert check_auto_resume(cfg, root) == root / "step_1"  # falls back to the intact one
    assert "step_2" in caplog.text and damaged in caplog.text
    with pytest.raises(ValueError, match=rf"trainer.resume=.*step_2.*{damaged}"):
        load_checkpoint(root / "step_2", model=model, optimizer=opt, scheduler=sched)
    assert load_checkpoint(root / "step_1", model=model, optimizer=opt, scheduler=sched)["step"] == 1


def test_corrupted_newest_checkpoint_resume_falls_back_end_to_end(dist_pools, setup, tmp_path):
    run_dir = tmp_path / "run"
    cfg = config(setup, run_dir, max_steps=6, checkpoint_every=2, keep_last=3)
    straight = dist_pools(1).run(run_reporting, cfg)[0]
    assert straight["error"] is None, straight
    damaged = _corrupt(run_dir / "checkpoints" / "step_6", "overwritten_256_bytes")
    explicit = config(
        setup,
        run_dir,
        max_steps=6,
        checkpoint_every=2,
        keep_last=3,
        resume=str(run_dir / "checkpoints" / "step_6"),
    )
    refused = dist_pools(1).run(run_reporting, explicit)[0]
    assert refused["error"] is not None and refused["error"][0] == "ValueError", refused
    assert damaged in refused["error"][1] and "fails verification" in refused["error"][1]
    resumed = dist_pools(1).run(run_reporting, cfg)[0]
    assert resumed["error"] is None, resumed
    assert resumed["out"]["start_step"] == 4
    assert any("step_6" in w and damaged in w for w in resumed["warnings"]), resumed["warnings"]
    assert resumed["out"]["losses"] == straight["out"]["losses"][4:]  # same layout: bit-identical


def test_no_checkpoint_verifies_refuses_to_start_over_them(setup, tmp_path):
    from usp.train.resume import check_auto_resume

    root = tmp_path / "checkpoints"
    _small_checkpoints(root, (1,))
    _corrupt(root / "step_1", "truncated_meta")
    with pytest.raises(ValueError, match=r"no checkpoint under .* verifies .*meta.pt.*mv "):
        check_auto_resume(config(setup, tmp_path), root)


# --- 8. no pickle --------------------------------------------------------------------------------------------
class _Plant:
    """Unpickling this creates a directory: proof that a checkpoint file ran code."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (os.mkdir, (self.path,))


def _reseal(ckpt: Path) -> None:
    """Recompute the checksums in COMPLETE, as a crafted checkpoint would carry them."""
    marker = json.loads((ckpt / "COMPLETE").read_text())
    for rel in marker.get("files", {}):
        data = (ckpt / rel).read_bytes()
        marker["files"][rel] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (ckpt / "COMPLETE").write_text(json.dumps(marker))


@pytest.mark.parametrize("target", ["rank_0.pt", "meta.pt", "dcp/.metadata"])
def test_crafted_pickle_is_refused_without_running(setup, tmp_path, target):
    from usp.checkpoint import load_checkpoint
    from usp.train.resume import check_auto_resume

    root = tmp_path / "checkpoints"
    model, opt, sched = _small_checkpoints(root, (1,))
    planted = tmp_path / "planted"
    path = root / "step_1" / target
    if target.endswith(".pt"):
        torch.save(
            {
                "extra": {"x": _Plant(str(planted))},
                "step": 1,
                "scheduler": None,
                "world_size": 1,
                "format_version": 2,
                "rank": 0,
            },
            path,
        )
    else:
        path.write_bytes(pickle.dumps(_Plant(str(planted))))
    _reseal(root / "step_1")
    cfg = config(setup, tmp_path)
    with pytest.raises(ValueError, match=r"refuses to unpickle|not allowed"):
        check_auto_resume(cfg, root)  # the fingerprint read (rank_0.pt) ...
        load_checkpoint(root / "step_1", model=model, optimizer=opt, scheduler=sched)  # ... or the load
    assert not planted.exists(), "a checkpoint file ran code while loading"


class _Construct:
    """Unpickling this calls ``cls(*args)``: a class that is not DCP metadata must be refused by name."""

    def __init__(self, cls, *args) -> None:
        self.cls, self.args = cls, args

    def __reduce__(self):
        return (self.cls, self.args)


def test_metadata_unpickler_admits_dcp_metadata_only(tmp_path):
    import io

    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    from usp.checkpoint.reader import MetadataUnpickler, SafeFileSystemReader

    _small_checkpoints(tmp_path / "c", (1,))
    real = SafeFileSystemReader(tmp_path / "c" / "step_1" / "dcp").read_metadata()
    assert real.state_dict_metadata  # a real DCP .metadata loads
    for payload in (_Construct(FileSystemWriter, str(tmp_path / "w")), _Construct(os.system, "true")):
        with pytest.raises(pickle.UnpicklingError, match="is not allowed"):
            MetadataUnpickler(io.BytesIO(pickle.dumps(payload))).load()


def test_extra_that_is_not_plain_data_is_refused_at_save(tmp_path):
    import numpy as np

    from usp.checkpoint import save_checkpoint

    model = torch.nn.Linear(2, 2)
    with pytest.raises(TypeError, match=r"extra\['rng'\] is a numpy.ndarray"):
        save_checkpoint(
            tmp_path, 1, model=model, optimizer=None, scheduler=None, extra={"rng": np.zeros(3)}, keep_last=1
        )
    assert not any(tmp_path.iterdir())


# --- 9. the run dir is checked at start-up -------------------------------------------------------------------
def test_foreign_run_dir_and_export_target_are_refused_before_any_work(dist_pools, setup, tmp_path):
    foreign = tmp_path / "someone-elses"
    foreign.mkdir()
    files = {
        "notes.txt": "mine\n",
        "metrics.jsonl": '{"my": 1}\n{"my": 2}\n',
        "layout.json": '{"mine": true}',
    }
    for name, text in files.items():
        (foreign / name).write_text(text)
    r = dist_pools(1).run(run_reporting, config(setup, foreign, max_steps=2))[0]
    assert r["error"] is not None and r["error"][0] == "ValueError", r
    assert (
        "not a usp run dir" in r["error"][1]
        and "notes.txt" in r["error"][1]
        and "metrics.jsonl" in r["error"][1]
    )
    assert {p.name: p.read_text() for p in foreign.iterdir()} == files  # untouched

    run_dir = tmp_path / "run"
    (run_dir / "hf").mkdir(parents=True)
    (run_dir / "hf" / "weights.bin").write_text("not an export")
    (run_dir / "usp-run.json").write_text("{}")  # a usp run dir, but its hf/ is someone's files
    r = dist_pools(1).run(run_reporting, config(setup, run_dir, max_steps=2, export_hf=True))[0]
    assert r["error"] is not None and "export out_dir" in r["error"][1], r
    assert not (run_dir / "metrics.jsonl").exists()  # found at start-up, not after training


def test_run_dir_of_this_usp_and_a_fresh_launch_are_accepted(tmp_path):
    from usp.train.rundir import check_run_dir

    check_run_dir(tmp_path / "missing")
    launched = tmp_path / "launched"
    (launched / ".hydra").mkdir(parents=True)
    (launched / "usp-train.log").write_text("")
    check_run_dir(launched)  # what Hydra writes before the trainer starts
    (launched / ".usp-run.json.tmp-123-456").write_text("")  # the marker's write was killed halfway
    check_run_dir(launched)
    older = tmp_path / "older"
    shutil.copytree(launched, older)
    (older / "layout.json").write_text('{"ulysses_degree": 2}')
    (older / "metrics.jsonl").write_text("")
    check_run_dir(older)  # a run dir of a usp without the marker
    (older / "notes.txt").write_text("")
    with pytest.raises(ValueError, match="notes.txt"):
        check_run_dir(older)


# --- 12. a longer schedule on resume -----------------------------------------------------------------------
def test_resume_with_more_steps_follows_the_new_schedule(dist_pools, setup, tmp_path):
    from usp.train.optim import lr_factor

    run_dir = tmp_path / "run"
    short = dist_pools(1).run(run_reporting, config(setup, run_dir, max_steps=4, checkpoint_every=2))[0]
    assert short["error"] is None, short
    longer = dist_pools(1).run(run_reporting, config(setup, run_dir, max_steps=8, checkpoint_every=2))[0]
    assert longer["error"] is None and longer["out"]["start_step"] == 4, longer
    cfg = config(setup, run_dir)
    expected = [
        cfg.optim.lr
        * lr_factor(s, warmup_steps=cfg.optim.warmup_steps, max_steps=8, min_lr_ratio=cfg.optim.min_lr_ratio)
        for s in range(4, 8)
    ]
    got = [r["lr"] for r in longer["out"]["metrics"]]
    torch.testing.assert_close(
        torch.tensor(got, dtype=torch.float64),
        torch.tensor(expected, dtype=torch.float64),
        rtol=1e-12,
        atol=0,
    )
