"""The checks of a composed run config that need no torch, no files and no world: the valid values of the
string-enum fields, simple ranges, and the layout against a given world size.

- :func:`validate_choices`: every enum field and range (the entry point calls it right after composition);
- :func:`validate_layout`: the degrees against the launched world and ``trainer.seq_len`` against the
  sequence layout (:class:`usp.parallel.ParallelLayout`; imports torch, lazily);
- :func:`states_on_host`: the one rule relating ``optim.name`` and ``parallel.cpu_offload``;
- :func:`text_fields_per_input`: ``data.text_field`` (one column name, or one per input) per input.

Each ``ValueError`` names the setting, the value and the fix. The shared rules come from their homes:
``parallel.ring_layout`` from :func:`usp.modes.check_ring_layout`, ``parallel.mlp_tiles`` from
:func:`usp.mlp_tiles.check_mlp_tiles_setting`, the node size from :func:`usp.parallel.mesh.resolve_node_size`.
"""

from __future__ import annotations

from collections.abc import Sequence

from usp.config.schema import TrainConfig
from usp.mlp_tiles import check_mlp_tiles_setting
from usp.modes import (
    AC_MODES,
    ATTENTION_BACKENDS,
    DATA_FORMATS,
    FSDP_MODES,
    LONG_CONVERSATIONS,
    LOSS_ON,
    OPTIMIZERS,
    check_ring_layout,
)

# Valid values of the string-enum fields that no other module implements a list of (checked once, here).
DTYPES: tuple[str, ...] = ("bfloat16", "float32", "float16")
REDUCE_DTYPES: tuple[str, ...] = ("float32", "bfloat16")
PROCESS_GROUP_BACKENDS: tuple[str | None, ...] = (None, "nccl", "gloo")
"""``parallel.backend`` (``None``: nccl on CUDA, gloo on CPU); not the attention kernels of
:data:`usp.modes.ATTENTION_BACKENDS`."""
DEVICES: tuple[str, ...] = ("auto", "cuda", "cpu")
WANDB_MODES: tuple[str, ...] = ("online", "offline", "disabled")
ROUTER_LOSS_SCOPES: tuple[str, ...] = ("micro_batch", "step")
"""``model.router_loss_scope`` (:mod:`usp.train.router_loss`)."""


def text_fields_per_input(text_field: str | Sequence[str], inputs: Sequence[str]) -> list[str]:
    """One text column name per input: a single name applies to all; a list needs one entry per input."""
    if isinstance(text_field, str):
        return [text_field] * len(inputs)
    fields = list(text_field)
    if len(fields) == 1:
        return fields * len(inputs)
    if len(fields) != len(inputs) or not all(isinstance(f, str) and f for f in fields):
        raise ValueError(
            f"--text-field / data.text_field={fields} has {len(fields)} entries for {len(inputs)} inputs: give one "
            "column name for all inputs, or one per input in the same order."
        )
    return fields


def _check_choice(name: str, value: object, valid: tuple) -> None:
    if value not in valid:
        shown = ", ".join("null" if v is None else str(v) for v in valid)
        raise ValueError(f"{name}={value!r} is invalid; choose one of: {shown}.")


def _check_degree(name: str, value: object) -> None:
    if value == "auto":
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} is invalid: use an integer >= 1 or 'auto' (ask the planner).")


def validate_choices(cfg: TrainConfig) -> None:
    """Check the enum-like string fields and simple ranges; ``ValueError`` names the setting and the valid values.

    Pure (no torch, no files): called once by the entry point right after composition.
    """
    _check_choice("model.dtype", cfg.model.dtype, DTYPES)
    _check_choice("model.attention_backend", cfg.model.attention_backend, ATTENTION_BACKENDS)
    _check_choice("model.router_loss_scope", cfg.model.router_loss_scope, ROUTER_LOSS_SCOPES)
    if cfg.model.path in ("", "???"):
        raise ValueError(
            "model.path is not set: point it at a local Hugging Face checkpoint dir "
            "(model.path=/path/to/Meta-Llama-3.1-8B), or use recipe=tiny."
        )
    d = cfg.data
    if not d.inputs and not d.prepared_path and not d.build_tiny_corpus:
        raise ValueError(
            "no training data: set data.prepared_path=<a usp-prepare-data output dir>, or "
            "data.inputs=[a.jsonl,owner/dataset] (local files or hub dataset names)."
        )
    if not isinstance(d.text_field, str):
        text_fields_per_input(d.text_field, d.inputs)
    if d.weights is not None and len(d.weights) != len(d.inputs):
        raise ValueError(
            f"data.weights has {len(d.weights)} entries but data.inputs has {len(d.inputs)}: give one weight "
            "per input, or data.weights=null to concatenate."
        )
    _check_choice("data.format", d.format, DATA_FORMATS)
    if d.loss_on is not None:
        _check_choice("data.loss_on", d.loss_on, LOSS_ON)
    _check_choice("data.long_conversations", d.long_conversations, LONG_CONVERSATIONS)
    if d.format == "text" and d.loss_on not in (None, "all"):
        raise ValueError(
            f"data.loss_on={d.loss_on} needs conversations: set data.format=chat (text documents train every token)."
        )
    if d.format == "chat" and not d.document_masking:
        raise ValueError(
            "data.format=chat packs one conversation per document and needs data.document_masking=true (attention "
            "must not cross conversations or reach the padding)."
        )
    if d.format == "preference":
        if not d.document_masking:
            raise ValueError(
                "data.format=preference packs prompt+chosen and prompt+rejected as separate documents and needs "
                "data.document_masking=true (attention must not cross from one completion into the other)."
            )
        if d.loss_on not in (None, "last_assistant"):
            raise ValueError(
                f"data.loss_on={d.loss_on} does not apply to data.format=preference: the targets are always the "
                "completion (the last assistant message). Remove data.loss_on."
            )
    p = cfg.parallel
    _check_degree("parallel.ulysses_degree", p.ulysses_degree)
    _check_degree("parallel.ring_degree", p.ring_degree)
    if p.dp_degree != -1 and p.dp_degree < 1:
        raise ValueError(
            f"parallel.dp_degree={p.dp_degree} is invalid: use an integer >= 1, or -1 (remaining ranks)."
        )
    check_ring_layout(p.ring_layout)
    _check_choice("parallel.fsdp_mode", p.fsdp_mode, FSDP_MODES)
    _check_choice("parallel.activation_checkpointing", p.activation_checkpointing, AC_MODES)
    if p.activation_checkpointing == "every_k" and p.ac_every_k < 1:
        raise ValueError(f"parallel.ac_every_k={p.ac_every_k} is invalid: use an integer >= 1.")
    check_mlp_tiles_setting(p.mlp_tiles)
    if (
        isinstance(p.attn_head_chunks, bool)
        or not isinstance(p.attn_head_chunks, int)
        or p.attn_head_chunks < 1
    ):
        raise ValueError(
            f"parallel.attn_head_chunks={p.attn_head_chunks!r} is invalid: use an integer >= 1 (1 = off) dividing "
            "the query and key/value heads per rank after the Ulysses all-to-all."
        )
    _check_choice("optim.name", cfg.optim.name, OPTIMIZERS)
    _check_choice("parallel.reduce_dtype", p.reduce_dtype, REDUCE_DTYPES)
    _check_choice("parallel.backend", p.backend, PROCESS_GROUP_BACKENDS)
    if isinstance(p.timeout_minutes, bool) or not isinstance(p.timeout_minutes, int) or p.timeout_minutes < 1:
        raise ValueError(
            f"parallel.timeout_minutes={p.timeout_minutes!r} is invalid: use an integer >= 1 (minutes a rank "
            "waits for the others in a collective; default 60)."
        )
    _check_choice("trainer.device", cfg.trainer.device, DEVICES)
    _check_choice("logging.wandb.mode", cfg.logging.wandb.mode, WANDB_MODES)
    t = cfg.trainer
    for name in ("max_steps", "seq_len", "micro_batch_size", "grad_accum_steps", "loss_chunk_size"):
        value = getattr(t, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"trainer.{name}={value!r} is invalid: use an integer >= 1.")
    for name in ("watchdog_factor", "watchdog_min_seconds", "watchdog_minutes"):
        value = getattr(t, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise ValueError(
                f"trainer.{name}={value!r} is invalid: use a number >= 0 (0 turns the rule off)."
            )
    if isinstance(t.max_bad_steps, bool) or not isinstance(t.max_bad_steps, int) or t.max_bad_steps < 1:
        raise ValueError(
            f"trainer.max_bad_steps={t.max_bad_steps!r} is invalid: use an integer >= 1 (consecutive non-finite "
            "steps before the run stops; default 3)."
        )
    if not (t.loss_spike_factor == 0 or t.loss_spike_factor > 1):
        raise ValueError(
            f"trainer.loss_spike_factor={t.loss_spike_factor} is invalid: use a factor > 1 (e.g. 3.0), or 0 to "
            "turn the loss-spike warning off."
        )
    if isinstance(t.eval_every, bool) or not isinstance(t.eval_every, int) or t.eval_every < 0:
        raise ValueError(f"trainer.eval_every={t.eval_every!r} is invalid: use an integer >= 0 (0 = off).")
    if t.checkpoint_every < 0 or t.keep_last < 1:
        raise ValueError(
            f"trainer.checkpoint_every={t.checkpoint_every} / trainer.keep_last={t.keep_last}: "
            "checkpoint_every must be >= 0 and keep_last >= 1."
        )
    mpe = cfg.model.max_position_embeddings
    if mpe is not None and mpe < t.seq_len:
        raise ValueError(
            f"model.max_position_embeddings={mpe} is shorter than trainer.seq_len={t.seq_len}: set "
            f"model.max_position_embeddings={t.seq_len} (or more) for context extension."
        )
    if cfg.optim.lr <= 0 or cfg.optim.grad_clip < 0:
        raise ValueError(
            f"optim.lr={cfg.optim.lr} must be > 0 and optim.grad_clip={cfg.optim.grad_clip} >= 0."
        )
    if cfg.logging.log_every < 1:
        raise ValueError(f"logging.log_every={cfg.logging.log_every} is invalid: use an integer >= 1.")


def states_on_host(optim_name: str, cpu_offload: bool) -> bool:
    """The one rule relating ``optim.name`` and ``parallel.cpu_offload``: the optimizer states (and the fp32
    sharded parameters and gradients with them) live in host memory when either asks for it. On CUDA that is
    FSDP2's ``CPUOffloadPolicy``; on a CPU device everything is in host memory already."""
    return cpu_offload or optim_name != "adamw"


def validate_layout(cfg: TrainConfig, *, world_size: int, local_world_size: int | None = None) -> None:
    """Check the degrees against the launched world (``WORLD_SIZE`` / ``LOCAL_WORLD_SIZE``) and ``seq_len``
    against the sequence layout, before anything expensive. A degree set to ``auto`` is left to the planner and
    counts as 1 here: the fixed one is checked (world size, node size) and the sequence length waits for the
    planner's choice.

    Raises ``ValueError`` with the numbers (from :class:`usp.parallel.ParallelLayout`, the constructor
    ``usp-launch`` uses too: :meth:`~usp.parallel.ParallelLayout.from_settings`) and the fix.
    """
    from usp.parallel import ParallelLayout  # lazy: composing a config needs no torch
    from usp.parallel.mesh import resolve_node_size

    p = cfg.parallel
    launcher = {} if local_world_size is None else {"LOCAL_WORLD_SIZE": str(local_world_size)}
    node_size = resolve_node_size(p.node_size, world_size, env=launcher)
    auto = [name for name in ("ulysses_degree", "ring_degree") if getattr(p, name) == "auto"]
    try:
        layout = ParallelLayout.from_settings(  # an ``auto`` degree counts as 1 (the planner's choice only
            world_size=world_size,  # multiplies the product)
            ulysses_degree=p.ulysses_degree,
            ring_degree=p.ring_degree,
            dp_degree=p.dp_degree,
            node_size=node_size,
            allow_cross_node_ulysses=p.allow_cross_node_ulysses,
            ring_layout=p.ring_layout,
        )
    except ValueError as e:
        if not auto:
            raise
        counted = " and ".join(f"parallel.{name}=auto" for name in auto)
        raise ValueError(f"{e} ({counted} counted as 1 here: the planner picks it at start-up.)") from e
    if auto:
        return
    layout.check_sequence_length(cfg.trainer.seq_len)
