"""The test harness itself: a rank that fails mid-collective fails the call instead of hanging the others; a rank
that hangs fails the call with every live worker's stacks."""

from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.distributed as dist

from tests.dist_pool import DistPool, WorkerError, WorkerTimeout


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


def _helper_thread_sleeping():
    time.sleep(600)


def _stuck_on_rank0():
    """Rank 0 hangs outside any collective (as in a stuck file read) with a second thread alive; rank 1 answers."""
    if dist.get_rank() == 0:
        threading.Thread(target=_helper_thread_sleeping, daemon=True).start()
        threading.Event().wait()
    return dist.get_rank()


def test_hanging_rank_reports_every_thread_stack():
    pool = DistPool(2, timeout=60, collective_timeout_s=5)
    try:
        start = time.monotonic()
        with pytest.raises(WorkerTimeout) as info:
            pool.run(_stuck_on_rank0, timeout=2)
        assert time.monotonic() - start < 10
    finally:
        pool.close()
    msg = str(info.value)
    assert "ranks [0] did not answer within 2s" in msg
    rank0 = msg.split("--- rank 0 ")[1].split("--- rank 1 ")[0]  # rank 1 is alive too: its stacks follow
    assert "_stuck_on_rank0" in rank0 and "test_dist_pool.py" in rank0  # the stuck frame, named
    assert "_helper_thread_sleeping" in rank0  # and the other threads
    assert (
        "--- rank 1 " in msg and "_stuck_on_rank0" not in msg.split("--- rank 1 ")[1]
    )  # idle: waiting for work
