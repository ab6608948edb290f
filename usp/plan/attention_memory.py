"""Device bytes of one decoder layer's attention backward on one rank, as the code allocates them.

Two parts, both per rank and in bytes:

- :func:`attention_phase_bytes_per_token`: what the layer holds while its attention backward runs, per local
  token (``s = S / (U R)``): the tensors the ring's autograd function saved (q, k, v after the all-to-all, its
  output and fp32 log-sum-exp), the gradient of its output (``dout``, after the all-to-all back), the residual
  stream's gradient, the layer input when something on the device keeps it (the checkpoint, or the tiled q/k/v
  projections of an uncheckpointed layer), and without tiles the input RMSNorm's saved tensors. By then the
  MLP, the post-attention norm and, under Ulysses, the o_proj input have been freed.
- :func:`attention_backward_bytes`: what the attention backward allocates on top, at its peak. With one ring
  rank the kernel is called once: its buffers (:func:`kernel_workspace_bytes`) and its ``dq, dk, dv``. With a
  ring, the larger of step 0 (the causal diagonal over the whole part, the next K/V block in flight) and a later
  step (the fp32 dq accumulator, the travelling fp32 dK/dV accumulators being sent and received, the K/V block
  received at the step before and, when another step follows, the next one; a zigzag step computes half the
  queries against all keys or all against half, a contiguous step all against all), each with its kernel
  call's buffers and block gradients. ``balanced`` is zigzag on a row of one document (what the fake-CUDA step
  checks) and is counted as zigzag; with several documents its calls are per-document rectangles
  (:mod:`usp.attention.blocks`) whose bytes this assumes within zigzag's, not traced yet. With
  ``attn_head_chunks = c > 1`` one group of heads runs at a time (everything above for ``1/c`` of the heads)
  and the full ``dq, dk, dv`` it writes into are held.

Checked against a whole training step on fake CUDA (:mod:`usp.bench.fake_memory`, ``tests/test_fake_memory.py``).
"""

from __future__ import annotations

from usp.plan.layout import Candidate, Workload
from usp.plan.lora import LoraPlan, adapted_linears, norm_bytes_per_token
from usp.plan.models import ModelSpec

KERNEL_ROWS, KERNEL_DIM = 128, 32  # flash-attn's seqlen_q rounding and head-dim rounding (head_size_rounded)
FLASH_FAMILY = ("flash_attn", "sdpa_flash")
EXPANDING_BACKENDS = ("sdpa_efficient", "sdpa_cudnn")
"""Backends for which usp expands GQA K/V to the query heads before the call (``usp.attention.cuda_kernels``)."""


def _round(x: float, m: int) -> float:
    return -(-x // m) * m


def kernel_workspace_bytes(
    backend: str, *, batch: int, sq: float, sk: float, hq: int, hkv: int, d: int, elem: int
) -> float:
    """Bytes a backend's backward allocates inside the kernel call, besides its ``dq, dk, dv``, for one call on
    ``q [batch, sq, hq, d]`` and ``k, v [batch, sk, hkv, d]`` of ``elem``-byte elements. Sources (each kernel's
    host code): flash-attn 2 ``mha_bwd`` and torch's vendored copy allocate ``softmax_d [B, Hq, Sq_r]`` fp32,
    ``dq_accum [B, Sq_r, Hq, D_r]`` fp32 (``Sq_r`` rounded up to 128 rows, ``D_r`` to 32) and, under GQA,
    ``dk_expanded, dv_expanded [B, Sk, Hq, D]``; torch's mem-efficient backward ``delta [B, Hq, Sq]`` fp32 and a
    ``B Sq Hq D`` fp32 ``grad_q`` accumulator; cuDNN's SDPA backward an fp32 ``dQ`` accumulator and the fp32
    softmax sums. CPU kernels: 0 (not a device budget)."""
    if backend in FLASH_FAMILY:
        out = batch * hq * _round(sq, KERNEL_ROWS) * 4  # softmax_d
        out += batch * _round(sq, KERNEL_ROWS) * hq * _round(d, KERNEL_DIM) * 4  # dq_accum
        if hkv < hq:
            out += 2 * batch * sk * hq * d * elem  # dk_expanded, dv_expanded
        return out
    if backend in EXPANDING_BACKENDS:
        return batch * hq * sq * 4 + batch * sq * hq * d * 4  # row sums + fp32 dQ accumulator
    return 0


def attention_phase_bytes_per_token(
    model: ModelSpec,
    ulysses_degree: int,
    compute_bytes: int,
    *,
    tiled: bool,
    keeps_input: bool,
    lora: LoraPlan | None = None,
) -> float:
    """What a layer holds during its attention backward, per local token (module docstring). ``keeps_input``:
    the layer input is on the device for this layer (its checkpoint's, unless offloaded; or, uncheckpointed
    under tiles, the q/k/v projections'). ``lora``: the input norm keeps what a frozen norm keeps, its output
    only when q, k or v is adapted, and each adapted q/k/v its ``r``-wide ``A`` output
    (:func:`usp.plan.lora.layer_lora_bytes`)."""
    U, B, h, d = ulysses_degree, compute_bytes, model.hidden_size, model.head_dim
    hq = model.q_heads_per_rank(U) * U  # per local token: the busiest rank's heads x U tokens per token
    kv = model.kv_heads_per_rank(U) * U
    saved = (hq + 2 * kv) * d * B + hq * d * B + 4 * hq  # q, k, v, out, fp32 lse
    grads = hq * d * B + h * B  # dout, the residual stream's gradient
    held = h * B if keeps_input else 0.0
    if (
        not tiled and lora is None
    ):  # the input norm: fp32 upcast, normalized input, rsqrt, its output (q/k/v's input)
        held += h * (4 + 2 * B) + 4
    elif not tiled:
        qkv = [n for n in adapted_linears(model, lora) if n in ("q_proj", "k_proj", "v_proj")]
        held += norm_bytes_per_token(model, lora, B, output_kept=bool(qkv)) + 4 + lora.rank * B * len(qkv)
    return saved + grads + held


def attention_backward_bytes(work: Workload, cand: Candidate) -> float:
    """Bytes the attention backward of one layer allocates at its peak, per rank (module docstring)."""
    model, B, mb = work.model, work.compute_bytes, work.micro_batch_size
    U, R, c = cand.ulysses_degree, cand.ring_degree, cand.attn_head_chunks
    d = model.head_dim
    sq = work.seq_len / R  # tokens of the rank's ring part after the all-to-all
    hq, hk = model.q_heads_per_rank(U) / c, model.kv_heads_per_rank(U) / c  # one group of heads
    # auto picks flash-attn or torch's flash kernel on CUDA (usp.attention.kernels.resolve_backend): the same buffers
    backend = work.attention_backend if work.attention_backend in EXPANDING_BACKENDS else "flash_attn"
    expands = backend in EXPANDING_BACKENDS and hk < hq

    def call(q_rows: float, k_rows: float) -> float:
        """One kernel call's buffers and its block gradients (and usp's expanded K/V copies with theirs)."""
        ws = kernel_workspace_bytes(
            backend,
            batch=mb,
            sq=q_rows,
            sk=k_rows,
            hq=hq,
            hkv=hq if expands else hk,
            d=d,
            elem=B,
        )
        if expands:
            ws += 4 * mb * k_rows * hq * d * B  # K/V copies at the query heads and their gradients
        return ws + mb * (q_rows * hq + 2 * k_rows * hk) * d * B

    if R == 1:
        peak = call(sq, sq)
    else:
        block = 2 * mb * sq * hk * d * B  # K and V of one ring part, the compute dtype
        block_fp32 = 2 * mb * sq * hk * d * 4  # their fp32 gradient accumulators
        first = block + call(sq, sq)  # the diagonal; the next K/V block arriving
        if work.ring_layout in ("zigzag", "balanced"):  # balanced: zigzag on a one-document row (module doc)
            later_call = max(call(sq, sq / 2), call(sq / 2, sq))
        else:
            later_call = call(sq, sq)
        received = block * (2 if R > 2 else 1)  # the K/V in use; the next one while a step follows
        later = mb * sq * hq * d * 4 + 2 * block_fp32 + received + later_call
        peak = max(first, later)
    if c > 1:
        peak += mb * sq * (model.q_heads_per_rank(U) + 2 * model.kv_heads_per_rank(U)) * d * B
    return peak
