"""End to end: the tiny recipe on packed documents under ``parallel.ring_layout=balanced``.

The trainer (real loader, document masking, cu_seqlens, the balanced placement of ids, labels and position
ids) trains the same losses under balanced (u1r4; u2r2 slow) as under zigzag (u1r4, slow) and as the
single-process run (world 1): fp32 (the trainer's master weights), to the rounding rule of
``tests.test_train_run.fp32_run_tolerance``; ``metrics.jsonl`` carries ``attn_work_imbalance``, equal to the
exact pair counts of the step's rows, and no worse under balanced than under zigzag.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.test_train_run import fp32_run_tolerance, make_config
from tests.tolerance import assert_close_scaled
from usp.tiny import build_tiny_llama
from usp.train.trainer import run

STEPS = 3


def train_worker(cfg) -> dict:
    out = run(cfg)
    return {
        "losses": out["losses"],
        "tol": fp32_run_tolerance(cfg.model.path, cfg.trainer.seq_len * cfg.trainer.grad_accum_steps),
    }


def config(setup: dict, name: str, **parallel):
    cfg = make_config(setup["model"], f"{setup['root']}/{name}", setup["cache"], **parallel)
    cfg.data.validation_fraction = 0.0
    cfg.trainer.eval_every = 0
    cfg.trainer.max_steps = STEPS
    cfg.trainer.checkpoint_every = 0
    cfg.trainer.export_hf = False
    cfg.trainer.resume = None
    return cfg


def imbalance_records(run_dir: str) -> list[float]:
    lines = Path(run_dir, "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["attn_work_imbalance"] for line in lines]


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("train_balanced")
    return {"root": str(root), "model": str(build_tiny_llama(root / "model")), "cache": str(root / "cache")}


@pytest.fixture(scope="module")
def single(dist_pools, setup) -> dict:
    return dist_pools(1).run(train_worker, config(setup, "world1"))[0]


@pytest.fixture(scope="module")
def balanced(dist_pools, setup) -> dict:
    cfg = config(setup, "u1r4-balanced", ulysses_degree=1, ring_degree=4, ring_layout="balanced")
    out = dist_pools(4).run(train_worker, cfg)[0]
    return {**out, "imbalance": imbalance_records(cfg.run_dir)}


def check_same_losses(got: dict, ref: dict, where: str) -> None:
    losses, want = (
        torch.tensor(got["losses"], dtype=torch.float64),
        torch.tensor(ref["losses"], dtype=torch.float64),
    )
    assert len(losses) == STEPS
    assert_close_scaled(losses, want, ref["tol"], f"{where} vs world 1: losses")


def test_balanced_trains_like_one_process(setup, single, balanced):
    check_same_losses(balanced, single, "u1r4 balanced")
    assert all(1.0 <= x < 5.0 for x in balanced["imbalance"])
    assert imbalance_records(f"{setup['root']}/world1") == [1.0] * STEPS  # no ring: nothing to balance


@pytest.mark.slow
@pytest.mark.parametrize("ulysses, ring, layout", [(1, 4, "zigzag"), (2, 2, "balanced")])
def test_other_layouts_train_the_same_losses(dist_pools, setup, single, balanced, ulysses, ring, layout):
    cfg = config(
        setup, f"u{ulysses}r{ring}-{layout}", ulysses_degree=ulysses, ring_degree=ring, ring_layout=layout
    )
    check_same_losses(dist_pools(4).run(train_worker, cfg)[0], single, f"u{ulysses}r{ring} {layout}")
    if layout == "zigzag":  # same rows, same order: balanced never does worse than zigzag
        assert all(b <= z + 1e-9 for b, z in zip(balanced["imbalance"], imbalance_records(cfg.run_dir)))
