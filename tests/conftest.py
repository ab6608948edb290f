"""Shared fixtures: gloo worker pools, started once per world size for the whole session; the tiny Llama."""

from __future__ import annotations

import os

import pytest

from tests.dist_pool import DistPool
from tests.tiny_run import TinyRun, run_tiny_under_torchrun
from usp.tiny import build_tiny_llama

os.environ.setdefault("OMP_NUM_THREADS", "1")

_POOLS: dict[int, DistPool] = {}

LONGEST_FIRST = (
    "test_real_model",
    "test_eval_ruler_run",
    "test_train_memory_run",
    "test_fake_memory",
    "test_model_families",
    "test_plan_memory",
    "test_eval_run",
)
"""Modules of a minute or more (``--durations``): collected first, so that `make test`'s parallel workers do not
end on one of them while the other waits."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    first = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: first.get(item.module.__name__.rsplit(".", 1)[-1], len(first)))  # stable


@pytest.fixture(scope="session")
def dist_pools():
    """``dist_pools(world_size) -> DistPool``: one pool per world size, reused by every test module."""

    def get(world_size: int) -> DistPool:
        if world_size not in _POOLS:
            _POOLS[world_size] = DistPool(world_size)
        return _POOLS[world_size]

    yield get
    for pool in _POOLS.values():
        pool.close()
    _POOLS.clear()


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> str:
    """The tiny random GQA Llama checkpoint (:func:`usp.tiny.build_tiny_llama`'s defaults: 2 layers, hidden 64,
    4 query and 2 K/V heads), built once per session. Tests read it; one that changes files copies it first."""
    return str(build_tiny_llama(tmp_path_factory.mktemp("tiny") / "llama"))


@pytest.fixture(scope="session")
def tiny_torchrun_run(tmp_path_factory) -> TinyRun:
    """The tiny recipe under torchrun (:mod:`tests.tiny_run`), run once per session and shared: one launch of 4
    processes fewer for each test that reads it. Tests assert its ``returncode`` themselves."""
    return run_tiny_under_torchrun(tmp_path_factory.mktemp("tiny_torchrun"))


@pytest.fixture
def tiny_config() -> dict:
    """A tiny GQA Llama's shape as a Hugging Face config dict: the planner tests' model (no checkpoint)."""
    return {
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 128,
        "vocab_size": 256,
    }


@pytest.fixture(scope="session")
def smollm2_dir():
    """``smollm2_dir(num_layers=None) -> Path``: the real SmolLM2-135M-Instruct HF dir (``usp.real``), built once
    under ~/.cache/usp; ``num_layers`` keeps the first layers only. Skips (naming the install) without the wheel."""
    from usp.real import build_smollm2

    def get(num_layers: int | None = None):
        try:
            return build_smollm2(num_layers=num_layers)
        except ValueError as e:
            pytest.skip(str(e))

    return get
