"""Preference optimization (``trainer.objective=dpo``): the DPO loss over sequence shards, exact.

Data: rows of ``data.format=preference`` (:mod:`usp.data`): each pair is two consecutive documents of one row,
``prompt + chosen`` (role 1) then ``prompt + rejected`` (role 2); ``loss_mask`` marks the completion tokens.
With ``trainer.dpo.shared_prompt`` the rejected document holds only the prompt's last token and the completion,
linked to the prompt in the chosen document (``shared_prefix``, passed to the attention): the same documents,
roles and targets, so nothing below changes.
A completion's log-probability ``pi`` is the sum of its target tokens' log-probabilities, which lie on several
sequence-parallel ranks. Per micro-batch:

1. each rank runs the model once and gets its **partial** per-document sums (:class:`usp.train.loss.
   ChunkedCausalLMLoss` with ``segments``: ``[B x D]``, a document ``d`` of row ``b`` is segment ``b D + d``);
2. one all_reduce over the sequence-parallel group of the detached partial sums and target counts gives every
   rank of the replica the *global* ``pi`` and ``n`` of every document;
3. the pair losses (:func:`pair_losses`) are computed from the global values, divided by the step's global
   pair count (all micro-batches, all data-parallel replicas: all-reduced once before the step), and their
   derivative ``g_d = dL / d pi_d`` taken (float64, autograd on the few global numbers);
4. each rank backpropagates ``sum_d g_d x (its partial pi_d)``. Since ``pi_d`` is the sum of the partials and
   the loss depends on them only through ``pi_d``, the ranks' gradients add up (FSDP2 sums them) to the
   gradient of the single-process loss.

Reference log-probabilities come from :mod:`usp.train.reference` (computed once, cached); ``simpo`` needs none.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from usp.parallel import SPMesh
from usp.train.loss import IGNORE_INDEX, global_target_count
from usp.train.step import StepResult, apply_update, batch_to_device, skip_update

OBJECTIVES: tuple[str, ...] = ("lm", "dpo")
"""``trainer.objective``."""
DPO_LOSS_TYPES: tuple[str, ...] = ("sigmoid", "ipo", "simpo")
"""``trainer.dpo.loss_type``; ``simpo`` is reference-free."""
ROLE_CHOSEN, ROLE_REJECTED = 1, 2
"""``document_roles`` of a preference row (0: padding)."""


@dataclass(frozen=True)
class DpoSpec:
    """``trainer.dpo.*``, checked."""

    beta: float = 0.1
    loss_type: str = "sigmoid"
    simpo_gamma: float = 0.5

    @property
    def needs_reference(self) -> bool:
        return self.loss_type != "simpo"


def check_dpo_spec(spec: DpoSpec) -> None:
    """``ValueError`` naming the setting for an impossible ``trainer.dpo`` setting."""
    if spec.loss_type not in DPO_LOSS_TYPES:
        raise ValueError(
            f"trainer.dpo.loss_type={spec.loss_type!r} is invalid; choose one of {list(DPO_LOSS_TYPES)}."
        )
    if not (math.isfinite(spec.beta) and spec.beta > 0):
        raise ValueError(f"trainer.dpo.beta={spec.beta!r} must be > 0 (e.g. 0.1 for DPO, 2.0 for SimPO).")
    if not math.isfinite(spec.simpo_gamma):
        raise ValueError(f"trainer.dpo.simpo_gamma={spec.simpo_gamma!r} must be a finite number.")


def row_pairs(roles: Sequence[int]) -> list[tuple[int, int]]:
    """The ``(chosen, rejected)`` document indices of one preference row (consecutive roles 1, 2)."""
    pairs = []
    k = 0
    while k < len(roles):
        if roles[k] == ROLE_CHOSEN:
            assert k + 1 < len(roles) and roles[k + 1] == ROLE_REJECTED, (
                f"document_roles {list(roles)}: unpaired"
            )
            pairs.append((k, k + 1))
            k += 2
        else:
            assert roles[k] == 0, (
                f"document_roles {list(roles)}: a rejected completion without its chosen one"
            )
            k += 1
    return pairs


def pair_losses(
    pi_c: torch.Tensor,
    pi_r: torch.Tensor,
    ref_c: torch.Tensor | None,
    ref_r: torch.Tensor | None,
    n_c: torch.Tensor,
    n_r: torch.Tensor,
    spec: DpoSpec,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(loss, reward_chosen, reward_rejected)`` per pair ``[P]`` from the completions' summed
    log-probabilities ``pi`` (policy), ``ref`` (reference; ``None`` for ``simpo``) and target counts ``n``.

    - ``sigmoid``: ``-log sigmoid(beta ((pi_c - ref_c) - (pi_r - ref_r)))``, rewards ``beta (pi - ref)``;
    - ``ipo``: ``((pi_c - ref_c) - (pi_r - ref_r) - 1 / (2 beta))^2``, rewards ``beta (pi - ref)``;
    - ``simpo``: ``-log sigmoid(beta (pi_c / n_c - pi_r / n_r) - simpo_gamma)``, rewards ``beta pi / n``.
    """
    beta = spec.beta
    if spec.loss_type == "simpo":
        reward_c, reward_r = beta * pi_c / n_c, beta * pi_r / n_r
        return -F.logsigmoid(reward_c - reward_r - spec.simpo_gamma), reward_c, reward_r
    assert ref_c is not None and ref_r is not None, (
        f"loss_type={spec.loss_type} needs reference log-probabilities"
    )
    logratio_c, logratio_r = pi_c - ref_c, pi_r - ref_r
    reward_c, reward_r = beta * logratio_c, beta * logratio_r
    if spec.loss_type == "ipo":
        return (logratio_c - logratio_r - 1.0 / (2.0 * beta)) ** 2, reward_c, reward_r
    return -F.logsigmoid(reward_c - reward_r), reward_c, reward_r


def step_pair_count(micro_batches: Sequence[dict[str, Any]], mesh: SPMesh, device: torch.device) -> int:
    """Pairs in the whole step: every micro-batch of every data-parallel replica (one all_reduce over dp)."""
    local = sum(len(row_pairs(roles)) for b in micro_batches for roles in b["document_roles"])
    return global_target_count(local, mesh.group("dp"), device)


def segment_forward(
    loss_model: nn.Module, micro: dict[str, Any], device: torch.device
) -> tuple[dict[str, Any], torch.Tensor, torch.Tensor]:
    """One forward of a preference micro-batch: ``(batch on the device, this rank's cross-entropy sums per
    segment [B x D], the segment ids [B, S_local])``."""
    b = batch_to_device(micro, device)
    segments, num_segments = _segments(micro, device)
    segment_ce = loss_model(
        b["input_ids"],
        b["labels"],
        position_ids=b["position_ids"],
        cu_seqlens=b["cu_seqlens"],
        segments=segments,
        num_segments=num_segments,
        shared_prefix=b.get("shared_prefix"),
    )
    return b, segment_ce, segments


def _segments(batch: dict[str, Any], device: torch.device) -> tuple[torch.Tensor, int]:
    """Segment ids ``[B, S_local]`` (document ``d`` of row ``b`` -> ``b D + d``) and ``B x D``."""
    index = batch["document_index"].to(device)  # [B, S_local]
    width = max(len(r) for r in batch["document_roles"])
    rows = torch.arange(index.size(0), device=device)[:, None]
    return index + rows * width, index.size(0) * width


def micro_batch_pairs(
    batch: dict[str, Any],
    labels: torch.Tensor,
    segment_ce: torch.Tensor,
    segments: torch.Tensor,
    *,
    mesh: SPMesh,
    spec: DpoSpec,
    reference: Any | None,
    total_pairs: int,
) -> tuple[torch.Tensor, dict[str, float]]:
    """This rank's surrogate for backward and the micro-batch's summed pair figures (this replica).

    ``segment_ce``: this rank's partial cross-entropy sums per segment ``[B x D]`` (differentiable). Collective
    over the sequence-parallel group (one all_reduce of ``2 B D`` numbers)."""
    num_segments = segment_ce.numel()
    valid = labels.reshape(-1) != IGNORE_INDEX
    counts = segment_ce.new_zeros(num_segments, dtype=torch.float64)
    counts.index_add_(
        0,
        segments.reshape(-1)[valid],
        torch.ones(int(valid.sum()), dtype=torch.float64, device=counts.device),
    )
    packed = torch.cat([segment_ce.detach().double(), counts])
    group = mesh.group("sp")
    if dist.get_world_size(group) > 1:
        dist.all_reduce(packed, group=group)
    logp = (-packed[:num_segments]).requires_grad_(True)  # float64 leaf: the global pi of every document
    n_tokens = packed[num_segments:]
    width = num_segments // len(batch["document_roles"])
    chosen, rejected, ref_c, ref_r = [], [], [], []
    for b, roles in enumerate(batch["document_roles"]):
        for c, r in row_pairs(roles):
            chosen.append(b * width + c)
            rejected.append(b * width + r)
            if reference is not None:
                row = int(batch["row_index"][b])
                ref_c.append(reference.get(row, c))
                ref_r.append(reference.get(row, r))
    figures = {"loss": 0.0, "reward_chosen": 0.0, "reward_rejected": 0.0, "correct": 0.0, "margin": 0.0}
    if not chosen:  # no pair here: still a backward (an exact zero), so every rank joins FSDP2's collectives
        return segment_ce.sum() * 0.0, figures
    ci = torch.tensor(chosen, device=logp.device)
    ri = torch.tensor(rejected, device=logp.device)
    refs = [torch.tensor(v, dtype=torch.float64, device=logp.device) for v in (ref_c, ref_r)]
    losses, reward_c, reward_r = pair_losses(
        logp[ci],
        logp[ri],
        refs[0] if reference is not None else None,
        refs[1] if reference is not None else None,
        n_tokens[ci],
        n_tokens[ri],
        spec,
    )
    (grad,) = torch.autograd.grad(
        losses.sum() / total_pairs, logp
    )  # dL/dpi per document, the same on every rank
    surrogate = -(grad.to(segment_ce.dtype) * segment_ce).sum()  # pi_partial = -ce_partial
    figures = {
        "loss": float(losses.detach().sum()),
        "reward_chosen": float(reward_c.detach().sum()),
        "reward_rejected": float(reward_r.detach().sum()),
        "correct": float((reward_c > reward_r).double().sum()),
        "margin": float((reward_c - reward_r).detach().sum()),
    }
    return surrogate, figures


def dpo_step(
    loss_model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None,
    micro_batches: Sequence[dict[str, Any]],
    *,
    mesh: SPMesh,
    grad_clip: float,
    spec: DpoSpec,
    reference: Any | None,
    device: torch.device | str = "cpu",
) -> StepResult:
    """One optimizer step of the preference loss: the mean over every pair of the step (every micro-batch and
    data-parallel replica) of :func:`pair_losses`, exact over sequence shards (module docstring).

    ``micro_batches``: this rank's preference batches (``document_roles``, ``document_index``, ``row_index``
    besides the usual keys). ``reference``: the cached reference log-probabilities
    (:class:`usp.train.reference.ReferenceLogps`; ``None`` for ``simpo``). A step without any pair is skipped
    (``no_targets``). ``StepResult.loss`` is the step's DPO loss and ``StepResult.preference`` holds the mean
    ``rewards_chosen``, ``rewards_rejected``, ``reward_margin`` and ``reward_accuracy`` over its pairs.
    """
    assert micro_batches, "dpo_step needs at least one micro-batch"
    assert reference is not None or not spec.needs_reference, f"loss_type={spec.loss_type} needs a reference"
    device = torch.device(device)
    start = time.perf_counter()
    lr = optimizer.param_groups[0]["lr"]
    total_pairs = step_pair_count(micro_batches, mesh, device)
    tokens = sum(b["input_ids"].numel() for b in micro_batches) * mesh.sp_degree * mesh.dp_degree
    doc_lengths = [lengths for b in micro_batches for lengths in b["document_lengths"]]
    local_targets = sum(int((b["labels"] != IGNORE_INDEX).sum()) for b in micro_batches)
    num_targets = global_target_count(local_targets, mesh.group("fsdp"), device)
    if total_pairs == 0:
        skip_update(optimizer, scheduler)
        return StepResult(
            loss=math.nan,
            grad_norm=math.nan,
            lr=lr,
            num_targets=num_targets,
            tokens=tokens,
            step_time_s=time.perf_counter() - start,
            document_lengths=doc_lengths,
            skipped=True,
            no_targets=True,
        )
    sums = torch.zeros(5, dtype=torch.float64, device=device)
    for micro in micro_batches:
        b, segment_ce, segments = segment_forward(loss_model, micro, device)
        surrogate, figures = micro_batch_pairs(
            micro,
            b["labels"],
            segment_ce,
            segments,
            mesh=mesh,
            spec=spec,
            reference=reference,
            total_pairs=total_pairs,
        )
        surrogate.backward()
        sums += torch.tensor(list(figures.values()), dtype=torch.float64, device=device)
    dp_group = mesh.group("dp")
    if dist.get_world_size(dp_group) > 1:
        dist.all_reduce(sums, group=dp_group)  # every sp rank of a replica holds the same figures
    loss_sum, chosen_sum, rejected_sum, correct, margin = (float(x) for x in sums / total_pairs)
    grad_norm, finite = apply_update(
        loss_model,
        optimizer,
        scheduler,
        loss=loss_sum,
        grad_clip=grad_clip,
        group=mesh.group("fsdp"),
        device=device,
    )
    return StepResult(
        loss=loss_sum,
        grad_norm=grad_norm,
        lr=lr,
        num_targets=num_targets,
        tokens=tokens,
        step_time_s=time.perf_counter() - start,
        document_lengths=doc_lengths,
        skipped=not finite,
        preference={
            "rewards_chosen": chosen_sum,
            "rewards_rejected": rejected_sum,
            "reward_margin": margin,
            "reward_accuracy": correct,
            "pairs": total_pairs,
        },
    )


@torch.no_grad()
def dpo_validation(
    loss_model: nn.Module,
    val_loader: Any,
    *,
    mesh: SPMesh,
    spec: DpoSpec,
    reference: Any | None,
    device: torch.device | str = "cpu",
) -> dict[str, float]:
    """One pass over the validation rows without gradients: ``val_loss`` (the mean pair loss),
    ``val_reward_accuracy`` and ``val_reward_margin`` over every validation pair. Collective (every rank runs
    the same micro-batches; the sums are all-reduced over the data-parallel group)."""
    device = torch.device(device)
    sums = torch.zeros(6, dtype=torch.float64, device=device)  # the figures of micro_batch_pairs, then pairs
    for micro in val_loader:
        b, segment_ce, segments = segment_forward(loss_model, micro, device)
        with torch.enable_grad():  # the pair loss's derivative is taken (and not used) on a few leaf numbers
            _, figures = micro_batch_pairs(
                micro,
                b["labels"],
                segment_ce,
                segments,
                mesh=mesh,
                spec=spec,
                reference=reference,
                total_pairs=1,
            )
        pairs = sum(len(row_pairs(roles)) for roles in micro["document_roles"])
        sums += torch.tensor([*figures.values(), pairs], dtype=torch.float64, device=device)
    dp_group = mesh.group("dp")
    if dist.get_world_size(dp_group) > 1:
        dist.all_reduce(sums, group=dp_group)
    loss, _, _, correct, margin, pairs = (float(x) for x in sums)
    if pairs == 0:
        return {"val_loss": math.nan, "val_reward_accuracy": math.nan, "val_reward_margin": math.nan}
    return {
        "val_loss": loss / pairs,
        "val_reward_accuracy": correct / pairs,
        "val_reward_margin": margin / pairs,
    }
