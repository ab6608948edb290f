"""Shared fixtures: gloo worker pools, started once per world size for the whole session."""

from __future__ import annotations

import os

import pytest

from tests.dist_pool import DistPool

os.environ.setdefault("OMP_NUM_THREADS", "1")

_POOLS: dict[int, DistPool] = {}


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
