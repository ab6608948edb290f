"""Ulysses all-to-all: sequence-sharded ``[B, S/U, H, D]`` <-> head-sharded ``[B, S, H_j, D]`` over ``U`` ranks.

``seq_to_head``: rank ``u`` sends head group ``j`` (``counts[j]`` contiguous heads; ``H / U`` each by default)
of its tokens to rank ``j`` and concatenates what it receives in rank order along the sequence, so it ends
with *all* the Ulysses group's tokens (in the order the ranks held them) for its own head group.
``head_to_seq`` is the exact inverse, and each is the other's backward. With even groups each call sends
``(U - 1) / U`` of its input per rank; with uneven ones (``counts`` from :mod:`usp.attention.heads`) rank
``u`` sends ``sum(counts[j] for j != u)`` heads of its tokens in, and ``(U - 1) * counts[u]`` heads back.

GQA (:func:`kv_seq_to_head`): each rank receives the KV heads its query heads read
(:class:`usp.attention.heads.UlyssesHeads`): a KV head whose group straddles two ranks goes to both, and a
rank whose query heads fall unevenly into its KV heads' groups repeats those KV heads locally so its kernel
sees a uniform GQA group. Autograd sums every copy's gradient back onto the real head, forward and backward
exact.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from usp.attention.comm import all_to_all, all_to_all_uneven
from usp.attention.heads import UlyssesHeads


def _even(counts: Sequence[int]) -> bool:
    return len(set(counts)) == 1


def _seq_to_head(x: torch.Tensor, group: dist.ProcessGroup, kind: str, counts: Sequence[int]) -> torch.Tensor:
    u = dist.get_world_size(group)
    b, s_local, h, d = x.shape
    me = dist.get_rank(group)
    if _even(counts):
        x = x.reshape(b, s_local, u, h // u, d).permute(2, 0, 1, 3, 4)  # [U(dst), B, S/U, H/U, D]
        y = all_to_all(x, group, kind)  # [U(src), B, S/U, H/U, D]
    else:
        parts = list(torch.split(x, list(counts), dim=2))  # U x [B, S/U, H_j, D]
        y = torch.stack(
            all_to_all_uneven(parts, [parts[me].shape] * u, group, kind)
        )  # [U(src), B, S/U, H_me, D]
    return y.permute(1, 0, 2, 3, 4).reshape(b, u * s_local, counts[me], d)  # [B, S, H_me, D]


def _head_to_seq(y: torch.Tensor, group: dist.ProcessGroup, kind: str, counts: Sequence[int]) -> torch.Tensor:
    u = dist.get_world_size(group)
    b, s, h_local, d = y.shape
    y = y.reshape(b, u, s // u, h_local, d).permute(1, 0, 2, 3, 4)  # [U(dst), B, S/U, H_me, D]
    if _even(counts):
        x = all_to_all(y, group, kind)  # [U(src head group), B, S/U, H/U, D]
        return x.permute(1, 2, 0, 3, 4).reshape(b, s // u, u * h_local, d)  # [B, S/U, H, D]
    shapes = [(b, s // u, c, d) for c in counts]
    parts = all_to_all_uneven(list(y.unbind(0)), shapes, group, kind)  # U x [B, S/U, H_j, D]
    return torch.cat(parts, dim=2)  # [B, S/U, H, D]


class _SeqToHead(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, kind, counts):
        ctx.group, ctx.kind, ctx.counts = group, kind, counts
        return _seq_to_head(x, group, kind, counts)

    @staticmethod
    def backward(ctx, grad):
        return _head_to_seq(grad, ctx.group, ctx.kind + "_grad", ctx.counts), None, None, None


class _HeadToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, group, kind, counts):
        ctx.group, ctx.kind, ctx.counts = group, kind, counts
        return _head_to_seq(y, group, kind, counts)

    @staticmethod
    def backward(ctx, grad):
        return _seq_to_head(grad, ctx.group, ctx.kind + "_grad", ctx.counts), None, None, None


def _counts(heads: int, group: dist.ProcessGroup, counts: Sequence[int] | None) -> tuple[int, ...]:
    u = dist.get_world_size(group)
    if counts is None:
        assert heads % u == 0, f"{heads} heads do not split evenly over {u} ranks: pass counts"
        return (heads // u,) * u
    assert len(counts) == u and sum(counts) == heads, f"head counts {counts} for {heads} heads over {u} ranks"
    return tuple(counts)


def seq_to_head(
    x: torch.Tensor, group: dist.ProcessGroup, kind: str = "ulysses", counts: Sequence[int] | None = None
) -> torch.Tensor:
    """``[B, S/U, H, D]`` -> ``[B, S, counts[u], D]`` (differentiable). ``counts``: heads per rank, contiguous
    and in rank order, summing to ``H``; ``None`` = ``H / U`` each (``H`` divisible by ``U``)."""
    if dist.get_world_size(group) == 1:
        return x
    return _SeqToHead.apply(x, group, kind, _counts(x.size(2), group, counts))


def head_to_seq(
    y: torch.Tensor, group: dist.ProcessGroup, kind: str = "ulysses", counts: Sequence[int] | None = None
) -> torch.Tensor:
    """``[B, S, counts[u], D]`` -> ``[B, S/U, H, D]`` (differentiable; inverse of :func:`seq_to_head` with the
    same ``counts``; ``None`` = ``H / U`` each, ``H = U * y.size(2)``)."""
    u = dist.get_world_size(group)
    if u == 1:
        return y
    return _HeadToSeq.apply(y, group, kind, _counts(sum(counts) if counts else u * y.size(2), group, counts))


def kv_seq_to_head(x: torch.Tensor, group: dist.ProcessGroup, heads: UlyssesHeads, kind: str) -> torch.Tensor:
    """K or V ``[B, S/U, Hkv, D]`` -> ``[B, S, heads.local_kv_heads(u), D]``: the KV heads rank ``u``'s query
    heads read (:meth:`UlyssesHeads.kv_send_index`), then its local copies (:meth:`UlyssesHeads.kv_expand_index`)."""
    u = dist.get_world_size(group)
    if u == 1:
        return x
    send = heads.kv_send_index()
    if send != list(range(x.size(2))):
        x = x[:, :, send]  # [B, S/U, sum_j kv_j, D]; backward sums a straddling head's copies
    y = seq_to_head(x, group, kind, heads.kv_counts())  # [B, S, kv_u, D]
    expand = heads.kv_expand_index(dist.get_rank(group))
    if expand is not None:
        y = y[:, :, expand]  # [B, S, local_kv_u, D]: local copies for a uniform GQA group
    return y
