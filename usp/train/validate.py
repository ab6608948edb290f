"""Resolve and validate a training run once, before any weights or data: :func:`validate`.

``validate(cfg, world_size, device)`` runs every check that needs no weights, data or collectives and returns
``(model_config, layout)``: the Hugging Face config the run trains (RoPE overrides applied) and a frozen
:class:`Layout`, the run's parallel layout with every ``auto`` resolved to an integer. Everything after it
reads the layout, never ``cfg.parallel``'s degrees, tiles or modes; the :class:`usp.config.TrainConfig` is
never changed (its ``auto`` stays ``auto``).

The layout comes from :func:`resolve_layout`, the one resolution of ``parallel.*`` that ``usp-eval`` calls too:

- degrees: as set, or ``auto`` -> :func:`usp.plan.auto_degrees` (with what the user fixed); either way checked
  by :class:`usp.parallel.ParallelDims`, the one validator of degrees, which also gives ``dp_degree``;
- node size: ``parallel.node_size``, else the launcher's ``LOCAL_WORLD_SIZE``
  (:func:`usp.parallel.mesh.launched_world`), else the whole world is one node;
- ``parallel.mlp_tiles``: when the planner chose the layout and ``mlp_tiles=auto``, the planner's count (the
  fewest tiles that fit) as is; otherwise :func:`usp.train.tiling.resolve_mlp_tiles` (``auto``: tiles of
  about ``hidden_size`` tokens).
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import torch

from usp.attention import check_attn_head_chunks, resolve_backend
from usp.config import TrainConfig, states_on_host, validate_choices
from usp.model import (
    apply_rope_overrides,
    check_heads,
    check_model_dir,
    check_rope_for_sequence_parallel,
    parse_dtype,
)
from usp.parallel import ParallelDims, check_sequence_length
from usp.parallel.mesh import launched_world
from usp.train.offload import check_host_memory
from usp.train.optim import check_optim_config
from usp.train.tiling import check_tiling_available, resolve_mlp_tiles


@dataclasses.dataclass(frozen=True)
class Layout:
    """The resolved parallel layout of a run (explicit degrees, or the planner's choice); frozen."""

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
    """``parallel.attn_head_chunks`` (checked against the heads per rank by :func:`validate`; 1 = off)."""
    reason: str = "set in the config"


def build_tiny_if_asked(cfg: TrainConfig, rank: int) -> None:
    """``model.build_tiny``: rank 0 writes a tiny random Llama at its own default path
    (``<run dir>/tiny-llama``, :data:`usp.tiny.TINY_MODEL_DIR`) if none is there (demo, tests), before
    :func:`validate` checks that dir.

    A tiny model is never built anywhere else: a ``model.path`` typed by the user (``recipe=tiny
    model.path=/ckpt/my-modle``) that does not exist is the ``ValueError`` naming it, not a random model
    trained and exported under the typed name. One that exists is trained as it is (the tiny recipe's
    optimizer and trainer settings are for a random model: a warning says so, on rank 0)."""
    if not cfg.model.build_tiny:
        return
    from usp.tiny import TINY_MODEL_DIR

    path = Path(cfg.model.path)
    default = Path(cfg.run_dir) / TINY_MODEL_DIR
    if path.absolute() != default.absolute():
        if not (path / "config.json").exists():
            raise ValueError(
                f"model.path={str(path)!r} does not exist or is not a Hugging Face checkpoint dir (no config.json). "
                f"model.build_tiny builds the random demo model only at its own path ({default}); for your "
                f"checkpoint, fix model.path (and use model=hf, docs/training.md)."
            )
        if rank == 0:
            logging.getLogger(__name__).warning(
                "model.path=%s is your checkpoint, but model.build_tiny=true (recipe=tiny or model=tiny): the tiny "
                "recipe's optimizer (optim.lr=%g, optim.warmup_steps=%d) is meant for a random model and will "
                "damage a trained one; use model=hf optim=finetune (docs/training.md).",
                path, cfg.optim.lr, cfg.optim.warmup_steps,
            )  # fmt: skip
        return
    if rank == 0 and not (path / "config.json").exists():
        from usp.tiny import build_tiny_llama

        build_tiny_llama(path, seed=cfg.trainer.seed, **dict(cfg.model.tiny_size))


def resolve_node_size(cfg: TrainConfig, world_size: int) -> int:
    """``parallel.node_size``, else the launcher's ``LOCAL_WORLD_SIZE``, else ``world_size`` (one node)."""
    if cfg.parallel.node_size is not None:
        return int(cfg.parallel.node_size)
    return launched_world()[1] or world_size


def fsdp_cpu_offload(cfg: TrainConfig, device: torch.device) -> bool:
    """Whether FSDP2 keeps the sharded parameters, gradients and optimizer states in host memory: on CUDA when
    :func:`usp.config.states_on_host` says so (``parallel.cpu_offload`` or an ``optim.name`` that steps on the
    host); never on a CPU device, where they are in host memory already."""
    return device.type == "cuda" and states_on_host(cfg.optim.name, cfg.parallel.cpu_offload)


def resolve_layout(cfg: TrainConfig, model_config: Any, world_size: int, device: torch.device) -> Layout:
    """``cfg.parallel`` -> the run's :class:`Layout` (``ValueError`` naming the setting and the fix).

    With ``auto`` the planner keeps what the user fixed (:meth:`usp.plan.request.PlanRequest.auto_constraints`,
    the request ``usp-launch`` sends too): the other degree when
    only one is ``auto``, and ``fsdp_mode`` / ``activation_checkpointing`` unless they are at their defaults
    (``full_shard`` / ``none``), which leave the choice to the planner. ``trainer.seq_len`` is checked against
    the layout (:func:`usp.parallel.check_sequence_length`) before the MLP tiles are resolved for it.
    ``model_config``: the Hugging Face config (``hidden_size``; the whole config for the planner).
    """
    p = cfg.parallel
    node_size = resolve_node_size(cfg, world_size)
    chosen: dict[str, Any] = {
        "ulysses_degree": p.ulysses_degree, "ring_degree": p.ring_degree, "dp_degree": p.dp_degree,
        "fsdp_mode": p.fsdp_mode, "activation_checkpointing": p.activation_checkpointing, "ac_every_k": p.ac_every_k,
        "attn_head_chunks": p.attn_head_chunks,
    }  # fmt: skip
    reason, planned_tiles = "set in the config", None
    if "auto" in (p.ulysses_degree, p.ring_degree):
        from usp.plan.request import PlanRequest

        gpu = cfg.cluster.gpu if device.type == "cuda" else "cpu"
        plan = PlanRequest.from_config(cfg).plan_auto(
            model_config.to_dict(), world_size=world_size, node_size=node_size, gpu=gpu,
            memory_gib=cfg.cluster.memory_gib,
        )
        chosen.update((k, v) for k, v in plan.items() if k in chosen)
        reason, planned_tiles = f"planner: {plan.get('reason', '')}", plan.get("mlp_tiles")  # tiles: if auto
    dims = ParallelDims(
        world_size=world_size, ulysses_degree=chosen["ulysses_degree"], ring_degree=chosen["ring_degree"],
        dp_degree=chosen["dp_degree"], node_size=node_size, allow_cross_node_ulysses=p.allow_cross_node_ulysses,
    )  # fmt: skip
    check_sequence_length(cfg.trainer.seq_len, dims.ring_degree, dims.ulysses_degree, p.ring_layout)
    if planned_tiles is not None:  # the planner's choice for mlp_tiles=auto, as it planned it
        mlp_tiles = int(planned_tiles)
    else:
        local_tokens = cfg.trainer.seq_len // dims.sp_degree
        mlp_tiles = resolve_mlp_tiles(p.mlp_tiles, local_tokens=local_tokens, hidden_size=model_config.hidden_size)
    return Layout(
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


def _check_memory_tricks(cfg: TrainConfig, model_config: Any, layout: Layout, world_size: int) -> None:
    """The resolved MLP tiles need DeepSpeed; the head chunks must split the heads per rank; the host memory
    that ``activation_checkpointing=offload`` takes on a node must be there (``ValueError`` naming the setting)."""
    check_tiling_available(layout.mlp_tiles)
    hq = model_config.num_attention_heads
    check_attn_head_chunks(
        layout.attn_head_chunks, hq, getattr(model_config, "num_key_value_heads", None) or hq, layout.ulysses_degree
    )
    if layout.activation_checkpointing == "offload":
        local_tokens = cfg.trainer.seq_len // (layout.ulysses_degree * layout.ring_degree)
        check_host_memory(
            num_layers=model_config.num_hidden_layers, local_tokens=local_tokens * cfg.trainer.micro_batch_size,
            hidden_size=model_config.hidden_size, compute_bytes=parse_dtype(cfg.model.dtype).itemsize,
            ranks_per_node=min(layout.node_size, world_size),
        )  # fmt: skip


def _check_trainer(cfg: TrainConfig) -> None:
    """The trainer settings that depend on the data settings or on files (the rest: ``validate_choices``)."""
    t = cfg.trainer
    if t.eval_every and not cfg.data.validation_fraction:
        raise ValueError(
            f"trainer.eval_every={t.eval_every} needs validation data: set data.validation_fraction > 0 "
            f"(e.g. 0.01), or trainer.eval_every=0."
        )
    if cfg.data.document_masking and t.micro_batch_size > 1:
        raise ValueError(
            f"data.document_masking=true needs trainer.micro_batch_size=1 (got {t.micro_batch_size}): document "
            f"boundaries (cu_seqlens) describe one packed row, so with several rows attention would cross "
            f"documents. Keep micro_batch_size=1 and raise trainer.grad_accum_steps (or the data-parallel "
            f"degree), or set data.document_masking=false."
        )
    if t.resume not in (None, "auto") and not Path(t.resume).exists():
        raise ValueError(
            f"trainer.resume={t.resume!r} does not exist. Point it at a step_<N> checkpoint dir (or a checkpoint "
            f"root), use trainer.resume=auto (latest in the checkpoint dir, if any), or null to start fresh."
        )


def start_up_warnings(cfg: TrainConfig) -> list[str]:
    """What is legal but almost surely not meant (the trainer logs each line on rank 0, after :func:`validate`):
    ``trainer.seq_len`` beyond the checkpoint's own context without a RoPE change, a warmup longer than the
    run. Reads ``config.json`` only."""
    from usp.train.optim import schedule_warnings

    out = schedule_warnings(cfg.optim, cfg.trainer.max_steps)
    m = cfg.model
    own = check_model_dir(m.path)  # the checkpoint's own settings, before this run's overrides
    context = getattr(own, "max_position_embeddings", None)
    if context and cfg.trainer.seq_len > context and m.rope_theta is None and m.rope_scaling is None:
        from usp.model.load import rope_settings

        rope = {k: v for k, v in rope_settings(own).items() if v is not None}
        out.append(
            f"trainer.seq_len={cfg.trainer.seq_len} is longer than the checkpoint's own context "
            f"(max_position_embeddings={context} in {m.path}/config.json; RoPE {rope}): positions beyond it are "
            f"untrained. Extend the context on purpose: raise model.rope_theta (e.g. model.rope_theta="
            f"{float(rope.get('rope_theta') or 10000.0) * 8:g}) or set model.rope_scaling={{rope_type: yarn, factor: "
            f"{-(-cfg.trainer.seq_len // context)}, original_max_position_embeddings: {context}}}, and "
            f"model.max_position_embeddings={cfg.trainer.seq_len} (docs/training.md)."
        )
    return out


def validate(cfg: TrainConfig, world_size: int, device: torch.device) -> tuple[Any, Layout]:
    """Every check that needs no weights, data or collectives; returns ``(model_config, layout)``.

    Called once per run, on every rank, before anything expensive. Reads ``cfg``, never changes it. Raises
    ``ValueError`` naming the setting and the fix.
    """
    validate_choices(cfg)  # the config's own rules (the entry point ran them too; a direct run() had not)
    model_config = check_model_dir(cfg.model.path)
    apply_rope_overrides(  # the RoPE the run will train with: the planner and the checks below see it
        model_config, rope_theta=cfg.model.rope_theta, rope_scaling=cfg.model.rope_scaling,
        max_position_embeddings=cfg.model.max_position_embeddings,
    )  # fmt: skip
    compute_dtype = parse_dtype(cfg.model.dtype, "model.dtype")
    try:
        head_dim = getattr(model_config, "head_dim", None) or (
            model_config.hidden_size // model_config.num_attention_heads
        )
        resolve_backend(cfg.model.attention_backend, device, compute_dtype, head_dim=head_dim)
    except ValueError as e:
        raise ValueError(f"model.attention_backend={cfg.model.attention_backend!r}: {e}") from e
    _check_trainer(cfg)
    check_optim_config(cfg.optim, cfg.trainer.max_steps)
    if cfg.parallel.cpu_offload and device.type != "cuda":
        raise ValueError(
            "parallel.cpu_offload=true needs CUDA devices (it moves FSDP2 shards between GPU and host); "
            "set parallel.cpu_offload=false for CPU runs."
        )
    layout = resolve_layout(cfg, model_config, world_size, device)
    check_heads(model_config, layout.ulysses_degree)
    check_rope_for_sequence_parallel(model_config, layout.ulysses_degree * layout.ring_degree)
    _check_memory_tricks(cfg, model_config, layout, world_size)
    return model_config, layout
