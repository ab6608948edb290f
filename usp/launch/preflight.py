"""The trainer's own start-up checks, run by ``usp-launch`` before it starts or submits a job, so a bad
layout fails on the login node instead of after the queue wait.

- :func:`check_layout`: :func:`usp.config.validate_layout`, the check ``usp.train`` runs first on every
  rank: the degrees against the world the launcher will start (:class:`usp.parallel.ParallelLayout`) and
  ``trainer.seq_len`` against the sequence layout (:func:`usp.parallel.check_sequence_length`); an ``auto``
  degree counts as 1 there, so the fixed one is checked.
- :func:`check_known_degrees`: :class:`usp.parallel.ParallelLayout` on the command line's degrees when no run
  config is composed (Hydra-flag mode).
- :func:`check_memory`: the planner's per-GPU memory estimate of that layout
  (:func:`usp.plan.evaluate_layout`, the figure ``usp-plan`` prints; MLP tiles resolved and the states'
  place decided as the trainer does) against ``cluster.gpu``'s memory
  (``cluster.memory_gib`` when set): a note with the figure when it fits, ``ValueError`` above the device.
  Degrees left to the planner (``auto``) are chosen here as the trainer chooses them at start-up, from the
  same planner input (:class:`usp.plan.request.PlanRequest`): a config this refuses, the trainer refuses.

A model whose ``config.json`` this machine cannot read is not estimated.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from usp.config import TrainConfig, validate_layout

LAYOUT_FIELDS = ("ulysses_degree", "ring_degree", "dp_degree", "node_size", "allow_cross_node_ulysses")
"""The ``parallel.*`` settings :class:`usp.parallel.ParallelLayout` validates."""


def check_layout(cfg: TrainConfig, *, world_size: int, local_world_size: int) -> None:
    """``usp.train``'s layout and sequence-length checks for ``world_size`` ranks, ``local_world_size`` per
    node. Raises ``ValueError`` with the trainer's message (the numbers and the fix).

    With an ``auto`` degree the fixed one is checked (``validate_layout`` counts ``auto`` as 1), so a
    ``ulysses_degree`` that cannot stay inside a node still fails before the queue."""
    validate_layout(cfg, world_size=world_size, local_world_size=local_world_size)


def _node_size(setting: object, *, world_size: int, local_world_size: int) -> int:
    """The trainer's node-size rule (:func:`usp.parallel.mesh.resolve_node_size`) with the
    ``LOCAL_WORLD_SIZE`` the launcher will export (``local_world_size``)."""
    from usp.parallel.mesh import resolve_node_size

    return resolve_node_size(setting, world_size, env={"LOCAL_WORLD_SIZE": str(local_world_size)})


def _integer(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_known_degrees(degrees: Mapping[str, Any], *, world_size: int, local_world_size: int) -> None:
    """:class:`usp.parallel.ParallelLayout` for what is known of a layout before start-up.

    ``degrees`` maps :data:`LAYOUT_FIELDS` names to values; a missing or ``None`` one is unknown.
    ``ulysses_degree`` / ``ring_degree`` count when integers; one that is unknown, ``auto`` or not an integer
    counts as 1 (what the planner, or the trainer's own check, decides for it only multiplies the product, so
    a layout failing here fails at start-up too). ``dp_degree`` counts only when both are integers.
    ``node_size`` defaults to ``local_world_size``; ``allow_cross_node_ulysses`` holds unless it is ``False``
    or unknown (a spelling the trainer's config reads as true, ``yes``, is not held against the layout).

    Raises:
        ValueError: :class:`usp.parallel.ParallelLayout`'s message, with the numbers and the fix (the same
            constructor, :meth:`~usp.parallel.ParallelLayout.from_settings`, as the config check).
    """
    from usp.parallel import ParallelLayout

    def known(name: str) -> object:  # a value the command line gave that is not an integer is unknown here
        value = degrees.get(name)
        return value if _integer(value) else None

    node = known("node_size")
    ParallelLayout.from_settings(
        world_size=world_size,
        ulysses_degree=known("ulysses_degree"),
        ring_degree=known("ring_degree"),
        dp_degree=known("dp_degree"),
        node_size=_node_size(node, world_size=world_size, local_world_size=local_world_size),
        allow_cross_node_ulysses=degrees.get("allow_cross_node_ulysses"),
    )


def _hybrid(cfg: TrainConfig) -> str | None:
    """Why the planner has no figure for the hybrid model at ``model.path`` with this run's settings (its
    family is not modelled, or LoRA or MLP tiles on mixer layers: :mod:`usp.plan.mixers`), or None."""
    from usp.plan.mixers import mixer_spec_of
    from usp.plan.models import hybrid_layers_of, text_config_of

    config_json = Path(cfg.model.path) / "config.json"
    if "auto" in (cfg.parallel.ulysses_degree, cfg.parallel.ring_degree) or not config_json.is_file():
        return None
    config = text_config_of(json.loads(config_json.read_text()))
    layers = hybrid_layers_of(config)
    try:
        mixer = mixer_spec_of(config)
    except ValueError as err:
        return f"{layers}: {err}"
    if mixer is None:
        return None
    if cfg.model.lora.rank > 0:
        return f"{layers}: LoRA on mixer layers is not modelled"
    if cfg.parallel.mlp_tiles not in (1, "1"):
        return f"{layers}: MLP tiles beside mixer layers are not modelled"
    return None


def check_memory(cfg: TrainConfig, *, world_size: int, local_world_size: int) -> str | None:
    """The planner's memory figure for ``cfg``'s layout: a one-line note when it fits, ``None`` when it
    cannot be estimated (no readable ``config.json`` at ``model.path``). The planner's input is the trainer's
    (:class:`usp.plan.request.PlanRequest`); with ``auto`` degrees the planner chooses them exactly as the
    trainer will at start-up, and the note names its choice.

    Raises:
        ValueError: when the estimate exceeds the device memory (with the figure, its breakdown and the fix),
            or, with ``auto`` degrees, when no layout fits (the trainer's start-up error).
    """
    from usp.plan import load_model_spec
    from usp.plan.request import PlanRequest
    from usp.startup.degrees import plan_layout

    p, t = cfg.parallel, cfg.trainer
    config_json = Path(cfg.model.path) / "config.json"
    if not config_json.is_file() or _hybrid(cfg) is not None:
        return None
    node_size = _node_size(p.node_size, world_size=world_size, local_world_size=local_world_size)
    run_layout = plan_layout(  # the layout start-up will make (the planner's choice for auto degrees)
        cfg,
        json.loads(config_json.read_text()),
        world_size=world_size,
        node_size=node_size,
        gpu=cfg.cluster.gpu,
    )
    if "auto" in (p.ulysses_degree, p.ring_degree):
        return (
            f"layout: the planner picks ulysses {run_layout.ulysses_degree} x ring {run_layout.ring_degree} x dp "
            f"{run_layout.dp_degree}, {run_layout.fsdp_mode}, activation checkpointing "
            f"{run_layout.activation_checkpointing} ({run_layout.reason.removeprefix('planner: ')})"
        )
    request = PlanRequest.from_config(cfg)
    device = request.device(cfg.cluster.gpu, memory_gib=cfg.cluster.memory_gib)
    est = request.evaluate(load_model_spec(cfg.model.path), device, run_layout)
    layout = (
        f"ulysses {est.ulysses_degree} x ring {est.ring_degree} x dp {est.dp_degree}, {est.fsdp_mode}, "
        f"activation checkpointing {est.activation_checkpointing}, trainer.seq_len={t.seq_len}"
    )
    figure = f"{est.mem_gib_per_gpu:.1f} GiB per GPU of {device.memory_gib:g} GiB ({device.name})"
    if est.fits:
        return f"memory: the planner estimates {figure} for {layout}"
    breakdown = ", ".join(f"{k} {v:.1f}" for k, v in est.memory_gib.items())
    raise ValueError(
        f"the planner estimates {figure} for {layout}: it would run out of memory (GiB: {breakdown}). Use "
        f"parallel.activation_checkpointing=full, larger parallel.ulysses_degree / ring_degree (more GPUs), a "
        f"shorter trainer.seq_len, parallel.mlp_tiles=auto or parallel.cpu_offload=true; `usp-plan` lists layouts "
        f"that fit. "
        f"(--skip-memory-check submits anyway; cluster.memory_gib sets the usable memory.)"
    )


def memory_skipped_reason(cfg: TrainConfig) -> str | None:
    """Why :func:`check_memory` gave no figure for ``cfg`` (it returned ``None``): a note for the user; None
    for the tiny demo model (built at start-up, a few MiB: nothing to say)."""
    p = cfg.parallel
    if "auto" in (p.ulysses_degree, p.ring_degree):
        return "memory: not checked here: the degrees are auto (the planner picks a layout that fits at start-up)"
    if cfg.model.build_tiny:
        return None
    hybrid = _hybrid(cfg)
    if hybrid is not None:
        return f"memory: not checked here: the planner has no figure for this hybrid model ({hybrid})"
    return (
        f"memory: not checked here: {cfg.model.path}/config.json cannot be read on this machine (model.path), so "
        f"the planner has no model to estimate; the trainer checks the model at start-up"
    )


def check_eval(cfg: TrainConfig, *, world_size: int, local_world_size: int) -> str | None:
    """``usp-eval``'s own checks that need no weights, on the launcher's world: the evaluated lengths vs the
    layout (:func:`usp.eval.runner.check_eval_settings`) and, where ``model.path`` is readable here, the heads
    vs the Ulysses degree and the RoPE type (:func:`usp.model.check_heads`, the eval's checks at start-up).
    ``ValueError`` with the eval's message; returns a note when a check was skipped (auto degrees, a
    ``model.path`` this machine cannot read), else ``None``."""
    from usp.eval.runner import check_eval_settings, resolve_model_source
    from usp.model import check_heads
    from usp.parallel import ParallelLayout

    p = cfg.parallel
    if "auto" in (p.ulysses_degree, p.ring_degree):
        return "eval checks: the degrees are auto (chosen at start-up), so lengths and heads are checked then"
    U, R = int(p.ulysses_degree), int(p.ring_degree)
    layout = ParallelLayout(
        world_size=world_size,
        ulysses_degree=U,
        ring_degree=R,
        node_size=_node_size(p.node_size, world_size=world_size, local_world_size=local_world_size),
        allow_cross_node_ulysses=p.allow_cross_node_ulysses,
        ring_layout=p.ring_layout,
    )
    check_eval_settings(cfg, layout)
    if not Path(cfg.model.path).exists():
        return f"eval checks: model.path={cfg.model.path} is not readable here, so the heads are checked at start-up"
    source = resolve_model_source(cfg.model.path)
    check_heads(source.config, U)
    return None
