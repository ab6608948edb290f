"""Model shapes the planner needs, from a Hugging Face ``config.json`` (a path or a dict) or a named preset."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from usp.attention.heads import UlyssesHeads, ulysses_heads


def head_dim_of(config: Any) -> int:
    """A Hugging Face config's attention head size (a config object or its ``config.json`` dict): ``head_dim``
    when set, else ``hidden_size / num_attention_heads``. The one fallback rule."""
    get = config.get if isinstance(config, dict) else (lambda key: getattr(config, key, None))
    return int(get("head_dim") or int(get("hidden_size")) // int(get("num_attention_heads")))


def layer_attention_of(config: Any) -> tuple[tuple[int | None, int | None], ...]:
    """Each layer's ``(sliding window, chunk)`` from a config object or ``config.json`` dict, by the one rule of
    :func:`usp.model.capabilities.layer_specs`; empty when every layer is full causal attention."""
    from usp.model.capabilities import layer_specs

    layers = tuple((spec.window, spec.chunk) for spec in layer_specs(config))
    return () if all(key == (None, None) for key in layers) else layers


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
    # Qwen/Qwen3-8B: 36 layers, 32 query / 8 KV heads of 128 (q/k norms), no sliding window in use
    "qwen3-8b": {
        "model_type": "qwen3",
        "hidden_size": 4096,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "intermediate_size": 12288,
        "vocab_size": 151936,
        "max_position_embeddings": 40960,
        "use_sliding_window": False,
        "sliding_window": None,
    },
    # google/gemma-3-12b-pt (text model): 48 layers, 5 local (sliding window 1024) : 1 global, 16 query / 8 KV
    # heads of 256, tied embeddings, vocab 262208
    "gemma-3-12b": {
        "model_type": "gemma3_text",
        "hidden_size": 3840,
        "num_hidden_layers": 48,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 256,
        "intermediate_size": 15360,
        "vocab_size": 262208,
        "max_position_embeddings": 131072,
        "sliding_window": 1024,
        "layer_types": ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(48)],
        "tie_word_embeddings": True,
    },
    # mistralai/Mistral-Small-24B-Base-2501: 40 layers, 32 query / 8 KV heads of 128, no sliding window
    "mistral-small-24b": {
        "model_type": "mistral",
        "hidden_size": 5120,
        "num_hidden_layers": 40,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "intermediate_size": 32768,
        "vocab_size": 131072,
        "max_position_embeddings": 32768,
        "sliding_window": None,
    },
    # HuggingFaceTB/SmolLM2-135M(-Instruct), as usp.real builds it: 9 query / 3 KV heads (uneven Ulysses heads)
    "smollm2-135m": {
        "hidden_size": 576,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "intermediate_size": 1536,
        "vocab_size": 49152,
        "tie_word_embeddings": True,
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
    layer_attention: tuple[tuple[int | None, int | None], ...] = ()
    """Each layer's ``(sliding window, chunk)`` (:func:`usp.model.capabilities.layer_specs`); empty when every
    layer is full causal attention. The attention FLOPs count what each layer attends."""

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
        head_dim = head_dim_of(config)
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
            layer_attention=layer_attention_of(config),
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
    def layer_matmul_params(self) -> int:
        """Weights of one decoder layer's linear layers (``layer_params`` less the two RMSNorm weights)."""
        return self.layer_params - 2 * self.hidden_size

    @property
    def matmul_params(self) -> int:
        """Parameters that take part in a matmul per token: every linear layer and the LM head (tied or not);
        not the input embedding (a lookup) nor the norm weights (elementwise). The model-FLOP count's ``N``
        (:func:`usp.plan.compute.training_flops`)."""
        return self.num_layers * self.layer_matmul_params + self.vocab_size * self.hidden_size

    # --- per-token sizes ----------------------------------------------------------------------------------
    def kv_bytes_per_token(self, bytes_per_elem: int = 2) -> int:
        """K and V of one token, all layers, all KV heads."""
        return 2 * self.num_kv_heads * self.head_dim * self.num_layers * bytes_per_elem

    def max_ulysses_degree(self, replicate_kv: bool = True) -> int:
        """Largest Ulysses degree the heads allow: the KV head count without replication, else the query heads."""
        return self.num_heads if replicate_kv else self.num_kv_heads

    def ulysses_heads(self, ulysses_degree: int) -> UlyssesHeads:
        """The heads each Ulysses rank holds (:mod:`usp.attention.heads`); ``ValueError`` when none can."""
        return ulysses_heads(self.num_heads, self.num_kv_heads, ulysses_degree)

    def ulysses_split_error(self, ulysses_degree: int) -> str | None:
        """Why ``ulysses_degree`` cannot split the heads, or None when it can: any degree from 1 to the query
        head count works (uneven counts split as evenly as possible, :mod:`usp.attention.heads`)."""
        u, h = ulysses_degree, self.num_heads
        if not 1 <= u <= h:
            return (
                f"num_attention_heads={h} leaves a Ulysses rank without a query head at ulysses_degree={u} "
                f"(degrees that split: 1..{h})"
            )
        if h % self.num_kv_heads:
            return f"num_attention_heads={h} is not a multiple of num_key_value_heads={self.num_kv_heads}"
        return None

    def q_heads_per_rank(self, ulysses_degree: int) -> int:
        """Query heads of the busiest Ulysses rank after the all-to-all: ``ceil(Hq / U)``."""
        return self.ulysses_heads(ulysses_degree).max_q_heads

    def kv_heads_per_rank(self, ulysses_degree: int) -> int:
        """K/V heads the busiest Ulysses rank holds after the all-to-all (1 when the heads are replicated;
        with uneven heads, its received KV heads and their local copies)."""
        heads = self.ulysses_heads(ulysses_degree)
        return heads.local_kv_heads(heads.busiest_rank())

    def ulysses_head_imbalance(self, ulysses_degree: int) -> float:
        """Attention work of the busiest Ulysses rank over the mean: ``ceil(Hq / U) * U / Hq`` (1 when even)."""
        return self.q_heads_per_rank(ulysses_degree) * ulysses_degree / self.num_heads

    def ulysses_a2a_heads(self, ulysses_degree: int) -> int:
        """Heads (times the local tokens) the busiest rank sends in one layer's all-to-alls, forward and
        backward: ``4 (U - 1) / U (Hq + max(Hkv, U))`` when even."""
        heads = self.ulysses_heads(ulysses_degree)
        sent = [heads.a2a_heads_sent(j) for j in range(ulysses_degree)]
        return max(s["fwd"] + s["bwd"] for s in sent)


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
