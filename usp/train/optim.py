"""AdamW, linear warmup + cosine decay, and gradient clipping by the global norm across FSDP shards."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim.lr_scheduler import LambdaLR

from usp.config import OptimConfig


def check_optim_config(cfg: OptimConfig, max_steps: int) -> None:
    """``ValueError`` naming the setting for out-of-range optimizer settings (pure; no tensors)."""
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
) -> tuple[torch.optim.AdamW, LambdaLR]:
    """AdamW (no weight decay on biases, norms and other 1-D parameters) and its warmup-cosine scheduler."""
    check_optim_config(cfg, max_steps)
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps)
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
