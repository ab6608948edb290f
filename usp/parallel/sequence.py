"""Where each rank's tokens sit in the global sequence, and moving tensors between global and local views.

Layout of one global sequence of length ``S`` over ``R = ring_degree`` x ``U = ulysses_degree`` ranks:

1. Ring split. ``zigzag`` (causal balance): cut ``S`` into ``2R`` chunks of ``c = S / 2R``; ring rank ``r``
   holds chunks ``r`` and ``2R-1-r`` (early and late tokens, so causal work is even). ``contiguous``: ring
   rank ``r`` holds chunk ``r`` of ``R``. ``balanced``: placed from the packed row's document boundaries
   ``cu_seqlens`` so every ring rank has ``S / R`` tokens and the same causal in-document work
   (:mod:`usp.parallel.balance`); zigzag when no boundaries are given. Each ring rank's part is kept in
   increasing global position.
2. Ulysses split. The ring rank's part (``S / R`` tokens, in the order above) is cut into ``U`` contiguous
   pieces; Ulysses rank ``u`` holds piece ``u``. The Ulysses all-to-all concatenates the pieces back in
   rank order, so after it every Ulysses rank sees its ring rank's whole part, as the ring kernel expects.

The same function shards tokens, labels, position ids and anything else along the sequence dim; under
``balanced`` every call for one row must pass that row's ``cu_seqlens``.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch
import torch.distributed as dist

from usp.parallel.balance import check_boundaries, pieces_to_positions, ring_pieces
from usp.parallel.layout import sequence_length_error, sequence_multiple
from usp.parallel.mesh import SPMesh


def check_sequence_length(
    seq_len: int,
    ring_degree: int,
    ulysses_degree: int,
    ring_layout: str,
    setting: str = "trainer.seq_len",
) -> None:
    """Raise ``ValueError`` naming ``setting`` (the setting that holds ``seq_len``) and the nearest valid
    lengths when ``seq_len`` does not suit the layout. A boundary check: start-up and the public entry points
    call it, never a training step (:meth:`usp.parallel.ParallelLayout.check_sequence_length` is the same)."""
    message = sequence_length_error(seq_len, ring_degree, ulysses_degree, ring_layout, setting)
    if message is not None:
        raise ValueError(message)


@lru_cache(maxsize=256)
def _uniform_token_indices(
    seq_len: int, ring_degree: int, ulysses_degree: int, ring_rank: int, ulysses_rank: int, ring_layout: str
) -> torch.Tensor:
    """:func:`local_token_indices` without boundaries (every layout but ``balanced`` with documents): the same
    for every row of a length, so computed once per length."""
    pieces = ring_pieces(seq_len, ring_degree, ring_layout, None)[ring_rank]
    part = pieces_to_positions(pieces)
    n = part.size // ulysses_degree
    return torch.from_numpy(part[ulysses_rank * n : (ulysses_rank + 1) * n].copy())


def local_token_indices(
    seq_len: int,
    ring_degree: int,
    ulysses_degree: int,
    ring_rank: int,
    ulysses_rank: int,
    ring_layout: str,
    cu_seqlens: torch.Tensor | None = None,
    *,
    checked: bool = False,
) -> torch.Tensor:
    """Global positions (int64 ``[seq_len / (R * U)]``) of the tokens one rank holds, in local order.

    ``cu_seqlens`` (the row's document boundaries, ``0 .. seq_len``) places the ``balanced`` layout; the
    other layouts ignore it. ``ValueError`` for a length that does not suit the layout, unless ``checked``
    (the caller checked it: a per-step caller). The returned tensor may be shared between calls: do not
    modify it.
    """
    if checked:
        assert seq_len % sequence_multiple(ring_degree, ulysses_degree, ring_layout) == 0, seq_len
    else:
        check_sequence_length(seq_len, ring_degree, ulysses_degree, ring_layout)
    return _token_indices(
        seq_len, ring_degree, ulysses_degree, ring_rank, ulysses_rank, ring_layout, cu_seqlens
    )


def mesh_token_indices(mesh: SPMesh, seq_len: int, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """This rank's :func:`local_token_indices` on ``mesh`` for a length already checked (no ``ValueError``
    check: for the per-step callers, whose length start-up checked). Cached per length for every layout but
    ``balanced`` with boundaries; do not modify the result."""
    assert seq_len % mesh.layout.sequence_multiple() == 0, f"unchecked sequence length {seq_len}"
    use_cu = cu_seqlens if mesh.ring_layout == "balanced" and mesh.ring_degree > 1 else None
    return _token_indices(
        seq_len,
        mesh.ring_degree,
        mesh.ulysses_degree,
        mesh.ring_rank,
        mesh.ulysses_rank,
        mesh.ring_layout,
        use_cu,
    )


def _token_indices(
    seq_len: int,
    ring_degree: int,
    ulysses_degree: int,
    ring_rank: int,
    ulysses_rank: int,
    ring_layout: str,
    cu_seqlens: torch.Tensor | None,
) -> torch.Tensor:
    """:func:`local_token_indices` for a length already checked."""
    assert 0 <= ring_rank < ring_degree and 0 <= ulysses_rank < ulysses_degree
    if cu_seqlens is None or ring_layout != "balanced" or ring_degree == 1:
        return _uniform_token_indices(
            seq_len, ring_degree, ulysses_degree, ring_rank, ulysses_rank, ring_layout
        )
    pieces = ring_pieces(seq_len, ring_degree, ring_layout, cu_seqlens)[ring_rank]
    part = pieces_to_positions(pieces)
    n = part.size // ulysses_degree
    return torch.from_numpy(part[ulysses_rank * n : (ulysses_rank + 1) * n].copy())


def sp_permutation(
    seq_len: int,
    ring_degree: int,
    ulysses_degree: int,
    ring_layout: str,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Global positions of all sp ranks' slices concatenated in sp-rank order (``ring_rank * U + u``)."""
    check_sequence_length(seq_len, ring_degree, ulysses_degree, ring_layout)
    pieces = ring_pieces(seq_len, ring_degree, ring_layout, cu_seqlens)
    return torch.from_numpy(np.concatenate([pieces_to_positions(p) for p in pieces]))


def _layout_boundaries(
    x: torch.Tensor, dim: int, mesh: SPMesh, cu_seqlens: torch.Tensor | None, seq_len: int
):
    """``cu_seqlens`` validated for the mesh's layout (``None`` when the layout does not use it)."""
    if cu_seqlens is None or mesh.ring_layout != "balanced" or mesh.ring_degree == 1:
        return None
    rows = int(np.prod(x.shape[:dim])) if dim > 0 else 1
    if rows != 1:
        raise ValueError(
            f"cu_seqlens describes one packed row, but the tensor has {rows} rows before the sequence dim "
            f"{dim} (shape {tuple(x.shape)}): use batch size 1 (trainer.micro_batch_size=1) with documents, "
            "or drop cu_seqlens."
        )
    check_boundaries(cu_seqlens, seq_len)
    return cu_seqlens


def shard_sequence(
    x: torch.Tensor, mesh: SPMesh, dim: int = 1, *, cu_seqlens: torch.Tensor | None = None
) -> torch.Tensor:
    """Global tensor (the whole sequence along ``dim``) -> this rank's slice, in the mesh's layout.

    Works for tokens ``[B, S]``, labels, position ids, hidden states ``[B, S, ...]`` alike. No communication.
    ``cu_seqlens``: the row's document boundaries (global, CPU, ``0 .. S``); the ``balanced`` layout places
    tokens from them (and then needs batch size 1), the others ignore them.
    Raises ``ValueError`` if ``S`` does not suit the layout (naming the nearest valid lengths), or for
    boundaries that do not cover the row. Several tensors of one row: :func:`shard_sequences` (one check,
    one index computation).
    """
    return shard_sequences((x,), mesh, dim, cu_seqlens=cu_seqlens)[0]


def shard_sequences(
    tensors: tuple[torch.Tensor, ...] | list[torch.Tensor],
    mesh: SPMesh,
    dim: int = 1,
    *,
    cu_seqlens: torch.Tensor | None = None,
    checked: bool = False,
) -> list[torch.Tensor]:
    """:func:`shard_sequence` of several tensors of the same rows (same length along ``dim``): the length and
    boundaries are checked once and the token indices computed once for all of them.

    ``checked=True`` skips the ``ValueError`` checks (length vs layout, boundaries): for the trainer's
    micro-batches, whose length start-up checked (``trainer.seq_len``) and whose boundaries the packer made.
    """
    first = tensors[0]
    dim = dim % first.dim()
    seq_len = first.size(dim)
    assert all(t.size(dim % t.dim()) == seq_len for t in tensors), "tensors of one row share its length"
    if not checked:
        check_sequence_length(seq_len, mesh.ring_degree, mesh.ulysses_degree, mesh.ring_layout)
        cu = _layout_boundaries(first, dim, mesh, cu_seqlens, seq_len)
    else:
        cu = cu_seqlens
    idx = mesh_token_indices(mesh, seq_len, cu)
    return [t.index_select(dim % t.dim(), idx.to(t.device)).contiguous() for t in tensors]


def gather_sequence(
    x: torch.Tensor, mesh: SPMesh, dim: int = 1, *, cu_seqlens: torch.Tensor | None = None
) -> torch.Tensor:
    """This rank's slice -> the global tensor, by an all-gather over the ``sp`` group (inverse of shard).

    Communicates ``(sp_degree - 1) * x.numel()`` elements per rank. Not differentiable; meant for evaluation
    and tests. Pass the same ``cu_seqlens`` the slice was sharded with (``balanced`` layout).
    """
    dim = dim % x.dim()
    sp = mesh.sp_degree
    if sp == 1:
        return x
    seq_len = x.size(dim) * sp
    check_sequence_length(seq_len, mesh.ring_degree, mesh.ulysses_degree, mesh.ring_layout)
    cu = _layout_boundaries(x, dim, mesh, cu_seqlens, seq_len)  # before communicating: errors on every rank
    parts = [torch.empty_like(x) for _ in range(sp)]
    dist.all_gather(parts, x.contiguous(), group=mesh.sp_group)
    stacked = torch.cat(parts, dim=dim)  # slices in sp-rank order
    perm = sp_permutation(seq_len, mesh.ring_degree, mesh.ulysses_degree, mesh.ring_layout, cu)
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(seq_len)
    return stacked.index_select(dim, inverse.to(x.device))
