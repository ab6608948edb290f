"""Ring degree 1 on fake CUDA tensors (no GPU): every CUDA backend takes the direct kernel path and head chunks.

Without a ring, ``usp.attention.ring`` hands the kernels the caller's tensors (and, with head chunks, strided
views of their heads, no copies) and returns the kernels' own outputs and gradients. This runs that path's
forward and backward (the autograd function's two halves) for torch's three CUDA SDPA kernels (and, where a
flash-attn release can be fetched, flash_attn over its stub) under :func:`tests.fake_cuda.fake_cuda`, which
checks each kernel call against its contract: dense and document blocks (small mask, per segment), GQA,
``B = 2`` and 1, head chunks 1 and 2. Numerics are covered on the CPU (``tests/test_attention_ring1.py``).
"""

from __future__ import annotations

import sys

import pytest
import torch

from tests.fake_cuda import cuda_randn, fake_cuda
from usp.attention import segmented
from usp.attention.blocks import plan_ring_blocks
from usp.attention.ring import _head_chunks, attention_heads_backward, attention_heads_forward

S = 160
CU = torch.tensor([0, 30, 31, 100, 160], dtype=torch.int32)  # documents of 30, 1, 69 and 60 tokens


def run_ring1(
    backend: str, *, chunks: int, docs: bool, batch: int, hq: int = 8, hkv: int = 2, dtype=torch.bfloat16
):
    """Forward + backward of one ring-1 attention on fake CUDA; returns the contract recorder."""
    plans = plan_ring_blocks(S, 1, 0, "zigzag", True, CU if docs else None)
    assert len(plans) == 1
    chunked = _head_chunks(hq, hkv, chunks)
    with fake_cuda() as contracts:  # the autograd function's two halves (autograd cannot run on fake CUDA)
        q = cuda_randn(batch, S, hq, 64, dtype=dtype)
        k, v = cuda_randn(batch, S, hkv, 64, dtype=dtype), cuda_randn(batch, S, hkv, 64, dtype=dtype)
        out, lse = attention_heads_forward(q, k, v, None, plans, 0.125, backend, chunked)
        assert out.shape == q.shape and out.dtype == dtype and out.device == q.device
        assert lse.shape == (batch, hq, S) and lse.dtype == torch.float32
        dout = cuda_randn(batch, S, hq, 64, dtype=dtype)
        grads = attention_heads_backward(dout, q, k, v, out, lse, None, plans, 0.125, backend, chunked)
        for g, x in zip(grads, (q, k, v)):
            assert g.shape == x.shape and g.dtype == dtype and g.device == x.device
    assert contracts.calls or backend == "flash_attn", "no CUDA SDPA op ran"
    return contracts


@pytest.mark.parametrize("backend", ["sdpa_flash", "sdpa_efficient", "sdpa_cudnn"])
@pytest.mark.parametrize("chunks", [1, 2])
@pytest.mark.parametrize("docs, per_segment", [(False, False), (True, False), (True, True)])
def test_ring1_meets_the_kernel_contracts(monkeypatch, backend, chunks, docs, per_segment):
    if per_segment:
        monkeypatch.setattr(segmented, "DENSE_MASK_MAX_ELEMENTS", 0)
    contracts = run_ring1(backend, chunks=chunks, docs=docs, batch=1 if docs else 2)
    fwd = [c for c in contracts.calls if not c.op.endswith("_backward")]
    bwd = [c for c in contracts.calls if c.op.endswith("_backward")]
    calls = 4 if per_segment else 1  # per segment (no mask allowed at all): one call per document
    assert len(fwd) == len(bwd) == calls * chunks, [c.op for c in contracts.calls]
    # each chunk's kernel sees its own heads: the query heads of the chunk, not the whole tensor's
    assert {c.shapes["query"][1] for c in contracts.calls} == {8 // chunks}


def test_ring1_fp32_on_the_efficient_kernel():
    run_ring1("sdpa_efficient", chunks=2, docs=False, batch=2, dtype=torch.float32)


@pytest.mark.network
@pytest.mark.parametrize("chunks, docs", [(1, False), (2, False), (2, True)])
def test_ring1_through_a_flash_attn_release(monkeypatch, chunks, docs):
    from tests.flash_attn_stub import release
    from usp.attention import kernels

    try:
        modules = release("2.8.3.post2")
    except RuntimeError as exc:
        pytest.skip(f"flash-attn could not be fetched: {exc}")
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    kernels.flash_attn_import_error.cache_clear()
    try:
        run_ring1("flash_attn", chunks=chunks, docs=docs, batch=1 if docs else 2)
    finally:
        kernels.flash_attn_import_error.cache_clear()
