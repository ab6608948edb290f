"""Gated DeltaNet (Qwen3-Next, Qwen3.5) under sequence parallelism by a head all-to-all: exact, ``S / P`` work.

The gated delta rule is independent per value head, and its short convolution is depthwise (per channel), so
a rank that holds *every* token of *some* heads computes those heads exactly. Over the sp group (all
``P = ulysses x ring`` ranks, any layout):

1. the token-wise input projections run on the rank's own tokens: ``[B, S/P, hidden]`` ->
   ``[B, S/P, Hk, W]``, one row per key head group, ``W = 2 dk + 2 r dv + 2 r`` (the group's query and key, its
   ``r = Hv / Hk`` value and gate heads, and their ``b``, ``a``): the order Qwen3-Next's fused projection
   already has;
2. one all-to-all (:func:`usp.attention.ulysses.seq_to_head`) -> ``[B, S, Hk / P, W]``: every token for the
   rank's key head groups, put in natural order;
3. per packed document: the convolution with the rank's channels of the weight, the gated delta rule (the
   family's own kernel: flash-linear-attention where installed, transformers' torch code otherwise) and the
   gated RMSNorm, each document from a fresh state;
4. one all-to-all back (:func:`usp.attention.ulysses.head_to_seq`) -> ``[B, S/P, Hv, dv]`` and the output
   projection on the rank's tokens.

Per rank and layer this sends ``(P - 1) / P`` of ``S/P x Hk x W`` elements and of ``S/P x Hv x dv`` back (about
what the gather scheme sends), but computes ``S / P`` tokens and holds ``S / P`` tokens' activations instead of
``S``. Key heads split over the ranks as evenly as they go (``Hk >= P``); with fewer key heads than ranks the
layer runs on the gather scheme (:mod:`usp.model.mixers`).
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from usp.attention.ulysses import head_to_seq, seq_to_head
from usp.model.conv_layout import conv_input

if TYPE_CHECKING:
    from usp.parallel import SPMesh


def head_counts(heads: int, ranks: int) -> tuple[int, ...]:
    """``heads`` split over ``ranks`` in rank order, as evenly as they go (the first ones get one more)."""
    base, extra = divmod(heads, ranks)
    return tuple(base + (r < extra) for r in range(ranks))


def supports_heads(module: nn.Module, sp_degree: int) -> bool:
    """Whether the head all-to-all applies: at least one key head per rank."""
    return module.num_k_heads >= sp_degree


def _grouped_projections(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``x`` ``[B, n, hidden]`` -> ``[B, n, Hk, W]``: per key head group ``[q | k | v | z | b | a]``."""
    b, n, _ = x.shape
    hk, r = module.num_k_heads, module.num_v_heads // module.num_k_heads
    dk, dv = module.head_k_dim, module.head_v_dim
    if hasattr(module, "in_proj_qkvz"):  # Qwen3-Next: fused, already grouped by key head
        qkvz = module.in_proj_qkvz(x).view(b, n, hk, 2 * dk + 2 * r * dv)
        ba = module.in_proj_ba(x).view(b, n, hk, 2 * r)
        return torch.cat([qkvz, ba], dim=-1)
    qkv = module.in_proj_qkv(x)  # Qwen3.5: [q (Hk dk) | k (Hk dk) | v (Hv dv)]
    kd = module.key_dim
    parts = [
        qkv[..., :kd].reshape(b, n, hk, dk),
        qkv[..., kd : 2 * kd].reshape(b, n, hk, dk),
        qkv[..., 2 * kd :].reshape(b, n, hk, r * dv),
        module.in_proj_z(x).reshape(b, n, hk, r * dv),
        module.in_proj_b(x).reshape(b, n, hk, r),
        module.in_proj_a(x).reshape(b, n, hk, r),
    ]
    return torch.cat(parts, dim=-1)


def _channels(module: nn.Module, first: int, count: int, device: torch.device) -> torch.Tensor:
    """The convolution's channels of key heads ``first .. first + count``: their q, k and v channels."""
    dk, vd = module.head_k_dim, module.head_v_dim * module.num_v_heads // module.num_k_heads
    kd = module.key_dim
    q = torch.arange(first * dk, (first + count) * dk)
    v = torch.arange(first * vd, (first + count) * vd)
    return torch.cat([q, kd + q, 2 * kd + v]).to(device)


def _document(
    module: nn.Module, rows: torch.Tensor, first: int, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """One document of the rank's key head groups, ``rows`` ``[B, L, hk, W]`` -> ``[B, L, hk r, dv]``."""
    fns = sys.modules[type(module).__module__]  # the family's own kernels (hub / fla / torch)
    b, length, hk, _ = rows.shape
    r = module.num_v_heads // module.num_k_heads
    dk, dv = module.head_k_dim, module.head_v_dim
    q, k, v, z, beta, a = torch.split(rows, [dk, dk, r * dv, r * dv, r, r], dim=-1)
    mixed = torch.cat(
        [q.reshape(b, length, hk * dk), k.reshape(b, length, hk * dk), v.reshape(b, length, hk * r * dv)],
        dim=-1,
    ).transpose(1, 2)  # [B, C_local, L]
    mixed = fns.causal_conv1d_fn(conv_input(mixed), weight, bias, activation=module.activation).transpose(
        1, 2
    )
    q, k, v = torch.split(mixed, [hk * dk, hk * dk, hk * r * dv], dim=-1)
    heads = slice(first * r, (first + hk) * r)  # the rank's value heads
    g = -module.A_log[heads].float().exp() * F.softplus(
        a.reshape(b, length, hk * r).float() + module.dt_bias[heads]
    )
    core, _ = fns.torch_chunk_gated_delta_rule(  # contiguous inputs: the strided views are 7x slower on CPU
        q.reshape(b, length, hk, dk).contiguous(),
        k.reshape(b, length, hk, dk).contiguous(),
        v.reshape(b, length, hk * r, dv).contiguous(),
        g=g.contiguous(),
        beta=beta.reshape(b, length, hk * r).sigmoid().contiguous(),
        initial_state=None,
        output_final_state=False,
        use_qk_l2norm_in_kernel=True,
    )  # [B, L, hk r, dv]
    out = module.norm(core.reshape(-1, dv), z.reshape(-1, dv))
    return out.reshape(b, length, hk * r, dv)


def forward(
    module: nn.Module, x: torch.Tensor, mesh: SPMesh, plan: dict, bounds: tuple[int, ...]
) -> torch.Tensor:
    """The layer's output for this rank's tokens: ``x`` ``[B, S/P, hidden]`` (local order) ->
    ``[B, S/P, hidden]``, equal to the unsharded layer run on each document of ``bounds``. ``plan``: the
    layout plan of :mod:`usp.model.mixers` (``order``: positions in sp-rank order; ``inverse``: the slot of
    each position)."""
    sp, me = mesh.sp_degree, mesh.sp_rank
    b, n, _ = x.shape
    r = module.num_v_heads // module.num_k_heads
    counts = head_counts(module.num_k_heads, sp)
    first, hk = sum(counts[:me]), counts[me]
    rows = seq_to_head(_grouped_projections(module, x), mesh.sp_group, "mixer_heads", counts)
    rows = rows.index_select(1, plan["inverse"].to(x.device))  # [B, S, hk, W], natural order
    channels = _channels(module, first, hk, x.device)
    weight = module.conv1d.weight.squeeze(1).index_select(0, channels)  # [C_local, K]
    bias = module.conv1d.bias.index_select(0, channels) if module.conv1d.bias is not None else None
    out = torch.cat(
        [
            _document(module, rows[:, a:e], first, weight, bias)
            for a, e in zip(bounds[:-1], bounds[1:])
            if e > a
        ],
        dim=1,
    )  # [B, S, hk r, dv], natural order
    out = out.index_select(1, plan["order"].to(x.device))  # sp-rank order
    out = head_to_seq(out, mesh.sp_group, "mixer_heads", tuple(c * r for c in counts))  # [B, S/P, Hv, dv]
    return module.out_proj(out.reshape(b, n, -1))
