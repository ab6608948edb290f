"""Process-group and device setup: the one home for starting ``torch.distributed`` in a job.

``usp-train``, ``usp-eval`` and the throughput benchmark start the same way: :func:`resolve_device` picks this
rank's device from ``trainer.device``, :func:`init_distributed` joins (or creates) the default process group.
Reuse an initialized group (tests, notebooks), else meet in the launcher's store (torchrun), else a one-process
world; nccl on CUDA, gloo on CPU. Only a group created here should be destroyed by its caller.

**Store per restart.** torchrun hosts one TCPStore in its agent for the whole job and points every worker at
it (``MASTER_ADDR:MASTER_PORT``, ``TORCHELASTIC_USE_AGENT_STORE=True``); after ``--max-restarts`` restarts
the workers, the new workers meet in the *same* store, where the previous attempt's keys still are (gloo's
peer addresses, NCCL's unique id). ``init_process_group(init_method="env://")`` uses that store without a
per-attempt prefix, so a restarted rank can read a dead peer's address: gloo fails with "connectFullMesh
failed ... Connection refused" or hangs, depending on which rank writes first (2 failures in 6 restarts of a
plain gloo script on torch 2.13, docs/launch.md). :func:`launcher_store` opens the same store and prefixes
every key with the restart count (``TORCHELASTIC_RESTART_COUNT``), so each attempt sees only its own keys.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, MutableMapping
from datetime import timedelta

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

ALLOC_CONF_VAR = "PYTORCH_CUDA_ALLOC_CONF"
ALLOC_CONF = "expandable_segments:True"
"""What usp sets ``PYTORCH_CUDA_ALLOC_CONF`` to unless the user set it: CUDA's caching allocator then grows
segments in place instead of caching fixed-size blocks per stream, so the sequence-long activations of
different sizes, and blocks freed on FSDP2's and checkpoint offload's side streams, do not fragment device
memory (the planner's fragmentation allowance assumes it, :mod:`usp.plan.memory`)."""

STORE_PREFIX = "usp/restart_"
"""Every key of a launched job's store is under ``usp/restart_<TORCHELASTIC_RESTART_COUNT>/``."""


def restart_count(env: Mapping[str, str] | None = None) -> int:
    """How many times torchrun has restarted the workers (0 on the first attempt, and without torchrun)."""
    env = os.environ if env is None else env
    value = env.get("TORCHELASTIC_RESTART_COUNT", "0")
    return int(value) if value.isdigit() else 0


def launcher_store(timeout: timedelta, env: Mapping[str, str] | None = None) -> dist.Store:
    """The launcher's store (``MASTER_ADDR:MASTER_PORT``), with keys private to this restart attempt.

    Under torchrun the agent hosts the store (every rank is a client); under another ``env://`` launcher
    rank 0 hosts it, as ``init_method="env://"`` would. Pass the result to
    ``init_process_group(store=..., rank=RANK, world_size=WORLD_SIZE)``.
    """
    env = os.environ if env is None else env
    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    agent_hosts = env.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
    store = dist.TCPStore(
        env.get("MASTER_ADDR", "localhost"),
        int(env.get("MASTER_PORT", "29500")),
        world,
        is_master=not agent_hosts and rank == 0,
        timeout=timeout,
        multi_tenant=True,  # as env:// does: another group of this process may share the port
    )
    return dist.PrefixStore(f"{STORE_PREFIX}{restart_count(env)}", store)


def configure_cuda_allocator(env: MutableMapping[str, str] | None = None) -> str:
    """Set :data:`ALLOC_CONF_VAR` to :data:`ALLOC_CONF` unless it is set (before CUDA's allocator starts: it
    reads the variable once, at its first allocation); log which one the run uses. Returns the value."""
    env = os.environ if env is None else env
    if env is os.environ and torch.cuda.is_initialized():
        log.warning(
            "CUDA was initialised before usp could set %s: the allocator keeps its settings", ALLOC_CONF_VAR
        )
    if ALLOC_CONF_VAR in env:
        log.info(
            "%s=%s (set by the user; usp's default is %s)", ALLOC_CONF_VAR, env[ALLOC_CONF_VAR], ALLOC_CONF
        )
    else:
        env[ALLOC_CONF_VAR] = ALLOC_CONF
        log.info("%s=%s (set by usp: unset before; set it to choose another)", ALLOC_CONF_VAR, ALLOC_CONF)
    return env[ALLOC_CONF_VAR]


def resolve_device(setting: str) -> torch.device:
    """``trainer.device``: ``auto`` -> this rank's CUDA device if there is one, else CPU. Configures CUDA's
    allocator first (:func:`configure_cuda_allocator`): this is where a job first touches CUDA."""
    if setting not in ("auto", "cuda", "cpu"):
        raise ValueError(f"trainer.device={setting!r} is invalid; choose auto, cuda or cpu.")
    if setting != "cpu":
        configure_cuda_allocator()
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
    Under a launcher the group meets in :func:`launcher_store` (the launcher's store, keys
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
