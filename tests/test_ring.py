"""Ring attention: block plans per layout, and the K/V transfer posted before each block's compute."""

from __future__ import annotations

import torch

from tests.mesh_cache import cached_sp_mesh
from usp.attention import usp_attention
from usp.attention.blocks import plan_ring_blocks


def _rect(block):
    return None if block is None else (block.q_start, block.q_end, block.k_start, block.k_end, block.causal)


def test_zigzag_plan_ring4():
    # S = 64, R = 4: part of 16 tokens = chunks r and 7 - r of 8
    for rank in range(4):
        plans = plan_ring_blocks(64, 4, rank, "zigzag", causal=True)
        for step, block in enumerate(plans):
            src = (rank - step) % 4
            if src == rank:
                assert _rect(block) == (0, 16, 0, 16, True)  # diagonal
            elif src < rank:
                assert _rect(block) == (0, 16, 0, 8, False)  # first half of K/V only
            else:
                assert _rect(block) == (8, 16, 0, 16, False)  # second half of Q only


def test_contiguous_plan_ring4():
    for rank in range(4):
        plans = plan_ring_blocks(64, 4, rank, "contiguous", causal=True)
        got = {(rank - step) % 4: _rect(b) for step, b in enumerate(plans)}
        for src in range(4):
            expected = None if src > rank else (0, 16, 0, 16, src == rank)
            assert got[src] == expected
        assert all(
            _rect(b) == (0, 16, 0, 16, False) for b in plan_ring_blocks(64, 4, rank, "contiguous", False)
        )


def run_event_order() -> list[str]:
    """Worker: log the order of K/V transfer posts, block computes and waits in one forward."""
    from usp.attention import comm, ring

    events: list[str] = []
    start, wait, forward = comm.RingExchange.start, comm.RingExchange.wait, ring.attention_forward

    def logged_start(self, tensors):
        events.append(f"start:{self.kind}")
        return start(self, tensors)

    def logged_wait(self):
        events.append(f"wait:{self.kind}")
        return wait(self)

    def logged_forward(*args, **kwargs):
        events.append("compute")
        return forward(*args, **kwargs)

    comm.RingExchange.start, comm.RingExchange.wait, ring.attention_forward = (
        logged_start,
        logged_wait,
        logged_forward,
    )
    try:
        mesh = cached_sp_mesh(1, 4, "zigzag")
        q = torch.randn(1, 8, 2, 4)
        with torch.no_grad():
            usp_attention(q, q, q, mesh=mesh)
    finally:
        comm.RingExchange.start, comm.RingExchange.wait, ring.attention_forward = start, wait, forward
    return events


def test_transfer_posted_before_compute(dist_pools):
    events = dist_pools(4).run(run_event_order)
    step = ["start:ring_kv", "compute", "wait:ring_kv"]
    for per_rank in events:
        assert per_rank == step * 3 + ["compute"]
