"""Ulysses all-to-all: sequence-sharded ``[B, S/U, H, D]`` <-> head-sharded ``[B, S, H/U, D]`` over ``U`` ranks.

``seq_to_head``: rank ``u`` sends head group ``j`` (heads ``[j*H/U, (j+1)*H/U)``) of its tokens to rank ``j``
and concatenates what it receives in rank order along the sequence, so it ends with *all* the Ulysses group's
tokens (in the order the ranks held them) for its own head group. ``head_to_seq`` is the exact inverse, and each
is the other's backward. Each call sends ``(U - 1) / U`` of its input per rank.

GQA: K/V with ``Hkv`` heads go through the same all-to-all when ``U`` divides ``Hkv``. When ``Hkv < U`` (and
``Hkv`` divides ``U``), each KV head is replicated ``U / Hkv`` times first, exactly enough for each rank to get
the one KV head its query heads use; autograd sums the replicas' gradients back onto the real head.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from usp.attention.comm import all_to_all


def _seq_to_head(x: torch.Tensor, group: dist.ProcessGroup, kind: str) -> torch.Tensor:
    u = dist.get_world_size(group)
    b, s_local, h, d = x.shape
    x = x.reshape(b, s_local, u, h // u, d).permute(2, 0, 1, 3, 4)  # [U(dst), B, S/U, H/U, D]
    y = all_to_all(x, group, kind)  # [U(src), B, S/U, H/U, D]
    return y.permute(1, 0, 2, 3, 4).reshape(b, u * s_local, h // u, d)  # [B, S, H/U, D]


def _head_to_seq(y: torch.Tensor, group: dist.ProcessGroup, kind: str) -> torch.Tensor:
    u = dist.get_world_size(group)
    b, s, h_local, d = y.shape
    y = y.reshape(b, u, s // u, h_local, d).permute(1, 0, 2, 3, 4)  # [U(dst), B, S/U, H/U, D]
    x = all_to_all(y, group, kind)  # [U(src head group), B, S/U, H/U, D]
    return x.permute(1, 2, 0, 3, 4).reshape(b, s // u, u * h_local, d)  # [B, S/U, H, D]


class _SeqToHead(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, kind):
        ctx.group, ctx.kind = group, kind
        return _seq_to_head(x, group, kind)

    @staticmethod
    def backward(ctx, grad):
        return _head_to_seq(grad, ctx.group, ctx.kind + "_grad"), None, None


class _HeadToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, group, kind):
        ctx.group, ctx.kind = group, kind
        return _head_to_seq(y, group, kind)

    @staticmethod
    def backward(ctx, grad):
        return _seq_to_head(grad, ctx.group, ctx.kind + "_grad"), None, None


def seq_to_head(x: torch.Tensor, group: dist.ProcessGroup, kind: str = "ulysses") -> torch.Tensor:
    """``[B, S/U, H, D]`` -> ``[B, S, H/U, D]`` (differentiable; ``H`` must be divisible by ``U``)."""
    if dist.get_world_size(group) == 1:
        return x
    return _SeqToHead.apply(x, group, kind)


def head_to_seq(y: torch.Tensor, group: dist.ProcessGroup, kind: str = "ulysses") -> torch.Tensor:
    """``[B, S, H/U, D]`` -> ``[B, S/U, H, D]`` (differentiable; inverse of :func:`seq_to_head`)."""
    if dist.get_world_size(group) == 1:
        return y
    return _HeadToSeq.apply(y, group, kind)


def kv_replication(num_q_heads: int, num_kv_heads: int, ulysses_degree: int) -> int:
    """How many copies of each KV head the Ulysses all-to-all needs (1 = none). Raises on impossible heads."""
    u = ulysses_degree
    if num_q_heads % num_kv_heads != 0:
        raise ValueError(
            f"num_heads={num_q_heads} is not a multiple of num_kv_heads={num_kv_heads} (GQA needs whole groups)."
        )
    if num_q_heads % u != 0 or (num_kv_heads % u != 0 and u % num_kv_heads != 0):
        working = [
            d
            for d in range(1, num_q_heads + 1)
            if num_q_heads % d == 0 and (num_kv_heads % d == 0 or d % num_kv_heads == 0)
        ]
        raise ValueError(
            f"parallel.ulysses_degree={u} does not fit num_heads={num_q_heads}, num_kv_heads={num_kv_heads}: "
            f"the query heads must split evenly over the Ulysses ranks and the KV heads must either split evenly "
            f"or divide the degree (then they are replicated). Use ulysses_degree in {working} and put the rest "
            f"of the sequence parallelism in parallel.ring_degree."
        )
    return 1 if num_kv_heads % u == 0 else u // num_kv_heads


def kv_seq_to_head(x: torch.Tensor, group: dist.ProcessGroup, replication: int, kind: str) -> torch.Tensor:
    """K or V ``[B, S/U, Hkv, D]`` -> ``[B, S, max(Hkv, U)/U, D]``, replicating heads ``replication`` times."""
    if replication > 1:
        x = x.repeat_interleave(replication, dim=2)  # [B, S/U, U, D]; backward sums the copies
    return seq_to_head(x, group, kind)
