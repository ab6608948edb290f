"""Unknown config keys are errors: every override must land on a field of the typed schema.

Hydra's struct mode rejects ``trainer.gradient_accumulation_steps=4`` and suggests ``+trainer...=4``, which
appends the key; ``OmegaConf.to_object`` then drops it and the run trains without the setting. This module
checks the composed config (and the command-line overrides, for a message before Hydra's) against the schema
and names the closest real key, or the usp key for a name known from a neighbouring tool (Hugging Face
Trainer, torchtitan, axolotl, DeepSpeed).
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from collections.abc import Iterable, Mapping

# Names from neighbouring tools -> what usp calls them (matched on the last component of the key).
FOREIGN_KEYS: dict[str, str] = {
    "gradient_accumulation_steps": "trainer.grad_accum_steps",
    "train_on_inputs": "data.loss_on (assistant: only assistant turns are targets; all: every token)",
    "assistant_only_loss": "data.loss_on=assistant (with data.format=chat)",
    "completion_only_loss": "data.loss_on=assistant (with data.format=chat; prompt/completion rows)",
    "dataset_text_field": "data.text_field (or data.messages_field with data.format=chat)",
    "grad_accum": "trainer.grad_accum_steps",
    "accumulate_grad_batches": "trainer.grad_accum_steps",
    "per_device_train_batch_size": "trainer.micro_batch_size",
    "micro_batch_size_per_gpu": "trainer.micro_batch_size",
    "train_micro_batch_size_per_gpu": "trainer.micro_batch_size",
    "batch_size": "trainer.micro_batch_size (sequences per rank per micro-step; x grad_accum_steps x dp)",
    "max_seq_len": "trainer.seq_len",
    "max_seq_length": "trainer.seq_len",
    "seq_length": "trainer.seq_len",
    "sequence_len": "trainer.seq_len",
    "sequence_length": "trainer.seq_len",
    "context_length": "trainer.seq_len",
    "max_steps": "trainer.max_steps",
    "steps": "trainer.max_steps",
    "save_total_limit": "trainer.keep_last",
    "save_steps": "trainer.checkpoint_every",
    "checkpoint_interval": "trainer.checkpoint_every",
    "eval_steps": "trainer.eval_every",
    "learning_rate": "optim.lr",
    "max_grad_norm": "optim.grad_clip",
    "gradient_clipping": "optim.grad_clip",
    "max_norm": "optim.grad_clip",
    "lr_warmup_steps": "optim.warmup_steps",
    "context_parallel_degree": "parallel.ring_degree (ring attention across nodes) and "
    "parallel.ulysses_degree (all-to-all inside a node): usp's sequence parallel degree is their product",
    "sequence_parallel_degree": "parallel.ulysses_degree x parallel.ring_degree (Ulysses inside a node, ring "
    "across nodes)",
    "sequence_parallel_size": "parallel.ulysses_degree x parallel.ring_degree (Ulysses inside a node, ring "
    "across nodes)",
    "ulysses_sp_size": "parallel.ulysses_degree",
    "ring_attn_size": "parallel.ring_degree",
    "data_parallel_shard_degree": "parallel.dp_degree (FSDP2 always shards over every rank)",
    "data_parallel_replicate_degree": "parallel.fsdp_mode=hybrid_shard (replicate across nodes)",
    "gradient_checkpointing": "parallel.activation_checkpointing",
    "activation_checkpoint": "parallel.activation_checkpointing",
    "fsdp_sharding_strategy": "parallel.fsdp_mode",
    "attn_implementation": "model.attention_backend",
    "model_name_or_path": "model.path",
    "base_model": "model.path",
    "torch_dtype": "model.dtype",
    "bf16": "model.dtype=bfloat16",
    "dataset": "data.inputs (or data.prepared_path)",
    "datasets": "data.inputs (or data.prepared_path)",
    "output_dir": "hydra.run.dir",
    "report_to": "logging.wandb.mode",
    "wandb_project": "logging.wandb.project",
    "logging_steps": "logging.log_every",
    "seed": "trainer.seed (data order: data.seed)",
}


def schema_keys(schema: type) -> tuple[set[str], set[str]]:
    """``(fields, open_prefixes)`` of a dataclass schema, as dotted paths.

    ``fields`` holds every field path (``trainer.grad_accum_steps``, and ``trainer`` itself); a field typed
    ``dict[...]`` (``model.rope_scaling``) takes any key below it, so its path is in ``open_prefixes``.
    """
    fields: set[str] = set()
    open_prefixes: set[str] = set()

    def walk(cls: type, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            path = f"{prefix}{f.name}"
            fields.add(path)
            hint = hints[f.name]
            args = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
            inner = args[0] if len(args) == 1 else hint
            if dataclasses.is_dataclass(inner):
                walk(inner, f"{path}.")
            elif inner is dict or typing.get_origin(inner) is dict or inner is typing.Any:
                open_prefixes.add(path)

    walk(schema, "")
    return fields, open_prefixes


def unknown_key_error(key: str, fields: Iterable[str]) -> str:
    """The message for an override ``key`` that is not in the schema: the usp name or the closest real key."""
    group, _, last = key.rpartition(".")
    fields = sorted(fields)
    siblings = {f.rsplit(".", 1)[-1]: f for f in fields if f.rpartition(".")[0] == group}
    near = difflib.get_close_matches(last, list(siblings), n=1, cutoff=0.75)
    if near:  # a real key of the same group first (eval.batch_size -> eval.micro_batch_size)
        hint = f"did you mean {siblings[near[0]]}?"
    elif last in FOREIGN_KEYS:
        hint = f"usp calls it {FOREIGN_KEYS[last]}"
    else:
        close = difflib.get_close_matches(key, fields, n=1, cutoff=0.6)
        if (
            not close
        ):  # the right name under another group (optim.grad_accum_steps -> trainer.grad_accum_steps)
            by_last = {f.rsplit(".", 1)[-1]: f for f in fields}
            names = difflib.get_close_matches(last, list(by_last), n=1, cutoff=0.6)
            close = [by_last[names[0]]] if names else []
        hint = f"did you mean {close[0]}?" if close else "see `usp-train --cfg job` for every key"
    return f"unknown config key {key!r}: {hint} (usp rejects keys its schema does not have, '+' included)."


def _is_known(key: str, fields: set[str], open_prefixes: set[str]) -> bool:
    return key in fields or any(key.startswith(p + ".") for p in open_prefixes)


def check_composed_keys(cfg: Mapping, schema: type, *, ignore: Iterable[str] = ()) -> None:
    """Raise ``ValueError`` for the first key of the composed config that the schema does not have.

    ``cfg`` is the composed ``DictConfig`` (or a plain dict); top-level names in ``ignore`` (``hydra``) are
    skipped. Values are not resolved.
    """
    from omegaconf import DictConfig, OmegaConf

    fields, open_prefixes = schema_keys(schema)
    skip = set(ignore) | {"hydra"}

    def walk(node: Mapping, prefix: str) -> None:
        for k in node:
            path = f"{prefix}{k}"
            if not prefix and k in skip:
                continue
            if not _is_known(path, fields, open_prefixes):
                raise ValueError(unknown_key_error(path, fields))
            if path in open_prefixes:
                continue
            child = node._get_node(k) if isinstance(node, DictConfig) else node[k]
            if (
                isinstance(child, DictConfig)
                and not OmegaConf.is_missing(node, k)
                and child._is_none() is False
            ):
                walk(child, f"{path}.")
            elif isinstance(child, Mapping):
                walk(child, f"{path}.")

    walk(cfg, "")


def check_override_keys(overrides: Iterable[str], schema: type, groups: Iterable[str]) -> None:
    """Raise ``ValueError`` for a command-line override whose key is not in the schema, before Hydra composes.

    ``groups`` are the config-group names (``recipe``, ``model``, ...): ``group=option`` picks an option.
    Hydra's own keys (``hydra.*``) and flags are left to Hydra; unparsable overrides too (Hydra reports them).
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    fields, open_prefixes = schema_keys(schema)
    groups = set(groups)
    candidates = [o for o in overrides if "=" in o and not o.startswith("-")]
    try:
        parsed = OverridesParser.create().parse_overrides(candidates)
    except HydraException:
        return
    for o in parsed:
        key = o.key_or_group
        head = key.split("/")[0].split(".")[0]
        if head == "hydra" or key in groups or ("/" in key and head in groups) or o.is_delete():
            continue
        if not _is_known(key, fields, open_prefixes):
            raise ValueError(unknown_key_error(key, fields))
