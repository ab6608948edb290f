"""CUDA kernels behind the :mod:`usp.attention.kernels` interface: torch SDPA aten ops and flash_attn.

Same contract as there: ``q [B, Sq, Hq, D]``, ``k, v [B, Sk, Hkv, D]`` -> ``out [B, Sq, Hq, D]``,
``lse [B, Hq, Sq]`` fp32; backward from the merged ``out``/``lse``. GQA: flash_attn and torch's flash kernel
take ``Hq % Hkv == 0`` natively; mem-efficient and cuDNN get K/V expanded to the query heads locally (inside
the kernel call, never before communication) and the gradients summed back. Document segments go to
flash_attn's varlen kernels (packed, no mask) or, for SDPA, to the mem-efficient kernel as an additive bias
when the block is small; larger segmented blocks never reach these functions with segments
(:mod:`usp.attention.segmented` calls them once per segment, unmasked).

Kernel rules the wrappers keep (checked on fake CUDA tensors by ``tests/test_cuda_fake.py``):

- causal blocks are square (``Sq == Sk``, per segment with documents): flash aligns a causal mask
  bottom-right, mem-efficient and cuDNN top-left, and only square blocks mean the same thing in both;
- head dims are multiples of 8 for flash and cuDNN (:func:`usp.attention.kernels.resolve_backend` refuses
  the rest up front);
- the cuDNN backward gets the lse with the rank its forward returns (``[B, H, S, 1]`` on recent torch,
  ``[B, H, S]`` on older ones) and dense q, k, v, out, dout with identical layouts (its graph derives the
  O/dO strides from q and checks them exactly);
- the mem-efficient backward gets the lse padded to a multiple of 32 rows, as its forward returns it;
- cuDNN never gets a key/value length of 1 (unsupported): those calls go to mem-efficient.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import re

import torch

from usp.attention.masks import dense_mask
from usp.attention.segmented import host_segments, to_device

# --- CUDA: torch SDPA aten ops -----------------------------------------------------------------------------

_EXPANDS_KV = ("sdpa_efficient", "sdpa_cudnn")  # kernels without grouped heads; torch's flash has them


def check_square_causal(q: torch.Tensor, k: torch.Tensor, causal: bool, segments) -> None:
    """Assert that a causal block (or each causal segment) is square: every kernel then means the same mask."""
    if not causal:
        return
    if segments is None:
        assert q.size(1) == k.size(1), f"causal blocks must be square, got Sq={q.size(1)}, Sk={k.size(1)}"
        return
    for q0, q1, k0, k1 in host_segments(segments):
        assert q1 - q0 == k1 - k0, f"causal segments must be square, got {(q0, q1, k0, k1)}"


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


def _dense(t: torch.Tensor) -> torch.Tensor:
    """``t`` ([B, S, H, D]) with exactly the strides of a contiguous tensor: a view when only size-1 dims
    differ (a B = 1 slice), else a copy. cuDNN compares strides literally, size-1 dims included."""
    want = torch.empty(t.shape, device="meta").stride()
    if t.stride() == want:
        return t
    if all(n == 1 or a == b for n, a, b in zip(t.shape, t.stride(), want)):
        return t.as_strided(t.shape, want)
    return t.contiguous().as_strided(t.shape, want)


@functools.lru_cache(maxsize=1)
def cudnn_lse_rank() -> int:
    """Rank of the lse this torch's cuDNN SDPA forward returns (4: ``[B, H, S, 1]``; older releases: 3).

    Read from the op's meta kernel once: the backward must be fed the rank the forward produced.
    """
    x = torch.empty(1, 1, 8, 8, device="meta", dtype=torch.bfloat16)
    _, lse, *_ = torch.ops.aten._scaled_dot_product_cudnn_attention(x, x, x, None, True, 0.0, False, False)
    return lse.dim()


def _bias(q, k, causal, segments):
    """Additive bias ``[B, Hq, Sq, Sk]`` (a broadcast view) with a 16-aligned row stride, for mem-efficient.

    None without segments: plain causal attention uses the kernel's own causal flag, never a dense bias.
    """
    if segments is None:
        return None
    mask = dense_mask(q.size(1), k.size(1), causal, segments, q.device)
    sq, sk = mask.shape
    padded = torch.zeros(sq, (sk + 15) // 16 * 16, dtype=q.dtype, device=q.device)[:, :sk]
    padded.masked_fill_(~mask, float("-inf"))
    return padded.expand(q.size(0), q.size(2), sq, sk)


def _use_efficient(kind: str, k: torch.Tensor, segments) -> bool:
    """Mem-efficient runs segmented blocks (bias), its own backend, and the calls cuDNN cannot take: cuDNN SDPA
    does not support a key/value length of 1 (a 1-token document run per segment)."""
    return segments is not None or kind == "sdpa_efficient" or (kind == "sdpa_cudnn" and k.size(1) == 1)


def sdpa_forward(kind, q, k, v, causal, scale, segments):
    check_square_causal(q, k, causal, segments)
    efficient = _use_efficient(kind, k, segments)
    ke, ve = _expand_kv(q, k, v) if efficient or kind in _EXPANDS_KV else (k, v)
    if kind == "sdpa_cudnn" and not efficient:
        q, ke, ve = _dense(q), _dense(ke), _dense(ve)
    qt, kt, vt = q.transpose(1, 2), ke.transpose(1, 2), ve.transpose(1, 2)  # [B, H, S, D]
    if efficient:
        bias = _bias(q, k, causal, segments)
        out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(
            qt, kt, vt, bias, True, 0.0, causal and bias is None, scale=scale
        )
        lse = lse[..., : q.size(1)]  # mem-efficient pads lse to a multiple of 32 rows
    elif kind == "sdpa_cudnn":
        out, lse, *_ = torch.ops.aten._scaled_dot_product_cudnn_attention(
            qt, kt, vt, None, True, 0.0, causal, False, scale=scale
        )
        lse = lse.reshape(q.size(0), q.size(2), q.size(1))  # [B, H, S, 1] or [B, H, S] -> [B, H, S]
    else:
        out, lse, *_ = torch.ops.aten._scaled_dot_product_flash_attention(
            qt, kt, vt, 0.0, causal, False, scale=scale
        )
    return out.transpose(1, 2), lse.float()


def sdpa_backward(kind, dout, q, k, v, out, lse, causal, scale, segments):
    check_square_causal(q, k, causal, segments)
    efficient = _use_efficient(kind, k, segments)
    ke, ve = _expand_kv(q, k, v) if efficient or kind in _EXPANDS_KV else (k, v)
    if kind == "sdpa_cudnn" and not efficient:
        q, ke, ve, out, dout = (_dense(t) for t in (q, ke, ve, out, dout))
    qt, kt, vt = q.transpose(1, 2), ke.transpose(1, 2), ve.transpose(1, 2)
    dot, ot = dout.transpose(1, 2), out.transpose(1, 2)
    sq, sk = q.size(1), k.size(1)
    seed = torch.zeros((), dtype=torch.int64, device=q.device)
    if efficient:
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
        lse_c = lse.contiguous() if cudnn_lse_rank() == 3 else lse.unsqueeze(-1).contiguous()
        dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            dot,
            qt,
            kt,
            vt,
            ot,
            lse_c,
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


def parameter_names(fn) -> frozenset[str]:
    """The named parameters of ``fn``, seen through a ``torch.library.custom_op`` wrapper.

    flash-attn >= 2.6 wraps ``_flash_attn_backward`` / ``_flash_attn_varlen_backward`` in
    ``torch.library.custom_op`` (on torch >= 2.4), whose ``__call__`` signature is ``(*args, **kwargs)``: the
    real names come from the wrapped function (``_init_fn``) or, failing that, from the op schema.
    """
    params = inspect.signature(getattr(fn, "_init_fn", fn)).parameters.values()
    named = frozenset(p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD))
    if named:
        return named
    op = getattr(fn, "_opoverload", None)
    schema = getattr(op, "_schema", None)
    if schema is not None:
        return frozenset(arg.name for arg in schema.arguments)
    raise TypeError(f"cannot read the parameter names of {fn!r} (an unsupported flash_attn version?)")


def _call_flexible(fn, **kwargs):
    """Call a flash_attn private function with the keyword names its installed version uses."""
    params = parameter_names(fn)
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


FLASH_ATTN_MIN = (2, 5, 9)
"""Oldest flash-attn release checked (its Python interface against a stub of its extension, tests)."""


def flash_attn_version(module) -> tuple[int, int, int]:
    """``(major, minor, patch)`` of an imported ``flash_attn`` module (``"2.5.9.post1"`` -> ``(2, 5, 9)``)."""
    m = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", getattr(module, "__version__", ""))
    if m is None:
        raise ValueError(f"cannot read flash_attn.__version__={getattr(module, '__version__', None)!r}")
    return int(m[1]), int(m[2]), int(m[3] or 0)


def _varlen_lse_packed() -> bool:
    """Whether the varlen kernels use the packed lse ``[H, total_q]`` (flash-attn >= 2.6) rather than the
    padded ``[num_seqs, H, max_seqlen_q]`` of 2.5.x (``mha_varlen_fwd`` in each release's flash_api.cpp)."""
    import flash_attn

    return flash_attn_version(flash_attn) >= (2, 6, 0)


def _padded_rows(segments, device):
    """Per packed query row, its sequence and its offset in it: indices into the 2.5.x padded lse."""
    segs = host_segments(segments)
    seq = torch.cat([torch.full((q1 - q0,), i, dtype=torch.int64) for i, (q0, q1, _, _) in enumerate(segs)])
    pos = torch.cat([torch.arange(q1 - q0) for q0, q1, _, _ in segs])
    return to_device(seq, device), to_device(pos, device)


def flash_attn_forward(q, k, v, causal, scale, segments):
    import flash_attn

    check_square_causal(q, k, causal, segments)
    if segments is None:
        out, lse, _ = flash_attn.flash_attn_func(q, k, v, 0.0, scale, causal, return_attn_probs=True)
        return out, lse.float()
    qi, ki, cu_q, cu_k, max_q, max_k = _varlen_pack(segments, q.device)
    assert q.size(0) == 1, "document segments need batch size 1"
    out_p, lse_p, _ = flash_attn.flash_attn_varlen_func(
        q[0, qi], k[0, ki], v[0, ki], cu_q, cu_k, max_q, max_k, 0.0, scale, causal, return_attn_probs=True
    )  # out_p [Nq, Hq, D]; lse_p [Hq, Nq] (>= 2.6) or [n, Hq, max_q] (2.5.x)
    if lse_p.dim() == 3:
        seq, pos = _padded_rows(segments, q.device)
        lse_p = lse_p.permute(0, 2, 1)[seq, pos].t()  # [n, max_q, Hq] -> [Nq, Hq] -> [Hq, Nq]
    if _every_row(qi, q.size(1)):  # the pack is q itself (back-to-back documents): the kernel's own result
        return out_p.unsqueeze(0), lse_p.float().unsqueeze(0)
    out = q.new_zeros(q.shape)
    out[0, qi] = out_p
    lse = torch.full((1, q.size(2), q.size(1)), float("-inf"), dtype=torch.float32, device=q.device)
    lse[0, :, qi] = lse_p.float()
    return out, lse


def flash_attn_backward(dout, q, k, v, out, lse, causal, scale, segments):
    from flash_attn import flash_attn_interface as fai

    check_square_causal(q, k, causal, segments)
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
    qi, ki, cu_q, cu_k, max_q, max_k = _varlen_pack(segments, q.device)
    qp, kp, vp = q[0, qi], k[0, ki], v[0, ki]
    dqp, dkp, dvp = torch.empty_like(qp), torch.empty_like(kp), torch.empty_like(vp)
    lse_p = lse[0][:, qi]  # [Hq, Nq]
    if not _varlen_lse_packed():  # 2.5.x reads [n, Hq, max_q]; padding rows are never read
        seq, pos = _padded_rows(segments, q.device)
        padded = torch.zeros(cu_q.numel() - 1, max_q, q.size(2), dtype=torch.float32, device=q.device)
        padded[seq, pos] = lse_p.t()
        lse_p = padded.permute(0, 2, 1)  # [n, Hq, max_q]
    _call_flexible(
        fai._flash_attn_varlen_backward,
        dout=dout[0, qi],
        q=qp,
        k=kp,
        v=vp,
        out=out[0, qi],
        softmax_lse=lse_p.contiguous(),
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
    if _every_row(qi, q.size(1)):
        dq = dqp.unsqueeze(0)
    else:
        dq = torch.zeros_like(q)
        dq[0, qi] = dqp
    if _every_row(ki, k.size(1)):
        return dq, dkp.unsqueeze(0), dvp.unsqueeze(0)
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    dk[0, ki], dv[0, ki] = dkp, dvp
    return dq, dk, dv


def _packed_rows(spans: list[tuple[int, int]], device: torch.device) -> slice | torch.Tensor:
    """The rows of ``spans`` (sorted ``[a, b)`` ranges) packed in order: a slice when they are back to back
    (indexing with it is a view, no copy), else an index tensor on ``device`` (a gather)."""
    if all(prev[1] == nxt[0] for prev, nxt in zip(spans, spans[1:])):
        return slice(spans[0][0], spans[-1][1])
    return to_device(torch.cat([torch.arange(a, b) for a, b in spans]), device)


def _every_row(rows: slice | torch.Tensor, n: int) -> bool:
    return isinstance(rows, slice) and rows.start == 0 and rows.stop == n


def _varlen_pack(segments: torch.Tensor, device: torch.device):
    """Rows of the packed q and k (:func:`_packed_rows`: a slice, i.e. no copy, when the documents are back to
    back, as on a causal diagonal block), their int32 cu_seqlens and max lengths, built on the host.

    Segments are read as Python ints (free when on the CPU, as ring plans keep them) and the index tensors
    copied to ``device`` without blocking: no device sync per block.
    """
    segs = host_segments(segments)
    q_len = [q1 - q0 for q0, q1, _, _ in segs]
    k_len = [k1 - k0 for _, _, k0, k1 in segs]
    qi = _packed_rows([(q0, q1) for q0, q1, _, _ in segs], device)
    ki = _packed_rows([(k0, k1) for _, _, k0, k1 in segs], device)
    cu_q = torch.tensor([0, *itertools.accumulate(q_len)], dtype=torch.int32)
    cu_k = torch.tensor([0, *itertools.accumulate(k_len)], dtype=torch.int32)
    cu_q, cu_k = (to_device(t, device) for t in (cu_q, cu_k))
    return qi, ki, cu_q, cu_k, max(q_len), max(k_len)
