"""What to say when no layout fits: why, and the nearest requests that would fit (each found by searching again)."""

from __future__ import annotations

import math
from dataclasses import replace

from usp.longest import longest_passing
from usp.parallel.layout import sequence_multiple
from usp.plan.estimate import LayoutEstimate, enumerate_candidates
from usp.plan.hardware import DeviceSpec
from usp.plan.layout import SearchSpace, Workload
from usp.plan.offload import OFFLOAD_OPTIMIZER


def _fits(work: Workload, space: SearchSpace, device: DeviceSpec) -> LayoutEstimate | None:
    """The fitting layout of ``space`` that needs the least device memory, or None."""
    try:
        candidates, _ = enumerate_candidates(work, space, device)
    except ValueError:
        return None
    fitting = [c for c in candidates if c.fits]
    return min(fitting, key=lambda c: c.mem_gib_per_gpu) if fitting else None


def explain_no_fit(
    work: Workload,
    space: SearchSpace,
    device: DeviceSpec,
    candidates: list[LayoutEstimate],
    rejected: list[str],
) -> str:
    """Why nothing fits (the smallest need and its breakdown, or every rejection) and what would: more GPUs,
    a shorter sequence, full checkpointing (when it was ruled out), the states on the host (or that with a
    shorter sequence). ``candidates`` and ``rejected`` are what :func:`usp.plan.estimate.enumerate_candidates` made
    of ``work`` and ``space``; each suggestion is a search of a changed copy of them."""
    model = work.model
    W, node, S = space.world_size, space.node_size, work.seq_len
    lines = [
        f"no layout of {model.name} at seq_len={S} fits {W} x {device.name} ({device.memory_gib:g} GiB each)."
    ]
    if not candidates:
        lines.append("Every (ulysses, ring) pair was rejected:")
        lines += [f"  - {r}" for r in rejected[:12]]
        lines.append(
            "Fix: pick degrees from the valid splits above, or a seq_len that is a multiple of "
            "2 x ring x ulysses."
        )
        return "\n".join(lines)
    best = min(candidates, key=lambda c: c.mem_gib_per_gpu)
    lines.append(
        f"Smallest need: {best.mem_gib_per_gpu:.1f} GiB/GPU (ulysses={best.ulysses_degree} ring={best.ring_degree} "
        f"{best.fsdp_mode}, checkpointing {best.activation_checkpointing}); breakdown GiB: "
        + ", ".join(f"{k} {v:.1f}" for k, v in best.memory_gib.items())
    )
    lines.append("What would fit:")
    n_header = len(lines)
    for factor in (2, 4, 8, 16, 32, 64):
        hit = _fits(
            work, replace(space, world_size=W * factor, ulysses_degree=None, ring_degree=None), device
        )
        if hit:
            lines.append(
                f"  - more GPUs: {W * factor // node} nodes of {node} ({W * factor} GPUs), e.g. "
                f"ulysses={hit.ulysses_degree} ring={hit.ring_degree} at {hit.mem_gib_per_gpu:.1f} GiB"
            )
            break

    # every layout's sequence multiple divides 2 x world (zigzag: 2 x ring x ulysses), and 1024 keeps it round
    unit = math.lcm(1024, sequence_multiple(W, 1, work.ring_layout))

    def longest_fitting(space: SearchSpace = space) -> tuple[int, LayoutEstimate] | None:
        """The longest length below ``seq_len`` that some layout of ``space`` fits, on multiples of ``unit``
        (halving from half of it, then bisection: :func:`usp.longest.search_longest`), with that layout."""
        hits: dict[int, LayoutEstimate] = {}

        def passes(seq: int) -> bool:
            hit = _fits(replace(work, seq_len=seq), space, device)
            if hit:
                hits[seq] = hit
            return hit is not None

        seq = longest_passing(passes, start=S // 2, unit=unit, limit=S - 1)
        return (seq, hits[seq]) if seq else None

    shorter = longest_fitting()
    if shorter:
        lines.append(
            f"  - a shorter sequence: trainer.seq_len={shorter[0]} fits ({shorter[1].mem_gib_per_gpu:.1f} GiB)"
        )
    if space.ac_modes is not None and "full" not in space.ac_modes:
        hit = _fits(work, replace(space, ac_modes=("full",)), device)
        if hit:
            lines.append(
                f"  - activation checkpointing: parallel.activation_checkpointing=full "
                f"({hit.mem_gib_per_gpu:.1f} GiB)"
            )
    offload = f"optim.name={OFFLOAD_OPTIMIZER} (parameters, gradients and optimizer states on the host, the step there)"
    host = replace(space, states=("cpu_offload",))
    tried = space.states == host.states  # already searched with the states on the host
    hit = None if tried else _fits(work, host, device)
    if hit:
        lines.append(f"  - offload: {offload} ({hit.mem_gib_per_gpu:.1f} GiB/GPU on device)")
    elif (
        work.loss_chunk_size > 1024
    ):  # smaller [chunk, vocab] logits of the chunked loss, with the states offloaded
        small = _fits(replace(work, loss_chunk_size=1024), host, device)
        if small:
            lines.append(
                f"  - offload and smaller loss chunks: {offload} and trainer.loss_chunk_size=1024 "
                f"({small.mem_gib_per_gpu:.1f} GiB/GPU on device)"
            )
    if not hit and not shorter and not tried:
        both = longest_fitting(host)
        if both:
            lines.append(
                f"  - offload and a shorter sequence: {offload} with trainer.seq_len={both[0]} "
                f"({both[1].mem_gib_per_gpu:.1f} GiB/GPU on device)"
            )
    if len(lines) == n_header:
        lines.append(
            f"  - nothing within 64x the GPUs or down to {unit} tokens; use a device with more memory."
        )
    if space.ac_modes is None:
        lines.append("(Full activation checkpointing was already tried in every layout above.)")
    lines.append("usp-plan --max-seq-len (instead of --seq-len) finds the longest sequence that fits.")
    return "\n".join(lines)
