"""Checkpoints in one process (no process group): round trip, keep-last, bad paths, crashes mid-save."""

from __future__ import annotations

import copy
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

import usp.checkpoint.save as ckpt_save
from usp.checkpoint import latest_checkpoint, list_checkpoints, load_checkpoint, save_checkpoint
from usp.train.rng import rng_state


def assert_tree_equal(a, b, path: str = "") -> None:
    """Exact equality of nested dicts/lists of tensors and plain values."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), path
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=lambda m: f"{path}: {m}")
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), f"{path}: keys {sorted(a)} != {sorted(b)}"
        for k in a:
            assert_tree_equal(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_tree_equal(x, y, f"{path}[{i}]")
    elif isinstance(a, np.ndarray):
        np.testing.assert_array_equal(a, b)
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def _setup(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))
    return model, opt, sched


def _step(model, opt, sched, step: int) -> float:
    g = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    sched.step()
    opt.zero_grad()
    return loss.item()


def _save(root: Path, step: int, model, opt, sched, keep_last: int = 3, extra=None) -> Path:
    return save_checkpoint(
        root,
        step,
        model=model,
        optimizer=opt,
        scheduler=sched,
        extra=extra or {"s": step},
        keep_last=keep_last,
    )


def test_round_trip_restores_everything(tmp_path):
    model, opt, sched = _setup()
    for s in range(3):
        _step(model, opt, sched, s)
    random.seed(7)
    np.random.seed(7)
    extra = {"loader": {"samples": 24, "epoch": 0}, "rng": rng_state(torch.device("cpu"))}
    path = _save(tmp_path / "ckpt", 3, model, opt, sched, extra=extra)
    assert path == tmp_path / "ckpt" / "step_3" and latest_checkpoint(tmp_path / "ckpt") == path
    saved_model = {k: v.clone() for k, v in model.state_dict().items()}
    saved_opt, saved_sched = copy.deepcopy(opt.state_dict()), copy.deepcopy(sched.state_dict())
    expected = [_step(model, opt, sched, s) for s in (3, 4)]

    model2, opt2, sched2 = _setup(seed=1)  # different weights, empty optimizer
    out = load_checkpoint(path, model=model2, optimizer=opt2, scheduler=sched2)
    assert out["step"] == 3 and out["extra_rank"] == 0 and out["saved_world_size"] == 1
    assert_tree_equal(model2.state_dict(), saved_model)
    assert_tree_equal(opt2.state_dict(), saved_opt)
    assert_tree_equal(sched2.state_dict(), saved_sched)
    assert_tree_equal(out["extra"], extra)
    assert [_step(model2, opt2, sched2, s) for s in (3, 4)] == expected


def test_keep_last_deletes_only_older_complete_checkpoints(tmp_path):
    model, opt, sched = _setup()
    root = tmp_path / "ckpt"
    for s in range(1, 6):
        _step(model, opt, sched, s)
        _save(root, s, model, opt, sched, keep_last=2)
        assert [st for st, _ in list_checkpoints(root)] == ([s - 1, s] if s > 1 else [1])
    assert sorted(p.name for p in root.iterdir()) == ["step_4", "step_5"]
    # saving a step again replaces it in place
    _save(root, 5, model, opt, sched, keep_last=2)
    assert sorted(p.name for p in root.iterdir()) == ["step_4", "step_5"]


@pytest.mark.parametrize("keep_last", [0, -1])
def test_bad_keep_last(tmp_path, keep_last):
    model, opt, sched = _setup()
    with pytest.raises(ValueError, match="trainer.keep_last"):
        _save(tmp_path, 1, model, opt, sched, keep_last=keep_last)
    assert not list(tmp_path.iterdir())


def test_bad_paths_raise_value_error(tmp_path):
    model, opt, sched = _setup()
    kw = dict(model=model, optimizer=opt, scheduler=sched)
    with pytest.raises(ValueError, match="trainer.resume=.*does not exist"):
        load_checkpoint(tmp_path / "nope", **kw)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="trainer.resume=.*is a file"):
        load_checkpoint(tmp_path / "file", **kw)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="not a complete checkpoint"):
        load_checkpoint(tmp_path / "empty", **kw)
    assert latest_checkpoint(tmp_path / "nope") is None and latest_checkpoint(tmp_path / "empty") is None
    # a checkpoint whose marker is gone (interrupted) is refused; its root falls back to the latest complete one
    root = tmp_path / "ckpt"
    first = _save(root, 1, model, opt, sched)
    second = _save(root, 2, model, opt, sched)
    (second / ckpt_save.COMPLETE_MARKER).unlink()
    with pytest.raises(ValueError, match="not a complete checkpoint"):
        load_checkpoint(second, **kw)
    assert latest_checkpoint(root) == first
    assert load_checkpoint(root, **kw)["path"] == first


def test_checkpoint_of_another_model_raises_value_error(tmp_path):
    model, opt, sched = _setup()
    path = _save(tmp_path, 1, model, opt, sched)
    other = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    with pytest.raises(ValueError, match="trainer.resume=.*does not fit this model.*Size mismatch"):
        load_checkpoint(path, model=other, optimizer=torch.optim.AdamW(other.parameters()), scheduler=None)


@pytest.mark.parametrize("where", ["rank_file", "publish"])
def test_failure_mid_save_keeps_previous(tmp_path, monkeypatch, where):
    model, opt, sched = _setup()
    root = tmp_path / "ckpt"
    good = _save(root, 1, model, opt, sched)
    good_state = {k: v.clone() for k, v in model.state_dict().items()}
    _step(model, opt, sched, 1)

    def boom(*args, **kwargs):
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(ckpt_save, "write_file" if where == "rank_file" else "publish_dir", boom)
    with pytest.raises(RuntimeError, match="disk full"):
        _save(root, 2, model, opt, sched)
    monkeypatch.undo()
    assert (root / ".tmp-step_2").is_dir()  # the partial save is left aside, not reported
    assert latest_checkpoint(root) == good and not (root / "step_2").exists()
    model2, opt2, sched2 = _setup(seed=3)
    assert load_checkpoint(root, model=model2, optimizer=opt2, scheduler=sched2)["step"] == 1
    assert_tree_equal(model2.state_dict(), good_state)
    # the next save clears the leftover
    _save(root, 2, model, opt, sched)
    assert sorted(p.name for p in root.iterdir()) == ["step_1", "step_2"]


_KILL_SCRIPT = textwrap.dedent(
    """
    import os, sys, torch
    import usp.checkpoint.save as c
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    root = sys.argv[1]
    c.save_checkpoint(root, 1, model=model, optimizer=opt, scheduler=None, extra={}, keep_last=1)
    torch.save(model.state_dict(), os.path.join(root, "..", "good.pt"))
    model.weight.data.add_(1.0)
    c.publish_dir = lambda tmp, final: os._exit(17)  # the process dies right before the rename
    c.save_checkpoint(root, 2, model=model, optimizer=opt, scheduler=None, extra={}, keep_last=1)
    """
)


def test_killed_process_mid_save_leaves_previous_loadable(tmp_path):
    root = tmp_path / "ckpt"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", _KILL_SCRIPT, str(root)], env=env, capture_output=True, timeout=120
    )
    assert proc.returncode == 17, proc.stderr.decode()[-2000:]
    assert (root / ".tmp-step_2" / "dcp" / ".metadata").is_file()  # the new one was written, never published
    assert latest_checkpoint(root) == root / "step_1"
    model = torch.nn.Linear(4, 4)
    out = load_checkpoint(root, model=model, optimizer=torch.optim.AdamW(model.parameters()), scheduler=None)
    assert out["step"] == 1
    assert_tree_equal(model.state_dict(), torch.load(tmp_path / "good.pt"))
