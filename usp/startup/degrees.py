"""``parallel.*`` resolved against the world, once per run: :func:`resolve_degrees` -> :class:`ResolvedDegrees`.

The one resolution that ``usp-train`` and ``usp-eval`` both call (so an evaluation runs on the degrees training
gets for the same config), and the mesh built from it (:func:`build_mesh`):

- degrees: as set, or ``auto`` -> the planner (:meth:`usp.plan.request.PlanRequest.plan_auto`, with what the user
  fixed); either way checked by :class:`usp.parallel.ParallelDims`, the one validator of degrees, which also
  gives ``dp_degree``;
- node size: :func:`usp.parallel.mesh.resolve_node_size` (``parallel.node_size``, else ``LOCAL_WORLD_SIZE``, else
  one node);
- ``parallel.mlp_tiles``: when the planner chose the degrees and ``mlp_tiles=auto``, the planner's count (the
  fewest tiles that fit) as is; otherwise :func:`usp.mlp_tiles.resolve_mlp_tiles` (``auto``: tiles of about
  ``hidden_size`` tokens).
"""

from __future__ import annotations

import dataclasses
from datetime import timedelta
from typing import Any

import torch

from usp.config import TrainConfig
from usp.mlp_tiles import resolve_mlp_tiles
from usp.parallel import ParallelDims, SPMesh, check_sequence_length, init_sp_mesh
from usp.parallel.mesh import resolve_node_size
from usp.plan.request import PlanRequest


@dataclasses.dataclass(frozen=True)
class ResolvedDegrees:
    """A run's parallel degrees and modes with every ``auto`` resolved (explicit, or the planner's choice); frozen.
    Its fields are the ``layout`` entries of ``metrics.jsonl`` and the trainer's result."""

    ulysses_degree: int
    ring_degree: int
    dp_degree: int
    node_size: int
    """Ranks per node (``parallel.node_size``, else ``LOCAL_WORLD_SIZE``, else the world size)."""
    fsdp_mode: str
    activation_checkpointing: str
    ac_every_k: int
    mlp_tiles: int = 1
    """Resolved ``parallel.mlp_tiles`` (a divisor of the local tokens; 1 = off)."""
    attn_head_chunks: int = 1
    """``parallel.attn_head_chunks`` (checked against the heads per rank by the trainer; 1 = off)."""
    reason: str = "set in the config"


def resolve_degrees(
    cfg: TrainConfig, model_config: Any, world_size: int, device: torch.device
) -> ResolvedDegrees:
    """``cfg.parallel`` -> the run's :class:`ResolvedDegrees` (``ValueError`` naming the setting and the fix).

    With ``auto`` the planner keeps what the user fixed (:meth:`usp.plan.request.PlanRequest.auto_constraints`,
    the request ``usp-launch`` sends too): the other degree when only one is ``auto``, and ``fsdp_mode`` /
    ``activation_checkpointing`` unless they are at their defaults (``full_shard`` / ``none``), which leave the
    choice to the planner. ``trainer.seq_len`` is checked against the degrees
    (:func:`usp.parallel.check_sequence_length`) before the MLP tiles are resolved for it.
    ``model_config``: the Hugging Face config (``hidden_size``; the whole config for the planner).
    """
    p = cfg.parallel
    node_size = resolve_node_size(p.node_size, world_size)
    chosen: dict[str, Any] = {
        "ulysses_degree": p.ulysses_degree,
        "ring_degree": p.ring_degree,
        "dp_degree": p.dp_degree,
        "fsdp_mode": p.fsdp_mode,
        "activation_checkpointing": p.activation_checkpointing,
        "ac_every_k": p.ac_every_k,
        "attn_head_chunks": p.attn_head_chunks,
    }
    reason, planned_tiles = "set in the config", None
    if "auto" in (p.ulysses_degree, p.ring_degree):
        gpu = cfg.cluster.gpu if device.type == "cuda" else "cpu"
        plan = PlanRequest.from_config(cfg).plan_auto(
            model_config.to_dict(),
            world_size=world_size,
            node_size=node_size,
            gpu=gpu,
            memory_gib=cfg.cluster.memory_gib,
        )
        chosen.update((k, v) for k, v in plan.items() if k in chosen)
        reason, planned_tiles = f"planner: {plan.get('reason', '')}", plan.get("mlp_tiles")  # tiles: if auto
    dims = ParallelDims(
        world_size=world_size,
        ulysses_degree=chosen["ulysses_degree"],
        ring_degree=chosen["ring_degree"],
        dp_degree=chosen["dp_degree"],
        node_size=node_size,
        allow_cross_node_ulysses=p.allow_cross_node_ulysses,
    )
    check_sequence_length(cfg.trainer.seq_len, dims.ring_degree, dims.ulysses_degree, p.ring_layout)
    if planned_tiles is not None:  # the planner's choice for mlp_tiles=auto, as it planned it
        mlp_tiles = int(planned_tiles)
    else:
        local_tokens = cfg.trainer.seq_len // dims.sp_degree
        mlp_tiles = resolve_mlp_tiles(
            p.mlp_tiles, local_tokens=local_tokens, hidden_size=model_config.hidden_size
        )
    return ResolvedDegrees(
        ulysses_degree=dims.ulysses_degree,
        ring_degree=dims.ring_degree,
        dp_degree=dims.dp_degree,
        node_size=node_size,
        fsdp_mode=chosen["fsdp_mode"],
        activation_checkpointing=chosen["activation_checkpointing"],
        ac_every_k=int(chosen["ac_every_k"]),
        mlp_tiles=mlp_tiles,
        attn_head_chunks=int(chosen["attn_head_chunks"]),
        reason=reason,
    )


def build_mesh(cfg: TrainConfig, degrees: ResolvedDegrees, device: torch.device) -> SPMesh:
    """The run's :class:`usp.parallel.SPMesh` for ``degrees`` (collective: every rank), with
    ``parallel.ring_layout``, ``parallel.allow_cross_node_ulysses`` and ``parallel.timeout_minutes``."""
    return init_sp_mesh(
        degrees.ulysses_degree,
        degrees.ring_degree,
        dp_degree=degrees.dp_degree,
        node_size=degrees.node_size,
        ring_layout=cfg.parallel.ring_layout,
        allow_cross_node_ulysses=cfg.parallel.allow_cross_node_ulysses,
        device_type=device.type,
        timeout=timedelta(minutes=cfg.parallel.timeout_minutes),
    )
