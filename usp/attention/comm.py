"""The communication layer of USP attention, instrumented: every byte a rank sends goes through here.

- :func:`all_to_all` wraps ``all_to_all_single`` over the Ulysses group (the piece a rank keeps for itself
  is not counted: it never leaves the device).
- :func:`all_gather_dim1` gathers every rank's piece, differentiably (the recurrent and convolution mixers of
  hybrid models, :mod:`usp.model.mixers`).
- :class:`RingExchange` posts one ``batch_isend_irecv`` (send to ring rank ``r + 1``, receive from ``r - 1``)
  and returns at once, so the caller computes on the current block while the next one travels.

Inside ``with record_comm() as stats:`` every call adds to ``stats.bytes_sent`` (and the ring adds the
attention pairs it computed to ``stats.attention_pairs``), which is how the benchmark *measures* traffic.
The recorder is a context variable of the calling thread: nothing is recorded outside the ``with``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass
class CommStats:
    """What this rank sent and computed while recording."""

    bytes_sent: int = 0
    bytes_by_kind: dict[str, int] = field(default_factory=dict)
    attention_pairs: int = 0
    """(query, key) pairs scored by the local kernels, summed over batch and heads (FLOPs = 4 * D * pairs fwd)."""
    attention_flops: int = 0

    def add_bytes(self, kind: str, nbytes: int) -> None:
        self.bytes_sent += nbytes
        self.bytes_by_kind[kind] = self.bytes_by_kind.get(kind, 0) + nbytes


_RECORDER: ContextVar[CommStats | None] = ContextVar("usp_attention_comm_stats", default=None)


@contextmanager
def record_comm() -> Iterator[CommStats]:
    """Count the bytes sent (and attention work done) by USP attention on this rank inside the block."""
    stats = CommStats()
    token = _RECORDER.set(stats)
    try:
        yield stats
    finally:
        _RECORDER.reset(token)


def recording() -> bool:
    """Whether a :func:`record_comm` block is open on this thread."""
    return _RECORDER.get() is not None


def _record_bytes(kind: str, nbytes: int) -> None:
    stats = _RECORDER.get()
    if stats is not None:
        stats.add_bytes(kind, nbytes)


def record_attention_work(pairs: int, head_dim: int, backward: bool) -> None:
    """Add one kernel call's work: ``pairs`` scored (q, k) pairs x heads x batch; fwd 4*D, bwd 10*D FLOPs."""
    stats = _RECORDER.get()
    if stats is not None:
        stats.attention_pairs += pairs
        stats.attention_flops += (10 if backward else 4) * head_dim * pairs


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def all_to_all(x: torch.Tensor, group: dist.ProcessGroup, kind: str) -> torch.Tensor:
    """``all_to_all_single`` along dim 0 (``x.size(0) == group size``): row ``j`` goes to rank ``j``.

    Returns the received rows, row ``j`` from rank ``j``. Sends ``(P - 1) / P`` of ``x``.
    """
    world = dist.get_world_size(group)
    if world == 1:
        return x
    assert x.size(0) == world, "all_to_all input must be split into one row per rank along dim 0"
    x = x.contiguous()
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    _record_bytes(kind, nbytes(x) * (world - 1) // world)
    return out


def all_to_all_uneven(
    parts: list[torch.Tensor],
    out_shapes: list[torch.Size | tuple[int, ...]],
    group: dist.ProcessGroup,
    kind: str,
) -> list[torch.Tensor]:
    """``all_to_all_single`` with per-rank sizes: ``parts[j]`` goes to rank ``j``; returns the tensors received,
    the one from rank ``j`` of shape ``out_shapes[j]`` (all of ``parts``' dtype). Sends every part but this
    rank's own (uneven Ulysses head groups, :mod:`usp.attention.heads`)."""
    world = dist.get_world_size(group)
    assert len(parts) == world and len(out_shapes) == world, "one part and one shape per rank"
    me = dist.get_rank(group)
    send = torch.cat([p.reshape(-1) for p in parts])
    out_sizes = [int(torch.Size(s).numel()) for s in out_shapes]
    recv = send.new_empty(sum(out_sizes))
    dist.all_to_all_single(
        recv, send, output_split_sizes=out_sizes, input_split_sizes=[p.numel() for p in parts], group=group
    )
    _record_bytes(kind, sum(nbytes(p) for j, p in enumerate(parts) if j != me))
    return [t.view(s) for t, s in zip(torch.split(recv, out_sizes), out_shapes)]


class _AllGather(torch.autograd.Function):
    """All-gather along dim 1; backward: each rank gets the sum of every rank's gradient of its piece (the
    reduce-scatter, as an all-to-all plus a sum: gloo has no reduce_scatter)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup, kind: str) -> torch.Tensor:  # noqa: ANN001
        world = dist.get_world_size(group)
        ctx.group, ctx.kind, ctx.width = group, kind, x.size(1)
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x.contiguous(), group=group)
        _record_bytes(kind, nbytes(x) * (world - 1))
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN205
        pieces = torch.stack(torch.split(grad, ctx.width, dim=1))  # [P, B, n, ...]: piece j -> rank j
        return all_to_all(pieces, ctx.group, ctx.kind + "_grad").sum(0), None, None


def all_gather_dim1(x: torch.Tensor, group: dist.ProcessGroup, kind: str) -> torch.Tensor:
    """Every rank's ``x`` (``[B, n, ...]``, the same shape everywhere) concatenated along dim 1 in group-rank
    order, differentiable: the backward sums each piece's gradient over the ranks and returns it to its owner.
    Sends ``(P - 1) * x`` forward and ``(P - 1) / P`` of the gathered gradient backward."""
    if dist.get_world_size(group) == 1:
        return x
    return _AllGather.apply(x, group, kind)


class RingExchange:
    """Send tensors to the next ring rank and receive same-shaped ones from the previous, asynchronously.

    ``start(tensors)`` posts the transfer and returns immediately; ``wait()`` returns the received tensors.
    Both peers must post the same list (same shapes, dtypes and order) in the same step. ``offset``: send to
    ring rank ``r + offset`` and receive from ``r - offset`` (1 = the next neighbour; used to send a gradient
    accumulator straight home when the ring stops early).
    """

    def __init__(self, group: dist.ProcessGroup, kind: str, tag: int = 0, offset: int = 1):
        self.group = group
        self.kind = kind
        self.tag = tag
        self.world = dist.get_world_size(group)
        rank = dist.get_rank(group)
        self.next_rank = dist.get_global_rank(group, (rank + offset) % self.world)
        self.prev_rank = dist.get_global_rank(group, (rank - offset) % self.world)
        self._reqs: list = []
        self._recv: list[torch.Tensor] = []

    def start(self, tensors: list[torch.Tensor]) -> None:
        assert not self._reqs, "wait() for the previous transfer before starting another"
        ops = []
        self._recv = []
        for t in tensors:
            t = t.contiguous()
            buf = torch.empty_like(t)
            ops.append(dist.P2POp(dist.isend, t, self.next_rank, self.group, self.tag))
            ops.append(dist.P2POp(dist.irecv, buf, self.prev_rank, self.group, self.tag))
            self._recv.append(buf)
            _record_bytes(self.kind, nbytes(t))
        self._reqs = dist.batch_isend_irecv(ops)

    def wait(self) -> list[torch.Tensor]:
        for req in self._reqs:
            req.wait()
        self._reqs = []
        out, self._recv = self._recv, []
        return out
