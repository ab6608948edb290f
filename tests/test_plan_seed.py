"""The planner against the seed articles' worked numbers (shared/seeds/000: Llama-70B at 1M tokens; 003: 8B).

Expected values are the articles' own arithmetic, restated here by hand; the planner must land on them.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from usp.attention.cost import analytic_bytes_sent, ring_work
from usp.plan.comm import kv_block_bytes, ring_comm, ulysses_comm
from usp.plan.compute import attention_fwd_flops, causal_imbalance, seed_zigzag_speedup
from usp.plan.hardware import GIB, GPUS
from usp.plan.inference import estimate_inference, kv_cache_bytes_per_gpu, plan_inference
from usp.plan.models import ModelSpec, load_model_spec

M = 1_000_000  # the seed's "1M" is decimal
LLAMA70 = load_model_spec("llama-3-70b")
LLAMA8 = load_model_spec("llama-3.1-8b")


def test_llama70b_shapes_match_the_seed():
    # one layer: q,o 8192x8192 each, k,v 8192x1024 each, MLP 3 x 8192 x 28672, two norms: "~856M params"
    layer = 2 * 8192 * 8192 + 2 * 8192 * 1024 + 3 * 8192 * 28672 + 2 * 8192
    assert layer == 855_654_400
    assert LLAMA70.layer_params == layer
    # weights "140 GB" in bf16: 80 layers + embedding + untied head + final norm
    total = 80 * layer + 2 * 128256 * 8192 + 8192
    assert LLAMA70.num_params == total
    assert 2 * total / 1e9 == pytest.approx(141.1, abs=0.05)


def test_kv_cache_per_gpu_is_40_96_gb_for_ulysses_and_ring_at_8():
    # Ulysses 8: full 1M sequence, 1 KV head; ring 8: 125K tokens, 8 KV heads. x 128 dim x (K,V) x 80 layers x 2 B
    expected = 1_000_000 * 1 * 128 * 2 * 80 * 2
    assert expected == 40_960_000_000
    assert kv_cache_bytes_per_gpu(LLAMA70, M, ulysses_degree=8, ring_degree=1) == expected
    assert kv_cache_bytes_per_gpu(LLAMA70, M, ulysses_degree=1, ring_degree=8) == expected
    assert kv_cache_bytes_per_gpu(LLAMA70, M, ulysses_degree=2, ring_degree=4) == expected


def test_ulysses_stops_at_8_gpus_from_8_kv_heads():
    assert LLAMA70.max_ulysses_degree(replicate_kv=False) == 8
    # Past 8, Ulysses only works by replicating KV heads, so its KV cache stops shrinking; the ring keeps going.
    at_8 = kv_cache_bytes_per_gpu(LLAMA70, M, ulysses_degree=8, ring_degree=1)
    assert kv_cache_bytes_per_gpu(LLAMA70, M, ulysses_degree=16, ring_degree=1) == at_8
    assert kv_cache_bytes_per_gpu(LLAMA70, M, ulysses_degree=1, ring_degree=16) == at_8 / 2
    assert LLAMA70.ulysses_split_error(16) is None  # 64 query heads still split (with KV replication)
    assert LLAMA70.ulysses_split_error(48) is None  # uneven: 16 ranks of 2 query heads, 32 of 1
    assert "num_attention_heads=64" in LLAMA70.ulysses_split_error(65)


def test_ring_block_step_compute_and_nvlink_time():
    # K and V: [125K tokens, 8 heads, 128 dim] x 2 bytes each = 0.256 GB each, 0.51 GB per ring step
    block = kv_block_bytes(LLAMA70, M, ulysses_degree=1, ring_degree=8)
    assert block == 2 * 125_000 * 8 * 128 * 2
    assert round(block / 1e9, 2) == 0.51
    # compute per step: 4 x 125K x 125K x 128 x 64 heads
    assert attention_fwd_flops(LLAMA70, 125_000, 125_000) == pytest.approx(5.12e14, rel=1e-12)
    # 0.512 GB over NVLink at 300 GB/s per direction: ~1.7 ms, hidden behind seconds of compute
    a100 = GPUS["a100-80g"]
    assert a100.intra_node_gbps == 300
    comm = ring_comm(LLAMA70, a100, seq_len=M, ulysses_degree=1, ring_degree=8, node_size=8, attention_s=1e4)
    assert comm["ring_step_comm_s"] == pytest.approx(1.7e-3, abs=0.01e-3)
    # every K/V (and dK/dV) transfer hides behind seconds of compute; only the last hop of the fp32 dK/dV back
    # to its owner (2 x 0.512 GB at 300 GB/s, per layer) has nothing to overlap with
    assert comm["ring_exposed_s"] == pytest.approx(80 * 1.024e9 / 300e9)
    # across nodes at 25 GB/s: 20.4 ms (ring of 8 strided over 8 nodes of 1 GPU)
    comm = ring_comm(LLAMA70, a100, seq_len=M, ulysses_degree=1, ring_degree=8, node_size=1, attention_s=1e4)
    assert comm["ring_step_comm_s"] == pytest.approx(20.48e-3, rel=1e-9)


def test_zigzag_speedup():
    assert round(seed_zigzag_speedup(8), 2) == 1.88  # 4N / (2N + 1) = 32 / 17
    assert [round(seed_zigzag_speedup(n), 2) for n in (16, 32, 64)] == [1.94, 1.97, 1.98]
    # The planner's tile-level accounting (diagonal blocks half-masked): contiguous waits (2N-1)/N, zigzag 1.
    assert causal_imbalance(8, "contiguous") / causal_imbalance(8, "zigzag") == pytest.approx(15 / 8)
    assert round(15 / 8, 2) == 1.88
    assert causal_imbalance(1, "contiguous") == 1.0
    assert causal_imbalance(10_000, "contiguous") == pytest.approx(2.0, abs=1e-3)


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_causal_imbalance_matches_the_ring_block_plans(layout, n):
    """The busiest rank's causal (q, k) pairs, counted exactly over the ring kernel's block plans by
    usp.attention.cost, over the balanced share S^2 / 2N."""
    S = 16384
    busiest = max(w["pairs"] for w in ring_work(S, n, layout, True))
    assert busiest / (S * S / 2 / n) == pytest.approx(causal_imbalance(n, layout), rel=1e-3)


def _a100_as_the_seed_counts() -> object:
    # The seed budgets "80 GB" (1e9 bytes), 2 TB/s HBM, ~175 TFLOP/s from FlashAttention-2 on large blocks.
    base = GPUS["a100-80g"]
    return replace(
        base, memory_gib=80e9 / GIB, hbm_tbps=2.0, attention_efficiency=175 / 312, dense_efficiency=175 / 312
    )


def test_batch_capacity_6_at_32_gpus():
    dev = _a100_as_the_seed_counts()
    plans = plan_inference(LLAMA70, dev, seq_len=M, world_size=32, node_size=8)
    # fixed: 141.1 GB / 32 = 4.41 GB weights + 2.0 GB overhead; per request: 10.24 GB KV + 0.64 GB q,k,v
    # (31,250 tokens x (64 + 2 x 8 heads) x 128 x 2 B). (80 - 6.41) / 10.88 = 6.76 -> 6 (7 would need 82.6 GB).
    for p in plans:
        assert p.kv_cache_gb_per_gpu == pytest.approx(10.24)
        assert p.weights_gb_per_gpu == pytest.approx(4.41, abs=0.005)
        assert p.activations_gb_per_request == pytest.approx(0.64)
        assert p.batch_capacity == 6
    assert {(p.ulysses_degree, p.ring_degree) for p in plans} == {(1, 32), (2, 16), (4, 8), (8, 4)}


def test_decode_and_prefill_time():
    dev = _a100_as_the_seed_counts()
    est = estimate_inference(LLAMA70, dev, seq_len=M, ulysses_degree=8, ring_degree=4, node_size=8)
    # per layer: 1.711 GB of gathered weights + 128 MB of local KV at 2 TB/s = 0.92 ms; x 80 = 73.6 ms (~74)
    assert est.decode_hbm_s_per_token == pytest.approx(80 * (855_654_400 * 2 + 128e6) / 2e12)
    assert round(est.decode_hbm_s_per_token * 1e3) == 74
    # prefill on 8 GPUs with zigzag: the seed's ~16.5 min (31 min / 1.88) within 10%
    est8 = estimate_inference(LLAMA70, dev, seq_len=M, ulysses_degree=1, ring_degree=8, node_size=8)
    assert 0.9 * 16.5 * 60 < est8.prefill_s < 1.1 * 16.5 * 60


def test_llama3_8b_kv_at_1m_tokens():
    # seed 003: 128 KiB per token, 128 GiB at 1,048,576 tokens; ring of 8: 16 GiB per GPU, 0.5 GiB block/layer
    assert LLAMA8.kv_bytes_per_token() == 2 * 8 * 128 * 32 * 2 == 128 * 1024
    assert kv_cache_bytes_per_gpu(LLAMA8, 2**20, 1, 1) == 128 * GIB
    assert kv_cache_bytes_per_gpu(LLAMA8, 2**20, 1, 8) == 16 * GIB
    assert kv_block_bytes(LLAMA8, 2**20, 1, 8) == 16 * GIB / 32


@pytest.mark.parametrize("compute_bytes", [2, 4])
@pytest.mark.parametrize(
    "seq_len,heads,kv_heads,ulysses,ring",
    [(4096, 32, 8, 8, 4), (4096, 32, 8, 2, 8), (1024, 8, 2, 4, 2), (2048, 16, 1, 4, 1), (512, 4, 4, 1, 4)],
)
def test_comm_bytes_agree_with_the_attention_cost_model(
    seq_len, heads, kv_heads, ulysses, ring, compute_bytes
):
    """The planner's per-layer bytes equal usp.attention.cost's count (written separately, by the attention
    engineer, and checked there against the bytes the kernels really send)."""
    model = ModelSpec("x", heads * 64, 1, heads, kv_heads, 64, 256, 1000)
    dev = GPUS["h100-80g"]
    kw = dict(seq_len=seq_len, ulysses_degree=ulysses, ring_degree=ring, compute_bytes=compute_bytes)
    ours = ulysses_comm(model, dev, **kw)["ulysses_bytes"]
    ours += ring_comm(model, dev, node_size=8, attention_s=1.0, **kw)["ring_bytes"]
    theirs = analytic_bytes_sent(
        batch=1,
        seq_len=seq_len,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=64,
        ulysses_degree=ulysses,
        ring_degree=ring,
        element_size=compute_bytes,
    )
    assert ours == theirs["fwd_bwd"]
