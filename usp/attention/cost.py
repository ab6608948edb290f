"""Analytic traffic and work of one ``usp_attention`` call, per rank (what the benchmark measures against).

Notation: ``B`` batch, ``S`` global tokens, ``U`` ulysses, ``R`` ring, ``L = S / (R U)`` local tokens, ``D``
head dim, ``e`` bytes per element of q/k/v, ``Hk' = Hkv`` when ``U`` divides ``Hkv``, else ``U`` (GQA
replication: one KV head per Ulysses rank), ``A(H) = (U - 1) / U * B * L * H * D * e`` (one all-to-all of an
``H``-head tensor: everything but the piece a rank keeps), ``P = B * (S / R) * (Hk' / U) * D`` (elements of one
K or V part on the ring).

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
from usp.attention.ulysses import kv_replication


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
) -> dict[str, int]:
    """Bytes one rank sends per call: ``{"fwd": ..., "bwd": ..., "fwd_bwd": ...}`` (see the module docstring).

    ``ring_steps``: steps the ring runs (``R`` unless document masking lets it stop early, see
    :func:`usp.attention.blocks.ring_steps_needed`); the ring terms use it in place of ``R``.
    """
    u = ulysses_degree
    local = seq_len // (u * ring_degree)
    steps = ring_degree if ring_steps is None else ring_steps
    hk = num_kv_heads * kv_replication(num_heads, num_kv_heads, u)

    def a2a(heads: int) -> int:
        return (u - 1) * batch * local * heads * head_dim * element_size // u

    part = batch * (seq_len // ring_degree) * (hk // u) * head_dim
    ring_kv = (steps - 1) * 2 * part * element_size
    fwd = 2 * a2a(num_heads) + 2 * a2a(hk) + ring_kv
    bwd = 2 * a2a(num_heads) + 2 * a2a(hk) + ring_kv + (steps * 2 * part * 4 if steps > 1 else 0)
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
