"""Where each rank's tokens sit in the global sequence, and moving tensors between global and local views.

Layout of one global sequence of length ``S`` over ``R = ring_degree`` x ``U = ulysses_degree`` ranks:

1. Ring split. ``zigzag`` (causal balance): cut ``S`` into ``2R`` chunks of ``c = S / 2R``; ring rank ``r``
   holds chunks ``r`` and ``2R-1-r`` (early and late tokens, so causal work is even). ``contiguous``: ring
   rank ``r`` holds chunk ``r`` of ``R``.
2. Ulysses split. The ring rank's part (``S / R`` tokens, in the order above) is cut into ``U`` contiguous
   pieces; Ulysses rank ``u`` holds piece ``u``. The Ulysses all-to-all concatenates the pieces back in
   rank order, so after it every Ulysses rank sees its ring rank's whole part, as the ring kernel expects.

The same function shards tokens, labels, position ids and anything else along the sequence dim.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from usp.parallel.mesh import RING_LAYOUTS, SPMesh, sequence_multiple


def check_sequence_length(seq_len: int, ring_degree: int, ulysses_degree: int, ring_layout: str) -> None:
    """Raise ``ValueError`` naming the nearest valid lengths when ``seq_len`` does not suit the layout."""
    m = sequence_multiple(ring_degree, ulysses_degree, ring_layout)
    if seq_len <= 0 or seq_len % m != 0:
        lower = (seq_len // m) * m
        upper = lower + m
        nearest = [x for x in (lower, upper) if x > 0]
        why = "2 x ring_degree x ulysses_degree" if ring_layout == "zigzag" else "ring_degree x ulysses_degree"
        raise ValueError(
            f"sequence length {seq_len} is not divisible by {m} (= {why} for the {ring_layout} layout with "
            f"ring_degree={ring_degree}, ulysses_degree={ulysses_degree}). Use trainer.seq_len = "
            f"{' or '.join(str(x) for x in nearest)} (nearest valid), or change the degrees."
        )


def local_token_indices(
    seq_len: int, ring_degree: int, ulysses_degree: int, ring_rank: int, ulysses_rank: int, ring_layout: str
) -> torch.Tensor:
    """Global positions (int64 ``[seq_len / (R * U)]``) of the tokens one rank holds, in local order."""
    check_sequence_length(seq_len, ring_degree, ulysses_degree, ring_layout)
    assert 0 <= ring_rank < ring_degree and 0 <= ulysses_rank < ulysses_degree
    if ring_layout == "zigzag":
        c = seq_len // (2 * ring_degree)
        part = torch.cat(
            [
                torch.arange(ring_rank * c, (ring_rank + 1) * c),
                torch.arange((2 * ring_degree - 1 - ring_rank) * c, (2 * ring_degree - ring_rank) * c),
            ]
        )
    elif ring_layout == "contiguous":
        c = seq_len // ring_degree
        part = torch.arange(ring_rank * c, (ring_rank + 1) * c)
    else:
        raise ValueError(f"ring_layout={ring_layout!r} is invalid; choose one of {RING_LAYOUTS}.")
    n = part.numel() // ulysses_degree
    return part[ulysses_rank * n : (ulysses_rank + 1) * n]


def sp_permutation(seq_len: int, ring_degree: int, ulysses_degree: int, ring_layout: str) -> torch.Tensor:
    """Global positions of all sp ranks' slices concatenated in sp-rank order (``ring_rank * U + u``)."""
    return torch.cat(
        [
            local_token_indices(seq_len, ring_degree, ulysses_degree, r, u, ring_layout)
            for r in range(ring_degree)
            for u in range(ulysses_degree)
        ]
    )


def shard_sequence(x: torch.Tensor, mesh: SPMesh, dim: int = 1) -> torch.Tensor:
    """Global tensor (the whole sequence along ``dim``) -> this rank's slice, in the mesh's layout.

    Works for tokens ``[B, S]``, labels, position ids, hidden states ``[B, S, ...]`` alike. No communication.
    Raises ``ValueError`` if ``S`` does not suit the layout (naming the nearest valid lengths).
    """
    dim = dim % x.dim()
    idx = local_token_indices(
        x.size(dim), mesh.ring_degree, mesh.ulysses_degree, mesh.ring_rank, mesh.ulysses_rank, mesh.ring_layout
    )
    return x.index_select(dim, idx.to(x.device)).contiguous()


def gather_sequence(x: torch.Tensor, mesh: SPMesh, dim: int = 1) -> torch.Tensor:
    """This rank's slice -> the global tensor, by an all-gather over the ``sp`` group (inverse of shard).

    Communicates ``(sp_degree - 1) * x.numel()`` elements per rank. Not differentiable; meant for evaluation
    and tests.
    """
    dim = dim % x.dim()
    sp = mesh.sp_degree
    if sp == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(sp)]
    dist.all_gather(parts, x.contiguous(), group=mesh.sp_group)
    stacked = torch.cat(parts, dim=dim)  # slices in sp-rank order
    seq_len = stacked.size(dim)
    perm = sp_permutation(seq_len, mesh.ring_degree, mesh.ulysses_degree, mesh.ring_layout)
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(seq_len)
    return stacked.index_select(dim, inverse.to(x.device))
