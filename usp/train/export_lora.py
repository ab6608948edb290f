"""Export LoRA adapters as a ``peft`` adapter directory (``PeftModel.from_pretrained`` loads it).

The full adapter tensors are gathered like :func:`usp.train.export.export_hf`'s state dict (a collective over the
FSDP2 mesh; full CPU tensors on rank 0 only) and written by rank 0, atomically, in ``peft``'s own layout:
``adapter_model.safetensors`` (:func:`usp.model.lora.peft_adapter_state`: ``base_model.model.<module>.lora_A.weight``
..., plus the trained embeddings and norms as ``modules_to_save``) and ``adapter_config.json`` (``peft``'s
``LoraConfig``, ``base_model_name_or_path`` = ``model.path``). The adapters stay in their fp32 master precision
(they are small; a bf16 cast would round the update away from the base).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from usp.atomic import write_dir
from usp.model.lora import (
    LoraSpec,
    embeddings_and_norms,
    is_adapter_key,
    peft_adapter_config,
    peft_adapter_state,
    tied_output_module,
)
from usp.parallel.agree import dist_rank, raise_if_any_failed
from usp.train.export import EXPORT_MARKER, TMP_TAG, check_export_dir

ADAPTER_FILE = "adapter_model.safetensors"


def trained_modules(model: torch.nn.Module, spec: LoraSpec) -> list[str]:
    """The modules trained besides the adapters (``peft``'s ``modules_to_save``): the embeddings and norms
    with ``train_embeddings_and_norms``, else none."""
    return embeddings_and_norms(model) if spec.train_embeddings_and_norms else []


def export_adapter(
    model: torch.nn.Module,
    spec: LoraSpec,
    *,
    out_dir: str | os.PathLike,
    base_path: str,
    tokenizer: Any | None = None,
) -> Path:
    """Write the adapters of ``model`` (``spec``: as applied, :func:`usp.model.lora.resolve_lora`) (and its trained embeddings and norms) to ``out_dir`` as a ``peft``
    adapter directory for the base checkpoint ``base_path``. Collective when a process group is initialized
    (call on every rank). ``out_dir`` is replaced atomically if it holds an earlier usp export; any other
    non-empty directory raises ``ValueError``. Returns ``out_dir``."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    check_export_dir(out_dir)
    saved = trained_modules(model, spec)
    tied = tied_output_module(model) if saved else None  # trained embeddings of a tied model: lm_head too
    full = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
    )
    error: BaseException | None = None
    if dist_rank() == 0:
        try:
            tensors = {k: v.detach().contiguous() for k, v in peft_adapter_state(full, saved, tied).items()}
            assert sum(is_adapter_key(k) for k in full) == sum(".lora_" in k for k in tensors) > 0

            def write(tmp: Path) -> None:
                save_file(tensors, str(tmp / ADAPTER_FILE), metadata={"format": "pt"})
                peft_adapter_config(spec, saved, base_path, tied).save_pretrained(str(tmp))
                if tokenizer is not None:
                    tokenizer.save_pretrained(str(tmp))
                marker = {"format": "usp-peft-adapter", "num_tensors": len(tensors), "dtype": "float32"}
                (tmp / EXPORT_MARKER).write_text(json.dumps(marker) + "\n")

            write_dir(out_dir, write, tag=TMP_TAG, unique=False)
        except Exception as e:  # noqa: BLE001 - reported to every rank
            error = e
    raise_if_any_failed(error, f"exporting the LoRA adapter to {out_dir}")
    return out_dir
