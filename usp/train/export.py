"""Export trained weights as a plain Hugging Face checkpoint (safetensors + config.json + tokenizer).

The full (unsharded) state dict is gathered with ``get_model_state_dict(full_state_dict=True,
cpu_offload=True)``: a collective over the FSDP2 mesh that leaves full CPU tensors on rank 0 only, so peak
memory on rank 0 is one copy of the model in host RAM (in the training dtype) plus one tensor: the cast to the
export dtype replaces the entries one by one (a mixture-of-experts model: plus one decoder layer's experts,
split back into the per-expert tensors ``save_pretrained`` writes). Rank 0 writes the files into
``.<name>.tmp-export`` beside ``out_dir`` and renames the directory into place (:func:`usp.atomic.write_dir`),
so a crash never leaves a half-written export at ``out_dir``: a previous export stays whole until the new one
replaces it. The result loads with ``AutoModelForCausalLM.from_pretrained(out_dir)`` in
plain transformers: the saved config uses the standard ``sdpa`` attention, never the trainer's own ``usp``, and
``use_cache: true`` in config.json and generation_config.json (the trainer runs without a KV cache; generation
needs it).
"""

from __future__ import annotations

import copy
import json
import logging
import os
import re
from pathlib import Path
from typing import Any

import torch
from huggingface_hub import save_torch_state_dict
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from usp.atomic import write_dir
from usp.model.lora import has_lora, merged_state
from usp.parallel.agree import dist_rank, raise_if_any_failed

EXPORT_MARKER = "usp_export.json"
TMP_TAG = "tmp-export"
"""The export is written into ``.<name>.tmp-export`` beside ``out_dir`` (:func:`usp.atomic.temp_path`)."""
SAFE_ATTENTION = "sdpa"
_ATTN_KEYS = ("attn_implementation", "_attn_implementation", "_attn_implementation_internal")


def check_export_dir(out_dir: str | os.PathLike) -> None:
    """``ValueError`` if :func:`export_hf` would refuse ``out_dir``: the trainer calls it at start-up, so a bad
    export target fails before training rather than after it."""
    _check_out_dir(Path(out_dir))


def _check_out_dir(out_dir: Path) -> None:
    """Refuse to replace a directory that is not empty and not an earlier export (e.g. the input checkpoint)."""
    if not out_dir.exists():
        return
    if not out_dir.is_dir():
        raise ValueError(
            f"export out_dir={str(out_dir)!r} is a file. Choose a directory path for the HF export."
        )
    if any(out_dir.iterdir()) and not (out_dir / EXPORT_MARKER).is_file():
        raise ValueError(
            f"export out_dir={str(out_dir)!r} exists, is not empty and is not an earlier usp export; refusing to "
            f"replace it. Choose another directory (or remove this one)."
        )


def _tied_output_key(model: torch.nn.Module, state_dict: dict[str, torch.Tensor]) -> str | None:
    """The output-embedding weight key to drop when the config ties it to the input embeddings."""
    config = getattr(model, "config", None)
    if not getattr(config, "tie_word_embeddings", False):
        return None
    get_out, get_in = (
        getattr(model, "get_output_embeddings", None),
        getattr(model, "get_input_embeddings", None),
    )
    if get_out is None or get_in is None or get_out() is None:
        return None
    names = {id(m): n for n, m in model.named_modules()}
    out_key, in_key = f"{names.get(id(get_out()))}.weight", f"{names.get(id(get_in()))}.weight"
    return out_key if out_key in state_dict and in_key in state_dict and out_key != in_key else None


def _plain_config(model: torch.nn.Module, dtype: torch.dtype | None) -> Any:
    config = copy.deepcopy(model.config)
    for cfg in [config] + [
        getattr(config, k) for k in ("text_config", "vision_config") if hasattr(config, k)
    ]:
        try:
            cfg._attn_implementation = SAFE_ATTENTION
        except (AttributeError, ValueError):  # a custom implementation may be unknown here; scrubbed below
            pass
    if dtype is not None:
        config.dtype = dtype
    config.use_cache = True  # training turns the KV cache off; a checkpoint for generation wants it on
    return config


def _generation_config(model: torch.nn.Module) -> Any:
    """The model's generation config with the KV cache on (``generate()`` would recompute every step)."""
    generation_config = getattr(model, "generation_config", None)
    if generation_config is None:
        return None
    generation_config = copy.deepcopy(generation_config)
    generation_config.use_cache = True
    return generation_config


def _scrub_attention(config_json: Path) -> None:
    """Remove any attention-implementation entry from config.json so the loader picks its default."""
    data = json.loads(config_json.read_text())

    def scrub(d: dict[str, Any]) -> None:
        for key in _ATTN_KEYS:
            d.pop(key, None)
        for value in d.values():
            if isinstance(value, dict):
                scrub(value)

    scrub(data)
    config_json.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


_LAYER = re.compile(r"^(.*?\.layers\.\d+)\.")


def _saved_layout(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` (the model's full state dict) in the layout ``save_pretrained`` writes: transformers' conversion
    rules for the model reverted (``revert_weight_conversion``, as ``save_pretrained`` does). A MoE layer's fused
    ``experts.gate_up_proj`` ``[E, 2I, H]`` / ``experts.down_proj`` become one tensor per expert under the names
    published checkpoints use (qwen3_moe ``mlp.experts.e.{gate,up,down}_proj.weight``, mixtral
    ``block_sparse_moe.experts.e.w{1,3,2}.weight``), which every loader reads; models without rules are unchanged.
    Reverted one decoder layer at a time (no rule spans layers): a fused tensor and its split copies exist for one
    layer at a time.
    """
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError as e:
        from usp.model.moe_weights import conversion_rules

        if not conversion_rules(model, legacy=False):
            return tensors
        raise ValueError(
            f"this transformers has no core_model_loading.revert_weight_conversion ({e}): usp cannot write the "
            f"{model.config.model_type!r} checkpoint in the layout transformers loads. Install the transformers "
            f"release usp pins (pyproject.toml)."
        ) from e
    groups: dict[str, list[str]] = {}
    for key in tensors:
        match = _LAYER.match(key)
        groups.setdefault(match.group(1) if match else "", []).append(key)
    out: dict[str, torch.Tensor] = {}
    for keys in groups.values():  # entries leave ``tensors`` as their layer is reverted
        for key, t in revert_weight_conversion(model, {k: tensors.pop(k) for k in keys}).items():
            # an expert's slice of a fused tensor gets storage of its own: the writer refuses partial views
            whole = t.is_contiguous() and t.untyped_storage().nbytes() == t.numel() * t.element_size()
            out[key] = t if whole else t.clone(memory_format=torch.contiguous_format)
    return out


def _write_files(
    tmp: Path,
    tensors: dict[str, torch.Tensor],
    model: Any,
    saved_dtype: torch.dtype | None,
    tokenizer: Any,
    max_shard_size: int | str,
) -> None:
    """Fill the (empty) directory ``tmp`` with the export: weights, config, generation config, tokenizer, marker."""
    # safetensors shards + model.safetensors.index.json when sharded, named like save_pretrained's
    logging.disable(logging.INFO)  # its "weights successfully saved to <tmp dir>" line would mislead
    try:
        save_torch_state_dict(tensors, tmp, max_shard_size=max_shard_size, metadata={"format": "pt"})
    finally:
        logging.disable(logging.NOTSET)
    _plain_config(model, saved_dtype).save_pretrained(str(tmp))
    _scrub_attention(tmp / "config.json")
    generation_config = _generation_config(model)
    if generation_config is not None:
        generation_config.save_pretrained(str(tmp))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(tmp))
    marker = {"format": "usp-hf-export", "num_tensors": len(tensors), "dtype": str(saved_dtype)}
    (tmp / EXPORT_MARKER).write_text(json.dumps(marker) + "\n")


def export_hf(
    model: torch.nn.Module,
    *,
    tokenizer: Any | None,
    out_dir: str | os.PathLike,
    max_shard_size: int | str = "5GB",
    dtype: torch.dtype | None = None,
    merge_lora_scale: float | None = None,
) -> Path:
    """Write ``model``'s full weights, config and ``tokenizer`` to ``out_dir`` as a Hugging Face checkpoint.

    Collective when a process group is initialized (call on every rank; works for FSDP2-sharded and plain
    models). Floating-point weights are cast to ``dtype`` (e.g. ``torch.bfloat16`` for fp32 master weights);
    ``None`` keeps the parameter dtype. Tied output embeddings are stored once. The tensors are written in the
    layout ``save_pretrained`` writes (:func:`_saved_layout`: a MoE model's experts one tensor each). ``out_dir`` is
    replaced atomically if it holds an earlier export; any other non-empty directory raises ``ValueError``.
    A model with LoRA adapters (:mod:`usp.model.lora`) is written merged: ``merge_lora_scale`` is the adapters'
    ``alpha / rank`` (:func:`usp.model.lora.merged_state`; required then). Returns ``out_dir``.
    """
    out_dir = Path(out_dir)
    if not hasattr(model, "config"):
        raise ValueError("export_hf needs a transformers model (with .config); got a plain nn.Module.")
    _check_out_dir(out_dir)  # on every rank, before any collective: a bad path raises everywhere, no hang
    if has_lora(model) and merge_lora_scale is None:
        raise ValueError("export_hf of a model with LoRA adapters needs merge_lora_scale (alpha / rank).")

    state_dict = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    error: BaseException | None = None
    if dist_rank() == 0:
        try:
            if merge_lora_scale is not None:
                state_dict = merged_state(state_dict, merge_lora_scale)
            drop = _tied_output_key(model, state_dict)
            if drop is not None:
                del state_dict[drop]
            tensors = (
                state_dict  # cast entry by entry, in place: peak is one copy plus one tensor, not two copies
            )
            for k in list(tensors):
                v = tensors[k].detach().cpu()
                tensors[k] = v.to(dtype) if dtype is not None and v.is_floating_point() else v
                del v  # the fp32 original is freed as soon as its entry is replaced
            tensors = _saved_layout(model, tensors)
            dtypes = {v.dtype for v in tensors.values() if v.is_floating_point()}
            saved_dtype = dtypes.pop() if len(dtypes) == 1 else None
            write_dir(
                out_dir,
                lambda tmp: _write_files(tmp, tensors, model, saved_dtype, tokenizer, max_shard_size),
                tag=TMP_TAG,
                unique=False,
            )
        except Exception as e:  # noqa: BLE001 - reported to every rank
            error = e
    raise_if_any_failed(error, f"exporting the Hugging Face checkpoint to {out_dir}")
    return out_dir
