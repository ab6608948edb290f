"""``parallel.*`` resolved against the world, once per run: :func:`resolve_layout` -> :class:`usp.parallel.ParallelLayout`.

The one resolution that ``usp-train`` and ``usp-eval`` both call (so an evaluation runs on the degrees training
gets for the same config), and the mesh built from it (:func:`build_mesh`):

- degrees: as set, or ``auto`` -> the planner (:meth:`usp.plan.request.PlanRequest.plan_auto`, with what the user
  fixed, which returns a layout); either way checked by :class:`usp.parallel.ParallelLayout`, the one
  validator of degrees, which also gives ``dp_degree``;
- node size: :func:`usp.parallel.mesh.resolve_node_size` (``parallel.node_size``, else ``LOCAL_WORLD_SIZE``, else
  one node);
- ``parallel.mlp_tiles``: when the planner chose the degrees and ``mlp_tiles=auto``, the planner's count (the
  fewest tiles that fit) as is; otherwise :func:`usp.mlp_tiles.resolve_mlp_tiles` (``auto``: tiles of about
  ``hidden_size`` tokens).
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import torch

from usp.config import TrainConfig, states_on_host
from usp.mlp_tiles import resolve_mlp_tiles
from usp.model.capabilities import MOE_FIELDS
from usp.parallel import ParallelLayout, SPMesh, init_sp_mesh
from usp.parallel.mesh import resolve_node_size
from usp.plan import load_model_spec
from usp.plan.request import PlanRequest


def plan_layout(
    cfg: TrainConfig, model_config: Mapping[str, Any], *, world_size: int, node_size: int, gpu: str
) -> ParallelLayout:
    """``cfg.parallel`` -> the run's :class:`usp.parallel.ParallelLayout` for ``world_size`` ranks,
    ``node_size`` per node, on ``gpu`` (``ValueError`` naming the setting and the fix). The one rule that makes
    a run's layout: start-up calls it (:func:`resolve_layout`) and so does ``usp-launch``'s memory check, so
    both see the same layout; the mesh owns it from then on (:func:`build_mesh`).

    With ``auto`` the planner keeps what the user fixed (:meth:`usp.plan.request.PlanRequest.auto_constraints`):
    the other degree when only one is ``auto``, and ``fsdp_mode`` / ``activation_checkpointing`` unless they
    are at their defaults (``full_shard`` / ``none``), which leave the choice to the planner; the planner returns
    the layout itself. ``trainer.seq_len`` is checked against the degrees before the MLP tiles are resolved for
    it. ``model_config``: the Hugging Face config as a dict.
    """
    p = cfg.parallel
    states = "cpu_offload" if states_on_host(cfg.optim.name, p.cpu_offload) else "device"
    planner_chose = "auto" in (p.ulysses_degree, p.ring_degree)
    if planner_chose:
        planned = PlanRequest.from_config(cfg).plan_auto(
            dict(model_config),
            world_size=world_size,
            node_size=node_size,
            gpu=gpu,
            memory_gib=cfg.cluster.memory_gib,
        )
        layout = planned.replace(
            node_size=node_size,  # the planner's node is at most the world; the run's is the launcher's
            allow_cross_node_ulysses=p.allow_cross_node_ulysses,
            ring_layout=p.ring_layout,
            states=states,
            ac_every_k=planned.ac_every_k
            if planned.activation_checkpointing == "every_k"
            else int(p.ac_every_k),
            reason=f"planner: {planned.reason}",
        )
    else:
        layout = ParallelLayout(
            world_size=world_size,
            ulysses_degree=p.ulysses_degree,
            ring_degree=p.ring_degree,
            dp_degree=p.dp_degree,
            node_size=node_size,
            allow_cross_node_ulysses=p.allow_cross_node_ulysses,
            ring_layout=p.ring_layout,
            fsdp_mode=p.fsdp_mode,
            activation_checkpointing=p.activation_checkpointing,
            ac_every_k=int(p.ac_every_k),
            attn_head_chunks=int(p.attn_head_chunks),
            states=states,
        )
    layout.check_sequence_length(cfg.trainer.seq_len)
    text = model_config.get("text_config") or model_config
    if any((text.get(f) or 0) > 1 for f in MOE_FIELDS):  # TiledMLP would drop the router loss's graph
        if p.mlp_tiles != "auto" and int(p.mlp_tiles) > 1:
            raise ValueError(
                f"parallel.mlp_tiles={p.mlp_tiles}: MLP tiles are not supported for mixture-of-experts layers "
                f"(the router's loss needs the routing graph that tiling drops); set parallel.mlp_tiles=1."
            )
        return layout.replace(mlp_tiles=1)
    if planner_chose and p.mlp_tiles == "auto":
        return layout  # the planner's count (the fewest tiles that fit), as it planned it
    hidden_size = model_config.get("hidden_size") if p.mlp_tiles == "auto" else None
    if p.mlp_tiles == "auto" and hidden_size is None:
        hidden_size = load_model_spec(dict(model_config)).hidden_size
    tiles = resolve_mlp_tiles(
        p.mlp_tiles, local_tokens=layout.local_tokens(cfg.trainer.seq_len), hidden_size=hidden_size or 1
    )
    return layout.replace(mlp_tiles=tiles)


def resolve_layout(
    cfg: TrainConfig, model_config: Any, world_size: int, device: torch.device
) -> ParallelLayout:
    """:func:`plan_layout` for this job: the node size from ``parallel.node_size`` or the launcher
    (:func:`usp.parallel.mesh.resolve_node_size`), the planner's device ``cluster.gpu`` on CUDA and ``cpu``
    otherwise. ``model_config``: the Hugging Face config object."""
    return plan_layout(
        cfg,
        model_config.to_dict(),
        world_size=world_size,
        node_size=resolve_node_size(cfg.parallel.node_size, world_size),
        gpu=cfg.cluster.gpu if device.type == "cuda" else "cpu",
    )


def build_mesh(cfg: TrainConfig, layout: ParallelLayout, device: torch.device) -> SPMesh:
    """The run's :class:`usp.parallel.SPMesh`, owning ``layout`` (collective: every rank), with
    ``parallel.timeout_minutes``."""
    return init_sp_mesh(
        layout=layout,
        device_type=device.type,
        timeout=timedelta(minutes=cfg.parallel.timeout_minutes),
    )
