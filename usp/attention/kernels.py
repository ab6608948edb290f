"""Local attention kernels behind one interface: forward -> ``(out, lse)``, backward from the *global* lse.

Layout (flash-attn convention): ``q [B, Sq, Hq, D]``, ``k, v [B, Sk, Hkv, D]`` with ``Hq % Hkv == 0`` (GQA is
handled inside the kernel, locally; nothing is expanded before communication), ``out [B, Sq, Hq, D]`` in
``q.dtype`` and ``lse [B, Hq, Sq]`` in fp32 (natural log of the softmax denominator, scale included).

Masking is described, not materialized, by the caller:

- ``causal``: top-left aligned lower triangle; only used with ``Sq == Sk`` on the same positions.
- ``segments``: int64 ``[n, 4]`` rows ``(q0, q1, k0, k1)``: query rows ``[q0, q1)`` attend only to keys
  ``[k0, k1)`` (with ``causal``: each segment is its own aligned lower triangle, ``q1 - q0 == k1 - k0``).
  Rows outside every segment attend to nothing: their ``out`` is 0 and their ``lse`` is ``-inf``. This is how
  document masking reaches a kernel: varlen kernels (flash_attn) pack the segments, dense ones build a mask.

``attention_backward`` takes the merged (global) ``out`` and ``lse`` of the rows it is given, so a ring block's
gradients are exact pieces of the full gradient without recomputing the merge.
"""

from __future__ import annotations

import importlib.util
import inspect
import math
from typing import Literal

import torch

Backend = Literal["auto", "flash_attn", "sdpa_flash", "sdpa_efficient", "sdpa_cudnn", "cpu_flash", "math"]
BACKENDS: tuple[str, ...] = (
    "auto",
    "flash_attn",
    "sdpa_flash",
    "sdpa_efficient",
    "sdpa_cudnn",
    "cpu_flash",
    "math",
)
CUDA_BACKENDS: tuple[str, ...] = ("flash_attn", "sdpa_flash", "sdpa_efficient", "sdpa_cudnn")


def flash_attn_available() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def resolve_backend(backend: str, device: torch.device, dtype: torch.dtype | None = None) -> str:
    """Map ``backend`` (``"auto"`` or a name in ``BACKENDS``) to a concrete kernel for ``device`` and ``dtype``.

    ``"auto"``: on CUDA, flash_attn when installed and the dtype is fp16/bf16, else torch's flash SDPA for
    fp16/bf16 and mem-efficient SDPA for fp32 (flash kernels have no fp32); on CPU, torch's CPU flash.
    """
    if backend not in BACKENDS:
        raise ValueError(f"attention backend={backend!r} is unknown; choose one of {BACKENDS}.")
    if backend == "auto":
        if device.type == "cuda":
            half = dtype in (torch.float16, torch.bfloat16) or dtype is None
            if not half:
                return "sdpa_efficient"
            return "flash_attn" if flash_attn_available() else "sdpa_flash"
        return "cpu_flash" if device.type == "cpu" else "math"
    if backend in CUDA_BACKENDS and device.type != "cuda":
        raise ValueError(
            f"attention backend={backend!r} needs CUDA tensors but got {device.type}; use backend='auto', "
            f"'cpu_flash' or 'math' on {device.type}."
        )
    if backend == "cpu_flash" and device.type != "cpu":
        raise ValueError(
            f"attention backend='cpu_flash' needs CPU tensors, got {device.type}; use backend='auto'."
        )
    if backend == "flash_attn" and not flash_attn_available():
        raise ValueError(
            "attention backend='flash_attn' but flash_attn is not installed; use backend='auto'."
        )
    return backend


def default_scale(head_dim: int, softmax_scale: float | None) -> float:
    return 1.0 / math.sqrt(head_dim) if softmax_scale is None else float(softmax_scale)


# --- masks from segments -----------------------------------------------------------------------------------


def segment_key_ranges(segments: torch.Tensor, sq: int, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Per query row, the allowed key range ``[lo, hi)`` (int64 ``[sq]`` each; ``lo == hi``: no key)."""
    rows = torch.arange(sq, device=segments.device)
    q0, q1, k0, k1 = (c.contiguous() for c in segments.unbind(1))
    seg = torch.searchsorted(q0, rows, right=True) - 1  # last segment starting at or before the row
    valid = seg >= 0
    seg = seg.clamp(min=0)
    valid &= rows < q1[seg]
    lo = k0[seg]
    hi = lo + (rows - q0[seg]) + 1 if causal else k1[seg]
    zero = torch.zeros_like(lo)
    return torch.where(valid, lo, zero), torch.where(valid, hi, zero)


def segment_mask(segments: torch.Tensor, sq: int, sk: int, causal: bool) -> torch.Tensor:
    """Boolean ``[sq, sk]`` mask (True = attend) of a segment list."""
    lo, hi = segment_key_ranges(segments, sq, causal)
    cols = torch.arange(sk, device=segments.device)
    return (cols[None, :] >= lo[:, None]) & (cols[None, :] < hi[:, None])


def _dense_mask(sq: int, sk: int, causal: bool, segments: torch.Tensor | None, device: torch.device):
    """Boolean mask for the dense kernels, or None when no mask is needed (plain full attention)."""
    if segments is not None:
        return segment_mask(segments.to(device), sq, sk, causal)
    if causal:
        assert sq == sk, "causal blocks are square (same positions for q and k)"
        return torch.ones(sq, sk, dtype=torch.bool, device=device).tril()
    return None


def _empty_rows(segments: torch.Tensor | None, sq: int, causal: bool) -> torch.Tensor | None:
    if segments is None:
        return None
    lo, hi = segment_key_ranges(segments, sq, causal)
    return hi <= lo


# --- math reference ----------------------------------------------------------------------------------------


def _math_scores(q, k, scale, mask):
    group = q.size(2) // k.size(2)
    qf = q.float().transpose(1, 2)  # [B, Hq, Sq, D]
    kf = k.float().transpose(1, 2).repeat_interleave(group, dim=1)  # [B, Hq, Sk, D]
    s = torch.matmul(qf, kf.transpose(-1, -2)) * scale  # [B, Hq, Sq, Sk]
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return s


def _math_forward(q, k, v, causal, scale, segments):
    mask = _dense_mask(q.size(1), k.size(1), causal, segments, q.device)
    s = _math_scores(q, k, scale, mask)
    lse = torch.logsumexp(s, dim=-1)  # [B, Hq, Sq], -inf on rows with no key
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
    group = q.size(2) // k.size(2)
    vf = v.float().transpose(1, 2).repeat_interleave(group, dim=1)  # [B, Hq, Sk, D]
    out = torch.matmul(p, vf).transpose(1, 2)  # [B, Sq, Hq, D]
    return out.to(q.dtype), lse


def _math_backward(dout, q, k, v, out, lse, causal, scale, segments):
    mask = _dense_mask(q.size(1), k.size(1), causal, segments, q.device)
    s = _math_scores(q, k, scale, mask)
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[..., None])  # [B, Hq, Sq, Sk]
    group = q.size(2) // k.size(2)
    b, sk, hkv, d = k.shape
    do = dout.float().transpose(1, 2)  # [B, Hq, Sq, D]
    vf = v.float().transpose(1, 2).repeat_interleave(group, dim=1)
    kf = k.float().transpose(1, 2).repeat_interleave(group, dim=1)
    delta = (do * out.float().transpose(1, 2)).sum(-1, keepdim=True)  # [B, Hq, Sq, 1]
    ds = p * (torch.matmul(do, vf.transpose(-1, -2)) - delta)
    dq = torch.matmul(ds, kf) * scale
    dk = torch.matmul(ds.transpose(-1, -2), q.float().transpose(1, 2)) * scale  # [B, Hq, Sk, D]
    dv = torch.matmul(p.transpose(-1, -2), do)
    dk = dk.view(b, hkv, group, sk, d).sum(2)  # sum the GQA group back onto its KV head
    dv = dv.view(b, hkv, group, sk, d).sum(2)
    return tuple(t.transpose(1, 2).to(x.dtype) for t, x in ((dq, q), (dk, k), (dv, v)))


# --- torch CPU flash ---------------------------------------------------------------------------------------


def _additive_mask(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    if mask is None:
        return None
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, float("-inf"))


def _cpu_flash_forward(q, k, v, causal, scale, segments):
    mask = (
        None
        if segments is None
        else _additive_mask(_dense_mask(q.size(1), k.size(1), causal, segments, q.device), q.dtype)
    )
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        0.0,
        causal and segments is None,
        attn_mask=mask,
        scale=scale,
    )  # out [B, Hq, Sq, D] (stored as [B, Sq, Hq, D]), lse [B, Hq, Sq]
    return out.transpose(1, 2), lse.float()


def _cpu_flash_backward(dout, q, k, v, out, lse, causal, scale, segments):
    mask = (
        None
        if segments is None
        else _additive_mask(_dense_mask(q.size(1), k.size(1), causal, segments, q.device), q.dtype)
    )
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout.transpose(1, 2),
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        out.transpose(1, 2),
        lse.contiguous(),
        0.0,
        causal and segments is None,
        attn_mask=mask,
        scale=scale,
    )
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


# --- CUDA: torch SDPA aten ops -----------------------------------------------------------------------------


def _expand_kv(q, k, v):
    group = q.size(2) // k.size(2)
    if group == 1:
        return k, v
    return k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)


def _reduce_kv(dk, dv, hkv):
    b, s, h, d = dk.shape
    if h == hkv:
        return dk, dv
    return dk.view(b, s, hkv, h // hkv, d).sum(3), dv.view(b, s, hkv, h // hkv, d).sum(3)


def _bias(q, k, causal, segments):
    """Additive bias ``[B, Hq, Sq, Sk]`` (a broadcast view) with a 16-aligned row stride, for mem-efficient."""
    mask = _dense_mask(q.size(1), k.size(1), causal, segments, q.device)
    if mask is None:
        return None
    sq, sk = mask.shape
    padded = torch.zeros(sq, (sk + 15) // 16 * 16, dtype=q.dtype, device=q.device)[:, :sk]
    padded.masked_fill_(~mask, float("-inf"))
    return padded.expand(q.size(0), q.size(2), sq, sk)


def _sdpa_forward(kind, q, k, v, causal, scale, segments):
    ke, ve = _expand_kv(q, k, v)
    qt, kt, vt = q.transpose(1, 2), ke.transpose(1, 2), ve.transpose(1, 2)  # [B, H, S, D]
    if segments is not None or kind == "sdpa_efficient":
        bias = _bias(q, k, causal, segments)
        out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(
            qt, kt, vt, bias, True, 0.0, causal and bias is None, scale=scale
        )
        lse = lse[..., : q.size(1)]  # mem-efficient pads lse to a multiple of 32 rows
    elif kind == "sdpa_cudnn":
        out, lse, *_ = torch.ops.aten._scaled_dot_product_cudnn_attention(
            qt, kt, vt, None, True, 0.0, causal, False, scale=scale
        )
        lse = lse.reshape(q.size(0), q.size(2), q.size(1))
    else:
        out, lse, *_ = torch.ops.aten._scaled_dot_product_flash_attention(
            qt, kt, vt, 0.0, causal, False, scale=scale
        )
    return out.transpose(1, 2), lse.float()


def _sdpa_backward(kind, dout, q, k, v, out, lse, causal, scale, segments):
    ke, ve = _expand_kv(q, k, v)
    qt, kt, vt = q.transpose(1, 2), ke.transpose(1, 2), ve.transpose(1, 2)
    dot, ot = dout.transpose(1, 2), out.transpose(1, 2)
    sq, sk = q.size(1), k.size(1)
    seed = torch.zeros((), dtype=torch.int64, device=q.device)
    if segments is not None or kind == "sdpa_efficient":
        bias = _bias(q, k, causal, segments)
        pad = (sq + 31) // 32 * 32
        lse_p = torch.zeros((*lse.shape[:-1], pad), dtype=torch.float32, device=q.device)
        lse_p[..., :sq] = lse
        dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            dot,
            qt,
            kt,
            vt,
            bias,
            ot,
            lse_p,
            seed,
            seed,
            0.0,
            [True, True, True, False],
            causal and bias is None,
            scale=scale,
        )
    elif kind == "sdpa_cudnn":
        dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            dot,
            qt,
            kt,
            vt,
            ot,
            lse.unsqueeze(-1).contiguous(),
            seed,
            seed,
            None,
            None,
            None,
            sq,
            sk,
            0.0,
            causal,
            scale=scale,
        )
    else:
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dot, qt, kt, vt, ot, lse.contiguous(), None, None, sq, sk, 0.0, causal, seed, seed, scale=scale
        )
    dk, dv = _reduce_kv(dk.transpose(1, 2), dv.transpose(1, 2), k.size(2))
    return dq.transpose(1, 2), dk, dv


# --- CUDA: flash_attn (dense and varlen) -------------------------------------------------------------------


def _call_flexible(fn, **kwargs):
    """Call a flash_attn private function with the keyword names its installed version uses."""
    params = inspect.signature(fn).parameters
    return fn(**{name: value for name, value in kwargs.items() if name in params})


_FA_BWD_DEFAULTS = dict(
    dropout_p=0.0,
    window_size=(-1, -1),
    window_size_left=-1,
    window_size_right=-1,
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    rng_state=None,
)


def _flash_attn_forward(q, k, v, causal, scale, segments):
    import flash_attn

    if segments is None:
        out, lse, _ = flash_attn.flash_attn_func(q, k, v, 0.0, scale, causal, return_attn_probs=True)
        return out, lse.float()
    qi, ki, cu_q, cu_k, max_q, max_k = _varlen_pack(segments, q.size(1))
    assert q.size(0) == 1, "document segments need batch size 1"
    out_p, lse_p, _ = flash_attn.flash_attn_varlen_func(
        q[0, qi], k[0, ki], v[0, ki], cu_q, cu_k, max_q, max_k, 0.0, scale, causal, return_attn_probs=True
    )  # out_p [Nq, Hq, D], lse_p [Hq, Nq]
    out = q.new_zeros(q.shape)
    out[0, qi] = out_p
    lse = torch.full((1, q.size(2), q.size(1)), float("-inf"), dtype=torch.float32, device=q.device)
    lse[0, :, qi] = lse_p.float()
    return out, lse


def _flash_attn_backward(dout, q, k, v, out, lse, causal, scale, segments):
    from flash_attn import flash_attn_interface as fai

    if segments is None:
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        _call_flexible(
            fai._flash_attn_backward,
            dout=dout,
            q=q,
            k=k,
            v=v,
            out=out,
            softmax_lse=lse.contiguous(),
            dq=dq,
            dk=dk,
            dv=dv,
            softmax_scale=scale,
            causal=causal,
            **_FA_BWD_DEFAULTS,
        )
        return dq, dk, dv
    qi, ki, cu_q, cu_k, max_q, max_k = _varlen_pack(segments, q.size(1))
    qp, kp, vp = q[0, qi], k[0, ki], v[0, ki]
    dqp, dkp, dvp = torch.empty_like(qp), torch.empty_like(kp), torch.empty_like(vp)
    _call_flexible(
        fai._flash_attn_varlen_backward,
        dout=dout[0, qi],
        q=qp,
        k=kp,
        v=vp,
        out=out[0, qi],
        softmax_lse=lse[0][:, qi].contiguous(),
        dq=dqp,
        dk=dkp,
        dv=dvp,
        cu_seqlens_q=cu_q,
        cu_seqlens_k=cu_k,
        max_seqlen_q=max_q,
        max_seqlen_k=max_k,
        softmax_scale=scale,
        causal=causal,
        **_FA_BWD_DEFAULTS,
    )
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    dq[0, qi], dk[0, ki], dv[0, ki] = dqp, dkp, dvp
    return dq, dk, dv


def _varlen_pack(segments: torch.Tensor, sq: int):
    """Row indices of the packed q and k, their int32 cu_seqlens and max lengths (segments are sorted)."""
    q_len = segments[:, 1] - segments[:, 0]
    k_len = segments[:, 3] - segments[:, 2]
    qi = _ranges_to_index(segments[:, 0], q_len)
    ki = _ranges_to_index(segments[:, 2], k_len)
    zero = segments.new_zeros(1)
    cu_q = torch.cat([zero, q_len.cumsum(0)]).to(torch.int32)
    cu_k = torch.cat([zero, k_len.cumsum(0)]).to(torch.int32)
    return qi, ki, cu_q, cu_k, int(q_len.max()), int(k_len.max())


def _ranges_to_index(starts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    total = int(lengths.sum())
    offsets = torch.repeat_interleave(
        starts - torch.cat([starts.new_zeros(1), lengths.cumsum(0)[:-1]]), lengths
    )
    return torch.arange(total, device=starts.device) + offsets


# --- the interface -----------------------------------------------------------------------------------------


def attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    softmax_scale: float,
    backend: str,
    segments: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One attention block: ``(out [B, Sq, Hq, D] q.dtype, lse [B, Hq, Sq] fp32)``; see the module docstring.

    ``backend`` must already be resolved (:func:`resolve_backend`). Rows with no allowed key get ``out = 0``,
    ``lse = -inf`` whatever the kernel does with them.
    """
    if backend == "math":
        out, lse = _math_forward(q, k, v, causal, softmax_scale, segments)
    elif backend == "cpu_flash":
        out, lse = _cpu_flash_forward(q, k, v, causal, softmax_scale, segments)
    elif backend == "flash_attn":
        out, lse = _flash_attn_forward(q, k, v, causal, softmax_scale, segments)
    else:
        out, lse = _sdpa_forward(backend, q, k, v, causal, softmax_scale, segments)
    empty = _empty_rows(segments, q.size(1), causal)
    if empty is not None and bool(empty.any()):
        lse = lse.masked_fill(empty, float("-inf"))  # broadcast over [B, Hq, Sq]
        out = out.masked_fill(empty[None, :, None, None], 0.0)
    return out, lse


def attention_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    causal: bool,
    softmax_scale: float,
    backend: str,
    segments: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients ``(dq, dk, dv)`` of one block, shaped like ``q, k, v``.

    ``out`` and ``lse`` are the *merged* results over all blocks for these query rows (global softmax), and
    must be finite-or-``-inf``-free where a row attends to anything; with them the block's contribution is
    exact: ``P = exp(S - lse)``, ``dS = P * (dP - rowsum(dout * out))``.
    """
    if backend == "math":
        return _math_backward(dout, q, k, v, out, lse, causal, softmax_scale, segments)
    if backend == "cpu_flash":
        return _cpu_flash_backward(dout, q, k, v, out, lse, causal, softmax_scale, segments)
    if backend == "flash_attn":
        return _flash_attn_backward(dout, q, k, v, out, lse, causal, softmax_scale, segments)
    return _sdpa_backward(backend, dout, q, k, v, out, lse, causal, softmax_scale, segments)
