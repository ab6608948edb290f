"""The test harness itself: a rank that fails mid-collective fails the call instead of hanging the others."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from tests.dist_pool import DistPool, WorkerError


def _allreduce_rank():
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return t.item()


def _fail_on_rank1_then_collect():
    if dist.get_rank() == 1:
        raise ValueError("boom on rank 1")
    t = torch.ones(1)
    dist.all_reduce(t)  # rank 0 waits here for a peer that is gone
    return t.item()


def test_failing_rank_does_not_hang():
    pool = DistPool(2, timeout=60, collective_timeout_s=5)
    try:
        assert pool.run(_allreduce_rank) == [1.0, 1.0]
        start = time.monotonic()
        with pytest.raises(WorkerError, match="boom on rank 1"):
            pool.run(_fail_on_rank1_then_collect)
        assert time.monotonic() - start < 40
        assert pool.run(_allreduce_rank) == [1.0, 1.0]  # restarted cleanly
    finally:
        pool.close()
