"""Hybrid USP attention: Ulysses all-to-all inside the node, ring across nodes, all-to-all back.

Per rank, for ``U = ulysses_degree``, ``R = ring_degree``, ``S`` global tokens, ``L = S / (R U)`` local:

1. ``q [B, L, Hq, D]`` -> ``[B, S/R, Hq_u, D]`` by the Ulysses all-to-all (K/V likewise, with the KV heads
   those query heads read); the rank now holds its ring rank's whole part. ``Hq_u = Hq / U`` when ``U``
   divides the heads, else ``Hq // U`` or one more (uneven heads, :mod:`usp.attention.heads`).
2. Ring attention over the ring group on that part (zigzag, contiguous or balanced, as ``mesh.ring_layout``;
   ``balanced`` is placed from ``cu_seqlens``, see :mod:`usp.parallel.balance`).
3. ``out [B, S/R, Hq/U, D]`` -> ``[B, L, Hq, D]`` by the inverse all-to-all.

Bytes sent per rank per call (element size ``e``, ``Hk' = max(Hkv, U)``, even heads; uneven ones in
:func:`usp.attention.cost.analytic_bytes_sent`): forward ``(U-1)/U * B*L*D*e * (2*Hq + 2*Hk')`` +
``(R-1) * 2 * B*(S/R)*(Hk'/U)*D*e``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import weakref
from functools import lru_cache

import torch
import torch.distributed as dist

from usp.attention.blocks import (
    join_steps,
    plan_banded_blocks,
    plan_prefix_blocks,
    plan_ring_blocks,
    ring_steps_needed,
)
from usp.attention.heads import UlyssesHeads, ulysses_heads
from usp.attention.kernels import default_scale, resolve_backend
from usp.attention.masks import RowRanges
from usp.attention.ring import check_head_chunks, ring_attention_checked
from usp.attention.ulysses import head_to_seq, kv_seq_to_head, seq_to_head
from usp.parallel import SPMesh, check_sequence_length


def _check_inputs(
    q: torch.Size,
    k: torch.Size,
    v: torch.Size,
    dtypes: tuple[torch.dtype, ...],
    devices: tuple[torch.device, ...],
) -> None:
    """``q``, ``k``, ``v``: the shapes."""
    if len(q) != 4 or len(k) != 4 or len(v) != 4:
        raise ValueError(
            f"usp_attention expects q [B, S_local, Hq, D] and k, v [B, S_local, Hkv, D]; got q {tuple(q)}, "
            f"k {tuple(k)}, v {tuple(v)}. Transpose [B, H, S, D] inputs with .transpose(1, 2)."
        )
    if k != v or q[0] != k[0] or q[1] != k[1] or q[3] != k[3]:
        raise ValueError(
            f"q {tuple(q)} and k {tuple(k)}, v {tuple(v)} disagree: batch, local sequence and "
            f"head dim must match, and k and v must have the same shape."
        )
    if len(set(dtypes)) != 1 or not dtypes[0].is_floating_point:
        raise ValueError(f"q, k, v must share one floating dtype, got {dtypes[0]}, {dtypes[1]}, {dtypes[2]}.")
    if len(set(devices)) != 1:
        raise ValueError(f"q, k, v must be on one device, got {devices[0]}, {devices[1]}, {devices[2]}.")


def check_attn_head_chunks(
    attn_head_chunks: int, num_heads: int, num_kv_heads: int, ulysses_degree: int
) -> None:
    """``ValueError`` naming ``parallel.attn_head_chunks`` and the values that work unless it splits the heads
    every Ulysses rank holds after the all-to-all (``Hq / U`` query heads and ``max(Hkv, U) / U`` K/V heads
    when even; each rank's own counts with uneven heads, :mod:`usp.attention.heads`) into equal groups of whole
    GQA groups; or the heads do not fit the Ulysses degree at all. The one rule, used by
    :func:`usp_attention` and the trainer's checks."""
    heads = ulysses_heads(num_heads, num_kv_heads, ulysses_degree)
    seen = set()
    for j in range(ulysses_degree):
        pair = (heads.q_counts[j], heads.local_kv_heads(j))
        if pair not in seen:
            seen.add(pair)
            check_head_chunks(attn_head_chunks, *pair)


def _check_cu_seqlens(cu: torch.Tensor, seq_len: int, batch: int) -> torch.Tensor:
    """``cu``: the boundaries on the host."""
    if batch != 1:
        raise ValueError(
            f"cu_seqlens (document masking) needs batch size 1, got {batch}: pack the documents of the batch into "
            f"one sequence (one row per step) or drop cu_seqlens."
        )
    if cu.dim() != 1 or cu.numel() < 2 or cu.is_floating_point():
        raise ValueError(
            f"cu_seqlens must be a 1-D integer tensor [num_docs + 1] of document boundaries, got "
            f"{cu.dtype} {tuple(cu.shape)}."
        )
    cu = cu.to(torch.int64)
    if int(cu[0]) != 0 or int(cu[-1]) != seq_len or bool((cu[1:] < cu[:-1]).any()):
        raise ValueError(
            f"cu_seqlens must rise from 0 to the GLOBAL sequence length {seq_len} (S_local x ring x ulysses), "
            f"got {cu.tolist()[:8]}{'...' if cu.numel() > 8 else ''} ending at {int(cu[-1])}; pass the boundaries "
            f"of the whole packed sequence, identical on every rank, not this rank's slice."
        )
    return cu


def _same_on_every_rank(t: torch.Tensor, mesh: SPMesh) -> bool:
    """Whether every sp rank holds the same host int64 tensor ``t``: one all-gather of a 16-byte fingerprint."""
    if mesh.sp_degree == 1:
        return True
    digest = hashlib.blake2b(t.numpy().tobytes(), digest_size=8).digest()
    mine = torch.tensor([int.from_bytes(digest, "little", signed=True), t.numel()], dtype=torch.int64)
    device = "cuda" if mesh.device_mesh.device_type == "cuda" else "cpu"
    parts = [torch.empty_like(mine, device=device) for _ in range(mesh.sp_degree)]
    dist.all_gather(parts, mine.to(device), group=mesh.sp_group)
    return all(torch.equal(p.cpu(), mine) for p in parts)


def _check_same_boundaries(cu: torch.Tensor, mesh: SPMesh) -> None:
    """``ValueError`` on every sp rank unless all of them pass the same boundaries (else the ring would hang
    or mix documents): one all-gather of a 16-byte fingerprint, before any K/V moves."""
    if not _same_on_every_rank(cu, mesh):
        raise ValueError(
            "cu_seqlens differs between the ranks of one sequence-parallel group: every rank of the group must "
            "pass the boundaries of the SAME packed row (global, 0 .. S), and shard that row with "
            "usp.parallel.shard_sequence(..., cu_seqlens=...). Check that the data loader gives every sp rank "
            "the same sample."
        )


_last_boundaries: tuple[weakref.ref, int, int, int, int, tuple[int, ...]] | None = None


def _boundaries_key(cu_seqlens: torch.Tensor, seq_len: int, batch: int, mesh: SPMesh) -> tuple[int, ...]:
    """The validated boundaries of ``cu_seqlens`` as a tuple (the block plans' cache key).

    Every layer of a step passes the same, unmodified tensor object: it is copied to the host (one device
    sync for a CUDA tensor), checked and compared across the sp group (one 16-byte all-gather) the first time
    only; later calls with that object return the same tuple.
    """
    global _last_boundaries
    last = _last_boundaries
    if (
        last is not None
        and last[0]() is cu_seqlens
        and last[1:5] == (cu_seqlens._version, seq_len, batch, id(mesh))
    ):
        return last[5]
    host = cu_seqlens.detach() if cu_seqlens.device.type == "cpu" else cu_seqlens.detach().to("cpu")
    cu = _check_cu_seqlens(host, seq_len, batch)
    _check_same_boundaries(cu, mesh)
    key = tuple(cu.tolist())
    _last_boundaries = (weakref.ref(cu_seqlens), cu_seqlens._version, seq_len, batch, id(mesh), key)
    return key


_last_prefix: tuple[weakref.ref, int, tuple[int, ...], int, tuple[int, ...]] | None = None


def _shared_prefix_key(prefix: torch.Tensor, cu_key: tuple[int, ...], mesh: SPMesh) -> tuple[int, ...]:
    """The validated ``shared_prefix`` as a tuple (a plan cache key): checked against the boundaries and
    compared across the sp group once per tensor object, as :func:`_boundaries_key` does."""
    global _last_prefix
    last = _last_prefix
    if last is not None and last[0]() is prefix and last[1:4] == (prefix._version, cu_key, id(mesh)):
        return last[4]
    host = prefix.detach().to("cpu")
    lengths = [b - a for a, b in zip(cu_key, cu_key[1:])]
    if host.dim() != 1 or host.is_floating_point() or host.numel() != len(lengths):
        raise ValueError(
            f"shared_prefix must be a 1-D integer tensor with one entry per document ({len(lengths)}), got "
            f"{host.dtype} {tuple(host.shape)}."
        )
    values = host.to(torch.int64).tolist()
    bad = [d for d, n in enumerate(values) if n < 0 or (n > 0 and (d == 0 or n > lengths[d - 1]))]
    if bad:
        d = bad[0]
        raise ValueError(
            f"shared_prefix[{d}]={values[d]}: a document's shared prefix is the first tokens of the document "
            f"before it (0 .. {lengths[d - 1] if d else 0} tokens here)."
        )
    if not _same_on_every_rank(host.to(torch.int64), mesh):
        raise ValueError(
            "shared_prefix differs between the ranks of one sequence-parallel group: every rank must pass the "
            "links of the SAME packed row."
        )
    key = tuple(values)
    _last_prefix = (weakref.ref(prefix), prefix._version, cu_key, id(mesh), key)
    return key


@lru_cache(maxsize=32)
def _cached_plans(
    seq_len: int,
    ring: int,
    ring_rank: int,
    layout: str,
    causal: bool,
    cu_key: tuple[int, ...] | None,
    window: int | None = None,
    chunk: int | None = None,
    softcap: float | None = None,
    prefix_key: tuple[int, ...] | None = None,
) -> list:
    """This rank's block plans (segments on the CPU), trimmed to the ring steps any rank needs.

    Reused by every layer of a step: the segments are computed on the host once per distinct ``cu_seqlens``
    (and per distinct window / chunk / softcap: a model with local and global layers has two plans a step).
    ``prefix_key``: the shared prefixes (:func:`~usp.attention.blocks.plan_prefix_blocks`), whose blocks join
    each step's document block.
    """
    cu = None if cu_key is None else torch.tensor(cu_key, dtype=torch.int64)
    if window is not None or chunk is not None:
        assert causal, "windows and chunks are causal"
        every = [plan_banded_blocks(seq_len, ring, rank, layout, cu, window, chunk) for rank in range(ring)]
    else:
        every = [plan_ring_blocks(seq_len, ring, rank, layout, causal, cu) for rank in range(ring)]
    if prefix_key is not None and any(prefix_key):
        assert cu is not None and causal and window is None and chunk is None, "checked by usp_attention"
        prefix = torch.tensor(prefix_key, dtype=torch.int64)
        every = [
            join_steps(plans, plan_prefix_blocks(seq_len, ring, rank, layout, cu, prefix))
            for rank, plans in enumerate(every)
        ]
    plans = every[ring_rank][: ring_steps_needed(every)]
    if softcap is not None:  # capped scores run a masking kernel: give every block its band (and tiles) now
        plans = [
            None
            if p is None
            else tuple(_capped(b, softcap) for b in p)
            if isinstance(p, tuple)
            else _capped(p, softcap)
            for p in plans
        ]
    return plans


def _capped(p, softcap: float):
    """Block ``p`` with softcapped scores, as a band (:class:`RowRanges`, with its tiles): the masking kernel."""
    return dataclasses.replace(
        p,
        causal=False,
        softcap=softcap,
        segments=p.segments
        if isinstance(p.segments, RowRanges)
        else RowRanges.of_block(p.q_end - p.q_start, p.k_end - p.k_start, p.causal, p.segments),
    )


def _check_mask_options(window, chunk, softcap, sinks_shape, hq: int, causal: bool) -> None:
    for name, value in (("window", window), ("chunk", chunk)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"usp_attention: {name}={value!r} must be a positive int or None.")
    if (window is not None or chunk is not None) and not causal:
        raise ValueError("usp_attention: window and chunk apply to causal attention only (causal=True).")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"usp_attention: softcap={softcap!r} must be positive or None.")
    if sinks_shape is not None and sinks_shape != (hq,):
        raise ValueError(
            f"usp_attention: sinks must hold one logit per query head ([{hq}]), got {sinks_shape}."
        )


@dataclasses.dataclass(frozen=True)
class _CallSetup:
    """What one kind of :func:`usp_attention` call needs, derived and validated once per kind (shapes, dtypes,
    mesh and options): every layer of every step reuses it, so a step does no validation and no backend or
    head-split resolution."""

    seq_len: int
    heads: UlyssesHeads
    kernel: str
    scale: float
    window: int | None
    chunk: int | None


@lru_cache(maxsize=128)
def _call_setup(
    mesh: SPMesh,
    shapes: tuple[torch.Size, torch.Size, torch.Size],
    dtypes: tuple[torch.dtype, torch.dtype, torch.dtype],
    devices: tuple[torch.device, torch.device, torch.device],
    causal: bool,
    softmax_scale: float | None,
    backend: str,
    attn_head_chunks: int,
    window: int | None,
    chunk: int | None,
    softcap: float | None,
    sinks_shape: tuple[int, ...] | None,
) -> _CallSetup:
    """The checks of :func:`usp_attention` (``ValueError`` before any communication) and what they derive;
    cached, so they run on the first call of each kind only."""
    if not isinstance(mesh, SPMesh):
        raise ValueError(
            f"mesh must be a usp.parallel.SPMesh (from init_sp_mesh), got {type(mesh).__name__}."
        )
    _check_inputs(*shapes, dtypes, devices)
    u, r = mesh.ulysses_degree, mesh.ring_degree
    _, s_local, hq, d = shapes[0]
    hkv = shapes[1][2]
    seq_len = s_local * u * r
    check_sequence_length(seq_len, r, u, mesh.ring_layout)
    heads = ulysses_heads(hq, hkv, u)
    check_attn_head_chunks(attn_head_chunks, hq, hkv, u)
    kernel = resolve_backend(backend, devices[0], dtypes[0], head_dim=d)
    _check_mask_options(window, chunk, softcap, sinks_shape, hq, causal)
    return _CallSetup(
        seq_len=seq_len,
        heads=heads,
        kernel=kernel,
        scale=default_scale(d, softmax_scale),
        window=None if window is not None and window >= seq_len else window,  # no token is out of reach
        chunk=None if chunk is not None and chunk >= seq_len else chunk,
    )


def usp_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mesh: SPMesh,
    causal: bool = True,
    softmax_scale: float | None = None,
    backend: str = "auto",
    cu_seqlens: torch.Tensor | None = None,
    attn_head_chunks: int = 1,
    window: int | None = None,
    chunk: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    shared_prefix: torch.Tensor | None = None,
) -> torch.Tensor:
    """Exact attention over the whole sequence, sharded over ``mesh``'s ulysses x ring ranks.

    Args:
        q: ``[B, S_local, Hq, D]``, this rank's slice in ``mesh.ring_layout`` (as ``shard_sequence`` cuts it;
            under ``balanced``, with the same ``cu_seqlens``).
        k, v: ``[B, S_local, Hkv, D]`` with ``Hq % Hkv == 0`` (GQA/MQA).
        mesh: the job's :class:`~usp.parallel.SPMesh`; its ulysses and ring groups are used.
        causal: causal mask over *global* positions.
        softmax_scale: defaults to ``1 / sqrt(D)``.
        backend: ``"auto"`` or one of :data:`usp.attention.kernels.BACKENDS`.
        cu_seqlens: optional int32 ``[num_docs + 1]`` boundaries of the global packed sequence (``0 .. S``, the
            same on every rank; batch size 1): no attention crosses a document boundary, forward or backward.
            Pass it **on the CPU**: it is read on the host every call (validation, block plans, segments),
            which is free for a CPU tensor and a device sync per call (per layer) for a CUDA one. Under the
            ``balanced`` layout it also says where each rank's tokens are. All sp ranks must pass the same
            boundaries (checked with one 16-byte all-gather per new tensor, i.e. once per step).
        attn_head_chunks: run step 2 (the ring, which holds the big fp32 buffers) over this many groups of the
            rank's heads one after another, forward and backward (:func:`check_attn_head_chunks`; 1 = all at
            once). Exact; the ring's fp32 output/dq accumulators and rotating K/V and fp32 dK/dV buffers shrink
            by this factor, the bytes sent stay the same (in more, smaller messages).
        window: sliding window (transformers' rule: a query at global token index ``i`` sees keys ``j`` with
            ``i - window < j <= i``), or None. Ring blocks wholly outside it are skipped (no kernel call), and
            ring steps no rank needs send no K/V (with ``contiguous``, a window of ``S / R`` or less runs 2
            steps, not ``R``); the others run with a banded mask.
        chunk: chunked attention (Llama 4: query and key in the same ``chunk``-token chunk, counted from their
            document's start as transformers counts packed sequences), or None; combines with ``window``.
        softcap: attention logit softcapping ``c * tanh(s / c)`` inside every block (Gemma 2), or None; runs
            the ``math`` kernel (no fused kernel here caps scores).
        sinks: per-head sink logits ``[Hq]`` (gpt-oss), or None: each query row's softmax denominator gains
            ``exp(sink)`` once, after the ring merge (this rank's heads' sinks only); differentiable.
        shared_prefix: with ``cu_seqlens`` (causal, no window or chunk), int ``[num_docs]`` on the host, or
            None: document ``d`` also attends to the first ``shared_prefix[d]`` tokens of document ``d - 1``
            (0: no link; never more than that document's length). A prompt followed by two completions,
            ``[prompt + chosen | rejected]`` with ``rejected``'s link the prompt's length, gives ``rejected`` the
            attention it has in its own sequence ``[prompt + rejected]`` (its position ids continuing from the
            prompt's, which the caller passes). Computed as one more block per ring step, merged by ``lse``
            (:func:`usp.attention.blocks.plan_prefix_blocks`); all sp ranks must pass the same links.

    Returns:
        ``out [B, S_local, Hq, D]`` like ``q``. Differentiable w.r.t. ``q, k, v`` (exact gradients).

    Raises:
        ValueError: before any communication, for shapes, heads that don't fit ``ulysses_degree`` (more
            Ulysses ranks than query heads; naming the degrees that work), sequence lengths that don't fit the layout, bad ``cu_seqlens`` (not covering
            ``0 .. S``, batch size above 1, different on different ranks of the group), backend or
            ``attn_head_chunks``.
    """
    call = _call_setup(
        mesh,
        (q.shape, k.shape, v.shape),
        (q.dtype, k.dtype, v.dtype),
        (q.device, k.device, v.device),
        causal,
        softmax_scale,
        backend,
        attn_head_chunks,
        window,
        chunk,
        softcap,
        None if sinks is None else tuple(sinks.shape),
    )
    cu_key = None if cu_seqlens is None else _boundaries_key(cu_seqlens, call.seq_len, q.size(0), mesh)
    prefix_key = None
    if shared_prefix is not None:
        if cu_key is None or not causal or call.window is not None or call.chunk is not None:
            raise ValueError(
                "usp_attention: shared_prefix links documents of cu_seqlens under causal attention without a "
                "sliding window or chunks; pass cu_seqlens, causal=True, window=None, chunk=None."
            )
        prefix_key = _shared_prefix_key(shared_prefix, cu_key, mesh)
    plans = _cached_plans(
        call.seq_len,
        mesh.ring_degree,
        mesh.ring_rank,
        mesh.ring_layout,
        causal,
        cu_key,
        call.window,
        call.chunk,
        softcap,
        prefix_key,
    )
    heads = call.heads
    local_sinks = None
    if sinks is not None:  # the sinks of the heads this Ulysses rank holds after the all-to-all
        first = heads.q_first(mesh.ulysses_rank)
        local_sinks = sinks[first : first + heads.q_counts[mesh.ulysses_rank]]

    ulysses_group = mesh.ulysses_group
    qh = seq_to_head(q, ulysses_group, "ulysses_q", heads.q_counts)  # [B, S/R, Hq_u, D]
    kh = kv_seq_to_head(k, ulysses_group, heads, "ulysses_k")  # [B, S/R, Hkv_u, D], Hq_u % Hkv_u == 0
    vh = kv_seq_to_head(v, ulysses_group, heads, "ulysses_v")
    oh = ring_attention_checked(
        qh,
        kh,
        vh,
        group=mesh.ring_group,
        plans=plans,
        softmax_scale=call.scale,
        backend=call.kernel,
        head_chunks=attn_head_chunks,
        sinks=local_sinks,
    )
    return head_to_seq(oh, ulysses_group, "ulysses_out", heads.q_counts)  # [B, S/(R U), Hq, D]
