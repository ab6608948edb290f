"""What to say when no layout fits: why, and the nearest requests that would fit (each found by searching again)."""

from __future__ import annotations

from typing import Any

from usp.plan.hardware import DeviceSpec
from usp.plan.models import ModelSpec
from usp.plan.offload import OFFLOAD_OPTIMIZER
from usp.plan.search import LayoutEstimate, enumerate_layouts


def _fits(model: ModelSpec, device: DeviceSpec, **kw: Any) -> LayoutEstimate | None:
    try:
        candidates, _ = enumerate_layouts(model, device, **kw)
    except ValueError:
        return None
    fitting = [c for c in candidates if c.fits]
    return min(fitting, key=lambda c: c.mem_gib_per_gpu) if fitting else None


def explain_no_fit(
    model: ModelSpec,
    device: DeviceSpec,
    candidates: list[LayoutEstimate],
    rejected: list[str],
    kw: dict[str, Any],
) -> str:
    """Why nothing fits (the smallest need and its breakdown, or every rejection) and what would: more GPUs,
    a shorter sequence, full checkpointing (when it was ruled out), the states on the host (or that with a
    shorter sequence). ``kw`` are the :func:`usp.plan.search.enumerate_layouts` arguments of the search."""
    W, node, S = kw["world_size"], kw["node_size"], kw["seq_len"]
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
            model, device, **(kw | {"world_size": W * factor, "ulysses_degree": None, "ring_degree": None})
        )
        if hit:
            lines.append(
                f"  - more GPUs: {W * factor // node} nodes of {node} ({W * factor} GPUs), e.g. "
                f"ulysses={hit.ulysses_degree} ring={hit.ring_degree} at {hit.mem_gib_per_gpu:.1f} GiB"
            )
            break

    def longest_fitting(**extra: Any) -> tuple[int, LayoutEstimate] | None:
        seq = S // 2
        while seq >= 1024:
            hit = _fits(model, device, **(kw | {"seq_len": seq} | extra))
            if hit:
                return seq, hit
            seq //= 2
        return None

    shorter = longest_fitting()
    if shorter:
        lines.append(
            f"  - a shorter sequence: trainer.seq_len={shorter[0]} fits ({shorter[1].mem_gib_per_gpu:.1f} GiB)"
        )
    if kw["ac_modes"] is not None and "full" not in kw["ac_modes"]:
        hit = _fits(model, device, **(kw | {"ac_modes": ("full",)}))
        if hit:
            lines.append(
                f"  - activation checkpointing: parallel.activation_checkpointing=full "
                f"({hit.mem_gib_per_gpu:.1f} GiB)"
            )
    offload = (
        f"optim.name={OFFLOAD_OPTIMIZER} (parameters, gradients and optimizer states on the host, the step there)"
    )
    host = {"states": ("cpu_offload",)}
    if kw.get("states") == host["states"]:
        host = {}  # already tried
    hit = _fits(model, device, **(kw | host)) if host else None
    if hit:
        lines.append(f"  - offload: {offload} ({hit.mem_gib_per_gpu:.1f} GiB/GPU on device)")
    elif kw["loss_chunk_size"] > 1024:  # smaller [chunk, vocab] logits of the chunked loss, with the states offloaded
        small = _fits(model, device, **(kw | host | {"loss_chunk_size": 1024}))
        if small:
            lines.append(
                f"  - offload and smaller loss chunks: {offload} and trainer.loss_chunk_size=1024 "
                f"({small.mem_gib_per_gpu:.1f} GiB/GPU on device)"
            )
    if not hit and not shorter and host:
        both = longest_fitting(**host)
        if both:
            lines.append(
                f"  - offload and a shorter sequence: {offload} with trainer.seq_len={both[0]} "
                f"({both[1].mem_gib_per_gpu:.1f} GiB/GPU on device)"
            )
    if len(lines) == n_header:
        lines.append("  - nothing within 64x the GPUs or down to 1K tokens; use a device with more memory.")
    if kw["ac_modes"] is None:
        lines.append("(Full activation checkpointing was already tried in every layout above.)")
    lines.append("usp-plan --max-seq-len (instead of --seq-len) finds the longest sequence that fits.")
    return "\n".join(lines)
