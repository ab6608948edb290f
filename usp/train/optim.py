"""AdamW, linear warmup + cosine decay, and gradient clipping by the global norm across FSDP shards.

``optim.name`` picks the AdamW implementation (:data:`usp.modes.OPTIMIZERS`): ``adamw`` and
``adamw_cpu_offload`` use ``torch.optim.AdamW`` (the second with the states on the host, see
:func:`usp.config.states_on_host`), always with torch's fused kernel: on the host CPU it steps about 5x faster
than the default for-each one, and on CUDA the for-each step allocates temporaries as large as the parameters
it updates (about 30 GiB for an 8B model), which the fused one does not and the planner does not count; ``deepspeed_cpu_adam`` uses DeepSpeed's vectorized C++ CPU Adam
(:class:`ShardedCPUAdam`), for states that live on the host. DeepSpeed compiles that op on first use (about
2 minutes on 2 cores), once per machine and version set: :func:`usp.train.deepspeed_parts.load_cpu_adam_op`
caches it in ``~/.cache/usp/ops/cpu_adam-<key>`` (``XDG_CACHE_HOME``), shared by every virtualenv.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim.lr_scheduler import LambdaLR

from usp.config import OptimConfig
from usp.modes import OPTIMIZERS
from usp.train.deepspeed_parts import import_deepspeed_part, load_cpu_adam_op


def _import_cpu_adam() -> type:
    return import_deepspeed_part(
        "deepspeed.ops.adam",
        "DeepSpeedCPUAdam",
        setting="optim.name=deepspeed_cpu_adam",
        alternative="optim.name=adamw_cpu_offload (torch's fused AdamW on the host)",
    )


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def sharded_cpu_adam(
    groups: list[dict], *, lr: float, betas: tuple[float, float], eps: float
) -> torch.optim.Optimizer:
    """DeepSpeed's ``DeepSpeedCPUAdam`` (AdamW mode) over FSDP2's sharded DTensor parameters on the host.

    DeepSpeed's ``step`` hands ``p.data`` to its C++ op, which needs plain tensors; this subclass passes each
    rank's local shard instead (the parameter, its gradient and the two moments, which are DTensors shaped
    like the parameter so that distributed checkpoints reshard them like torch AdamW's). Same update as
    ``torch.optim.AdamW`` (fp32; equal to rounding).
    """
    base = _import_cpu_adam()
    load_cpu_adam_op()  # from the per-machine cache: DeepSpeedCPUAdam.__init__'s own load() then finds it

    class ShardedCPUAdam(base):  # type: ignore[misc, valid-type]
        @torch.no_grad()
        def step(self, closure: Any = None) -> Any:
            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            for group in self.param_groups:
                beta1, beta2 = group["betas"]
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    if _local(p).device.type != "cpu":
                        raise ValueError(
                            "optim.name=deepspeed_cpu_adam steps on the host: the sharded parameters must be in "
                            "host memory (on CUDA set parallel.cpu_offload=true, which this optimizer implies)."
                        )
                    state = self.state[p]
                    if not state:
                        state["step"] = 0
                        state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                        state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
                    state["step"] += 1
                    self.ds_opt_adam.adam_update(
                        self.opt_id,
                        state["step"],
                        group["lr"],
                        beta1,
                        beta2,
                        group["eps"],
                        group["weight_decay"],
                        group["bias_correction"],
                        _local(p),
                        _local(p.grad),
                        _local(state["exp_avg"]),
                        _local(state["exp_avg_sq"]),
                    )
            return loss

    return ShardedCPUAdam(groups, lr=lr, betas=betas, eps=eps, adamw_mode=True)


def check_optim_config(cfg: OptimConfig, max_steps: int) -> None:
    """``ValueError`` naming the setting for out-of-range optimizer settings (pure; no tensors)."""
    if cfg.name not in OPTIMIZERS:
        raise ValueError(f"optim.name={cfg.name!r} is invalid; choose one of {', '.join(OPTIMIZERS)}.")
    if cfg.name == "deepspeed_cpu_adam":
        _import_cpu_adam()
    if not cfg.lr > 0:
        raise ValueError(f"optim.lr={cfg.lr} must be > 0.")
    if cfg.weight_decay < 0:
        raise ValueError(f"optim.weight_decay={cfg.weight_decay} must be >= 0.")
    if len(cfg.betas) != 2 or not all(0 <= b < 1 for b in cfg.betas):
        raise ValueError(f"optim.betas={tuple(cfg.betas)} must be two numbers in [0, 1).")
    if cfg.warmup_steps < 0:
        raise ValueError(f"optim.warmup_steps={cfg.warmup_steps} must be >= 0.")
    if not 0 <= cfg.min_lr_ratio <= 1:
        raise ValueError(f"optim.min_lr_ratio={cfg.min_lr_ratio} must be in [0, 1].")
    if cfg.grad_clip < 0:
        raise ValueError(f"optim.grad_clip={cfg.grad_clip} must be >= 0 (0 disables clipping).")
    if max_steps < 1:
        raise ValueError(f"trainer.max_steps={max_steps} must be >= 1.")


def schedule_warnings(cfg: OptimConfig, max_steps: int) -> list[str]:
    """What is legal but almost surely not meant in the schedule (the trainer logs it on rank 0)."""
    if cfg.warmup_steps > max_steps:
        return [
            f"optim.warmup_steps={cfg.warmup_steps} > trainer.max_steps={max_steps}: the learning rate never "
            f"reaches optim.lr={cfg.lr:g} and never decays (the run ends inside the warmup); set "
            f"optim.warmup_steps below trainer.max_steps (e.g. optim.warmup_steps={max_steps // 10})."
        ]
    return []


def lr_factor(step: int, *, warmup_steps: int, max_steps: int, min_lr_ratio: float) -> float:
    """Multiplier of ``optim.lr`` for optimizer step ``step`` (0-based).

    Linear warmup ``(step + 1) / warmup_steps`` over the first ``warmup_steps`` steps, then cosine from 1 down
    to ``min_lr_ratio`` at ``max_steps``.
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    decay_steps = max(1, max_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_optimizer(
    model: nn.Module, cfg: OptimConfig, *, max_steps: int
) -> tuple[torch.optim.Optimizer, LambdaLR]:
    """AdamW (no weight decay on biases, norms and other 1-D parameters) and its warmup-cosine scheduler.

    ``cfg.name``: ``adamw`` / ``adamw_cpu_offload`` -> ``torch.optim.AdamW`` (it steps where the parameters
    are: the host under FSDP2 CPU offload; always fused, see the module docstring); ``deepspeed_cpu_adam`` ->
    :func:`sharded_cpu_adam`.
    """
    check_optim_config(cfg, max_steps)
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    if cfg.name == "deepspeed_cpu_adam":
        optimizer = sharded_cpu_adam(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps)
    else:
        optimizer = torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, fused=True)
    scheduler = LambdaLR(
        optimizer,
        lambda step: lr_factor(
            step, warmup_steps=cfg.warmup_steps, max_steps=max_steps, min_lr_ratio=cfg.min_lr_ratio
        ),
    )
    return optimizer, scheduler


def reapply_schedule(optimizer: torch.optim.Optimizer, scheduler: LambdaLR, lr: float) -> None:
    """After loading a checkpoint: make the next step's learning rate the one this run's schedule gives.

    A loaded optimizer carries the saved run's current lr and a loaded scheduler its base lr, so a resume with
    a larger ``trainer.max_steps`` (or another ``optim.lr``) would take its first step on the old schedule.
    The schedule functions are this run's (``LambdaLR`` does not save them); this sets ``base_lr = lr`` and
    every group's lr to ``lr * factor(last_epoch)``.
    """
    scheduler.base_lrs = [lr for _ in optimizer.param_groups]
    for group, fn in zip(optimizer.param_groups, scheduler.lr_lambdas):
        group["initial_lr"] = lr
        group["lr"] = lr * fn(scheduler.last_epoch)
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]


@torch.no_grad()
def clip_grad_norm(parameters: Iterable[torch.Tensor], max_norm: float) -> float:
    """Clip gradients to ``max_norm`` by their global L2 norm; return the norm before clipping.

    With FSDP2 the gradients are sharded DTensors: the norm of each is a DTensor whose ``full_tensor()``
    reduces the partial sums of squares over the shard axis (and not over replicas under HSDP), so every rank
    gets the norm of the whole, unsharded gradient. ``max_norm == 0`` only measures; a non-finite norm is
    returned without clipping (the step will be skipped, see :func:`usp.train.step.train_step`).
    """
    params = [p for p in parameters if p.grad is not None]
    grads = [p.grad for p in params]
    if not grads:
        return 0.0
    total = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
    if isinstance(total, DTensor):
        total = total.full_tensor()
    norm = float(total.item())
    if max_norm > 0 and math.isfinite(norm):
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return norm
