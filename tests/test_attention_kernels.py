"""Local kernels: (out, lse) forward and global-lse backward of every CPU backend vs a float64 reference.

fp32 cases: ``tests.tolerance.rounding_tolerance`` over the longest reduction (keys for out, lse and dq, queries
for dk and dv; at most 12 here), relative to each element and to the reference's largest magnitude. The flash_attn varlen packing (CUDA only) is
checked on CPU through a stand-in ``flash_attn`` module whose kernels loop over the packed sequences.
"""

from __future__ import annotations

import inspect
import math
import sys
import types

import pytest
import torch

from tests.tolerance import assert_close_scaled, rounding_tolerance
from usp.attention import kernels
from usp.attention.kernels import attention_backward, attention_forward, resolve_backend
from usp.attention.masks import segment_mask
from usp.attention.ring import merge_block_


def fp32_tol(*lengths: int) -> float:
    """The rounding rule for fp32 attention whose longest reduction is ``max(lengths)`` (keys or queries)."""
    return rounding_tolerance(torch.float32, max(lengths))


FP32_TOL = fp32_tol(12)  # every case in this file: at most 12 queries and 12 keys
CPU_BACKENDS = ["math", "cpu_flash"]


def _inputs(sq, sk, hq, hkv, d=8, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, sq, hq, d, generator=g).to(dtype)
    k = torch.randn(2, sk, hkv, d, generator=g).to(dtype)
    v = torch.randn(2, sk, hkv, d, generator=g).to(dtype)
    dout = torch.randn(2, sq, hq, d, generator=g).to(dtype)
    return q, k, v, dout


def _reference(q, k, v, mask):
    """float64 (out, lse) with a boolean [Sq, Sk] mask (None = full); rows without keys: out 0, lse -inf."""
    g = q.size(2) // k.size(2)
    qd, kd, vd = (t.double().transpose(1, 2) for t in (q, k, v))
    kd, vd = kd.repeat_interleave(g, 1), vd.repeat_interleave(g, 1)
    s = qd @ kd.transpose(-1, -2) / math.sqrt(q.size(-1))
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
    return (p @ vd).transpose(1, 2), lse


SEGMENTS = torch.tensor([[1, 4, 0, 3], [4, 9, 3, 8], [10, 12, 9, 11]])  # rows 0 and 9 attend to nothing


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize(
    "causal, segments, hq, hkv",
    [(False, None, 4, 4), (True, None, 4, 2), (False, SEGMENTS, 4, 1), (True, "diag", 4, 2)],
)
def test_forward_out_and_lse(backend, causal, segments, hq, hkv):
    s = 12
    if isinstance(segments, str):  # causal per-document segments on the diagonal
        segments = torch.tensor([[0, 5, 0, 5], [5, 6, 5, 6], [6, 12, 6, 12]])
    q, k, v, _ = _inputs(s, s, hq, hkv)
    out, lse = attention_forward(
        q, k, v, causal=causal, softmax_scale=1 / math.sqrt(8), backend=backend, segments=segments
    )
    mask = segment_mask(segments, s, s, causal) if segments is not None else None
    if mask is None and causal:
        mask = torch.ones(s, s, dtype=torch.bool).tril()
    ref_out, ref_lse = _reference(q, k, v, mask)
    assert out.dtype == q.dtype and lse.dtype == torch.float32 and lse.shape == (2, hq, s)
    assert_close_scaled(out.double(), ref_out, FP32_TOL)
    assert_close_scaled(lse.double(), ref_lse, FP32_TOL)  # -inf rows must match exactly


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_backward_from_global_lse_is_exact_per_block(backend):
    """Keys split in two blocks; each block's backward with the merged out/lse gives pieces of the true grads."""
    sq, sk, hq, hkv = 8, 10, 4, 2
    q, k, v, dout = _inputs(sq, sk, hq, hkv, seed=3)
    scale = 1 / math.sqrt(8)
    blocks = [slice(0, 4), slice(4, 10)]
    out_acc = torch.zeros(q.shape)
    lse_acc = torch.full((2, hq, sq), float("-inf"))
    for ks in blocks:
        o, lse = attention_forward(q, k[:, ks], v[:, ks], causal=False, softmax_scale=scale, backend=backend)
        merge_block_(out_acc, lse_acc, o, lse)
    out = out_acc.to(q.dtype)
    dq = torch.zeros_like(q)
    dks, dvs = [], []
    for ks in blocks:
        gq, gk, gv = attention_backward(
            dout, q, k[:, ks], v[:, ks], out, lse_acc, causal=False, softmax_scale=scale, backend=backend
        )
        dq += gq
        dks.append(gk)
        dvs.append(gv)
    qr, kr, vr = (t.double().requires_grad_() for t in (q, k, v))
    ref = torch.nn.functional.scaled_dot_product_attention(
        qr.transpose(1, 2), kr.transpose(1, 2), vr.transpose(1, 2), enable_gqa=True
    ).transpose(1, 2)
    ref.backward(dout.double())
    assert_close_scaled(out.double(), ref.detach(), FP32_TOL)
    assert_close_scaled(dq.double(), qr.grad, FP32_TOL)
    assert_close_scaled(torch.cat(dks, 1).double(), kr.grad, FP32_TOL)
    assert_close_scaled(torch.cat(dvs, 1).double(), vr.grad, FP32_TOL)


def test_merge_handles_rows_without_keys():
    out_acc = torch.zeros(1, 3, 1, 2)
    lse_acc = torch.full((1, 1, 3), float("-inf"))
    o = torch.tensor([[[[1.0, 2.0]], [[0.0, 0.0]], [[3.0, 4.0]]]])
    lse = torch.tensor([[[0.5, float("-inf"), 1.0]]])
    merge_block_(out_acc, lse_acc, o, lse)
    merge_block_(out_acc, lse_acc, torch.zeros_like(o), torch.full_like(lse, float("-inf")))
    assert not out_acc.isnan().any() and not lse_acc.isnan().any()
    torch.testing.assert_close(out_acc, o)
    assert lse_acc[0, 0].tolist() == [0.5, float("-inf"), 1.0]


def test_backward_rows_without_keys_have_zero_grads():
    q, k, v, dout = _inputs(12, 12, 4, 2)
    out, lse = attention_forward(
        q, k, v, causal=False, softmax_scale=0.3, backend="cpu_flash", segments=SEGMENTS
    )
    global_lse = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)  # as if other blocks covered them
    dq, dk, dv = attention_backward(
        dout,
        q,
        k,
        v,
        out,
        global_lse,
        causal=False,
        softmax_scale=0.3,
        backend="cpu_flash",
        segments=SEGMENTS,
    )
    assert not any(t.isnan().any() for t in (dq, dk, dv))
    assert dq[:, [0, 9]].abs().max() == 0 and dk[:, 11].abs().max() == 0


def test_resolve_backend():
    assert resolve_backend("auto", torch.device("cpu")) == "cpu_flash"
    assert resolve_backend("math", torch.device("cpu")) == "math"
    assert resolve_backend("auto", torch.device("cuda"), torch.float32) == "sdpa_efficient"  # no fp32 flash
    with pytest.raises(ValueError, match="needs CUDA"):
        resolve_backend("sdpa_efficient", torch.device("cpu"))
    with pytest.raises(ValueError, match="unknown"):
        resolve_backend("xformers", torch.device("cpu"))


# --- flash_attn varlen packing, through a stand-in module ------------------------------------------------


def _fake_flash_attn() -> tuple[types.ModuleType, types.ModuleType]:
    """flash_attn's varlen API ([N, H, D] packed, lse [H, N]) implemented by looping over the sequences."""

    def varlen_fwd(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, scale, causal, return_attn_probs=False):
        outs, lses = [], []
        for i in range(cu_q.numel() - 1):
            qs, ks = slice(int(cu_q[i]), int(cu_q[i + 1])), slice(int(cu_k[i]), int(cu_k[i + 1]))
            o, lse = attention_forward(
                q[None, qs], k[None, ks], v[None, ks], causal=causal, softmax_scale=scale, backend="math"
            )
            outs.append(o[0])
            lses.append(lse[0])
        return torch.cat(outs), torch.cat(lses, dim=1), None

    def varlen_bwd(
        dout,
        q,
        k,
        v,
        out,
        softmax_lse,
        dq,
        dk,
        dv,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        dropout_p,
        softmax_scale,
        causal,
        window_size_left,
        window_size_right,
        softcap,
        alibi_slopes,
        deterministic,
        rng_state=None,
    ):
        cu_q, cu_k = cu_seqlens_q, cu_seqlens_k
        for i in range(cu_q.numel() - 1):
            qs, ks = slice(int(cu_q[i]), int(cu_q[i + 1])), slice(int(cu_k[i]), int(cu_k[i + 1]))
            g = attention_backward(
                dout[None, qs],
                q[None, qs],
                k[None, ks],
                v[None, ks],
                out[None, qs],
                softmax_lse[None, :, qs],
                causal=causal,
                softmax_scale=softmax_scale,
                backend="math",
            )
            dq[qs], dk[ks], dv[ks] = g[0][0], g[1][0], g[2][0]

    fa = types.ModuleType("flash_attn")
    fa.__version__ = "2.6.3"  # the packed varlen lse [H, total_q] below is the >= 2.6 layout
    iface = types.ModuleType("flash_attn.flash_attn_interface")
    fa.flash_attn_varlen_func = varlen_fwd
    iface._flash_attn_varlen_backward = varlen_bwd
    fa.flash_attn_interface = iface
    return fa, iface


@pytest.mark.parametrize("causal", [True, False])
def test_flash_attn_varlen_packing(monkeypatch, causal):
    fa, iface = _fake_flash_attn()
    monkeypatch.setitem(sys.modules, "flash_attn", fa)
    monkeypatch.setitem(sys.modules, "flash_attn.flash_attn_interface", iface)
    if causal:
        segments = torch.tensor([[0, 3, 0, 3], [5, 9, 5, 9], [9, 12, 9, 12]])  # rows 3, 4 attend to nothing
    else:
        segments = SEGMENTS
    q, k, v, dout = _inputs(12, 12, 4, 2)
    q, k, v, dout = q[:1], k[:1], v[:1], dout[:1]
    kw = dict(causal=causal, softmax_scale=0.3, segments=segments)
    out_fa, lse_fa = attention_forward(q, k, v, backend="flash_attn", **kw)
    out_m, lse_m = attention_forward(q, k, v, backend="math", **kw)
    assert_close_scaled(out_fa, out_m, FP32_TOL)
    assert_close_scaled(lse_fa, lse_m, FP32_TOL)
    lse_g = torch.where(torch.isinf(lse_m), torch.zeros_like(lse_m), lse_m)
    for a, b in zip(
        attention_backward(dout, q, k, v, out_m, lse_g, backend="flash_attn", **kw),
        attention_backward(dout, q, k, v, out_m, lse_g, backend="math", **kw),
    ):
        assert_close_scaled(a, b, FP32_TOL)


# --- CUDA torch SDPA paths: call signatures and shapes checked on the meta device (no GPU here) -------------


@pytest.mark.parametrize("backend", ["sdpa_flash", "sdpa_efficient", "sdpa_cudnn"])
@pytest.mark.parametrize("segments", [None, torch.tensor([[0, 5, 0, 5], [5, 16, 5, 16]])])
def test_cuda_sdpa_paths_on_meta(backend, segments):
    q = torch.empty(1, 16, 4, 8, device="meta", dtype=torch.bfloat16)
    k = torch.empty(1, 16, 2, 8, device="meta", dtype=torch.bfloat16)
    kw = dict(causal=True, softmax_scale=0.3, backend=backend, segments=segments)
    out, lse = attention_forward(q, k, k, **kw)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (1, 4, 16) and lse.dtype == torch.float32
    dq, dk, dv = attention_backward(out, q, k, k, out, lse, **kw)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == k.shape


# --- flash-attn >= 2.6: backward kernels wrapped in torch.library.custom_op (signature (*args, **kwargs)) ----


def _custom_op_backwards():
    """Stand-ins for ``_flash_attn_backward`` / ``_flash_attn_varlen_backward`` as flash-attn 2.6+ defines them."""
    if hasattr(_custom_op_backwards, "ops"):  # an op name can be registered once per process
        return _custom_op_backwards.ops
    _, plain = _fake_flash_attn()
    plain_varlen = plain._flash_attn_varlen_backward

    @torch.library.custom_op("usp_test::fa_bwd", mutates_args=("dq", "dk", "dv"), device_types="cpu")
    def fa_bwd(
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        softmax_lse: torch.Tensor,
        dq: torch.Tensor,
        dk: torch.Tensor,
        dv: torch.Tensor,
        dropout_p: float,
        softmax_scale: float,
        causal: bool,
        window_size_left: int,
        window_size_right: int,
        softcap: float,
        alibi_slopes: torch.Tensor | None,
        deterministic: bool,
        rng_state: torch.Tensor | None = None,
    ) -> None:
        g = attention_backward(
            dout, q, k, v, out, softmax_lse, causal=causal, softmax_scale=softmax_scale, backend="math"
        )
        dq.copy_(g[0])
        dk.copy_(g[1])
        dv.copy_(g[2])

    @torch.library.custom_op("usp_test::fa_varlen_bwd", mutates_args=("dq", "dk", "dv"), device_types="cpu")
    def fa_varlen_bwd(
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        softmax_lse: torch.Tensor,
        dq: torch.Tensor,
        dk: torch.Tensor,
        dv: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        cu_seqlens_k: torch.Tensor,
        max_seqlen_q: int,
        max_seqlen_k: int,
        dropout_p: float,
        softmax_scale: float,
        causal: bool,
        window_size_left: int,
        window_size_right: int,
        softcap: float,
        alibi_slopes: torch.Tensor | None,
        deterministic: bool,
        rng_state: torch.Tensor | None = None,
    ) -> None:
        plain_varlen(
            dout,
            q,
            k,
            v,
            out,
            softmax_lse,
            dq,
            dk,
            dv,
            cu_seqlens_q,
            cu_seqlens_k,
            max_seqlen_q,
            max_seqlen_k,
            dropout_p,
            softmax_scale,
            causal,
            window_size_left,
            window_size_right,
            softcap,
            alibi_slopes,
            deterministic,
            rng_state,
        )

    _custom_op_backwards.ops = fa_bwd, fa_varlen_bwd
    return _custom_op_backwards.ops


@pytest.mark.parametrize("segments", [None, SEGMENTS])
def test_flash_attn_backward_through_custom_op_wrapper(monkeypatch, segments):
    """flash-attn >= 2.6 on torch >= 2.4: the backward is a custom op; every argument must still reach it."""
    fa, iface = _fake_flash_attn()
    fa_bwd, fa_varlen_bwd = _custom_op_backwards()
    iface._flash_attn_backward, iface._flash_attn_varlen_backward = fa_bwd, fa_varlen_bwd
    monkeypatch.setitem(sys.modules, "flash_attn", fa)
    monkeypatch.setitem(sys.modules, "flash_attn.flash_attn_interface", iface)
    assert str(inspect.signature(fa_bwd)) == "(*args, **kwargs)"  # what broke the keyword filter
    q, k, v, dout = (t[:1] for t in _inputs(12, 12, 4, 2, seed=5))
    kw = dict(causal=False, softmax_scale=0.3, segments=segments)
    out, lse = attention_forward(q, k, v, backend="math", **kw)
    lse_g = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    got = attention_backward(dout, q, k, v, out, lse_g, backend="flash_attn", **kw)
    want = attention_backward(dout, q, k, v, out, lse_g, backend="math", **kw)
    for a, b in zip(got, want):
        assert_close_scaled(a, b, FP32_TOL)


def test_auto_skips_flash_attn_that_is_found_but_fails_to_import(tmp_path, monkeypatch):
    """A flash_attn wheel for another torch ABI is found by find_spec but raises on import: auto uses SDPA."""
    package = tmp_path / "flash_attn"
    package.mkdir()
    (package / "__init__.py").write_text(
        "raise ImportError('undefined symbol: _ZN3c10 (stand-in ABI mismatch)')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "flash_attn", raising=False)
    kernels.flash_attn_import_error.cache_clear()
    try:
        assert resolve_backend("auto", torch.device("cuda"), torch.bfloat16) == "sdpa_flash"
        with pytest.raises(ValueError, match="import flash_attn failed.*undefined symbol"):
            resolve_backend("flash_attn", torch.device("cuda"), torch.bfloat16)
    finally:
        kernels.flash_attn_import_error.cache_clear()
