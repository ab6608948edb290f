"""The embedded default: a tiny random Llama checkpoint, its tokenizer and a small corpus, made locally.

Nothing here downloads anything. The demo (``recipe=tiny``) and the tests build these on the fly:

- :func:`build_tiny_tokenizer` trains a small byte-level BPE on the synthetic corpus (``<s>`` BOS, ``</s>``
  EOS, ``<pad>``) and saves it as a Hugging Face fast tokenizer;
- :func:`build_tiny_llama` saves a randomly initialised ``LlamaForCausalLM`` (GQA by default) with that
  tokenizer, in the same layout as a hub checkpoint (config.json + model.safetensors + tokenizer files);
- :func:`build_tiny_corpus` writes a jsonl corpus of documents of varied length with learnable structure
  (counting runs, repeated phrases), so the loss visibly falls in a few dozen steps;
- :func:`build_tiny_chats` writes synthetic multi-turn conversations (``messages`` rows) for the SFT demo:
  the assistant continues the user's counting run or repeats their phrase, a task the loss can learn.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any

from usp.atomic import write_dir, write_text

TINY_MODEL_DIR = "tiny-llama"
"""Where ``model.build_tiny`` builds the tiny model: ``<run dir>/tiny-llama`` (``conf/model/tiny.yaml``), and
nowhere else."""
TINY_LLAMA_DEFAULTS: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
}

_WORDS = (
    "the a ring node rank token block head query key value layer batch step loss model data shard mesh "
    "sequence attention gradient memory long context train merge send receive zigzag ulysses chunk"
).split()


def _document(rng: random.Random) -> str:
    kind = rng.randrange(3)
    n = int(rng.paretovariate(1.2) * 8)  # heavy tail: a few long documents
    n = max(3, min(n, 400))
    if kind == 0:
        start = rng.randrange(1000)
        return " ".join(str(start + i) for i in range(n))
    if kind == 1:
        phrase = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(2, 5)))
        return " , ".join(phrase for _ in range(max(1, n // 3)))
    return " ".join(rng.choice(_WORDS) for _ in range(n)) + " ."


def tiny_corpus_texts(num_docs: int = 400, seed: int = 0) -> list[str]:
    """Deterministic synthetic documents (same ``seed`` -> same texts)."""
    rng = random.Random(seed)
    return [_document(rng) for _ in range(num_docs)]


def build_tiny_corpus(
    path: str | os.PathLike, num_docs: int = 400, seed: int = 0, text_field: str = "text"
) -> Path:
    """Write ``num_docs`` synthetic documents as jsonl (``{"text": ...}`` per line); returns the file path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = (json.dumps({text_field: text}) + "\n" for text in tiny_corpus_texts(num_docs, seed))
    write_text(path, "".join(lines))
    return path


def build_tiny_tokenizer(path: str | os.PathLike, vocab_size: int = 384):
    """Train a byte-level BPE on the synthetic corpus and save it at ``path``; returns the HF tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(tiny_corpus_texts(400, seed=1), trainer=trainer)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", model_max_length=1 << 30
    )
    hf.save_pretrained(str(path))
    return hf


def is_tiny_model(config: Any) -> bool:
    """Whether a Hugging Face config is one :func:`build_tiny_llama` wrote (or an export of one)."""
    return bool(getattr(config, "usp_tiny", False))


def build_tiny_llama(path: str | os.PathLike, seed: int = 0, **config_overrides: Any) -> Path:
    """Save a tiny random Llama checkpoint (+ tokenizer) at ``path`` unless one is already there.

    ``config_overrides`` are LlamaConfig fields (e.g. ``num_key_value_heads=1``); with ``model_type`` (e.g.
    ``qwen3_moe`` and its ``num_experts``, ``num_experts_per_tok``, ``moe_intermediate_size``) they are that
    family's config fields and the model is that family's causal LM (``recipe=tiny_moe``). Written aside and
    renamed, so concurrent callers (several ranks) and interrupted runs never leave a half-written checkpoint.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(path)
    if (path / "config.json").exists() and (path / "model.safetensors").exists():
        return path

    def write(tmp: Path) -> None:
        tokenizer = build_tiny_tokenizer(tmp)
        fields = {**TINY_LLAMA_DEFAULTS, **config_overrides}
        config = AutoConfig.for_model(
            fields.pop("model_type", "llama"),
            vocab_size=len(tokenizer),
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            **fields,
        )
        config.usp_tiny = True  # saved in config.json and kept by the export: "the random demo model"
        torch.manual_seed(seed)
        AutoModelForCausalLM.from_config(config).save_pretrained(str(tmp), safe_serialization=True)

    write_dir(path, write, replace=False)  # False: another process won the race; its checkpoint is complete
    return path


def _chat(rng: random.Random) -> list[dict[str, str]]:
    messages = [{"role": "system", "content": "continue the run"}] if rng.random() < 0.5 else []
    for _ in range(rng.randint(1, 4)):
        if rng.random() < 0.5:
            start, n = rng.randrange(500), rng.randint(3, 12)
            ask = " ".join(str(start + i) for i in range(n))
            answer = " ".join(str(start + n + i) for i in range(rng.randint(3, 24)))
        else:
            phrase = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(2, 4)))
            ask, answer = f"repeat {phrase}", " , ".join(phrase for _ in range(rng.randint(2, 8)))
        messages += [{"role": "user", "content": ask}, {"role": "assistant", "content": answer}]
    return messages


def build_tiny_chats(path: str | os.PathLike, num_chats: int = 600, seed: int = 0) -> Path:
    """Write ``num_chats`` synthetic conversations as jsonl (``{"messages": [{role, content}, ...]}``)."""
    rng = random.Random(seed)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text(path, "".join(json.dumps({"messages": _chat(rng)}) + "\n" for _ in range(num_chats)))
    return path
