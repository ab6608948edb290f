"""Process-group and device setup: the one home for starting ``torch.distributed`` in a job.

``usp-train``, ``usp-eval`` and the throughput benchmark start the same way: :func:`resolve_device` picks this
rank's device from ``trainer.device``, :func:`init_distributed` joins (or creates) the default process group.
Reuse an initialized group (tests, notebooks), else meet in the launcher's store (torchrun), else a one-process
world; nccl on CUDA, gloo on CPU. Only a group created here should be destroyed by its caller.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from usp.train.elastic import launcher_store


def resolve_device(setting: str) -> torch.device:
    """``trainer.device``: ``auto`` -> this rank's CUDA device if there is one, else CPU."""
    if setting not in ("auto", "cuda", "cpu"):
        raise ValueError(f"trainer.device={setting!r} is invalid; choose auto, cuda or cpu.")
    if setting == "cuda" and not torch.cuda.is_available():
        raise ValueError("trainer.device=cuda but no CUDA device is visible; use trainer.device=cpu or auto.")
    if setting == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())


def init_distributed(
    device: torch.device, backend: str | None = None, *, timeout_minutes: int = 60, cpu_offload: bool = False
) -> bool:
    """Initialize torch.distributed unless it already is; returns whether this call created the group.

    ``timeout_minutes`` (``parallel.timeout_minutes``) bounds every collective wait: long enough for rank 0's
    start-up data preparation and a large checkpoint save, short enough that a dead peer ends the job.
    ``cpu_offload`` (``parallel.cpu_offload``) with nccl adds gloo for CPU tensors (``cpu:gloo,cuda:nccl``): the
    offloaded shards are CPU tensors in the weight broadcast and the gradient-norm all-reduce.
    Under a launcher the group meets in :func:`usp.train.elastic.launcher_store` (the launcher's store, keys
    private to each ``torchrun --max-restarts`` attempt), not ``env://``, whose keys a restart would reuse.
    """
    if dist.is_initialized():
        return False
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = backend or ("nccl" if device.type == "cuda" else "gloo")
    if cpu_offload and backend == "nccl":
        backend = "cpu:gloo,cuda:nccl"
    timeout = timedelta(minutes=timeout_minutes)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # a launcher; keys private to this restart
        store = launcher_store(timeout)
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    else:  # one process, no launcher
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    return True
