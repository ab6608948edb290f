"""Peak memory probes of a training rank, per logged step: CUDA allocated / reserved (reset per window), else
the process's peak resident set; the max over ranks."""

from __future__ import annotations

import sys
from typing import Any

from usp.host import peak_rss_bytes
from usp.units import GIB


def peak_memory_gib() -> float:
    """Peak memory of this process: CUDA max allocated since the last :func:`reset_peak_memory` when CUDA is in
    use, else the process's peak resident set since it started (CPU runs: not reset per step)."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.max_memory_allocated() / GIB
    return peak_rss_bytes() / GIB


def peak_memory_reserved_gib() -> float | None:
    """CUDA: peak bytes reserved by the caching allocator since the last :func:`reset_peak_memory`, in GiB
    (allocated plus cached free blocks: what an out-of-memory error depends on). ``None`` without CUDA."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.max_memory_reserved() / GIB
    return None


def reset_peak_memory() -> None:
    """Start a new CUDA peak-memory window (no-op without CUDA: the CPU figure is the process peak RSS)."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.reset_peak_memory_stats()


def max_over_ranks(value: float, device: Any = "cpu") -> float:
    """``value`` all-reduced with MAX over every rank (one float64 all_reduce on ``device``; nccl needs the
    rank's CUDA device); ``value`` itself without a multi-rank process group."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return float(value)
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())
