"""Ring attention over one ring group: local Q stays, K/V parts rotate, out/lse merged in fp32.

Shapes (per rank, after any Ulysses all-to-all): ``q [B, L, Hq, D]``, ``k, v [B, L, Hkv, D]`` (only the real
KV heads travel; GQA is expanded inside the local kernel), ``out`` like ``q``; ``L = S / R`` is this ring
rank's part in the ring layout (see :mod:`usp.attention.blocks`). Below, per token of the part: ``e`` bytes
per element of the inputs, ``a`` of the accumulators (4; 8 for fp64 inputs), ``hq = Hq / C`` and
``hkv = Hkv / C`` the heads of one head chunk (``C = 1`` without chunks).

**No ring** (ring degree 1, or documents that need only step 0): the kernel is called directly, once per
head chunk: forward keeps its ``(out, lse)`` and backward calls its backward once and returns its ``dq, dk,
dv``. No accumulator, no merge, no buffer. Bytes held besides the kernel's own: forward ``Hq * (D*e + a)``
(``out`` and ``lse``, kept for backward); backward ``Hq * D*e + 2 * Hkv * D*e`` (``dq, dk, dv``), plus
``Hq * D*e`` when the incoming gradient is not contiguous. With ``C > 1`` the full ``out``/``lse`` and ``dq, dk,
dv`` are allocated first and one chunk's kernel result (``hq * (D*e + a)`` forward, ``(hq + 2 hkv) * D*e``
backward) exists besides them while it is copied in; the chunks are strided views, never copies (cuDNN
copies its chunk inside its call: it needs dense strides).

**Ring**, forward, step ``t = 0 .. T-1``: post the send of the current K/V part to ring rank ``r + 1`` (and the
receive from ``r - 1``), compute this step's block (:func:`~usp.attention.blocks.plan_ring_blocks`) while it
travels, then wait. The first block computed initialises the accumulators (for fp32 inputs it *is* the
accumulator), the later ones merge into them in place (:func:`merge_block_`, in row slices of at most
:data:`MERGE_SLICE_ELEMENTS`, so no block-sized temporary). Held while it runs: the ``a``-byte output and lse
accumulators ``hq * (D + 1) * a``, K/V current and incoming ``2 * 2 hkv * D*e``, one block's kernel output,
and at the end the output in the inputs' dtype ``hq * D*e`` (the same tensor for fp32).

Backward runs the same ring: each rank computes its block's ``dq`` (kept) and ``dk, dv`` (added to an fp32
accumulator that travels *with* the K/V part, one hop behind it), using the merged ``out`` and ``lse`` saved by
the forward. After the last step each accumulator is sent straight home (one hop when the ring ran all ``R``
steps), so each rank holds the exact ``dk, dv`` of its own K/V. Held while it runs: the dq accumulator ``hq * D
* a``, dK/dV accumulators current and incoming ``2 * 2 hkv * D * a``, K/V current and incoming ``2 * 2 hkv *
D*e``, one block's kernel gradients, and at the end ``dq, dk, dv`` in the inputs' dtype.

A step may hold two blocks (a document block and its shared-prefix block, :func:`~usp.attention.blocks.
plan_prefix_blocks`): both are computed on the same K/V part and merged like blocks of different steps, and
their gradients are added the same way (with one step, locally).

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

from usp.attention.blocks import BlockSpec, StepBlocks, step_blocks
from usp.attention.comm import RingExchange, record_attention_work, recording
from usp.attention.kernels import (
    OWN_AUTOGRAD_BACKENDS,
    accumulation_dtype,
    attention_backward,
    attention_forward,
    attention_own_autograd,
)

_TAG_KV, _TAG_DKV, _TAG_DKV_HOME = 11, 12, 13

MERGE_SLICE_ELEMENTS = 1 << 22
"""Most elements of ``out`` one merge or gradient-accumulation step touches at once (16 MiB in fp32). A
mixed-dtype in-place op (a bf16 block into an fp32 accumulator) casts its input to a temporary of the
accumulator's dtype on the CPU; slicing the rows bounds that temporary to this many elements."""


def _row_slices(t: torch.Tensor, max_elements: int) -> list[slice]:
    """Slices of ``t``'s dim 1 (rows of ``[B, S, H, D]``) holding at most ``max_elements`` elements each."""
    rows = t.size(1)
    per_row = max(1, t.numel() // max(rows, 1))
    step = max(1, max_elements // per_row)
    return [slice(a, min(a + step, rows)) for a in range(0, rows, step)]


def merge_block_(
    out_acc: torch.Tensor,
    lse_acc: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    max_elements: int | None = None,
) -> None:
    """In place: ``(out_acc, lse_acc) <- softmax-merge of (out_acc, lse_acc) and (out, lse)``.

    ``out_acc [B, S, H, D]`` and ``lse_acc [B, H, S]`` are fp32 (fp64 for fp64 inputs); ``out`` may be in the
    compute dtype. ``-inf`` lse (rows that saw no key yet, or none in this block) merge without NaN: both
    weights are ``exp(lse_i - lse_new) <= 1``. Runs over slices of at most ``max_elements`` (default
    :data:`MERGE_SLICE_ELEMENTS`) elements of ``out``, so the temporaries are lse-sized per slice plus (a compute-dtype ``out`` cast on the CPU) one
    slice: no temporary of the block's size exists.
    """
    for rows in _row_slices(out_acc, max_elements or MERGE_SLICE_ELEMENTS):
        la, lb = lse_acc[:, :, rows], lse[:, :, rows]
        new = torch.logaddexp(la, lb)  # [B, H, rows]
        safe = torch.where(torch.isinf(new), 0.0, new)  # rows with no key anywhere so far: weights 0
        w_acc = torch.exp(la - safe).transpose(1, 2).unsqueeze(-1)  # [B, rows, H, 1]
        w_new = torch.exp(lb - safe).transpose(1, 2).unsqueeze(-1)
        out_acc[:, rows].mul_(w_acc).addcmul_(out[:, rows], w_new)
        la.copy_(new)


def _add_(acc: torch.Tensor, grad: torch.Tensor) -> None:
    """``acc += grad`` in row slices (``[B, S, H, D]``): a compute-dtype ``grad`` is cast a slice at a time."""
    for rows in _row_slices(acc, MERGE_SLICE_ELEMENTS):
        acc[:, rows] += grad[:, rows]


def _covers(sl: slice, n: int) -> bool:
    return sl.start == 0 and sl.stop == n


def _first_block(shape: torch.Size, rows: slice, block: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A ``shape`` tensor of ``dtype`` initialised from the first block computed into it (rows ``rows``; the
    other rows 0): the block itself when it covers every row in that dtype and layout, else one copy."""
    if _covers(rows, shape[1]) and block.dtype == dtype and block.is_contiguous():
        return block
    if _covers(rows, shape[1]):
        return block.to(dtype, memory_format=torch.contiguous_format)
    acc = torch.zeros(shape, dtype=dtype, device=block.device)
    acc[:, rows] = block
    return acc


def _first_lse(b: int, h: int, n: int, rows: slice, lse: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[b, h, n]`` lse initialised from the first block's (the block's own tensor when it covers every row;
    rows outside it ``-inf``)."""
    if _covers(rows, n):
        return lse.to(dtype)
    full = torch.full((b, h, n), float("-inf"), dtype=dtype, device=lse.device)
    full[:, :, rows] = lse
    return full


def _empty_forward(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An attention that computes nothing: ``out = 0`` (q's dtype), ``lse = -inf`` (``[B, h, L]``, fp32)."""
    b, n, hq, _ = q.shape
    return q.new_zeros(q.shape), torch.full(
        (b, hq, n), float("-inf"), dtype=accumulation_dtype(q.dtype), device=q.device
    )


def _block_forward(q, k, v, spec: BlockSpec, softmax_scale, backend):
    """The kernel on one block (``spec``'s query rows of ``q`` against its key rows of ``k, v``), its work
    recorded: ``(out, lse)`` of those rows."""
    qs, ks = spec.q_slice, spec.k_slice
    o, lse = attention_forward(
        q[:, qs],
        k[:, ks],
        v[:, ks],
        causal=spec.causal,
        softmax_scale=softmax_scale,
        backend=backend,
        segments=spec.segments,
        softcap=spec.softcap,
    )
    record_attention_work(spec.pairs() * q.size(0) * q.size(2), q.size(3), backward=False)
    return o, lse


def _block_backward(dout, q, k, v, out, lse, spec: BlockSpec, softmax_scale, backend):
    """The kernel's backward on one block (as :func:`_block_forward`), its work recorded: ``dq`` of the block's
    query rows, ``dk, dv`` of its key rows."""
    qs, ks = spec.q_slice, spec.k_slice
    grads = attention_backward(
        dout[:, qs],
        q[:, qs],
        k[:, ks],
        v[:, ks],
        out[:, qs],
        lse[:, :, qs],
        causal=spec.causal,
        softmax_scale=softmax_scale,
        backend=backend,
        segments=spec.segments,
        softcap=spec.softcap,
    )
    record_attention_work(spec.pairs() * q.size(0) * q.size(2), q.size(3), backward=True)
    return grads


def _local_forward(q, k, v, spec, softmax_scale, backend):
    """No ring (one step: ring degree 1, or documents that need no other part): the kernel's own ``(out,
    lse)``, no accumulator, no merge. Only when the block leaves rows out (never at ring degree 1) are they
    filled with ``out = 0``, ``lse = -inf`` around it."""
    if spec is None:
        return _empty_forward(q)
    b, n, hq, _ = q.shape
    qs = spec.q_slice
    o, lse = _block_forward(q, k, v, spec, softmax_scale, backend)
    if _covers(qs, n):
        return o, lse
    return _first_block(q.shape, qs, o, q.dtype), _first_lse(b, hq, n, qs, lse, accumulation_dtype(q.dtype))


def _local_backward(dout, q, k, v, out, lse, spec, softmax_scale, backend):
    """No ring: the kernel's backward once, its ``dq, dk, dv`` returned as they are."""
    if spec is None:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    n = q.size(1)
    qs, ks = spec.q_slice, spec.k_slice
    dq, dk, dv = _block_backward(dout, q, k, v, out, lse, spec, softmax_scale, backend)
    if not _covers(qs, n):
        dq = _first_block(q.shape, qs, dq, q.dtype)
    if not _covers(ks, k.size(1)):
        dk, dv = _first_block(k.shape, ks, dk, k.dtype), _first_block(v.shape, ks, dv, v.dtype)
    return dq, dk, dv


def _ring_forward(q, k, v, group, plans, softmax_scale, backend):
    """One ring pass over ``q [B, L, h, D]`` and its ``k, v``; returns ``(out [B, L, h, D] in q's dtype, lse
    [B, h, L] fp32)``. With one step of one block it is :func:`_local_forward`. Otherwise the first block
    computed initialises the fp32 output accumulator (its rows; the rest 0 / ``-inf``), later ones (later steps,
    or a step's shared-prefix block, :func:`~usp.attention.blocks.step_blocks`) merge into it in place
    (:func:`merge_block_`); it and the rotating K/V exist only while this runs."""
    ring = len(plans)
    if ring == 1 and not isinstance(plans[0], tuple):
        return _local_forward(q, k, v, plans[0], softmax_scale, backend)
    b, n, hq, _ = q.shape  # [B, L, h, D]
    acc = accumulation_dtype(q.dtype)
    out_acc = lse_acc = None
    exchange = RingExchange(group, "ring_kv", _TAG_KV) if ring > 1 else None
    kc, vc = k, v
    for step in range(ring):
        if step + 1 < ring:
            exchange.start([kc, vc])  # the next block travels while this one is computed
        entry: StepBlocks = plans[step]
        for spec in step_blocks(entry):
            qs = spec.q_slice
            o, lse = _block_forward(q, kc, vc, spec, softmax_scale, backend)
            if out_acc is None:
                out_acc, lse_acc = _first_block(q.shape, qs, o, acc), _first_lse(b, hq, n, qs, lse, acc)
            else:
                merge_block_(out_acc[:, qs], lse_acc[:, :, qs], o, lse)
            del o, lse
        if step + 1 < ring:
            kc, vc = exchange.wait()
    if out_acc is None:  # no rank computes anything (not produced by the planners): an empty attention
        return _empty_forward(q)
    return out_acc.to(q.dtype), lse_acc


def _accumulate(acc, shape, rows, grad, dtype):
    """``acc[:, rows] += grad``; the first gradient initialises the accumulator (:func:`_first_block`)."""
    if acc is None:
        return _first_block(shape, rows, grad, dtype)
    _add_(acc[:, rows], grad)
    return acc


def _ring_backward(dout, q, k, v, out, lse, group, plans, softmax_scale, backend):
    """The ring pass of the backward for one set of heads; returns ``dq, dk, dv`` in the inputs' dtypes. With
    one step it is :func:`_local_backward`. Otherwise the fp32 dq accumulator and the travelling fp32 dK/dV
    accumulators exist only while it runs, each initialised by the first block gradient added to it."""
    steps = len(plans)
    if steps == 1 and not isinstance(plans[0], tuple):
        return _local_backward(dout, q, k, v, out, lse, plans[0], softmax_scale, backend)
    acc = accumulation_dtype(q.dtype)
    if steps == 1:
        # one step of several blocks (a shared prefix): their gradients added here, nothing travels
        dq_acc = dk_acc = dv_acc = None
        for spec in step_blocks(plans[0]):
            qs, ks = spec.q_slice, spec.k_slice
            gq, gk, gv = _block_backward(dout, q, k, v, out, lse, spec, softmax_scale, backend)
            dq_acc = _accumulate(dq_acc, q.shape, qs, gq, acc)
            dk_acc = _accumulate(dk_acc, k.shape, ks, gk, acc)
            dv_acc = _accumulate(dv_acc, v.shape, ks, gv, acc)
            del gq, gk, gv
        return dq_acc.to(q.dtype), dk_acc.to(k.dtype), dv_acc.to(v.dtype)
    dq_acc = dk_acc = dv_acc = None
    kv_exchange = RingExchange(group, "ring_kv_bwd", _TAG_KV)
    dkv_exchange = RingExchange(group, "ring_dkv", _TAG_DKV)
    # after the last step the accumulator we hold belongs to ring rank r - (steps - 1): send it home
    home = RingExchange(group, "ring_dkv", _TAG_DKV_HOME, offset=-(steps - 1))
    kc, vc = k, v
    for step in range(steps):
        if step + 1 < steps:
            kv_exchange.start([kc, vc])
        kv_grads = []  # (key rows, dk, dv) of each block of the step, added once its accumulator is here
        for spec in step_blocks(plans[step]):
            grads = _block_backward(dout, q, kc, vc, out, lse, spec, softmax_scale, backend)
            dq_acc = _accumulate(dq_acc, q.shape, spec.q_slice, grads[0], acc)
            kv_grads.append((spec.k_slice, grads[1], grads[2]))
            del grads
        if step > 0:
            dk_acc, dv_acc = dkv_exchange.wait()  # the accumulator of the K/V part we hold now
        for ks, gk, gv in kv_grads:
            dk_acc = _accumulate(dk_acc, k.shape, ks, gk, acc)
            dv_acc = _accumulate(dv_acc, v.shape, ks, gv, acc)
        if dk_acc is None:  # step 0 computed nothing: start this part's accumulator at zero
            dk_acc = torch.zeros(k.shape, dtype=acc, device=k.device)
            dv_acc = torch.zeros(v.shape, dtype=acc, device=v.device)
        del kv_grads
        if step + 1 < steps:
            dkv_exchange.start([dk_acc, dv_acc])  # one hop behind its K/V
        else:
            home.start([dk_acc, dv_acc])
        if step + 1 < steps:
            kc, vc = kv_exchange.wait()
    dk_acc, dv_acc = home.wait()
    dq = torch.zeros_like(q) if dq_acc is None else dq_acc.to(q.dtype)
    return dq, dk_acc.to(k.dtype), dv_acc.to(v.dtype)


def _head_chunks(hq: int, hkv: int, chunks: int) -> list[tuple[slice, slice]]:
    """``(q heads, kv heads)`` of each chunk: ``chunks`` consecutive groups, each holding whole GQA groups."""
    cq, ckv = hq // chunks, hkv // chunks
    return [(slice(c * cq, (c + 1) * cq), slice(c * ckv, (c + 1) * ckv)) for c in range(chunks)]


def _part(x: torch.Tensor, heads: slice) -> torch.Tensor:
    """``x[:, :, heads]``: a strided view of one chunk of heads, no copy. Every kernel takes it as it takes
    the full tensor (``[B, S, H, D]`` memory read as ``[B, H, S, D]``, last dim contiguous); cuDNN alone needs
    dense strides and copies the chunk inside its call (``cuda_kernels._dense``), and the ring's send
    (:class:`~usp.attention.comm.RingExchange`) copies the K/V chunk it sends, as it would any K/V."""
    return x[:, :, heads]


def attention_heads_forward(q, k, v, group, plans, softmax_scale, backend, chunks):
    """``(out, lse)`` of the ring (or, with one step, the kernel) over every group of heads in ``chunks``
    (:func:`_head_chunks`) in turn. One group: the ring's own result. More: each group's result is written into
    one full ``out`` (q's dtype) and ``lse``; only one group's kernel output exists besides them."""
    if len(chunks) == 1:
        return _ring_forward(q, k, v, group, plans, softmax_scale, backend)
    b, n, hq, _ = q.shape
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((b, hq, n), dtype=accumulation_dtype(q.dtype), device=q.device)
    for hs, ks in chunks:  # the same order on every rank: the ring exchanges pair up
        o, l_ = _ring_forward(_part(q, hs), _part(k, ks), _part(v, ks), group, plans, softmax_scale, backend)
        out[:, :, hs] = o
        lse[:, hs] = l_
        del o, l_
    return out, lse


def attention_heads_backward(dout, q, k, v, out, lse, group, plans, softmax_scale, backend, chunks):
    """``(dq, dk, dv)`` for :func:`attention_heads_forward`, group by group in the same order, each group's
    gradients written into full ones (only one group's kernel gradients exist besides them)."""
    if len(chunks) == 1:
        return _ring_backward(dout, q, k, v, out, lse, group, plans, softmax_scale, backend)
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    for hs, ks in chunks:
        g = _ring_backward(
            _part(dout, hs),
            _part(q, hs),
            _part(k, ks),
            _part(v, ks),
            _part(out, hs),
            lse[:, hs],
            group,
            plans,
            softmax_scale,
            backend,
        )
        dq[:, :, hs], dk[:, :, ks], dv[:, :, ks] = g
        del g
    return dq, dk, dv


def add_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of attention whose softmax denominators also hold ``exp(sink_h)`` (gpt-oss sinks: a
    logit per head with a zero value): ``lse' = logaddexp(lse, sink)``, ``out' = out * exp(lse - lse')``.
    ``out [B, L, h, D]``, ``lse [B, h, L]``, ``sinks [h]``. The backward of every block is then the ordinary
    one with ``out'`` and ``lse'`` (``P = exp(S - lse')`` are the true probabilities; the sink's value is 0)."""
    sink = sinks.detach().to(lse.dtype)[None, :, None]  # [1, h, 1]
    lse_s = torch.logaddexp(lse, sink)
    keep = torch.exp(lse - lse_s).transpose(1, 2).unsqueeze(-1)  # [B, L, h, 1]
    return (out.to(lse.dtype) * keep).to(out.dtype), lse_s


def sinks_grad(dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """``d sink_h = -sum over rows of P_sink * rowsum(dout * out)``, ``P_sink = exp(sink - lse)``, from the
    sink-including ``out``/``lse`` of :func:`add_sinks`; ``[h]`` in the sinks' dtype."""
    acc = lse.dtype
    delta = (dout.to(acc) * out.to(acc)).sum(-1).transpose(1, 2)  # [B, h, L]
    p_sink = torch.exp(sinks.detach().to(acc)[None, :, None] - lse)
    return -(p_sink * delta).sum(dim=(0, 2)).to(sinks.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, group, plans, softmax_scale, backend, head_chunks):
        chunks = _head_chunks(q.size(2), k.size(2), head_chunks)
        out, lse = attention_heads_forward(q, k, v, group, plans, softmax_scale, backend, chunks)
        if sinks is not None:
            out, lse = add_sinks(out, lse, sinks)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.group, ctx.plans, ctx.softmax_scale, ctx.backend = group, plans, softmax_scale, backend
        ctx.chunks = chunks
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        dout = dout.contiguous()
        grads = attention_heads_backward(
            dout,
            q,
            k,
            v,
            out,
            lse,
            ctx.group,
            ctx.plans,
            ctx.softmax_scale,
            ctx.backend,
            ctx.chunks,
        )
        dsinks = None if sinks is None else sinks_grad(dout, out, lse, sinks)
        return *grads, dsinks, None, None, None, None, None


def head_chunk_options(q_heads: int, kv_heads: int) -> list[int]:
    """The head chunk counts that split a rank's ``q_heads`` and ``kv_heads`` into equal groups of whole GQA
    groups: the common divisors (``kv_heads`` divides ``q_heads``, so the divisors of ``kv_heads``)."""
    return [c for c in range(1, kv_heads + 1) if kv_heads % c == 0 and q_heads % c == 0]


def check_head_chunks(
    head_chunks: int, q_heads: int, kv_heads: int, *, setting: str = "parallel.attn_head_chunks"
) -> None:
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
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Exact attention of this rank's queries over the ring group's whole K/V (see the module docstring).

    ``plans[t]`` is the block computed at ring step ``t`` (from :func:`usp.attention.blocks.plan_ring_blocks`);
    the list may stop before ``R`` steps when no rank needs the later ones (every ring rank must pass the same
    length, see :func:`usp.attention.blocks.ring_steps_needed`). ``backend`` is a resolved kernel name.
    ``head_chunks`` (:func:`check_head_chunks`) runs the ring once per group of ``Hq / head_chunks`` query heads
    with their ``Hkv / head_chunks`` K/V heads, forward and backward, so the fp32 output/dq accumulators and the
    rotating K/V and fp32 dK/dV buffers exist for one group at a time (1/``head_chunks`` of their bytes); the
    math and the bytes sent are the same, in ``head_chunks`` times more, smaller messages.
    ``sinks`` (``[h]``, this rank's heads): per-head sink logits added to every row's softmax denominator once,
    after the merge (:func:`add_sinks`). Differentiable w.r.t. ``q, k, v`` (and ``sinks``).
    """
    check_head_chunks(head_chunks, q.size(2), k.size(2), setting="head_chunks")
    assert 1 <= len(plans) <= dist.get_world_size(group), "one block plan per ring step, at most R steps"
    assert sinks is None or sinks.shape == (q.size(2),), "one sink per local query head"
    return ring_attention_checked(
        q,
        k,
        v,
        group=group,
        plans=plans,
        softmax_scale=softmax_scale,
        backend=backend,
        head_chunks=head_chunks,
        sinks=sinks,
    )


def ring_attention_checked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group: dist.ProcessGroup,
    plans: list[BlockSpec | None],
    softmax_scale: float,
    backend: str,
    head_chunks: int = 1,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`ring_attention` once its arguments are known good (:func:`usp.attention.usp_attention` checks
    them once per kind of call): no check here. When the whole attention is one unmasked block over every
    query and key (one ring step: ring degree 1 with one document or none, no sinks, one head chunk) and the
    kernel has aten's own autograd formula, that formula runs it (:func:`attention_own_autograd`: the same
    kernels, the same numbers, no Python in the backward), except inside :func:`usp.attention.record_comm`,
    which counts the work of the ring's path."""
    if head_chunks == 1 and sinks is None and len(plans) == 1 and backend in OWN_AUTOGRAD_BACKENDS:
        spec = plans[0]
        if _whole_unmasked_block(spec, q.size(1), k.size(1)) and not recording():
            return attention_own_autograd(backend, q, k, v, causal=spec.causal, softmax_scale=softmax_scale)
    return _RingAttention.apply(q, k, v, sinks, group, plans, softmax_scale, backend, head_chunks)


def _whole_unmasked_block(spec: object, n_q: int, n_k: int) -> bool:
    """``spec`` is one block over all ``n_q`` query rows and ``n_k`` keys, with no mask but the causal one."""
    return (
        isinstance(spec, BlockSpec)
        and spec.segments is None
        and spec.softcap is None
        and _covers(spec.q_slice, n_q)
        and _covers(spec.k_slice, n_k)
    )
