"""Measured memory of a block of training code, on CUDA and on CPU: peak bytes and bytes held for backward.

``with track_memory(device) as mem: ...`` then read ``mem.peak_bytes``, ``mem.held_bytes`` and (CUDA only)
``mem.peak_reserved_bytes``:

- ``peak_bytes``: the highest number of bytes allocated on ``device`` during the block, above what was
  allocated when it started. CUDA: ``torch.cuda.max_memory_allocated`` (its window is reset on entry) minus
  ``memory_allocated`` at entry. CPU: the PyTorch profiler's allocation events (``profile_memory=True``): a
  running sum of every allocation and free the CPU allocator reports during the block, whose maximum is the
  peak. The profiler reports the free of a block only if the block was allocated while memory profiling was on
  (in this block or an earlier one: its CPU reporter keeps those sizes across profiling sessions); blocks
  allocated with no profiler running are freed silently, so on CPU the figure is an upper bound when the
  block frees such older tensors (a training step frees little it did not allocate: gradients are set to
  ``None`` at the end of the previous step, and a backward's frees of what its forward saved are reported
  when the forward ran under ``track_memory`` too).
- Garbage: on entry, and again at the end of the block (inside the window), :func:`gc.collect` runs, on both
  devices. Tensors held by unreachable reference cycles from before the block (a previous model, an earlier
  block's graph) are therefore freed before the window instead of at whatever allocation inside the block
  triggers Python's collector, which would lower the block's figures by memory the block never used (and
  when that happens depends on object counts, so on the torch version); the block's own cyclic garbage is
  freed before ``net_bytes`` is read, so ``net_bytes`` is what the block left reachable.
- ``held_bytes``: bytes autograd keeps for backward on ``device`` from what ran in the block: every tensor
  packed by ``torch.autograd.graph.saved_tensors_hooks`` while the block runs, each storage counted once,
  leaves that require grad (parameters) left out. Tensors saved under an inner hook are not seen: inside a
  checkpointed region only the region's inputs count (what the checkpoint keeps), and checkpointed inputs
  that :mod:`usp.train.checkpoint_offload` moves to the host do not count.
- ``net_bytes``: bytes allocated at the end of the block minus at its start (what the block left allocated,
  e.g. the activations a forward keeps for backward), with the same CPU caveat as ``peak_bytes``. A forward's
  ``net_bytes`` plus the backward's ``peak_bytes`` is the step's peak during backward.
- ``peak_reserved_bytes``: CUDA only (``None`` on CPU): the caching allocator's peak reserved bytes during the
  block, absolute (what an out-of-memory error depends on: allocated plus fragmentation).

The CPU profiler costs time (an event per allocation): measure in tests and benchmarks, not in training.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import saved_tensors_hooks

__all__ = ["MemoryReport", "cpu_peak_from_profile", "track_memory"]


@dataclass
class MemoryReport:
    """What :func:`track_memory` measured; filled in when the block exits (``held_bytes`` as it runs)."""

    device: torch.device
    peak_bytes: int = 0
    """Peak bytes allocated on ``device`` during the block, above the bytes allocated at its start."""
    held_bytes: int = 0
    """Bytes saved for backward on ``device`` by the block (each storage once; parameters excluded)."""
    net_bytes: int = 0
    """Bytes allocated on ``device`` at the end of the block minus at its start."""
    peak_reserved_bytes: int | None = None
    """CUDA: peak bytes reserved by the caching allocator during the block (absolute); ``None`` on CPU."""
    start_bytes: int = 0
    """Bytes allocated on ``device`` when the block started (CUDA; 0 on CPU, where it is not known)."""
    _storages: set[int] = field(default_factory=set, repr=False)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if t.device.type == self.device.type and not (t.is_leaf and t.requires_grad):
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key not in self._storages:
                self._storages.add(key)
                self.held_bytes += storage.nbytes()
        return t


def cpu_peak_from_profile(prof: torch.profiler.profile) -> tuple[int, int]:
    """``(peak, net)``: the maximum (>= 0) and the final value of the running sum of the CPU allocator's
    allocation events recorded by ``prof``, in bytes.

    ``prof`` must have been run with ``profile_memory=True``. Events are ordered by time over all threads
    (backward runs in autograd's threads on some devices).
    """
    from torch._C._profiler import _EventType

    events: list[tuple[int, int]] = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation:
            extra = node.extra_fields
            if extra.device.type == "cpu":
                events.append((node.start_time_ns, int(extra.alloc_size)))
        stack.extend(node.children)
    events.sort()
    live = peak = 0
    for _, delta in events:
        live += delta
        peak = max(peak, live)
    return peak, live


@contextmanager
def track_memory(device: torch.device | str) -> Iterator[MemoryReport]:
    """Measure the block's peak allocated bytes and the bytes it saves for backward on ``device``.

    Yields a :class:`MemoryReport` whose ``peak_bytes``, ``net_bytes`` and ``peak_reserved_bytes`` are set on
    exit. Measure a forward and its backward in two blocks: the hooks would otherwise also count what a
    backward's recomputation saves. On CUDA the
    device is synchronized on entry and exit, garbage is collected on entry and at the end of the block (module
    docstring), and the peak-memory window is reset on entry (so it does not
    nest with another CUDA peak measurement). On CPU it runs the PyTorch profiler (which does not nest either).
    """
    device = torch.device(device)
    report = MemoryReport(device=device)
    if device.type == "cuda":
        gc.collect()  # garbage from before the block is freed now, not inside the window (module docstring)
        torch.cuda.synchronize(device)
        report.start_bytes = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        with saved_tensors_hooks(report._pack, lambda t: t):
            yield report
        gc.collect()  # the block's own unreachable cycles do not count in net_bytes
        torch.cuda.synchronize(device)
        report.peak_bytes = max(0, torch.cuda.max_memory_allocated(device) - report.start_bytes)
        report.net_bytes = torch.cuda.memory_allocated(device) - report.start_bytes
        report.peak_reserved_bytes = torch.cuda.max_memory_reserved(device)
        return
    if device.type != "cpu":
        raise ValueError(f"track_memory: device {device} is not supported; use a cuda or cpu device.")
    from torch.profiler import ProfilerActivity, profile

    gc.collect()  # garbage from before the block is freed now, not inside the window (module docstring)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with saved_tensors_hooks(report._pack, lambda t: t):
            yield report
        gc.collect()  # inside the window: the block's own unreachable cycles do not count in net_bytes
    report.peak_bytes, report.net_bytes = cpu_peak_from_profile(prof)
