"""One optimizer step over a list of micro-batches: token-weighted loss, backward, clip, AdamW, schedule.

Split out of the trainer loop so tests can drive it with hand-made batches and compare against a plain,
single-process transformers model.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from usp.parallel import SPMesh
from usp.train.guard import all_finite
from usp.train.loss import count_targets, global_target_count
from usp.train.optim import clip_grad_norm

BATCH_KEYS: tuple[str, ...] = ("input_ids", "labels", "position_ids")


@dataclass
class StepResult:
    """What one optimizer step measured (identical on every rank except ``document_lengths``)."""

    loss: float
    """Mean cross-entropy over every target token of the step, on every rank of the job."""
    grad_norm: float
    """Global L2 norm of the gradient before clipping."""
    lr: float
    """Learning rate the step used."""
    num_targets: int
    """Target tokens in the whole step (all ranks, all micro-batches)."""
    tokens: int
    """Input tokens in the whole step (all data-parallel replicas, all micro-batches)."""
    step_time_s: float
    document_lengths: list[list[int]] = field(default_factory=list)
    """This data-parallel replica's document-piece lengths (one list per sample), for FLOP counting."""
    skipped: bool = False
    """The loss or the gradient norm was not finite on some rank, or the step had no target token at all: no
    optimizer step was taken (every rank)."""
    no_targets: bool = False
    """The step's micro-batches held no target token on any rank (e.g. chat rows whose assistant turns were all
    truncated away): nothing was run, ``loss`` is NaN, the step is skipped."""
    aux_loss: float | None = None
    """Mixture-of-experts models whose loss has a router term: the router load-balancing loss (mean over the
    micro-batches, without its coefficient; :mod:`usp.train.router_loss`). ``loss`` stays the cross-entropy."""
    expert_tokens: list[list[int]] | None = None
    """Top-k selections per MoE layer and expert, summed over every rank and micro-batch of the step."""
    preference: dict[str, float] | None = None
    """``trainer.objective=dpo`` (:func:`usp.train.dpo.dpo_step`): the means over the step's pairs of
    ``rewards_chosen``, ``rewards_rejected``, ``reward_margin``, ``reward_accuracy``, and ``pairs``."""


def batch_to_device(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    missing = [k for k in BATCH_KEYS if k not in batch]
    assert not missing, f"batch lacks {missing}; a batch is a dict with {BATCH_KEYS} (+ cu_seqlens)"
    out = {k: batch[k].to(device, non_blocking=True) for k in BATCH_KEYS}
    cu = batch.get("cu_seqlens")
    out["cu_seqlens"] = None if cu is None else cu.to(dtype=torch.int32)  # stays on the CPU: read on the host
    if batch.get("shared_prefix") is not None:  # DPO's shared prompt: on the CPU too
        out["shared_prefix"] = batch["shared_prefix"]
    return out


def skip_update(
    optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LRScheduler | None
) -> None:
    """A step that runs nothing (no target, no pair on any rank): no update; the schedule still advances."""
    optimizer.zero_grad(set_to_none=True)
    if scheduler is not None:
        scheduler.step()


def apply_update(
    loss_model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None,
    *,
    loss: float,
    grad_clip: float,
    group: dist.ProcessGroup,
    device: torch.device,
) -> tuple[float, bool]:
    """The end of a step once the gradients are accumulated: clip (the global norm), step the optimizer when
    the loss and the norm are finite on every rank of ``group`` (one MIN all-reduce of a flag), drop the
    gradients, advance the schedule. Returns ``(grad_norm, finite)``."""
    grad_norm = clip_grad_norm(loss_model.parameters(), grad_clip)  # no clipping when it is not finite
    finite = all_finite(math.isfinite(loss) and math.isfinite(grad_norm), group, device)
    if finite:
        optimizer.step()
    skip_update(optimizer, scheduler)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return grad_norm, finite


def _step_routing(
    loss_model: nn.Module, batches: list[dict[str, Any]], group: dist.ProcessGroup
) -> tuple[torch.Tensor, torch.Tensor]:
    """``model.router_loss_scope=step``: every micro-batch's forward without gradients, its routers' top-k
    counted; ``(counts [L, E], rows)`` over the step and every rank (one all_reduce)."""
    with torch.no_grad():
        packed = sum(
            loss_model(
                b["input_ids"],
                b["labels"],
                position_ids=b["position_ids"],
                cu_seqlens=b["cu_seqlens"],
                routing_only=True,
            )
            for b in batches
        )
    if dist.get_world_size(group) > 1:
        dist.all_reduce(packed, group=group)
    return packed[:-1].reshape(-1, loss_model.router_aux.num_experts), packed[-1]


def train_step(
    loss_model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None,
    micro_batches: Sequence[dict[str, Any]],
    *,
    mesh: SPMesh,
    grad_clip: float,
    device: torch.device | str = "cpu",
) -> StepResult:
    """Forward/backward every micro-batch, then clip, step and advance the schedule.

    A step without any target token (counted over every rank and micro-batch) runs nothing and is skipped
    (``StepResult.no_targets``); a micro-batch or a rank without targets contributes an exact zero to the loss
    and gradients (a sum over no tokens), never NaN. A non-finite loss or gradient norm (on any rank: every
    rank agrees, one MIN all-reduce of a flag) skips the optimizer step: the gradients are dropped and the weights and optimizer state stay as they were; the
    schedule still advances. ``StepResult.skipped`` says so.

    ``micro_batches``: this rank's slices (``input_ids``, ``labels``, ``position_ids`` ``[B, S_local]``;
    optional global ``cu_seqlens``; optional ``document_lengths``). The global target count of the whole
    step is all-reduced first (one collective over every rank), so each micro-batch's loss is its share of the
    step's global mean and the accumulated gradients equal the single-process gradient of that mean.
    """
    assert micro_batches, "train_step needs at least one micro-batch"
    device = torch.device(device)
    start = time.perf_counter()
    group = mesh.group("fsdp")
    batches = [batch_to_device(b, device) for b in micro_batches]
    local_targets = sum(count_targets(b["labels"]) for b in batches)
    num_targets = global_target_count(local_targets, group, device)
    lr = optimizer.param_groups[0]["lr"]
    tokens = sum(b["input_ids"].numel() for b in micro_batches) * mesh.sp_degree * mesh.dp_degree
    doc_lengths: list[list[int]] = []
    for b in micro_batches:
        doc_lengths.extend(
            b.get("document_lengths") or [[b["input_ids"].size(1) * mesh.sp_degree]] * b["input_ids"].size(0)
        )
    if num_targets == 0:  # every rank agrees (a global count): no forward, no division by zero, no update
        skip_update(optimizer, scheduler)
        return StepResult(
            loss=math.nan,
            grad_norm=math.nan,
            lr=lr,
            num_targets=0,
            tokens=tokens,
            step_time_s=time.perf_counter() - start,
            document_lengths=doc_lengths,
            skipped=True,
            no_targets=True,
        )

    loss_sum = torch.zeros(
        (), dtype=torch.float64, device=device
    )  # float64 so fp64 runs are reported exactly
    routed = getattr(loss_model, "router_aux", None) is not None
    aux_sum, expert_tokens, routing = 0.0, None, None
    aux_scale = 1.0 / len(batches)  # the router loss: the mean of the micro-batches' ...
    if routed and loss_model.router_scope == "step" and len(batches) > 1:
        routing = _step_routing(loss_model, batches, group)
        aux_scale = 1.0  # ... or each micro-batch's part of the step's, from the step's counts
    for b in batches:
        loss = loss_model(
            b["input_ids"],
            b["labels"],
            position_ids=b["position_ids"],
            cu_seqlens=b["cu_seqlens"],
            num_targets=num_targets,  # > 0; a rank (or micro-batch) without targets adds an exact 0
            aux_scale=aux_scale,
            **({} if routing is None else {"routing": routing}),
        )
        loss.backward()
        if routed:  # the reported loss is the cross-entropy; the router's is apart
            stats = loss_model.last_router_stats
            loss_sum += loss_model.last_cross_entropy.double()
            aux_sum += float(stats.aux) * aux_scale
            counts = stats.expert_tokens.round().long()
            if routing is not None:  # the step's counts already
                expert_tokens = counts
            else:
                expert_tokens = counts if expert_tokens is None else expert_tokens + counts
        else:
            loss_sum += loss.detach().double()
    if dist.get_world_size(group) > 1:
        dist.all_reduce(loss_sum, group=group)  # shares of the global mean -> the global mean
    loss_value = float(loss_sum.item())
    grad_norm, finite = apply_update(
        loss_model, optimizer, scheduler, loss=loss_value, grad_clip=grad_clip, group=group, device=device
    )
    return StepResult(
        loss=loss_value,
        grad_norm=grad_norm,
        lr=lr,
        num_targets=num_targets,
        tokens=tokens,
        step_time_s=time.perf_counter() - start,
        document_lengths=doc_lengths,
        skipped=not finite,
        aux_loss=aux_sum if routed else None,
        expert_tokens=None if expert_tokens is None else expert_tokens.tolist(),
    )
