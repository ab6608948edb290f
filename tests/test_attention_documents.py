"""Document masking (cu_seqlens) across Ulysses, ring (zigzag and contiguous) and hybrid, fwd + bwd.

Reference: single-process float64 attention where each token attends only inside its document (causal within
it). Tolerance fp32 atol = rtol = 1e-5, bf16 atol = rtol = 3e-2 (as in test_attention_usp).
"""

from __future__ import annotations

import pytest
import torch

from tests.test_attention_usp import check_cases, factorizations
from usp.attention.blocks import plan_ring_blocks

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
                    dtype = "bfloat16" if i % 5 == 4 else "float32"
                    cases.append(
                        dict(ulysses=u, ring=r, layout=layout, causal=causal, hq=hq, hkv=hkv, dtype=dtype,
                             batch=1, seq_len=SEQ_LEN, seed=2000 + i, cu_seqlens=cu)
                    )  # fmt: skip
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
