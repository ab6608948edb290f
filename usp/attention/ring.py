"""Ring attention over one ring group: local Q stays, K/V parts rotate, out/lse merged in fp32.

Shapes (per rank, after any Ulysses all-to-all): ``q [B, L, Hq, D]``, ``k, v [B, L, Hkv, D]`` (only the real
KV heads travel; GQA is expanded inside the local kernel), ``out`` like ``q``; ``L = S / R`` is this ring
rank's part in the ring layout (see :mod:`usp.attention.blocks`).

Forward, step ``t = 0 .. R-1``: post the send of the current K/V part to ring rank ``r + 1`` (and the receive
from ``r - 1``), compute this step's block (:func:`~usp.attention.blocks.plan_ring_blocks`) while it travels,
merge its ``(out, lse)`` into the running fp32 result, then wait. ``R - 1`` transfers of ``k`` and ``v``.

Backward runs the same ring: each rank computes its block's ``dq`` (kept) and ``dk, dv`` (added to an fp32
accumulator that travels *with* the K/V part, one hop behind it), using the merged ``out`` and ``lse`` saved by
the forward. After the last step each accumulator is sent straight home (one hop when the ring ran all ``R``
steps), so each rank holds the exact ``dk, dv`` of its own K/V.

With document masking the ring may stop after ``T < R`` steps when no rank needs a later block (every rank
computes the same ``T`` from the global ``cu_seqlens``). Bytes sent per rank: forward ``(T-1) * 2 * |kv|``;
backward ``(T-1) * 2 * |kv| + T * 2 * |kv|_fp32`` (``T = R`` without documents; nothing when ``T = 1``).

Head chunks (``head_chunks = C > 1``): the whole ring, forward and backward, runs ``C`` times, each over ``Hq/C``
query heads and the ``Hkv/C`` K/V heads of their GQA groups, so its fp32 accumulators and rotating buffers
exist for one group at a time; the same bytes move in ``C`` times more, smaller messages.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from usp.attention.blocks import BlockSpec
from usp.attention.comm import RingExchange, record_attention_work
from usp.attention.kernels import accumulation_dtype, attention_backward, attention_forward

_TAG_KV, _TAG_DKV, _TAG_DKV_HOME = 11, 12, 13


def merge_block_(out_acc: torch.Tensor, lse_acc: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
    """In place: ``(out_acc, lse_acc) <- softmax-merge of (out_acc, lse_acc) and (out, lse)``.

    ``out_acc [B, S, H, D]`` and ``lse_acc [B, H, S]`` are fp32 (fp64 for fp64 inputs); ``-inf`` lse (rows that saw no key yet, or
    none in this block) merge without NaN: both weights are ``exp(lse_i - lse_new) <= 1``.
    """
    new = torch.logaddexp(lse_acc, lse)
    safe = torch.where(torch.isinf(new), 0.0, new)  # rows with no key anywhere so far: weights 0, out stays 0
    w_acc = torch.exp(lse_acc - safe).transpose(1, 2).unsqueeze(-1)  # [B, S, H, 1]
    w_new = torch.exp(lse - safe).transpose(1, 2).unsqueeze(-1)
    out_acc.mul_(w_acc).add_(out.to(out_acc.dtype) * w_new)
    lse_acc.copy_(new)


def _ring_forward(q, k, v, group, plans, softmax_scale, backend):
    """One ring pass over ``q [B, L, h, D]`` and its ``k, v``; returns ``(out [B, L, h, D] in q's dtype, lse fp32
    [B, h, L])``. The fp32 output accumulator and the rotating K/V exist only while it runs."""
    ring = len(plans)
    b, _, hq, d = q.shape
    acc = accumulation_dtype(q.dtype)  # fp32, fp64 for fp64 inputs
    out_acc = torch.zeros(q.shape, dtype=acc, device=q.device)
    lse_acc = torch.full((b, hq, q.size(1)), float("-inf"), dtype=acc, device=q.device)
    exchange = RingExchange(group, "ring_kv", _TAG_KV) if ring > 1 else None
    kc, vc = k, v
    for step in range(ring):
        if step + 1 < ring:
            exchange.start([kc, vc])  # the next block travels while this one is computed
        spec: BlockSpec | None = plans[step]
        if spec is not None:
            qs, ks = spec.q_slice, spec.k_slice
            o, lse = attention_forward(
                q[:, qs],
                kc[:, ks],
                vc[:, ks],
                causal=spec.causal,
                softmax_scale=softmax_scale,
                backend=backend,
                segments=spec.segments,
            )
            merge_block_(out_acc[:, qs], lse_acc[:, :, qs], o, lse)
            record_attention_work(spec.pairs() * b * hq, d, backward=False)
        if step + 1 < ring:
            kc, vc = exchange.wait()
    return out_acc.to(q.dtype), lse_acc


def _ring_backward(dout, q, k, v, out, lse, group, plans, softmax_scale, backend):
    """The ring pass of the backward for one set of heads; returns ``dq, dk, dv`` in the inputs' dtypes. The fp32
    dq accumulator and the travelling fp32 dK/dV accumulators exist only while it runs."""
    b, _, hq, d = q.shape
    acc = accumulation_dtype(q.dtype)  # fp32, fp64 for fp64 inputs
    dq_acc = torch.zeros(q.shape, dtype=acc, device=q.device)
    dk_acc = torch.zeros(k.shape, dtype=acc, device=k.device)
    dv_acc = torch.zeros(v.shape, dtype=acc, device=v.device)
    steps = len(plans)
    kv_exchange = dkv_exchange = home = None
    if steps > 1:
        kv_exchange = RingExchange(group, "ring_kv_bwd", _TAG_KV)
        dkv_exchange = RingExchange(group, "ring_dkv", _TAG_DKV)
        # after the last step the accumulator we hold belongs to ring rank r - (steps - 1): send it home
        home = RingExchange(group, "ring_dkv", _TAG_DKV_HOME, offset=-(steps - 1))
    kc, vc = k, v
    for step in range(steps):
        if step + 1 < steps:
            kv_exchange.start([kc, vc])
        spec: BlockSpec | None = plans[step]
        grads = None
        if spec is not None:
            qs, ks = spec.q_slice, spec.k_slice
            grads = attention_backward(
                dout[:, qs],
                q[:, qs],
                kc[:, ks],
                vc[:, ks],
                out[:, qs],
                lse[:, :, qs],
                causal=spec.causal,
                softmax_scale=softmax_scale,
                backend=backend,
                segments=spec.segments,
            )
            dq_acc[:, qs] += grads[0]
            record_attention_work(spec.pairs() * b * hq, d, backward=True)
        if step > 0:
            dk_acc, dv_acc = dkv_exchange.wait()  # the accumulator of the K/V part we hold now
        if grads is not None:
            dk_acc[:, ks] += grads[1]
            dv_acc[:, ks] += grads[2]
        if step + 1 < steps:
            dkv_exchange.start([dk_acc, dv_acc])  # one hop behind its K/V
        elif home is not None:
            home.start([dk_acc, dv_acc])
        if step + 1 < steps:
            kc, vc = kv_exchange.wait()
    if home is not None:
        dk_acc, dv_acc = home.wait()
    return dq_acc.to(q.dtype), dk_acc.to(k.dtype), dv_acc.to(v.dtype)


def _head_chunks(hq: int, hkv: int, chunks: int) -> list[tuple[slice, slice]]:
    """``(q heads, kv heads)`` of each chunk: ``chunks`` consecutive groups, each holding whole GQA groups."""
    cq, ckv = hq // chunks, hkv // chunks
    return [(slice(c * cq, (c + 1) * cq), slice(c * ckv, (c + 1) * ckv)) for c in range(chunks)]


def _part(x: torch.Tensor, heads: slice) -> torch.Tensor:
    """``x[:, :, heads]`` as a contiguous tensor (a copy of one chunk; the whole tensor when one chunk)."""
    return x if heads.start == 0 and heads.stop == x.size(2) else x[:, :, heads].contiguous()


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, plans, softmax_scale, backend, head_chunks):
        chunks = _head_chunks(q.size(2), k.size(2), head_chunks)
        if head_chunks == 1:
            out, lse = _ring_forward(q, k, v, group, plans, softmax_scale, backend)
        else:
            # one chunk of heads at a time, written into the full output: no full-size fp32 tensor is ever held
            out = torch.empty_like(q)
            lse = torch.empty((q.size(0), q.size(2), q.size(1)), dtype=accumulation_dtype(q.dtype), device=q.device)
            for hs, ks in chunks:
                o, l_ = _ring_forward(_part(q, hs), _part(k, ks), _part(v, ks), group, plans, softmax_scale, backend)
                out[:, :, hs] = o
                lse[:, hs] = l_
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.plans, ctx.softmax_scale, ctx.backend = group, plans, softmax_scale, backend
        ctx.chunks = chunks
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dout = dout.contiguous()
        args = (ctx.group, ctx.plans, ctx.softmax_scale, ctx.backend)
        if len(ctx.chunks) == 1:
            dq, dk, dv = _ring_backward(dout, q, k, v, out, lse, *args)
        else:
            dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
            for hs, ks in ctx.chunks:  # the same order on every rank: the ring exchanges pair up
                g = _ring_backward(
                    _part(dout, hs), _part(q, hs), _part(k, ks), _part(v, ks), _part(out, hs),
                    lse[:, hs].contiguous(), *args,
                )  # fmt: skip
                dq[:, :, hs], dk[:, :, ks], dv[:, :, ks] = g
        return dq, dk, dv, None, None, None, None, None


def head_chunk_options(q_heads: int, kv_heads: int) -> list[int]:
    """The head chunk counts that split a rank's ``q_heads`` and ``kv_heads`` into equal groups of whole GQA
    groups: the common divisors (``kv_heads`` divides ``q_heads``, so the divisors of ``kv_heads``)."""
    return [c for c in range(1, kv_heads + 1) if kv_heads % c == 0 and q_heads % c == 0]


def check_head_chunks(head_chunks: int, q_heads: int, kv_heads: int, *, setting: str = "parallel.attn_head_chunks") -> None:
    """``ValueError`` unless ``head_chunks`` (an int >= 1) splits this rank's ``q_heads`` and ``kv_heads`` (after
    the Ulysses all-to-all: ``Hq / U`` and ``max(Hkv, U) / U``) evenly, so every chunk holds whole GQA groups."""
    fits = head_chunk_options(q_heads, kv_heads)
    if isinstance(head_chunks, bool) or not isinstance(head_chunks, int) or head_chunks not in fits:
        raise ValueError(
            f"{setting}={head_chunks!r} does not split the {q_heads} query and {kv_heads} key/value heads each "
            f"rank holds after the Ulysses all-to-all into equal groups of whole GQA groups; use one of {fits} "
            f"(1 = off)."
        )


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group: dist.ProcessGroup,
    plans: list[BlockSpec | None],
    softmax_scale: float,
    backend: str,
    head_chunks: int = 1,
) -> torch.Tensor:
    """Exact attention of this rank's queries over the ring group's whole K/V (see the module docstring).

    ``plans[t]`` is the block computed at ring step ``t`` (from :func:`usp.attention.blocks.plan_ring_blocks`);
    the list may stop before ``R`` steps when no rank needs the later ones (every ring rank must pass the same
    length, see :func:`usp.attention.blocks.ring_steps_needed`). ``backend`` is a resolved kernel name.
    ``head_chunks`` (:func:`check_head_chunks`) runs the ring once per group of ``Hq / head_chunks`` query heads
    with their ``Hkv / head_chunks`` K/V heads, forward and backward, so the fp32 output/dq accumulators and the
    rotating K/V and fp32 dK/dV buffers exist for one group at a time (1/``head_chunks`` of their bytes); the
    math and the bytes sent are the same, in ``head_chunks`` times more, smaller messages.
    Differentiable w.r.t. ``q, k, v``.
    """
    check_head_chunks(head_chunks, q.size(2), k.size(2), setting="head_chunks")
    assert 1 <= len(plans) <= dist.get_world_size(group), "one block plan per ring step, at most R steps"
    return _RingAttention.apply(q, k, v, group, plans, softmax_scale, backend, head_chunks)
