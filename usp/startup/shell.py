"""The ``run()`` shell of ``usp-train`` and ``usp-eval``: the device, the process group, the job, the group's end."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as dist

from usp.config import TrainConfig
from usp.parallel.process_group import init_distributed, resolve_device

T = TypeVar("T")


def run_in_process_group(
    cfg: TrainConfig,
    job: Callable[[TrainConfig, torch.device], T],
    *,
    cpu_offload: Callable[[torch.device], bool] | None = None,
) -> T:
    """``job(cfg, device)`` on ``trainer.device`` inside a process group (:func:`usp.parallel.process_group.init_distributed`:
    reuse an initialized one, else the launcher's, else a one-process world; ``parallel.backend``,
    ``parallel.timeout_minutes``). A group created here is destroyed here, whatever ``job`` raised; one that
    existed before is left as it was. ``cpu_offload(device)``: whether FSDP2 keeps states in host memory (the
    backend then also needs a CPU path)."""
    device = resolve_device(cfg.trainer.device)
    created = init_distributed(
        device,
        cfg.parallel.backend,
        timeout_minutes=cfg.parallel.timeout_minutes,
        cpu_offload=bool(cpu_offload(device)) if cpu_offload is not None else False,
    )
    try:
        return job(cfg, device)
    finally:
        if created:
            dist.destroy_process_group()
