"""Evaluation work split over the data-parallel replicas of the mesh.

With ``world = dp x ring x ulysses``, each dp replica (one sp group) evaluates every ``dp``-th item (documents,
passkey trials) on its own, and the per-replica results are gathered over the dp group at the end (one
``all_gather_object`` of small Python objects): every rank ends with all the results, in item order.
"""

from __future__ import annotations

import time
from typing import Any, TypeVar

import torch.distributed as dist

from usp.parallel import SPMesh

T = TypeVar("T")


def my_share(items: list[T], mesh: SPMesh) -> list[T]:
    """The items this rank's dp replica evaluates: ``items[dp_rank::dp_degree]``."""
    return items[mesh.dp_rank :: mesh.dp_degree]


def gather_shares(mine: list[Any], mesh: SPMesh) -> list[Any]:
    """Every replica's :func:`my_share` results back in item order (collective over the dp group)."""
    if mesh.dp_degree == 1:
        return mine
    shares: list[Any] = [None] * mesh.dp_degree
    dist.all_gather_object(shares, mine, group=mesh.dp_group)
    out: list[Any] = []
    for i in range(max(len(s) for s in shares)):
        out.extend(s[i] for s in shares if i < len(s))  # item k was evaluated by replica k % dp
    return out


def gather_timing(seconds: float, tokens: int, mesh: SPMesh) -> tuple[float, int]:
    """``(slowest replica's seconds, tokens of all replicas)``: replicas run side by side."""
    if mesh.dp_degree == 1:
        return seconds, tokens
    every: list[Any] = [None] * mesh.dp_degree
    dist.all_gather_object(every, (seconds, tokens), group=mesh.dp_group)
    return max(s for s, _ in every), sum(n for _, n in every)


def decode_timing(
    prefill_tokens: int, prefill_s: float, decode_tokens: int, decode_s: float, t0: float
) -> dict:
    """The ``timing`` entry of a generation eval (passkey, ruler): tokens, seconds and tokens/s of the sharded
    prefill and the decode, and the wall time since ``t0`` (``time.perf_counter()``)."""
    return {
        "prefill_tokens": prefill_tokens,
        "prefill_s": prefill_s,
        "prefill_tokens_per_s": prefill_tokens / prefill_s if prefill_s > 0 else None,
        "decode_tokens": decode_tokens,
        "decode_s": decode_s,
        "decode_tokens_per_s": decode_tokens / decode_s if decode_s > 0 else None,
        "wall_s": time.perf_counter() - t0,
    }
