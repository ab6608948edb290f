"""The longest sequence a model trains at on a cluster (``usp-plan --max-seq-len``).

For every candidate of :func:`usp.plan.search.enumerate_layouts` without the sequence length (Ulysses and ring
degrees, FSDP mode, checkpointing, where the states live), the longest length that fits is found by doubling
then bisection (:func:`usp.longest.longest_passing`): every memory term grows with the sequence, so "fits" is
monotone in it. Lengths are multiples of the layout's granularity: the sequence multiple the trainer requires (``2 x ring x ulysses`` for zigzag),
``ulysses x ring x`` the largest MLP tile count (so every tile count divides the local tokens) and
``--seq-multiple`` (1024 by default). With ``mlp_tiles`` on ``auto`` a length fits when it fits with the most
tiles; the answer then reports the fewest tiles that fit. Ring attention's head chunks
(``parallel.attn_head_chunks``, :func:`usp.plan.search.head_chunk_candidates`) are searched the same way: a
length fits when it fits with the most chunks the layout's heads allow, and the answer reports the fewest
that fit (after the tiles). Smaller loss chunks (``trainer.loss_chunk_size``,
:data:`LOSS_CHUNK_CANDIDATES` unless one is given) shrink the ``[chunk, vocab]`` fp32 logits of the chunked
loss; the largest chunk that reaches a candidate's longest length is kept. The answer is the longest length
over all candidates; among candidates that reach it, the fastest (then fewer tricks).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from usp.longest import longest_passing
from usp.parallel.layout import sequence_multiple
from usp.plan.estimate import (
    LayoutEstimate,
    base_candidates,
    estimate_layout,
    head_chunks_to_try,
    mlp_tile_candidates,
    valid_pairs,
)
from usp.plan.hardware import DeviceSpec
from usp.plan.layout import STATE_PLACEMENTS, Candidate, SearchSpace, Workload
from usp.plan.lora import LoraPlan
from usp.plan.memory import check_moe_tiles
from usp.plan.models import ModelSpec

SEQ_MULTIPLE = 1024
LOSS_CHUNK_CANDIDATES: tuple[int, ...] = (4096, 2048, 1024)
TRAINER_LOSS_CHUNK = 4096  # trainer.loss_chunk_size's default
SEQ_LIMIT = 2**31
"""No search goes past this many tokens (the answer says when it hit the limit)."""


@dataclass
class MaxSeqLenEstimate:
    """The longest length of one candidate and what the cost model predicts there."""

    max_seq_len: int
    granularity: int
    estimate: LayoutEstimate
    loss_chunk_size: int = TRAINER_LOSS_CHUNK

    def overrides(self) -> list[str]:
        """Hydra overrides that train this layout at this length."""
        out = self.estimate.overrides() + [f"trainer.seq_len={self.max_seq_len}"]
        if self.loss_chunk_size != TRAINER_LOSS_CHUNK:
            out.append(f"trainer.loss_chunk_size={self.loss_chunk_size}")
        return out

    def to_dict(self) -> dict[str, Any]:
        e = self.estimate
        return {
            "max_seq_len": self.max_seq_len,
            "ulysses_degree": e.ulysses_degree,
            "ring_degree": e.ring_degree,
            "dp_degree": e.dp_degree,
            "fsdp_mode": e.fsdp_mode,
            "activation_checkpointing": e.activation_checkpointing,
            "mlp_tiles": e.mlp_tiles,
            "attn_head_chunks": e.attn_head_chunks,
            "states": e.states,
            "mem_gib_per_gpu": round(e.mem_gib_per_gpu, 3),
            "host_mem_gib_per_node": round(e.host_mem_gib_per_node, 3),
            "step_time_s": e.step_time_s,
            "tokens_per_s_per_gpu": e.tokens_per_s_per_gpu,
            "mfu": round(e.mfu, 4),
            "granularity": self.granularity,
            "loss_chunk_size": self.loss_chunk_size,
            "memory_gib": {k: round(v, 3) for k, v in e.memory_gib.items()},
            "time_s": e.time_s,
            "overrides": self.overrides(),
        }


def max_seq_lens(
    model: ModelSpec,
    device: DeviceSpec,
    *,
    world_size: int,
    node_size: int,
    ring_layout: str = "zigzag",
    ulysses_degree: int | None = None,
    ring_degree: int | None = None,
    ac_modes: tuple[str, ...] | None = None,
    fsdp_modes: tuple[str, ...] | None = None,
    states: tuple[str, ...] = STATE_PLACEMENTS,
    mlp_tiles: int | None = None,
    attn_head_chunks: int | None = None,
    loss_chunk_sizes: tuple[int, ...] = (TRAINER_LOSS_CHUNK,),
    overhead_frac: float = 0.05,
    compute_bytes: int = 2,
    headroom_gib: float | None = None,
    seq_multiple: int = SEQ_MULTIPLE,
    limit: int = SEQ_LIMIT,
    lora: LoraPlan | None = None,
) -> list[MaxSeqLenEstimate]:
    """The longest fitting length of every candidate that fits at all, longest first (then fastest, then
    fewer tricks). ``mlp_tiles`` and ``attn_head_chunks`` None are ``auto`` (a fixed head chunk count is
    kept only for layouts whose heads it splits); ``loss_chunk_sizes`` the chunks to try, largest first;
    ``lora``: LoRA adapters on a frozen base (:mod:`usp.plan.lora`; ``None``: full training).
    Raises ``ValueError`` when nothing fits at the smallest
    length, or on bad input."""
    if world_size < 1 or node_size < 1 or world_size % min(node_size, world_size):
        raise ValueError(f"world size {world_size} is not a multiple of the node size {node_size}.")
    if seq_multiple < 1:
        raise ValueError(f"--seq-multiple={seq_multiple} must be >= 1.")
    if not loss_chunk_sizes or min(loss_chunk_sizes) < 1:
        raise ValueError(f"--loss-chunk-size={loss_chunk_sizes} must be >= 1.")
    chunks = sorted(set(loss_chunk_sizes), reverse=True)
    if mlp_tiles is not None and mlp_tiles < 1:
        raise ValueError(f"--mlp-tiles={mlp_tiles} must be >= 1 (or auto).")
    bad = [x for x in states if x not in STATE_PLACEMENTS]
    if bad:
        raise ValueError(f"states {bad} are invalid; choose from {STATE_PLACEMENTS}.")
    node = min(node_size, world_size)
    space = SearchSpace(
        world_size,
        node,
        ulysses_degree=ulysses_degree,
        ring_degree=ring_degree,
        fsdp_modes=fsdp_modes,
        ac_modes=ac_modes,
        mlp_tiles=mlp_tiles,
        attn_head_chunks=attn_head_chunks,
        states=tuple(states),
    )
    for name, value in (("ulysses_degree", ulysses_degree), ("ring_degree", ring_degree)):
        if value is not None and (value < 1 or world_size % value):
            raise ValueError(f"--{name.replace('_', '-')}={value} must divide the world size {world_size}.")
    # the length and the loss chunk are what the search varies
    work = Workload(
        model,
        limit,
        compute_bytes=compute_bytes,
        ring_layout=ring_layout,
        overhead_frac=overhead_frac,
        headroom_gib=headroom_gib,
        lora=lora,
    )
    out = longest_per_candidate(work, space, device, chunks, seq_multiple, limit)
    if not out:
        raise ValueError(
            f"no layout of {model.name} fits {world_size} x {device.name} ({device.memory_gib:g} GiB each) even "
            f"at the smallest length it allows: use more GPUs or a device with more memory."
        )
    out.sort(key=lambda m: (-m.max_seq_len, -m.estimate.tokens_per_s_per_gpu, m.estimate.tricks))
    return out


def longest_per_candidate(
    work: Workload, space: SearchSpace, device: DeviceSpec, chunks: list[int], seq_multiple: int, limit: int
) -> list[MaxSeqLenEstimate]:
    """For each candidate of ``space`` (``space.node_size`` at most the world), its longest fitting length
    with the largest of ``chunks`` that reaches it (``work.seq_len`` and ``work.loss_chunk_size`` are what
    varies; the rest of ``work`` is kept), unordered; candidates that fit at no length are left out. Raises
    ``ValueError`` when every (ulysses, ring) pair is rejected."""
    model = work.model
    check_moe_tiles(model, space.mlp_tiles)
    tile_counts = mlp_tile_candidates(model)  # none for a MoE: the trainer refuses MLP tiles there
    most_tiles = (tile_counts[-1] if tile_counts else 1) if space.mlp_tiles is None else space.mlp_tiles
    out: list[MaxSeqLenEstimate] = []
    valid, rejected = valid_pairs(model, space)
    pairs = len(valid) + len(rejected)
    for U, R, _ in valid:
        head_chunks = head_chunks_to_try(model, U, R, space.attn_head_chunks)
        if not head_chunks:
            rejected.append(
                f"ulysses={U} ring={R}: attn_head_chunks={space.attn_head_chunks} does not split its heads"
            )
            continue
        g = math.lcm(sequence_multiple(R, U, work.ring_layout), U * R * most_tiles, seq_multiple)
        for base in base_candidates(space, U, R):

            def estimate(
                seq: int,
                tiles: int = most_tiles,
                chunk: int = chunks[0],
                heads: int = head_chunks[-1],
                base: Candidate = base,
            ) -> LayoutEstimate:
                return estimate_layout(
                    replace(work, seq_len=seq, loss_chunk_size=chunk),
                    replace(base, mlp_tiles=tiles, attn_head_chunks=heads),
                    device,
                )

            by_chunk = [
                (longest_passing(lambda x, c=c: estimate(x, chunk=c).fits, g, g, limit), c) for c in chunks
            ]
            seq = max(x for x, _ in by_chunk)
            if not seq:
                continue
            chunk = next(c for x, c in by_chunk if x == seq)  # the largest chunk that gets there
            tiles = most_tiles
            if space.mlp_tiles is None:  # auto: the fewest tiles that fit at this length
                tiles = next(t for t in (1, *tile_counts) if estimate(seq, t, chunk).fits)
            # the fewest head chunks that fit
            heads = next(c for c in head_chunks if estimate(seq, tiles, chunk, c).fits)
            out.append(MaxSeqLenEstimate(seq, g, estimate(seq, tiles, chunk, heads), chunk))
    if rejected and len(rejected) == pairs:
        raise ValueError("every (ulysses, ring) pair was rejected: " + "; ".join(rejected[:8]))
    return out


def max_seq_len(model: ModelSpec, device: DeviceSpec, **kw: Any) -> MaxSeqLenEstimate:
    """The longest trainable length (:func:`max_seq_lens`' first answer)."""
    return max_seq_lens(model, device, **kw)[0]
