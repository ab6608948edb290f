"""Model shapes the planner needs, from a Hugging Face ``config.json`` (a path or a dict) or a named preset."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PRESETS: dict[str, dict[str, Any]] = {
    "llama-2-7b": {
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "intermediate_size": 11008,
        "vocab_size": 32000,
        "max_position_embeddings": 4096,
    },
    "llama-3.1-8b": {
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "intermediate_size": 14336,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
    },
    "llama-3-70b": {
        "hidden_size": 8192,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "intermediate_size": 28672,
        "vocab_size": 128256,
        "max_position_embeddings": 8192,
    },
    "llama-3.1-405b": {
        "hidden_size": 16384,
        "num_hidden_layers": 126,
        "num_attention_heads": 128,
        "num_key_value_heads": 8,
        "intermediate_size": 53248,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
    },
}
_REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")


@dataclass(frozen=True)
class ModelSpec:
    """A Llama-family decoder: the shapes that set parameter count, FLOPs and activation sizes."""

    name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool = False
    max_position_embeddings: int | None = None
    """The checkpoint's own context (``config.json``); None when unknown. Only the overrides the planner
    prints read it (a longer ``trainer.seq_len`` needs ``model.max_position_embeddings``)."""

    @classmethod
    def from_hf_config(cls, config: dict[str, Any], name: str = "model") -> ModelSpec:
        """Build from an HF config dict; ``head_dim`` defaults to ``hidden_size / num_attention_heads``."""
        missing = [k for k in _REQUIRED if config.get(k) is None]
        if missing:
            raise ValueError(f"model config {name!r} lacks {missing}; give a Llama-style HF config.json.")
        heads = int(config["num_attention_heads"])
        kv = int(config.get("num_key_value_heads") or heads)
        hidden = int(config["hidden_size"])
        if heads % kv != 0:
            raise ValueError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv}.")
        head_dim = config.get("head_dim") or hidden // heads
        return cls(
            name=name,
            hidden_size=hidden,
            num_layers=int(config["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=kv,
            head_dim=int(head_dim),
            intermediate_size=int(config["intermediate_size"]),
            vocab_size=int(config["vocab_size"]),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            max_position_embeddings=config.get("max_position_embeddings"),
        )

    # --- parameter counts ---------------------------------------------------------------------------------
    @property
    def layer_params(self) -> int:
        """Parameters of one decoder layer: q, k, v, o projections, gated MLP, two RMSNorm weights."""
        h, d = self.hidden_size, self.head_dim
        attn = h * self.num_heads * d * 2 + h * self.num_kv_heads * d * 2
        mlp = 3 * h * self.intermediate_size
        return attn + mlp + 2 * h

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def head_params(self) -> int:
        """The output projection (zero extra parameters when tied to the embedding)."""
        return 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size

    @property
    def num_params(self) -> int:
        return (
            self.embedding_params + self.num_layers * self.layer_params + self.hidden_size + self.head_params
        )

    @property
    def matmul_params(self) -> int:
        """Parameters that take part in a matmul per token (every linear layer and the LM head)."""
        return self.num_layers * self.layer_params + self.vocab_size * self.hidden_size

    # --- per-token sizes ----------------------------------------------------------------------------------
    def kv_bytes_per_token(self, bytes_per_elem: int = 2) -> int:
        """K and V of one token, all layers, all KV heads."""
        return 2 * self.num_kv_heads * self.head_dim * self.num_layers * bytes_per_elem

    def max_ulysses_degree(self, replicate_kv: bool = True) -> int:
        """Largest Ulysses degree the heads allow: the KV head count without replication, else the query heads."""
        return self.num_heads if replicate_kv else self.num_kv_heads

    def ulysses_split_error(self, ulysses_degree: int) -> str | None:
        """Why ``ulysses_degree`` cannot split the heads, or None when it can.

        Query heads must divide evenly; KV heads either divide evenly or, with GQA, are replicated so every
        rank gets one (``ulysses_degree`` a multiple of the KV head count).
        """
        u, h, kv = ulysses_degree, self.num_heads, self.num_kv_heads
        ok = [x for x in range(1, h + 1) if h % x == 0 and (kv % x == 0 or x % kv == 0)]
        if h % u != 0:
            return (
                f"num_attention_heads={h} is not divisible by ulysses_degree={u} (degrees that split: {ok})"
            )
        if kv % u != 0 and u % kv != 0:
            return (
                f"num_key_value_heads={kv} neither divides by ulysses_degree={u} nor divides it (for GQA "
                f"replication); degrees that split: {ok}"
            )
        return None

    def kv_heads_per_rank(self, ulysses_degree: int) -> int:
        """KV heads each Ulysses rank holds after the all-to-all (1 when the heads are replicated)."""
        return max(self.num_kv_heads // ulysses_degree, 1)


def load_model_spec(model: str | dict[str, Any]) -> ModelSpec:
    """A preset name (``llama-3.1-8b``...), a ``config.json`` path, a checkpoint dir, or an HF config dict."""
    if isinstance(model, dict):
        return ModelSpec.from_hf_config(model, name=str(model.get("_name_or_path") or "model"))
    key = model.lower()
    if key in PRESETS:
        return ModelSpec.from_hf_config(PRESETS[key], name=key)
    path = Path(model)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(
            f"--model={model!r} is neither a preset ({sorted(PRESETS)}) nor a config.json path / checkpoint dir."
        )
    with path.open() as f:
        config = json.load(f)
    return ModelSpec.from_hf_config(config, name=str(model))
