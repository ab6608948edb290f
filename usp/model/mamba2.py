"""Mamba2 mixers (Bamba, Granite-4 hybrids, Nemotron-H, Falcon-H1) under sequence parallelism by a head all-to-all.

The SSD scan is independent per head given its group's ``B`` and ``C``, and the convolution before it is
depthwise, so a rank holding every token of some heads computes them exactly. Over the sp group (``P`` ranks):

1. the input projection runs on the rank's own tokens: ``[B, S/P, hidden]`` -> gate, ``xBC``, ``dt``;
2. one all-to-all (:func:`usp.attention.ulysses.seq_to_head`, one "head" of width ``W`` per rank) sends rank
   ``j`` its heads' ``x`` channels, the ``B`` and ``C`` channels of their groups and their ``dt``:
   ``W = (H / P) hd + 2 (G / P or 1) N + H / P``; a group whose heads span several ranks goes to each of them
   (its gradient sums back);
3. per packed document: the convolution with the rank's channels of the weight and the family's chunked scan
   (``mamba2_chunk_scan``: mamba-ssm's kernel where transformers finds it, its torch code otherwise) with the
   rank's ``A``, ``D`` and ``dt_bias``, each document from a zero state;
4. one all-to-all back (:func:`usp.attention.ulysses.head_to_seq`) -> ``[B, S/P, H hd]`` on the rank's tokens,
   then the grouped gated RMSNorm with the local gate and the output projection, both per token (Falcon-H1:
   its muP multipliers on the input and the projection, and ``silu(gate)`` when it has no gated norm).

It needs ``H % P == 0`` and the groups to fall on whole ranks (``G % P == 0`` or ``P % G == 0``); otherwise the
layer runs on the gather scheme (:mod:`usp.model.mixers`). Jamba's Mamba1 runs on the gather.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import torch
from torch import nn

from usp.attention.ulysses import head_to_seq, seq_to_head
from usp.model.conv_layout import conv_input

if TYPE_CHECKING:
    from usp.parallel import SPMesh


def supports_heads(module: nn.Module, sp_degree: int) -> bool:
    """Whether the head all-to-all applies: heads split evenly and every rank's heads in whole groups."""
    h, g = module.num_heads, module.n_groups
    return h % sp_degree == 0 and (g % sp_degree == 0 or sp_degree % g == 0)


def _rank_layout(module: nn.Module, rank: int, ranks: int) -> tuple[range, range]:
    """Rank ``rank``'s heads and the groups they read."""
    h, g = module.num_heads, module.n_groups
    per = h // ranks
    heads = range(rank * per, (rank + 1) * per)
    per_group = h // g
    return heads, range(heads.start // per_group, (heads.stop - 1) // per_group + 1)


def _channels(module: nn.Module, heads: range, groups: range) -> tuple[torch.Tensor, torch.Tensor]:
    """(indices into ``xBC`` = the convolution's channels, indices into ``dt``) of a rank's heads and groups."""
    hd, n, inner = module.head_dim, module.ssm_state_size, module.intermediate_size
    gn = module.n_groups * n
    x = torch.arange(heads.start * hd, heads.stop * hd)
    bc = torch.arange(groups.start * n, groups.stop * n)
    return torch.cat([x, inner + bc, inner + gn + bc]), torch.arange(heads.start, heads.stop)


def _document(
    module: nn.Module,
    piece: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    dt_index: torch.Tensor,
    g_local: int,
) -> torch.Tensor:
    """One document of the rank's heads: ``piece`` ``[B, L, W]`` (the rank's ``x``, ``B``, ``C`` channels, then
    its heads' ``dt``) -> ``[B, L, 1, h hd]``, by the family's convolution and chunked scan (mamba-ssm's
    ``mamba_chunk_scan_combined`` and causal-conv1d where transformers finds them)."""
    fns = sys.modules[type(module).__module__]  # the family's own kernels (hub / mamba-ssm / torch)
    b, length, _ = piece.shape
    hd, state, h_local = module.head_dim, module.ssm_state_size, dt_index.numel()
    channels = weight.size(0)
    conv = fns.causal_conv1d_fn(
        conv_input(piece[..., :channels].transpose(1, 2)), weight, bias, activation=module.activation
    ).transpose(1, 2)  # [B, L, C_local]
    hs, bb, cc = torch.split(conv, [h_local * hd, g_local * state, g_local * state], dim=-1)
    scan = fns.mamba2_chunk_scan(
        hs.reshape(b, length, h_local, hd).contiguous(),
        piece[..., channels:].contiguous(),
        -torch.exp(module.A_log.float()).index_select(0, dt_index),
        bb.reshape(b, length, g_local, state).contiguous(),
        cc.reshape(b, length, g_local, state).contiguous(),
        chunk_size=module.chunk_size,
        D=module.D.index_select(0, dt_index),
        z=None,
        dt_bias=module.dt_bias.index_select(0, dt_index),
        dt_softplus=True,
        dt_limit=module.time_step_limit,
    )
    return scan.reshape(b, length, 1, h_local * hd)


def forward(
    module: nn.Module, x: torch.Tensor, mesh: SPMesh, plan: dict, bounds: tuple[int, ...]
) -> torch.Tensor:
    """The layer's output for this rank's tokens: ``x`` ``[B, S/P, hidden]`` (local order) -> ``[B, S/P,
    hidden]``, equal to the unsharded layer run on each document of ``bounds``. ``plan``: the layout plan of
    :mod:`usp.model.mixers`."""
    sp, me = mesh.sp_degree, mesh.sp_rank
    b, n, _ = x.shape
    dtype = x.dtype
    inner, conv_dim = module.intermediate_size, module.conv1d.weight.size(0)
    if hasattr(module, "mup_vector"):  # Falcon-H1: muP multipliers on the input and on the projection
        projected = module.in_proj(x * module.ssm_in_multiplier) * module.mup_vector
    else:
        projected = module.in_proj(x)  # [B, n, inner + conv_dim + H]
    gate = projected[..., :inner]
    send = []
    for rank in range(sp):
        heads, groups = _rank_layout(module, rank, sp)
        xbc, dt = _channels(module, heads, groups)
        send.append(torch.cat([inner + xbc, inner + conv_dim + dt]))
    send = torch.stack(send).to(x.device)  # [P, W]: rank j's channels of the projection
    width = send.size(1)
    packed = projected.index_select(-1, send.flatten()).view(b, n, sp, width)
    rows = seq_to_head(packed, mesh.sp_group, "mixer_heads")  # [B, S, 1, W], sp-rank order
    rows = rows[:, :, 0].index_select(1, plan["inverse"].to(x.device))  # [B, S, W], natural order
    heads, groups = _rank_layout(module, me, sp)
    xbc, dt_index = _channels(module, heads, groups)
    weight = module.conv1d.weight.squeeze(1).index_select(0, xbc.to(x.device))  # [C_local, K]
    bias = module.conv1d.bias.index_select(0, xbc.to(x.device)) if module.conv1d.bias is not None else None
    dt_index = dt_index.to(x.device)
    outs = [
        _document(module, rows[:, start:end], weight, bias, dt_index, len(groups))
        for start, end in zip(bounds[:-1], bounds[1:])
        if end > start
    ]
    out = torch.cat(outs, dim=1).index_select(1, plan["order"].to(x.device))  # [B, S, 1, h hd], sp-rank order
    out = head_to_seq(out, mesh.sp_group, "mixer_heads").reshape(b, n, inner)  # [B, S/P, H hd]
    if getattr(module, "mamba_rms_norm", True):
        out = module.norm(out, gate)
    else:  # Falcon-H1 without its gated norm
        out = out * nn.functional.silu(gate)
    return module.out_proj(out.to(dtype))
