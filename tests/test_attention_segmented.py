"""Document segments run one unmasked kernel call per segment (no dense [Sq, Sk] mask) vs the masked reference.

The per-segment path is what large segmented blocks take on the dense backends (torch SDPA on CUDA, CPU
flash); here it is forced on small shapes (``DENSE_MASK_MAX_ELEMENTS = 0``) and compared with the ``math``
backend's dense mask and a float64 reference: forward ``out``/``lse`` and backward ``dq, dk, dv`` from the
global lse, fp32 at ``tests.tolerance.rounding_tolerance`` over the block's longest reduction. Any dense mask built on that path makes the test fail.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.test_attention_kernels import _inputs, _reference, fp32_tol
from tests.tolerance import assert_close_scaled
from usp.attention import cuda_kernels, kernels, masks, segmented
from usp.attention.blocks import plan_ring_blocks
from usp.attention.kernels import attention_backward, attention_forward
from usp.attention.masks import segment_mask


@pytest.fixture(params=[0, 40], ids=["one_call_per_segment", "grouped_up_to_40"])
def per_segment(request, monkeypatch):
    """Force the per-segment path (groups of at most ``param`` elements) and fail on any larger dense mask."""
    limit = request.param
    real = masks.dense_mask

    def small_dense_mask(sq, sk, causal, segments, device):
        if sq * sk > limit:
            raise AssertionError(f"a dense [{sq}, {sk}] mask was built on the per-segment path")
        return real(sq, sk, causal, segments, device)

    monkeypatch.setattr(segmented, "DENSE_MASK_MAX_ELEMENTS", limit)
    monkeypatch.setattr(kernels, "dense_mask", small_dense_mask)
    monkeypatch.setattr(cuda_kernels, "dense_mask", small_dense_mask)


def _check_block(q, k, v, dout, causal, segments, scale=0.3):
    """Per-segment cpu_flash == float64 masked reference (fwd), == math with the dense mask (bwd)."""
    kw = dict(causal=causal, softmax_scale=scale, segments=segments)
    out, lse = attention_forward(q, k, v, backend="cpu_flash", **kw)
    mask = segment_mask(segments, q.size(1), k.size(1), causal)
    ref_out, ref_lse = _reference(q * (scale * math.sqrt(q.size(-1))), k, v, mask)
    tol = fp32_tol(q.size(1), k.size(1))
    assert_close_scaled(out.double(), ref_out, tol)
    assert_close_scaled(lse.double(), ref_lse, tol)  # -inf on rows with no key, exactly
    # global lse as if other blocks gave the empty rows keys: their gradients must stay exactly 0 here
    lse_g = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    got = attention_backward(dout, q, k, v, out, lse_g, backend="cpu_flash", **kw)
    want = _math_backward_reference(dout, q, k, v, out, lse_g, causal, scale, segments)
    for a, b in zip(got, want):
        assert_close_scaled(a, b, tol)
    return out, lse, got


def _math_backward_reference(dout, q, k, v, out, lse, causal, scale, segments):
    """The math backend's dense-mask backward, called directly (the fixture blocks ``kernels.dense_mask``)."""
    mask = segment_mask(segments, q.size(1), k.size(1), causal)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kernels, "dense_mask", lambda *a, **kw: mask)
        return kernels._math_backward(dout, q, k, v, out, lse, causal, scale, segments)


LAYOUTS = {
    # non-causal off-diagonal pieces: keys precede queries; rows 0 and 9 have no key, key 11 no query
    "offset_rectangles": (12, 12, False, [[1, 4, 0, 3], [4, 9, 3, 8], [10, 12, 9, 11]]),
    # a document running from the end of the key part into the start of the query part; rows 4.. empty
    "spanning_block_edges": (10, 14, False, [[0, 4, 6, 14]]),
    # queries starting mid-document in the key part, a last document reaching the end of both parts
    "spanning_to_the_end": (10, 14, False, [[2, 6, 0, 5], [6, 10, 5, 14]]),
    # causal diagonal: per-document triangles, a 1-token document
    "causal_diagonal": (12, 12, True, [[0, 5, 0, 5], [5, 6, 5, 6], [6, 12, 6, 12]]),
    # causal with rows outside every segment (3, 4)
    "causal_with_gaps": (12, 12, True, [[0, 3, 0, 3], [5, 9, 5, 9], [9, 12, 9, 12]]),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("hq, hkv", [(4, 4), (4, 2), (4, 1)])
def test_per_segment_matches_masked_reference(per_segment, layout, hq, hkv):
    sq, sk, causal, segs = LAYOUTS[layout]
    q, k, v, _ = _inputs(sq, sk, hq, hkv, seed=11)
    dout = _inputs(sq, sq, hq, hkv, seed=12)[3]
    out, lse, (dq, dk, dv) = _check_block(q, k, v, dout, causal, torch.tensor(segs))
    covered_q = torch.zeros(sq, dtype=torch.bool)
    covered_k = torch.zeros(sk, dtype=torch.bool)
    for q0, q1, k0, k1 in segs:
        covered_q[q0:q1], covered_k[k0:k1] = True, True
    assert (out[:, ~covered_q] == 0).all() and (dq[:, ~covered_q] == 0).all()
    assert (dk[:, ~covered_k] == 0).all() and (dv[:, ~covered_k] == 0).all()


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("cu", [[0, 1, 7, 20, 21, 33, 48], [0, 30, 31, 32, 48], [0, 3, 6, 9, 12, 40, 48]])
def test_per_segment_on_real_ring_blocks(per_segment, layout, cu):
    """Every segmented block of every rank and step of a ring-4 plan (documents crossing parts and chunks)."""
    seen = 0
    for rank in range(4):
        for block in plan_ring_blocks(48, 4, rank, layout, True, torch.tensor(cu)):
            if block is None or block.segments is None:
                continue
            assert block.segments.device.type == "cpu"  # read on the host: no device sync per block
            sq, sk = block.q_end - block.q_start, block.k_end - block.k_start
            q, k, v, _ = _inputs(sq, sk, 4, 2, seed=rank)
            dout = _inputs(sq, sq, 4, 2, seed=rank + 7)[3]
            _check_block(q, k, v, dout, block.causal, block.segments)
            seen += 1
    assert seen > 0


def test_large_segmented_blocks_take_the_per_segment_path(monkeypatch):
    """Default threshold: a 128K-token block never builds a mask; a 2K x 4K CPU block runs without one."""
    assert segmented.per_segment_calls(131072, 131072) and not segmented.per_segment_calls(64, 64)

    def no_dense_mask(*args, **kwargs):
        raise AssertionError("dense mask built")

    sq, sk = 2048, 4096
    assert segmented.per_segment_calls(sq, sk)
    segs = torch.tensor([[0, 1000, 0, 1500], [1000, 2048, 1500, 4096]])
    q, k, v, _ = _inputs(sq, sk, 1, 1, d=4)
    q, k, v = q[:1], k[:1], v[:1]
    monkeypatch.setattr(kernels, "dense_mask", no_dense_mask)
    out, lse = attention_forward(q, k, v, causal=False, softmax_scale=0.5, backend="cpu_flash", segments=segs)
    for q0, q1, k0, k1 in segs.tolist():
        ref, ref_lse = _reference(q[:, q0:q1] * (0.5 * 2), k[:, k0:k1], v[:, k0:k1], None)
        assert_close_scaled(out[:, q0:q1].double(), ref, fp32_tol(k1 - k0))
        assert_close_scaled(lse[:, :, q0:q1].double(), ref_lse, fp32_tol(k1 - k0))


@pytest.mark.parametrize("backend", ["sdpa_flash", "sdpa_efficient", "sdpa_cudnn"])
def test_cuda_sdpa_per_segment_on_meta(per_segment, backend):
    """The CUDA SDPA per-segment calls: signatures and shapes on the meta device (no GPU here)."""
    q = torch.empty(1, 16, 4, 8, device="meta", dtype=torch.bfloat16)
    k = torch.empty(1, 16, 2, 8, device="meta", dtype=torch.bfloat16)
    kw = dict(
        causal=True, softmax_scale=0.3, backend=backend, segments=torch.tensor([[0, 5, 0, 5], [7, 16, 7, 16]])
    )
    out, lse = attention_forward(q, k, k, **kw)
    assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == (1, 4, 16)
    dq, dk, dv = attention_backward(out, q, k, k, out, lse, **kw)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == k.shape


def test_sdpa_efficient_causal_without_documents_builds_no_bias(monkeypatch):
    """Plain causal mem-efficient attention (auto's fp32 choice on CUDA) uses the kernel's causal flag."""

    def no_dense_mask(*args, **kwargs):
        raise AssertionError("a dense causal bias was built")

    monkeypatch.setattr(cuda_kernels, "dense_mask", no_dense_mask)
    q = torch.empty(1, 64, 4, 8, device="meta", dtype=torch.float32)
    kw = dict(causal=True, softmax_scale=0.3, backend="sdpa_efficient")
    out, lse = attention_forward(q, q[:, :, :2], q[:, :, :2], **kw)
    dq, dk, _ = attention_backward(out, q, q[:, :, :2], q[:, :, :2], out, lse, **kw)
    assert out.shape == dq.shape == q.shape and dk.shape == (1, 64, 2, 8)


def test_group_segments_packs_short_documents_under_the_limit():
    segs = [(0, 3, 0, 3), (3, 5, 3, 5), (5, 12, 5, 12), (12, 13, 12, 13)]
    groups = segmented.group_segments(segs, 30)
    assert [rect for rect, _ in groups] == [(0, 5, 0, 5), (5, 12, 5, 12), (12, 13, 12, 13)]
    assert groups[0][1].tolist() == [[0, 3, 0, 3], [3, 5, 3, 5]]
    assert groups[1][1] is None and groups[2][1] is None  # one segment: an unmasked call (49 > 30 allowed)
    # off-diagonal rectangles: rebased on the group's own row and key offsets
    groups = segmented.group_segments([(1, 4, 0, 3), (4, 9, 3, 8), (10, 12, 9, 11)], 121)
    assert groups[0][0] == (1, 12, 0, 11)
    assert groups[0][1].tolist() == [[0, 3, 0, 3], [3, 8, 3, 8], [9, 11, 9, 11]]
    assert len(segmented.group_segments(segs, 0)) == len(segs)
