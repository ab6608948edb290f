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


def _stacks_of(msg: str, rank: int) -> str:
    """Rank ``rank``'s stack dump out of a pool error's message."""
    assert f"--- rank {rank} (pid " in msg, msg
    return msg.split(f"--- rank {rank} (pid ")[1].split("\n--- rank ")[0]


def _helper_thread_sleeping():
    time.sleep(600)


def _stuck_on_rank0():
    """Rank 0 hangs outside any collective (as in a stuck file read) with a second thread alive; rank 1 answers."""
    dist.barrier()  # both ranks are inside the function (a loaded machine may take seconds to get here)
    if dist.get_rank() == 0:
        threading.Thread(target=_helper_thread_sleeping, daemon=True).start()
        threading.Event().wait()
    return dist.get_rank()


def test_hanging_rank_reports_every_thread_stack():
    pool = DistPool(
        2, collective_timeout_s=5
    )  # the default (300 s) start-up timeout: a loaded machine is slow
    try:
        start = time.monotonic()
        with pytest.raises(WorkerTimeout) as info:
            pool.run(_stuck_on_rank0, timeout=15)
        # the 15 s timeout, the 5 s dump wait and the kill; generous for a loaded machine, far below a hang
        assert time.monotonic() - start < 90
    finally:
        pool.close()
    msg = str(info.value)
    assert "ranks [0] did not answer within 15s" in msg
    rank0 = _stacks_of(msg, 0)
    assert "_stuck_on_rank0" in rank0 and "test_dist_pool.py" in rank0  # the stuck frame, named
    assert "_helper_thread_sleeping" in rank0  # and the other threads
    assert "_stuck_on_rank0" not in _stacks_of(msg, 1)  # rank 1 answered: it waits for the next task


def _raise_on_rank1_while_rank0_hangs():
    dist.barrier()  # rank 0 is inside the function before rank 1 fails
    if dist.get_rank() == 1:
        raise ValueError("boom on rank 1")
    threading.Event().wait()


def test_failed_rank_gives_a_hanging_one_only_the_grace():
    pool = DistPool(2, collective_timeout_s=5, failure_grace_s=2)
    try:
        start = time.monotonic()
        with pytest.raises(WorkerError) as info:
            pool.run(_raise_on_rank1_while_rank0_hangs, timeout=60)
        assert (
            time.monotonic() - start < 55
        )  # the 2 s grace (+ the 5 s dump wait), not the call's 60 s timeout
    finally:
        pool.close()
    msg = str(info.value)
    assert "ranks [0] did not answer within 2s of ranks [1] failing" in msg and "boom on rank 1" in msg
    assert "_raise_on_rank1_while_rank0_hangs" in _stacks_of(msg, 0)
