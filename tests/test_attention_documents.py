"""Document masking (cu_seqlens) across Ulysses, ring (zigzag and contiguous) and hybrid, fwd + bwd.

Reference: single-process float64 attention where each token attends only inside its document (causal within
it). float64 cases exact (``tests.tolerance.EXACT_TOL``), every fifth in bf16 (``rounding_tolerance``), as in
test_attention_usp.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.mesh_cache import cached_sp_mesh
from tests.test_attention_usp import check_cases, factorizations
from usp.attention import record_comm, usp_attention
from usp.attention.blocks import plan_ring_blocks, ring_steps_needed
from usp.attention.cost import analytic_bytes_sent

SEQ_LEN = 48
# boundaries with 1-token documents, documents crossing zigzag chunks and ring parts, one whole document
DOCUMENTS = [
    [0, 1, 7, 20, 21, 33, 48],
    [0, 30, 31, 32, 48],
    [0, 48],
    [0, 3, 6, 9, 12, 15, 18, 21, 24, 27, 30, 33, 36, 39, 42, 45, 48],
]


def doc_matrix(world: int, heads: list[tuple[int, int]]) -> list[dict]:
    cases = []
    i = 0
    for u, r in factorizations(world):
        for layout in ("zigzag", "contiguous") if r > 1 else ("zigzag",):
            for causal in (True, False):
                for cu in DOCUMENTS if causal else DOCUMENTS[:1]:
                    hq, hkv = heads[i % len(heads)]
                    dtype = "bfloat16" if i % 5 == 4 else "float64"
                    cases.append(
                        dict(
                            ulysses=u,
                            ring=r,
                            layout=layout,
                            causal=causal,
                            hq=hq,
                            hkv=hkv,
                            dtype=dtype,
                            batch=1,
                            seq_len=SEQ_LEN,
                            seed=2000 + i,
                            cu_seqlens=cu,
                        )
                    )
                    i += 1
    return cases


@pytest.mark.parametrize("world", [1, 2, 4])
def test_document_masking_matches_per_document_attention(dist_pools, world):
    check_cases(dist_pools(world), doc_matrix(world, [(4, 4), (8, 2), (4, 1)]))


@pytest.mark.slow
def test_document_masking_world8(dist_pools):
    check_cases(dist_pools(8), doc_matrix(8, [(8, 8), (8, 2), (8, 1)]))


def test_documents_skip_blocks_that_share_no_document():
    """Ring 4 zigzag, S = 48 (chunks of 6): documents never span two ring parts -> only diagonal blocks."""
    cu = torch.tensor([0, 6, 42, 48])  # chunk 0 | chunks 1..6 | chunk 7
    plans = [plan_ring_blocks(48, 4, r, "zigzag", True, cu) for r in range(4)]
    # rank 0 holds chunks 0 and 7: docs 0 and 2, which no other rank holds
    assert [p is None for p in plans[0]] == [False, True, True, True]
    assert plans[1][1] is None  # rank 1 (chunks 1, 6: doc 1) vs rank 0's keys (docs 0, 2)
    # rank 2 (chunks 2, 5) vs rank 1's keys: first half of K/V only (chunk 1), all document 1: no mask needed
    block = plans[2][1]
    assert (block.q_start, block.q_end, block.k_start, block.k_end, block.segments) == (0, 12, 0, 6, None)
    # diagonal block of rank 0: two documents -> two causal segments, no key crosses them
    diag = plans[0][0]
    assert diag.causal and diag.segments.tolist() == [[0, 6, 0, 6], [6, 12, 6, 12]]
    # without documents nothing is skipped beyond the causal layout rule
    assert all(b is not None for b in plan_ring_blocks(48, 4, 0, "zigzag", True))


def test_ring_stops_when_no_rank_needs_later_blocks():
    every = lambda cu, layout: [  # noqa: E731
        plan_ring_blocks(48, 4, r, layout, True, torch.tensor(cu)) for r in range(4)
    ]
    # contiguous parts of 12: documents cross part boundaries only into the next part -> 2 steps
    assert ring_steps_needed(every(DOCUMENTS[0], "contiguous")) == 2
    # 3-token documents aligned with every part and chunk: no communication at all
    assert ring_steps_needed(every(DOCUMENTS[3], "contiguous")) == 1
    assert ring_steps_needed(every(DOCUMENTS[3], "zigzag")) == 1
    # zigzag: a document crossing a back-half chunk boundary needs the last step
    assert ring_steps_needed(every(DOCUMENTS[0], "zigzag")) == 4
    assert ring_steps_needed([plan_ring_blocks(48, 4, r, "zigzag", True) for r in range(4)]) == 4


def run_document_bytes(layout: str, cu: list[int]) -> int:
    mesh = cached_sp_mesh(1, 4, layout)
    q = torch.randn(1, 12, 2, 8, requires_grad=True)
    with record_comm() as stats:
        usp_attention(q, q, q, mesh=mesh, cu_seqlens=torch.tensor(cu, dtype=torch.int32)).sum().backward()
    return stats.bytes_sent


@pytest.mark.parametrize("layout, cu, steps", [("contiguous", DOCUMENTS[0], 2), ("zigzag", DOCUMENTS[3], 1)])
def test_document_ring_bytes_match_trimmed_formula(dist_pools, layout, cu, steps):
    sent = dist_pools(4).run(run_document_bytes, layout, cu)
    want = analytic_bytes_sent(
        batch=1,
        seq_len=48,
        num_heads=2,
        num_kv_heads=2,
        head_dim=8,
        ulysses_degree=1,
        ring_degree=4,
        element_size=4,
        ring_steps=steps,
    )["fwd_bwd"]
    assert sent == [want] * 4


def test_plan_segments_stay_on_the_host():
    """Kernels read segments as Python ints every block: on the CPU that is free, on a GPU it would sync."""
    cu = torch.tensor(DOCUMENTS[0])
    plans = plan_ring_blocks(48, 4, 0, "zigzag", True, cu, device=torch.device("meta"))
    segmented = [b for b in plans if b is not None and b.segments is not None]
    assert segmented and all(b.segments.device.type == "cpu" for b in segmented)


def test_device_cu_seqlens_is_copied_to_the_host_once_per_tensor(monkeypatch):
    """Every layer passes the same cu_seqlens: a device tensor is read back once, again only when modified."""
    from usp.attention import usp as usp_module

    copies = []
    real_to = torch.Tensor.to

    def counting_to(self, *args, **kwargs):
        if self.device.type == "meta" and args == ("cpu",):
            copies.append(1)
            return torch.tensor(DOCUMENTS[0])
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", counting_to)
    mesh = SimpleNamespace(sp_degree=1)  # one rank: no fingerprint exchange
    cu = torch.empty(len(DOCUMENTS[0]), dtype=torch.int32, device="meta")  # stands in for a CUDA tensor
    for _ in range(3):
        assert usp_module._boundaries_key(cu, 48, 1, mesh) == tuple(DOCUMENTS[0])
    assert len(copies) == 1
    cu.add_(0)  # an in-place change: read it again
    usp_module._boundaries_key(cu, 48, 1, mesh)
    assert len(copies) == 2
    cpu_cu = torch.tensor(DOCUMENTS[0])
    usp_module._boundaries_key(cpu_cu, 48, 1, mesh)  # CPU (preferred): no copy at all
    assert len(copies) == 2
