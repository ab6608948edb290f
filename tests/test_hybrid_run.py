"""The trainer end to end on a hybrid model: the tiny Qwen3.5 of ``recipe=tiny_hybrid`` (3 gated-DeltaNet layers,
1 attention layer) trains the same losses under world 1 and under u2r2 (the DeltaNet layers on the head
all-to-all, packed documents from the real loader; the other layouts are the family matrix's), then resumes from its checkpoint and exports a
checkpoint transformers loads with the trained weights.

fp32 on both sides (the trainer's master weights): the rounding rule of
``tests.test_train_run.fp32_run_tolerance``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from tests.test_train_run import fp32_run_tolerance, make_config, run_worker
from tests.tolerance import assert_close_scaled
from usp.tiny import build_tiny_llama

CONF = OmegaConf.load(Path(__file__).resolve().parents[1] / "conf/model/tiny_hybrid.yaml")
MAX_STEPS = 4


def hybrid_config(setup: dict, name: str, **parallel):
    cfg = make_config(setup["model"], f"{setup['root']}/{name}", setup["cache"], **parallel)
    cfg.trainer.max_steps = MAX_STEPS
    cfg.trainer.checkpoint_every = 2
    cfg.trainer.eval_every = 0
    cfg.data.validation_fraction = 0.0
    return cfg


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("hybrid_run")
    fields = OmegaConf.to_container(CONF.tiny_size)
    model = build_tiny_llama(root / "model", **fields)
    return {"root": str(root), "model": str(model), "cache": str(root / "cache")}


def resumed_worker(cfg) -> dict:
    from transformers import AutoModelForCausalLM

    first = run_worker(cfg)
    cfg.trainer.max_steps = MAX_STEPS + 2
    cfg.trainer.resume = "auto"
    second = run_worker(cfg)
    out = {"first": first, "second": second}
    if torch.distributed.get_rank() == 0:
        exported = AutoModelForCausalLM.from_pretrained(second["export_dir"])
        out["mixers"] = sorted(
            {type(m).__name__ for m in exported.modules() if "DeltaNet" in type(m).__name__}
        )
    return out


@pytest.mark.slow
def test_hybrid_trains_the_same_losses_under_every_layout(dist_pools, setup):
    single = dist_pools(1).run(run_worker, hybrid_config(setup, "world1"))[0]
    tol = fp32_run_tolerance(setup["model"], 64 * 2)
    for name, parallel in {"u2r2": dict(ulysses_degree=2, ring_degree=2, node_size=2)}.items():
        got = dist_pools(4).run(resumed_worker, hybrid_config(setup, name, **parallel))[0]
        losses = torch.tensor(got["first"]["losses"], dtype=torch.float64)
        assert_close_scaled(
            losses, torch.tensor(single["losses"], dtype=torch.float64), tol, f"{name} losses"
        )
        assert got["second"]["start_step"] == MAX_STEPS and got["second"]["final_step"] == MAX_STEPS + 2
        assert got["mixers"] == ["Qwen3_5GatedDeltaNet"]  # transformers' own class, no usp subclass saved
    assert single["losses"][-1] < single["losses"][0]
