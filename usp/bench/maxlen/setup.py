"""What one longest-sequence search (``python -m usp.bench.maxlen``) trains on, made locally: a checkpoint with
random weights from a model's config, and a synthetic corpus long enough for one packed row.

Nothing is downloaded. The checkpoint has the layout of a hub checkpoint (``config.json``, ``*.safetensors``
shards with an index, tokenizer files), so the trainer loads it through its ordinary path
(:func:`usp.model.load_sharded_weights`). Its tokenizer is the tiny byte-level BPE of :mod:`usp.tiny` (a few
hundred ids, all below any Llama vocabulary): the step's cost does not depend on which token ids are fed.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from usp.plan.models import PRESETS
from usp.units import GIB

MARKER = "usp_random_checkpoint.json"
"""Written last into a finished checkpoint dir: the fields it was made from (a rerun with the same ones reuses it)."""
SHARD_BYTES = 4 * GIB


def model_fields(model: str, *, num_layers: int | None = None) -> dict[str, Any]:
    """``LlamaConfig`` fields for a preset name (:data:`usp.plan.models.PRESETS`) or the ``config.json`` of a
    checkpoint dir; ``num_layers`` replaces ``num_hidden_layers`` (a shallower model of the same width)."""
    from usp.tiny import TINY_LLAMA_DEFAULTS

    if model == "tiny":
        fields = dict(TINY_LLAMA_DEFAULTS)
    elif model in PRESETS:
        fields = {
            **PRESETS[model],
            "tie_word_embeddings": False,
            "rms_norm_eps": 1e-5,
            "rope_theta": 500000.0,
        }
    else:
        path = Path(model)
        path = path / "config.json" if path.is_dir() else path
        if not path.is_file():
            raise ValueError(
                f"--model={model!r} is neither 'tiny', a preset ({sorted(PRESETS)}) nor a config.json."
            )
        keep = (
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "vocab_size",
            "rms_norm_eps",
            "rope_theta",
            "tie_word_embeddings",
            "max_position_embeddings",
        )
        fields = {k: v for k, v in json.loads(path.read_text()).items() if k in keep and v is not None}
    if num_layers is not None:
        if num_layers < 1:
            raise ValueError(f"--num-layers={num_layers} must be >= 1.")
        fields["num_hidden_layers"] = int(num_layers)
    return fields


def write_random_checkpoint(
    path: str | os.PathLike,
    fields: dict[str, Any],
    *,
    seed: int = 0,
    std: float = 0.02,
    dtype: str = "bfloat16",
) -> Path:
    """A Llama checkpoint at ``path`` with random weights (normal, ``std``; norms 1) in ``dtype``, unless one made
    from the same ``fields``, ``seed`` and ``dtype`` is already there.

    ``vocab_size`` defaults to the tokenizer's. Weights are drawn on the GPU when there is one (8B: 16 GB in
    bf16, seconds) and written in shards of :data:`SHARD_BYTES`, so the host holds one shard at a time.
    """
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, LlamaConfig

    from usp.model import parse_dtype
    from usp.tiny import build_tiny_tokenizer

    path = Path(path)
    recipe = {"fields": fields, "seed": seed, "std": std, "dtype": dtype}
    if (path / MARKER).is_file() and json.loads((path / MARKER).read_text()) == recipe:
        return path
    shutil.rmtree(path, ignore_errors=True)
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tokenizer = build_tiny_tokenizer(tmp)
    config = LlamaConfig(
        **{"vocab_size": len(tokenizer), **fields},
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    config.save_pretrained(str(tmp))
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gen = torch.Generator(device).manual_seed(seed)
    torch_dtype = parse_dtype(dtype, "--dtype")
    current: dict[str, Any] = {}
    weight_map: dict[str, str] = {}
    size = 0
    for name, p in skeleton.named_parameters():
        t = torch.empty(p.shape, dtype=torch_dtype, device=device)
        t.fill_(1.0) if p.ndim == 1 else t.normal_(0.0, std, generator=gen)
        nbytes = t.numel() * t.element_size()
        if current and size + nbytes > SHARD_BYTES:  # one shard in host memory at a time
            _write_shard(current, tmp, weight_map, save_file)
            current, size = {}, 0
        current[name] = t.cpu()
        size += nbytes
    _write_shard(current, tmp, weight_map, save_file)
    index = {"metadata": {}, "weight_map": weight_map}
    (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    (tmp / MARKER).write_text(json.dumps(recipe))
    os.replace(tmp, path)
    return path


def _write_shard(tensors: dict[str, Any], out: Path, weight_map: dict[str, str], save_file: Any) -> None:
    """Save ``tensors`` as the next shard (``model-00001.safetensors``, ...) and map their names to it."""
    name = f"model-{len(set(weight_map.values())) + 1:05d}.safetensors"
    save_file(tensors, str(out / name), metadata={"format": "pt"})
    weight_map.update({k: name for k in tensors})


def write_corpus(path: str | os.PathLike, tokenizer: Any, *, min_tokens: int, seed: int = 0) -> int:
    """A jsonl corpus (``{"text": ...}`` per line) of :mod:`usp.tiny`'s synthetic documents with at least
    ``min_tokens`` tokens under ``tokenizer`` (BOS and EOS counted per document, as the packer adds them), so
    it packs into at least one row of ``min_tokens``. Returns the token count."""
    from usp.tiny import tiny_corpus_texts

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    total, batch = 0, seed
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w") as f:
        while total < min_tokens:
            texts = tiny_corpus_texts(400, seed=batch)
            batch += 1
            for text, ids in zip(texts, tokenizer(texts, add_special_tokens=False)["input_ids"]):
                f.write(json.dumps({"text": text}) + "\n")
                total += len(ids) + 2
    os.replace(tmp, path)
    return total


def device_info() -> dict[str, Any]:
    """The compute device of this machine: ``{"cuda", "name", "memory_gib"}`` (the CPU when there is no GPU)."""
    import torch

    if not torch.cuda.is_available():
        return {"cuda": False, "name": "cpu", "memory_gib": None}
    props = torch.cuda.get_device_properties(0)
    return {"cuda": True, "name": props.name, "memory_gib": props.total_memory / GIB}


def main(argv: list[str] | None = None) -> None:
    """Write the random checkpoint, then print one JSON line: ``{"device": device_info(), "checkpoint_s"}``.

    Run by the search in a process of its own, so the search process itself never holds a CUDA context."""
    import argparse
    import time

    p = argparse.ArgumentParser(prog="python -m usp.bench.maxlen.setup", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="'tiny', a preset name, or a config.json / checkpoint dir")
    p.add_argument("--num-layers", type=int, default=None)
    p.add_argument("--out", required=True, help="the checkpoint dir to write (reused when it matches)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    start = time.perf_counter()
    write_random_checkpoint(
        args.out, model_fields(args.model, num_layers=args.num_layers), seed=args.seed, dtype=args.dtype
    )
    print(
        json.dumps({"device": device_info(), "checkpoint_s": round(time.perf_counter() - start, 1)}),
        flush=True,
    )


if __name__ == "__main__":
    main()
