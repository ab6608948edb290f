"""Analytic traffic and work of one ``usp_attention`` call, per rank (what the benchmark measures against).

Notation: ``B`` batch, ``S`` global tokens, ``U`` ulysses, ``R`` ring, ``L = S / (R U)`` local tokens, ``D``
head dim, ``e`` bytes per element of q/k/v, ``Hk' = Hkv`` when ``U`` divides ``Hkv``, else ``U`` (GQA
replication: one KV head per Ulysses rank), ``A(H) = (U - 1) / U * B * L * H * D * e`` (one all-to-all of an
``H``-head tensor: everything but the piece a rank keeps), ``P = B * (S / R) * (Hk' / U) * D`` (elements of one
K or V part on the ring). These are the even-head formulas; with uneven heads (``U`` not dividing them,
:mod:`usp.attention.heads`) each rank's all-to-all sizes follow its own head counts
(:meth:`~usp.attention.heads.UlyssesHeads.a2a_heads_sent`) and ``P`` its own K/V heads after local copies.

- forward: ``A(Hq)`` (q) + ``2 A(Hk')`` (k, v) + ``A(Hq)`` (out back) + ``(R - 1) * 2 P e`` (K/V hops);
- backward: ``A(Hq)`` (dout) + ``A(Hq)`` (dq) + ``2 A(Hk')`` (dk, dv) + ``(R - 1) * 2 P e`` (K/V hops again)
  + ``R * 2 P * 4`` (fp32 dK/dV accumulators, one hop behind their K/V; 0 when ``R = 1``).

With document masking the ring may stop after ``T < R`` steps (no rank needs a later block): ``R`` becomes
``T`` in the ring terms.

Each all-to-all sends only what the other ranks need, and ``R - 1`` hops is the fewest in which a ring shows
every K/V part to every rank, so these are the minimum for this algorithm. (The dK/dV hops travel in fp32 for
exact accumulation; an input-dtype variant would halve that term for bf16.)
"""

from __future__ import annotations

import torch

from usp.attention.blocks import plan_ring_blocks, ring_steps_needed
from usp.attention.heads import ulysses_heads


def analytic_bytes_sent(
    *,
    batch: int,
    seq_len: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    ulysses_degree: int,
    ring_degree: int,
    element_size: int,
    ring_steps: int | None = None,
    ulysses_rank: int | None = None,
) -> dict[str, int]:
    """Bytes one rank sends per call: ``{"fwd": ..., "bwd": ..., "fwd_bwd": ...}`` (see the module docstring).

    ``ring_steps``: steps the ring runs (``R`` unless document masking lets it stop early, see
    :func:`usp.attention.blocks.ring_steps_needed`); the ring terms use it in place of ``R``.
    ``ulysses_rank``: the rank counted when uneven heads make ranks differ; ``None``: the busiest
    (:meth:`~usp.attention.heads.UlyssesHeads.busiest_rank`). Even heads: every rank sends the same.
    """
    u = ulysses_degree
    local = seq_len // (u * ring_degree)
    steps = ring_degree if ring_steps is None else ring_steps
    heads = ulysses_heads(num_heads, num_kv_heads, u)
    rank = heads.busiest_rank() if ulysses_rank is None else ulysses_rank
    a2a = heads.a2a_heads_sent(rank) if u > 1 else {"fwd": 0, "bwd": 0}
    token_bytes = batch * local * head_dim * element_size
    part = batch * (seq_len // ring_degree) * heads.local_kv_heads(rank) * head_dim
    ring_kv = (steps - 1) * 2 * part * element_size
    fwd = a2a["fwd"] * token_bytes + ring_kv
    bwd = a2a["bwd"] * token_bytes + ring_kv + (steps * 2 * part * 4 if steps > 1 else 0)
    return {"fwd": fwd, "bwd": bwd, "fwd_bwd": fwd + bwd}


def ring_work(
    seq_len: int, ring_degree: int, layout: str, causal: bool, cu_seqlens: torch.Tensor | None = None
) -> list[dict[str, int]]:
    """Per ring rank: attending (q, k) ``pairs`` and computed rectangle ``area`` (causality inside a block not
    credited), per batch row and head, summed over the ring steps of one forward; plus the ring ``steps`` run
    (fewer than ``R`` only with documents)."""
    every = [
        plan_ring_blocks(seq_len, ring_degree, r, layout, causal, cu_seqlens) for r in range(ring_degree)
    ]
    steps = ring_steps_needed(every)
    work = []
    for plans in every:
        blocks = [b for b in plans if b is not None]
        work.append(
            {
                "pairs": sum(b.pairs() for b in blocks),
                "area": sum((b.q_end - b.q_start) * (b.k_end - b.k_start) for b in blocks),
                "steps": steps,
            }
        )
    return work


def imbalance(values: list[int | float]) -> float:
    """max / mean (1.0 = perfectly balanced)."""
    mean = sum(values) / len(values)
    return max(values) / mean if mean else 1.0
