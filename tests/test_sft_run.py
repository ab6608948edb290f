"""The trainer end to end on chat data (``data.format=chat``): the tiny SFT setting under world 1 and u2r2.

The real loader prepares the synthetic chats on the fly (tiny ChatML template, loss on assistant turns,
best-fit packing); both layouts train the same losses (fp32, the trainer's master weights: the rounding rule
of ``tests.test_train_run.fp32_run_tolerance``) and ``metrics.jsonl`` reports
``trained_tokens`` (equal to ``num_targets``, fewer than ``tokens``) and ``trained_tokens_per_s``.
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


def sft_config(setup: dict, name: str, **parallel):
    cfg = make_config(setup["model"], f"{setup['root']}/{name}", setup["cache"], **parallel)
    cfg.data.format, cfg.data.chat_template = "chat", "tiny_chatml"
    cfg.data.validation_fraction = 0.0
    cfg.trainer.eval_every = 0
    cfg.trainer.max_steps = 3
    cfg.trainer.checkpoint_every = 0
    cfg.trainer.export_hf = False
    cfg.trainer.resume = None
    return cfg


def sft_worker(cfg) -> dict:
    return {"losses": run(cfg)["losses"]}


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("sft_run")
    return {"root": str(root), "model": str(build_tiny_llama(root / "model")), "cache": str(root / "cache")}


@pytest.mark.slow
def test_sft_trains_the_same_losses_under_u2r2_and_reports_trained_tokens(dist_pools, setup):
    one = sft_config(setup, "world1")
    single = dist_pools(1).run(sft_worker, one)[0]
    four = sft_config(setup, "u2r2", ulysses_degree=2, ring_degree=2, node_size=2)
    sharded = dist_pools(4).run(sft_worker, four)[0]
    tol = fp32_run_tolerance(
        setup["model"], one.trainer.seq_len * one.trainer.grad_accum_steps
    )  # fp32 trainer
    assert_close_scaled(
        torch.tensor(sharded["losses"], dtype=torch.float64),
        torch.tensor(single["losses"], dtype=torch.float64),
        tol,
        "u2r2 vs world 1: losses",
    )
    records = [json.loads(line) for line in Path(one.run_dir, "metrics.jsonl").read_text().splitlines()]
    for r in records:
        assert r["trained_tokens"] == r["num_targets"] and 0 < r["trained_tokens"] < r["tokens"]
        assert r["trained_tokens_per_s"] == pytest.approx(r["trained_tokens"] / r["step_time_s"])
    keys = list(records[0])
    assert keys.index("trained_tokens") == keys.index("tokens_per_s_per_gpu") + 1  # next to the token fields
