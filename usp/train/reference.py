"""DPO's reference log-probabilities: computed once on the training mesh, cached beside the prepared data.

The reference is ``trainer.dpo.reference_path`` or, by default, ``model.path``: the starting policy (with LoRA
the base, its adapters not yet trained: ``B = 0``). Before the first step (of a fresh or a resumed run: the
model then still holds the weights start-up loaded, before the checkpoint), :func:`reference_logps` looks for
the cache ``ref-<key>.npy`` in the prepared data's directory (the run directory when that one is read-only);
when missing, every row of the dataset (training and validation split) is run once through the training
model without gradients, in the training layout, each data-parallel replica taking every ``dp``-th row, and
the sum of each document's target log-probabilities is kept. Rank 0 writes the cache atomically and sends the
values to every rank. The key covers the reference checkpoint (path, config, weight files' names and sizes),
the dataset's fingerprint and the compute dtype, so another model or other data never reads a stale cache.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from usp.atomic import write_file
from usp.data.batch import collate_rows
from usp.parallel import SPMesh
from usp.parallel.agree import raise_if_any_failed
from usp.train.step import batch_to_device

logger = logging.getLogger(__name__)
CACHE_VERSION = 1


@dataclass
class ReferenceLogps:
    """``values[row, document]``: the reference's summed target log-probability of each document of each
    dataset row (NaN where a row has fewer documents)."""

    values: np.ndarray
    path: Path | None = None

    def get(self, row: int, document: int) -> float:
        value = float(self.values[row, document])
        assert np.isfinite(value), f"no reference log-probability for row {row}, document {document}"
        return value


def reference_key(reference_path: str | os.PathLike, dataset: Any, dtype: str) -> str:
    """What the cached values depend on: the reference checkpoint, the data, the compute dtype."""
    ref = Path(reference_path).resolve()
    weights = sorted(
        (p.name, p.stat().st_size) for p in ref.iterdir() if p.suffix in (".safetensors", ".bin")
    )
    config = (ref / "config.json").read_bytes() if (ref / "config.json").exists() else b""
    blob = json.dumps(
        {
            "version": CACHE_VERSION,
            "reference": str(ref),
            "config": hashlib.sha256(config).hexdigest(),
            "weights": weights,
            "data": getattr(dataset, "_fingerprint", None),
            "rows": len(dataset),
            "dtype": dtype,
        },
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def cache_dir_for(dataset: Any, fallback: Path) -> Path:
    """The prepared data's directory when writable, else ``fallback`` (the run directory)."""
    files = getattr(dataset, "cache_files", None) or []
    if files:
        here = Path(files[0]["filename"]).parent
        if os.access(here, os.W_OK):
            return here
    return fallback


@torch.no_grad()
def compute_reference_logps(
    loss_model: nn.Module,
    dataset: Any,
    *,
    mesh: SPMesh,
    device: torch.device,
    document_masking: bool = True,
) -> np.ndarray:
    """``[rows, max documents]`` float64: each document's summed target log-probability under ``loss_model``
    as it is now. Collective over every rank: replica ``r`` runs rows ``r, r + dp, ...`` (the last round padded
    with row 0, its result dropped, so every rank runs the same forwards); one all_gather at the end."""
    rows = len(dataset)
    width = max(len(dataset[i]["document_roles"]) for i in range(rows))
    dp, replica = mesh.dp_degree, mesh.dp_rank
    mine: dict[int, list[float]] = {}
    sp_group = mesh.group("sp")
    for first in range(0, rows, dp):
        index = first + replica
        row = dataset[index if index < rows else 0]
        batch = collate_rows([row], mesh=mesh, document_masking=document_masking)
        b = batch_to_device(batch, device)
        docs = len(row["document_roles"])
        segment_ce = loss_model(
            b["input_ids"],
            b["labels"],
            position_ids=b["position_ids"],
            cu_seqlens=b["cu_seqlens"],
            shared_prefix=b.get("shared_prefix"),
            segments=batch["document_index"].to(device),
            num_segments=docs,
        ).double()
        if dist.get_world_size(sp_group) > 1:
            dist.all_reduce(segment_ce, group=sp_group)
        if index < rows:
            mine[index] = (-segment_ce).tolist()
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine if mesh.sp_rank == 0 else {})
    values = np.full((rows, width), np.nan, dtype=np.float64)
    for part in gathered:
        for index, logps in part.items():
            values[index, : len(logps)] = logps
    assert not np.isnan(values[:, 0]).any(), "a row's reference log-probabilities are missing"
    return values


def reference_logps(
    loss_model: nn.Module,
    dataset: Any,
    *,
    mesh: SPMesh,
    device: torch.device,
    reference_path: str,
    dtype: str,
    run_dir: Path,
    load_reference: Any = None,
    restore_policy: Any = None,
    document_masking: bool = True,
) -> ReferenceLogps:
    """The cached reference log-probabilities of ``dataset``, computed first when the cache is missing
    (collective; see the module docstring). ``load_reference`` / ``restore_policy``: callables that load the
    reference's weights into the model and the policy's back (``trainer.dpo.reference_path`` other than
    ``model.path``); ``None`` when the model holds the reference already."""
    key = reference_key(reference_path, dataset, dtype)
    path = cache_dir_for(dataset, run_dir) / f"ref-{key}.npy"
    found: list[Any] = [None]
    if dist.get_rank() == 0 and path.exists():
        found[0] = np.load(path)
    dist.broadcast_object_list(found, src=0)
    if found[0] is not None:
        if dist.get_rank() == 0:
            logger.info("DPO reference log-probabilities: %s (cached)", path)
        return ReferenceLogps(found[0], path)
    start = time.perf_counter()
    if load_reference is not None:
        load_reference()
    values = compute_reference_logps(
        loss_model, dataset, mesh=mesh, device=device, document_masking=document_masking
    )
    if restore_policy is not None:
        restore_policy()
    error: BaseException | None = None
    if dist.get_rank() == 0:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_file(path, lambda f: np.save(f, values))
            logger.info(
                "DPO reference log-probabilities of %d rows from %s in %.1f s: %s",
                len(values),
                reference_path,
                time.perf_counter() - start,
                path,
            )
        except OSError as e:
            error = e
    raise_if_any_failed(error, f"writing the DPO reference cache {path}")
    return ReferenceLogps(values, path)
