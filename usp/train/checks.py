"""The trainer's start-up checks, once, before any weights or data: :func:`check_training_run`.

``check_training_run(cfg, world_size, device)`` runs every check that needs no weights, data or collectives and
returns ``(model_config, layout)``: the Hugging Face config the run trains (RoPE overrides applied) and the frozen
:class:`usp.parallel.ParallelLayout` with every ``auto`` resolved (:func:`usp.startup.resolve_layout`, the one
resolution of ``parallel.*`` that ``usp-eval`` and ``usp-launch`` call too). Everything after it reads the layout, never
``cfg.parallel``'s degrees, tiles or modes; the :class:`usp.config.TrainConfig` is never changed (its ``auto``
stays ``auto``). Also here: the tiny model built if asked (:func:`build_tiny_if_asked`), whether FSDP2 keeps
states on the host (:func:`keeps_states_on_host`), and the start-up warnings (:func:`start_up_warnings`).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from usp.attention import check_attn_head_chunks, resolve_backend
from usp.config import TrainConfig, states_on_host, validate_choices
from usp.model import apply_rope_overrides, check_model_dir, parse_dtype
from usp.model.lora import LoraSpec, check_lora_spec
from usp.parallel import ParallelLayout
from usp.plan.models import head_dim_of
from usp.startup import check_model_for_degrees, resolve_layout
from usp.train.checkpoint_offload import check_host_memory
from usp.train.dpo import OBJECTIVES, DpoSpec, check_dpo_spec
from usp.train.optim import check_optim_config
from usp.train.tiling import check_tiling_available


def build_tiny_if_asked(cfg: TrainConfig, rank: int) -> None:
    """``model.build_tiny``: rank 0 writes a tiny random Llama at its own default path
    (``<run dir>/tiny-llama``, :data:`usp.tiny.TINY_MODEL_DIR`) if none is there (demo, tests), before
    :func:`check_training_run` checks that dir.

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
                path,
                cfg.optim.lr,
                cfg.optim.warmup_steps,
            )
        return
    if rank == 0 and not (path / "config.json").exists():
        from usp.tiny import build_tiny_llama

        build_tiny_llama(path, seed=cfg.trainer.seed, **dict(cfg.model.tiny_size))


def keeps_states_on_host(cfg: TrainConfig, device: torch.device) -> bool:
    """Whether FSDP2 keeps the sharded parameters, gradients and optimizer states in host memory: on CUDA when
    :func:`usp.config.states_on_host` says so (``parallel.cpu_offload`` or an ``optim.name`` that steps on the
    host); never on a CPU device, where they are in host memory already."""
    return device.type == "cuda" and states_on_host(cfg.optim.name, cfg.parallel.cpu_offload)


def _check_memory_tricks(
    cfg: TrainConfig, model_config: Any, layout: ParallelLayout, world_size: int
) -> None:
    """The resolved MLP tiles need DeepSpeed; the head chunks must split the heads per rank; the host memory
    that ``activation_checkpointing=offload`` takes on a node must be there (``ValueError`` naming the setting)."""
    check_tiling_available(layout.mlp_tiles)
    hq = model_config.num_attention_heads
    check_attn_head_chunks(
        layout.attn_head_chunks,
        hq,
        getattr(model_config, "num_key_value_heads", None) or hq,
        layout.ulysses_degree,
    )
    if layout.activation_checkpointing == "offload":
        local_tokens = layout.local_tokens(cfg.trainer.seq_len)
        check_host_memory(
            num_layers=model_config.num_hidden_layers,
            local_tokens=local_tokens * cfg.trainer.micro_batch_size,
            hidden_size=model_config.hidden_size,
            compute_bytes=parse_dtype(cfg.model.dtype).itemsize,
            ranks_per_node=min(layout.node_size, world_size),
        )


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


def lora_spec(cfg: TrainConfig) -> LoraSpec | None:
    """``model.lora`` as :class:`usp.model.lora.LoraSpec`, or ``None`` when ``model.lora.rank`` is 0 (off)."""
    lora = cfg.model.lora
    if lora.rank == 0:
        return None
    targets = None if lora.target_modules is None else tuple(lora.target_modules)
    return LoraSpec(lora.rank, lora.alpha, lora.dropout, targets, lora.train_embeddings_and_norms)


def check_lora(cfg: TrainConfig, model_config: Any) -> None:
    """``model.lora``: the numbers in range and every target module a linear layer of this model's decoder
    blocks (read from the model built on the meta device: no weights); ``ValueError`` naming the setting."""
    spec = lora_spec(cfg)
    if spec is None:
        if cfg.model.lora.export_merged:
            raise ValueError("model.lora.export_merged=true needs adapters: set model.lora.rank > 0.")
        return
    from usp.model import build_empty_causal_lm

    check_lora_spec(spec, build_empty_causal_lm(model_config))


def dpo_spec(cfg: TrainConfig) -> DpoSpec | None:
    """``trainer.dpo`` as :class:`usp.train.dpo.DpoSpec` when ``trainer.objective=dpo``, else ``None``."""
    if cfg.trainer.objective != "dpo":
        return None
    d = cfg.trainer.dpo
    return DpoSpec(beta=d.beta, loss_type=d.loss_type, simpo_gamma=d.simpo_gamma)


_SAME_ARCHITECTURE = ("model_type", "hidden_size", "num_hidden_layers", "vocab_size", "num_attention_heads")


def check_objective(cfg: TrainConfig, model_config: Any) -> None:
    """``trainer.objective`` and, for ``dpo``, what the preference loss needs: preference rows with document
    masking, no router loss, a reference checkpoint of the
    same architecture. ``ValueError`` naming the setting."""
    objective = cfg.trainer.objective
    if objective not in OBJECTIVES:
        raise ValueError(f"trainer.objective={objective!r} is invalid; choose one of {list(OBJECTIVES)}.")
    if objective != "dpo":
        if cfg.trainer.dpo.shared_prompt:
            raise ValueError(
                "trainer.dpo.shared_prompt=true lays out preference pairs for trainer.objective=dpo; set "
                "trainer.objective=dpo or trainer.dpo.shared_prompt=false."
            )
        if cfg.data.format == "preference":
            raise ValueError(
                "data.format=preference holds chosen/rejected pairs for trainer.objective=dpo; set "
                "trainer.objective=dpo (or prepare the data as text or chat)."
            )
        return
    spec = dpo_spec(cfg)
    assert spec is not None
    check_dpo_spec(spec)
    if cfg.data.format != "preference":
        raise ValueError(
            f"trainer.objective=dpo trains on preference pairs: set data.format=preference (got "
            f"data.format={cfg.data.format!r}; usp-prepare-data --format preference, docs/data.md)."
        )
    if not cfg.data.document_masking:
        raise ValueError(
            "trainer.objective=dpo needs data.document_masking=true: a pair's chosen and rejected sequences "
            "share a row and must not attend to each other."
        )
    if getattr(model_config, "output_router_logits", False) or getattr(
        model_config, "router_aux_loss_coef", 0
    ):
        from usp.model import build_empty_causal_lm
        from usp.train.router_loss import router_aux_spec

        if router_aux_spec(build_empty_causal_lm(model_config), cfg.model.router_aux_loss_coef) is not None:
            raise ValueError(
                "trainer.objective=dpo on a mixture-of-experts model with a router loss is not supported yet "
                "(the router's load-balancing loss would be dropped); set model.router_aux_loss_coef=0 to "
                "train without it on purpose."
            )
    if cfg.trainer.dpo.shared_prompt:
        _check_shared_prompt(model_config, cfg.trainer.seq_len)
    ref = cfg.trainer.dpo.reference_path
    if ref is not None and spec.needs_reference:
        try:
            ref_config = check_model_dir(ref)
        except ValueError as e:
            raise ValueError(f"trainer.dpo.reference_path: {e}") from e
        diffs = [
            f"{k} {getattr(ref_config, k, None)!r} vs {getattr(model_config, k, None)!r}"
            for k in _SAME_ARCHITECTURE
            if getattr(ref_config, k, None) != getattr(model_config, k, None)
        ]
        if diffs:
            raise ValueError(
                f"trainer.dpo.reference_path={ref!r} is not the architecture of model.path ({'; '.join(diffs)}). "
                f"The reference must be the same model family and size (e.g. the SFT checkpoint the policy "
                f"starts from)."
            )


def _check_shared_prompt(model_config: Any, seq_len: int) -> None:
    """``trainer.dpo.shared_prompt``: the rejected completion attends to the prompt through a link that
    softmax attention over the whole sequence honours (:func:`usp.attention.usp_attention`'s
    ``shared_prefix``); recurrent / convolution mixers, sliding windows and chunks shorter than the row do not."""
    from usp.model.capabilities import model_capabilities

    caps = model_capabilities(model_config)
    local = sorted(
        {
            f"{spec.kind} {spec.window or spec.chunk}"
            for spec in caps.layers
            if (spec.window is not None and spec.window < seq_len)
            or (spec.chunk is not None and spec.chunk < seq_len)
        }
    )
    if caps.mixers or local:
        what = ", ".join([*caps.mixers, *local])
        raise ValueError(
            f"trainer.dpo.shared_prompt=true needs softmax attention over the whole row in every layer; "
            f"{caps.model_type} has {what}. Set trainer.dpo.shared_prompt=false (each prompt twice)."
        )


def start_up_warnings(cfg: TrainConfig) -> list[str]:
    """What is legal but almost surely not meant (the trainer logs each line on rank 0, after :func:`check_training_run`):
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


def check_training_run(cfg: TrainConfig, world_size: int, device: torch.device) -> tuple[Any, ParallelLayout]:
    """Every check that needs no weights, data or collectives; returns ``(model_config, layout)``.

    Called once per run, on every rank, before anything expensive. Reads ``cfg``, never changes it. Raises
    ``ValueError`` naming the setting and the fix.
    """
    validate_choices(cfg)  # the config's own rules (the entry point ran them too; a direct run() had not)
    model_config = check_model_dir(cfg.model.path)
    apply_rope_overrides(  # the RoPE the run will train with: the planner and the checks below see it
        model_config,
        rope_theta=cfg.model.rope_theta,
        rope_scaling=cfg.model.rope_scaling,
        max_position_embeddings=cfg.model.max_position_embeddings,
    )
    compute_dtype = parse_dtype(cfg.model.dtype, "model.dtype")
    try:
        resolve_backend(
            cfg.model.attention_backend, device, compute_dtype, head_dim=head_dim_of(model_config)
        )
    except ValueError as e:
        raise ValueError(f"model.attention_backend={cfg.model.attention_backend!r}: {e}") from e
    _check_trainer(cfg)
    check_optim_config(cfg.optim, cfg.trainer.max_steps)
    if cfg.parallel.cpu_offload and device.type != "cuda":
        raise ValueError(
            "parallel.cpu_offload=true needs CUDA devices (it moves FSDP2 shards between GPU and host); "
            "set parallel.cpu_offload=false for CPU runs."
        )
    check_lora(cfg, model_config)
    check_objective(cfg, model_config)
    layout = resolve_layout(cfg, model_config, world_size, device)
    check_model_for_degrees(model_config, layout)
    _check_memory_tricks(cfg, model_config, layout, world_size)
    if cfg.model.lora.rank and cfg.model.lora.dropout > 0 and layout.mlp_tiles > 1:
        raise ValueError(
            f"model.lora.dropout={cfg.model.lora.dropout} with parallel.mlp_tiles={layout.mlp_tiles}: the MLP tiles "
            f"recompute each tile in backward without the forward's random state, so the adapters' dropout mask "
            f"would differ between forward and backward. Set model.lora.dropout=0 or parallel.mlp_tiles=1."
        )
    return model_config, layout
