"""The validation figures a training run logs: the validation loss, and the loss by position.

Both run over one pass of the validation loader on every rank together (collective); the model is not
changed (no gradients).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from usp.config import TrainConfig
from usp.eval.losses import val_ppl_by_position
from usp.parallel import SPMesh
from usp.train.loss import IGNORE_INDEX


@torch.no_grad()
def evaluate(loss_model: torch.nn.Module, loader: Any, mesh: SPMesh, device: torch.device) -> float:
    """The validation loss: token-weighted mean over one pass of ``loader`` (all ranks together)."""
    total = torch.zeros(2, dtype=torch.float64, device=device)  # [loss sum, targets]
    for batch in loader:
        labels = batch["labels"].to(device)
        cu = batch.get("cu_seqlens")
        loss_sum = loss_model(
            batch["input_ids"].to(device),
            labels,
            position_ids=batch["position_ids"].to(device),
            cu_seqlens=None if cu is None else cu.to(dtype=torch.int32),
            num_targets=1.0,  # host-side
            aux_scale=0.0,  # a MoE's router loss is no part of the validation loss
        )
        total[0] += loss_sum.double()
        total[1] += (labels != IGNORE_INDEX).sum()
    dist.all_reduce(total, group=mesh.group("fsdp"))
    return float(total[0] / total[1].clamp(min=1))


def validation_metrics(
    cfg: TrainConfig, loss_model: torch.nn.Module, val_loader: Any, mesh: SPMesh, device: torch.device
) -> dict[str, Any]:
    """``val_loss`` (:func:`evaluate`) and, with ``trainer.eval_ppl_by_position``, ``val_ppl_by_position``
    (:func:`usp.eval.losses.val_ppl_by_position`: mean loss per bucket of document positions). Collective."""
    out: dict[str, Any] = {"val_loss": evaluate(loss_model, val_loader, mesh, device)}
    if cfg.trainer.eval_ppl_by_position:
        out["val_ppl_by_position"] = val_ppl_by_position(
            loss_model,
            val_loader,
            mesh,
            device,
            bucket_size=cfg.eval.bucket_size,
            chunk_size=cfg.trainer.loss_chunk_size,
        )
    return out
