"""Which attention heads each Ulysses rank holds: even splits, GQA replication and uneven head counts.

After the Ulysses all-to-all, rank ``j`` of ``U`` holds the whole sequence for a contiguous range of query
heads, as even as the count allows: ``Hq // U`` heads, one more on the first ``Hq % U`` ranks. With GQA
(``G = Hq / Hkv`` query heads per KV head) it also needs every KV head its query heads read: the contiguous
range ``[first_q // G, last_q // G]``. A KV head whose group straddles two ranks is sent to both (this is the
old "replication" for ``Hkv < U``, now one rule for every case).

The local kernel runs GQA with a uniform group: local query head ``i`` reads local KV head ``i // g``. Rank
``j``'s query heads fall into its KV heads' groups in counts ``n_1, ..., n_m`` (e.g. SmolLM2's 9 query / 3 KV
heads at ``U = 2``: rank 0 holds query heads 0-4, three of KV head 0 and two of KV head 1); the rank takes
``g = gcd(n_1, ..., n_m)`` and, after receiving, repeats KV head ``h`` ``n_h / g`` times (3 and 2 copies here,
``g = 1``). Nothing is padded and no query head is computed twice: the attention FLOPs of a rank are exactly
its query heads' share. What uneven heads cost instead:

- the busiest rank holds ``ceil(Hq / U)`` query heads: attention time follows the busiest rank, so the step
  pays ``ceil(Hq / U) / (Hq / U)`` of the even split's attention (9 heads at U=2: 5 / 4.5 = 1.11; at U=4:
  3 / 2.25 = 1.33; Qwen2.5-7B's 28 at U=8: 4 / 3.5 = 1.14);
- straddling KV heads travel to two ranks, and local copies (``n_h / g > 1``) enlarge what the ring passes
  around and the K/V activations a rank keeps (:attr:`UlyssesHeads.max_local_kv_heads`).

When ``U`` divides ``Hq`` and ``Hkv`` (or ``Hkv`` divides ``U``) the layout is the classic one: ``Hq / U``
query and ``max(Hkv, U) / U`` K/V heads per rank, no copies. What still cannot work: more Ulysses ranks than
query heads (a rank would hold none) and ``Hq`` not a multiple of ``Hkv``.

Pure arithmetic, no torch: the attention, the trainer's checks, the cost model and the planner share it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache


@dataclass(frozen=True)
class UlyssesHeads:
    """The head layout of one Ulysses group (see the module docstring); build it with :func:`ulysses_heads`."""

    num_heads: int
    num_kv_heads: int
    ulysses_degree: int
    q_counts: tuple[int, ...]
    """Query heads per Ulysses rank (contiguous ranges in rank order)."""
    kv_firsts: tuple[int, ...]
    """First KV head each rank needs."""
    kv_copies: tuple[tuple[int, ...], ...]
    """Per rank, local copies of each KV head it needs (``n_h / g``); ``len`` = distinct KV heads received."""

    @property
    def group_size(self) -> int:
        """Query heads per KV head in the model (``G``)."""
        return self.num_heads // self.num_kv_heads

    def q_first(self, rank: int) -> int:
        """First query head of ``rank``."""
        return sum(self.q_counts[:rank])

    def kv_counts(self) -> tuple[int, ...]:
        """Distinct KV heads each rank receives from every rank (the K and V all-to-all's per-rank sizes)."""
        return tuple(len(c) for c in self.kv_copies)

    def local_kv_heads(self, rank: int) -> int:
        """K/V heads ``rank`` holds after its local copies (what its kernel and the ring see)."""
        return sum(self.kv_copies[rank])

    @property
    def even(self) -> bool:
        """Every rank holds the same query and K/V head counts, and no KV head is copied locally."""
        return (
            len(set(self.q_counts)) == 1
            and len({self.local_kv_heads(j) for j in range(self.ulysses_degree)}) == 1
            and all(c == 1 for copies in self.kv_copies for c in copies)
        )

    @property
    def max_q_heads(self) -> int:
        """Query heads of the busiest rank (``ceil(Hq / U)``): attention time follows it."""
        return max(self.q_counts)

    @property
    def max_local_kv_heads(self) -> int:
        """The most K/V heads a rank holds after the all-to-all and its copies (ring blocks, saved K/V)."""
        return max(self.local_kv_heads(j) for j in range(self.ulysses_degree))

    @property
    def total_local_kv_heads(self) -> int:
        """K/V heads summed over the ranks (``max(Hkv, U)`` in the classic layout): per-token K/V activations."""
        return sum(self.local_kv_heads(j) for j in range(self.ulysses_degree))

    def kv_send_index(self) -> list[int]:
        """The KV heads a rank sends, in destination order: rank ``j``'s range, then ``j + 1``'s (a head whose
        group straddles two ranks appears twice)."""
        return [f + i for f, c in zip(self.kv_firsts, self.kv_counts()) for i in range(c)]

    def kv_expand_index(self, rank: int) -> list[int] | None:
        """Indices into the KV heads ``rank`` received that give its local uniform-GQA layout; None when
        there are no copies (the received heads are used as they are)."""
        copies = self.kv_copies[rank]
        if all(c == 1 for c in copies):
            return None
        return [h for h, c in enumerate(copies) for _ in range(c)]

    def a2a_heads_sent(self, rank: int) -> dict[str, int]:
        """Heads (times this rank's ``L`` tokens; multiply by ``B * L * D * e``) that ``rank`` sends to the
        other ranks in one call's all-to-alls. ``fwd``: q in (``sum(q_j, j != rank)``), K and V in (the other
        ranks' KV heads), out back (``(U - 1) * q_rank``). ``bwd``: dout in, dq back, dK and dV back
        (``(U - 1) * kv_rank`` each: the gradients of what this rank received)."""
        u = self.ulysses_degree
        kv = self.kv_counts()
        q_in = sum(c for j, c in enumerate(self.q_counts) if j != rank)
        kv_in = sum(c for j, c in enumerate(kv) if j != rank)
        back = (u - 1) * self.q_counts[rank]
        return {"fwd": q_in + 2 * kv_in + back, "bwd": q_in + back + 2 * (u - 1) * kv[rank]}

    def busiest_rank(self) -> int:
        """The rank with the most query heads, then the most K/V heads (first on ties): the planner's rank."""
        return max(range(self.ulysses_degree), key=lambda j: (self.q_counts[j], self.local_kv_heads(j), -j))


@lru_cache(maxsize=256)
def ulysses_heads(num_heads: int, num_kv_heads: int, ulysses_degree: int) -> UlyssesHeads:
    """The head layout of ``ulysses_degree`` ranks for a model with ``num_heads`` query and ``num_kv_heads``
    KV heads. ``ValueError`` (naming the setting and the degrees that work) when it cannot exist."""
    hq, hkv, u = num_heads, num_kv_heads, ulysses_degree
    if hkv < 1 or hq < 1 or hq % hkv != 0:
        raise ValueError(f"num_heads={hq} is not a multiple of num_kv_heads={hkv} (GQA needs whole groups).")
    if isinstance(u, bool) or not isinstance(u, int) or not 1 <= u <= hq:
        raise ValueError(
            f"parallel.ulysses_degree={u} does not fit num_heads={hq}: every Ulysses rank needs at least one "
            f"query head. Use ulysses_degree in 1..{hq} (any of them; uneven head counts are split as evenly as "
            f"possible) and put the rest of the sequence parallelism in parallel.ring_degree."
        )
    g = hq // hkv
    base, extra = divmod(hq, u)
    q_counts = tuple(base + (j < extra) for j in range(u))
    kv_firsts, kv_copies = [], []
    start = 0
    for count in q_counts:
        first, last = start // g, (start + count - 1) // g
        per_kv = [min(start + count, (h + 1) * g) - max(start, h * g) for h in range(first, last + 1)]
        local_g = math.gcd(*per_kv)
        kv_firsts.append(first)
        kv_copies.append(tuple(n // local_g for n in per_kv))
        start += count
    return UlyssesHeads(hq, hkv, u, q_counts, tuple(kv_firsts), tuple(kv_copies))
