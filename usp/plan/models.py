"""Model shapes the planner needs, from a Hugging Face ``config.json`` (a path or a dict) or a named preset.

Mixture-of-experts models (:class:`MoESpec`, learned from the config's expert fields by
:func:`moe_spec_of`): a MoE layer replaces the dense MLP by a router (``[E, h]``, a bias in gpt-oss), ``E``
routed experts of width ``I_e`` (each a gated MLP, ``3 h I_e``; gpt-oss adds ``2 I_e + h`` biases) of which
each token uses ``k``, and optionally shared experts every token uses (DeepSeek's ``n_shared_experts``,
Qwen2-MoE's ``shared_expert_intermediate_size`` with its sigmoid gate ``[1, h]``, Llama 4's one ungated
``shared_expert`` of the expert width). Only some layers may route (:attr:`MoESpec.layers`, by the family's rule:
:func:`moe_layer_pattern`); the others run the dense MLP of width :attr:`ModelSpec.intermediate_size` (Llama 4's
``intermediate_size_mlp``, whose ``intermediate_size`` is the expert width). Two counts follow:

- total parameters (:attr:`ModelSpec.num_params`): every expert; what the weights, gradients and Adam states
  take, and what FSDP all-gathers and reduce-scatters (one decoder layer, the FSDP unit, holds all of its
  experts: :attr:`ModelSpec.layer_params`);
- active parameters per token (:attr:`ModelSpec.active_params`; :attr:`ModelSpec.matmul_params` the part in
  matmuls, the model-FLOP count's ``N``): attention, the router, the ``k`` chosen experts, the shared ones.

Not counted, dense or MoE (as the dense count never did): attention biases, attention sinks and per-head
q/k norm weights (elementwise, under 0.01 % of the presets).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from usp.attention.heads import UlyssesHeads, ulysses_heads
from usp.plan.mixers import MixerSpec, mixer_spec_of


def head_dim_of(config: Any) -> int:
    """A Hugging Face config's attention head size (a config object or its ``config.json`` dict): ``head_dim``
    when set, else ``hidden_size / num_attention_heads``. The one fallback rule."""
    get = config.get if isinstance(config, dict) else (lambda key: getattr(config, key, None))
    return int(get("head_dim") or int(get("hidden_size")) // int(get("num_attention_heads")))


def layer_attention_of(config: Any) -> tuple[tuple[int | None, int | None], ...]:
    """Each layer's ``(sliding window, chunk)`` from a config object or ``config.json`` dict, by the one rule of
    :func:`usp.model.capabilities.layer_specs`; empty when every layer is full causal attention. A layer with
    no softmax attention (a hybrid model's recurrent / convolution mixer layer, or an MLP-only layer) has
    window 0: it scores no (query, key) pairs."""
    from usp.model.capabilities import layer_specs

    layers = tuple((spec.window, spec.chunk) if spec.attention else (0, None) for spec in layer_specs(config))
    return () if all(key == (None, None) for key in layers) else layers


def hybrid_layers_of(config: Any) -> str | None:
    """What a hybrid model's config has beyond softmax attention in every layer (``"layer_types: 36
    linear_attention, 12 full_attention"``), or None: what messages name (the planner models some hybrid
    families' mixer layers and refuses the rest, :mod:`usp.plan.mixers`)."""
    from usp.model.capabilities import layer_specs

    specs = layer_specs(text_config_of(config) if isinstance(config, dict) else config)
    if all(spec.attention and not spec.mixer for spec in specs):
        return None
    get = (
        config.get if isinstance(config, dict) else (lambda key, default=None: getattr(config, key, default))
    )
    types = list(get("layer_types", None) or [])
    counts = ", ".join(f"{types.count(t)} {t}" for t in dict.fromkeys(types))
    return f"layer_types: {counts}"


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
    # Mixture-of-experts presets: their config.json fields (published totals / active parameters per token in
    # tests/test_plan_moe.py). Qwen/Qwen3-30B-A3B: 48 layers, 32 query / 4 KV heads of 128, 128 experts of
    # 768, 8 per token, every layer sparse, renormalized top-k; no sliding window in use
    "qwen3-30b-a3b": {
        "model_type": "qwen3_moe",
        "hidden_size": 2048,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "router_aux_loss_coef": 0.001,
        "vocab_size": 151936,
        "max_position_embeddings": 40960,
        "use_sliding_window": False,
        "sliding_window": None,
        "tie_word_embeddings": False,
    },
    # openai/gpt-oss-20b: 24 layers alternating sliding window 128 / full attention, 64 query / 8 KV heads of
    # 64 (attention biases and sinks), 32 experts of 2880, 4 per token
    "gpt-oss-20b": {
        "model_type": "gpt_oss",
        "hidden_size": 2880,
        "num_hidden_layers": 24,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "intermediate_size": 2880,
        "num_local_experts": 32,
        "num_experts_per_tok": 4,
        "experts_per_token": 4,
        "router_aux_loss_coef": 0.9,
        "attention_bias": True,
        "swiglu_limit": 7.0,
        "vocab_size": 201088,
        "max_position_embeddings": 131072,
        "sliding_window": 128,
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(24)],
        "tie_word_embeddings": False,
    },
    # openai/gpt-oss-120b: gpt-oss-20b's layer with 128 experts, 36 layers
    "gpt-oss-120b": {
        "model_type": "gpt_oss",
        "hidden_size": 2880,
        "num_hidden_layers": 36,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "intermediate_size": 2880,
        "num_local_experts": 128,
        "num_experts_per_tok": 4,
        "experts_per_token": 4,
        "router_aux_loss_coef": 0.9,
        "attention_bias": True,
        "swiglu_limit": 7.0,
        "vocab_size": 201088,
        "max_position_embeddings": 131072,
        "sliding_window": 128,
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(36)],
        "tie_word_embeddings": False,
    },
    # mistralai/Mixtral-8x7B-v0.1: 32 layers, 32 query / 8 KV heads of 128, 8 experts of 14336, 2 per token
    "mixtral-8x7b": {
        "model_type": "mixtral",
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "intermediate_size": 14336,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "router_aux_loss_coef": 0.02,
        "vocab_size": 32000,
        "max_position_embeddings": 32768,
        "sliding_window": None,
        "tie_word_embeddings": False,
    },
    # meta-llama/Llama-4-Scout-17B-16E (text model): 48 layers, 40 query / 8 KV heads of 128, chunked attention
    # (8192) on three layers of four, the fourth global without RoPE; every layer MoE: 16 experts of 8192, 1 per
    # token, one shared expert of 8192; no router loss in its causal LM
    "llama4-scout": {
        "model_type": "llama4_text",
        "hidden_size": 5120,
        "num_hidden_layers": 48,
        "num_attention_heads": 40,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "intermediate_size": 8192,
        "intermediate_size_mlp": 16384,
        "num_local_experts": 16,
        "num_experts_per_tok": 1,
        "interleave_moe_layer_step": 1,
        "router_aux_loss_coef": 0.001,
        "vocab_size": 202048,
        "max_position_embeddings": 10485760,
        "attention_chunk_size": 8192,
        "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "chunked_attention" for i in range(48)],
        "tie_word_embeddings": False,
    },
    # meta-llama/Llama-4-Maverick-17B-128E (text model): Scout's shapes with 128 experts on every second layer
    # (interleave_moe_layer_step 2: layers 1, 3, ..., 47), the other 24 a dense MLP of 16384
    "llama4-maverick": {
        "model_type": "llama4_text",
        "hidden_size": 5120,
        "num_hidden_layers": 48,
        "num_attention_heads": 40,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "intermediate_size": 8192,
        "intermediate_size_mlp": 16384,
        "num_local_experts": 128,
        "num_experts_per_tok": 1,
        "interleave_moe_layer_step": 2,
        "router_aux_loss_coef": 0.001,
        "vocab_size": 202048,
        "max_position_embeddings": 1048576,
        "attention_chunk_size": 8192,
        "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "chunked_attention" for i in range(48)],
        "tie_word_embeddings": False,
    },
    # Qwen/Qwen3-Next-80B-A3B (hybrid): 48 layers, 3 gated DeltaNet (16 key / 32 value heads of 128) : 1 gated
    # attention (16 query / 2 KV heads of 256), every layer a MoE of 512 experts (10 per token, width 512) and a
    # shared expert of 512; 80B total, 3B active (the planner counts 79.7B and 3.25B without the embedding
    # and the LM head)
    "qwen3-next-80b-a3b": {
        "model_type": "qwen3_next",
        "hidden_size": 2048,
        "num_hidden_layers": 48,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "intermediate_size": 5120,
        "moe_intermediate_size": 512,
        "num_experts": 512,
        "num_experts_per_tok": 10,
        "shared_expert_intermediate_size": 512,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "router_aux_loss_coef": 0.001,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(48)],
        "partial_rotary_factor": 0.25,
        "vocab_size": 151936,
        "max_position_embeddings": 262144,
        "tie_word_embeddings": False,
    },
    # LiquidAI/LFM2-1.2B (hybrid): 16 layers, short convolutions (width 3) in all but layers 2, 5, 8, 10, 12, 14
    # (attention, 32 query / 8 KV heads of 64), MLP 8192 (intermediate_size 12288 auto-adjusted), tied
    # embeddings; 1.17B parameters (its model card; the planner counts 1.170B)
    "lfm2-1.2b": {
        "model_type": "lfm2",
        "hidden_size": 2048,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "intermediate_size": 12288,
        "block_auto_adjust_ff_dim": True,
        "block_ffn_dim_multiplier": 1.0,
        "block_multiple_of": 256,
        "layer_types": ["full_attention" if i in (2, 5, 8, 10, 12, 14) else "conv" for i in range(16)],
        "conv_L_cache": 3,
        "conv_bias": False,
        "vocab_size": 65536,
        "max_position_embeddings": 128000,
        "tie_word_embeddings": True,
    },
    # ibm-fms/Bamba-9B (hybrid): 32 layers, Mamba2 (128 heads of 64, 1 group, state 128, conv 4) in all but
    # layers 9, 18 and 27 (attention, 32 query / 8 KV heads of 128), dense MLP 14336 in every layer, trained
    # at 4K; 9.78B parameters (its model card; the planner counts 9.780B)
    "bamba-9b": {
        "model_type": "bamba",
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "intermediate_size": 14336,
        "attn_layer_indices": [9, 18, 27],
        "mamba_n_heads": 128,
        "mamba_d_head": 64,
        "mamba_n_groups": 1,
        "mamba_d_state": 128,
        "mamba_expand": 2,
        "mamba_d_conv": 4,
        "mamba_chunk_size": 256,
        "mamba_conv_bias": True,
        "mamba_proj_bias": False,
        "vocab_size": 128256,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
    },
}
_REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")


EXPERT_COUNT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
"""Where families keep the routed expert count (the first one set wins)."""
TOP_K_FIELDS = ("num_experts_per_tok", "experts_per_token", "moe_topk")
"""Where families keep the experts each token is routed to."""
_MOE_FAMILIES: dict[str, dict[str, Any]] = {
    # router Linear with a bias, top-k of the logits then a softmax over the k chosen ones (compute dtype);
    # expert biases; the clamped GLU keeps gate_up, clamp(gate), sigmoid, glu, up + 1 and its output
    "gpt_oss": {
        "router_bias": True,
        "expert_bias": True,
        "expert_widths": 7,
        "router_softmax": "top_k",
        "norm_topk_prob": False,
    },
    # softmax over every expert in fp32, top-k renormalized, the routing weights left in fp32
    "mixtral": {"routing_weights_fp32": True, "norm_topk_prob": True},
    # a sigmoid of the top-k logits (fp32, the others -inf), and every expert run on every token (the input
    # repeated E times, scaled by its score: 0 for the experts not chosen); Llama4ForCausalLM adds no router
    # loss whatever router_aux_loss_coef says
    "llama4_text": {"every_expert_runs": True, "router_aux_loss": False},
}
"""What a family's MoE block does differently from the Qwen3-MoE one (the default): the router's softmax,
biases, and what its experts keep for backward (measured in ``tests/test_plan_moe.py``)."""
_EXPERT_WIDTH_FIELD = {
    "mixtral": "intermediate_size",
    "gpt_oss": "intermediate_size",
    "llama4_text": "intermediate_size",
}
"""Families whose experts are ``intermediate_size`` wide whatever else the config holds (their modules read it)."""
_SHARED_EXPERTS = {"llama4_text": 1}
"""Families whose MoE layers hold shared experts of the expert width, ungated, that no config field states
(Llama 4's ``shared_expert``: a ``Llama4TextMLP`` of ``intermediate_size``)."""
DENSE_WIDTH_FIELDS = ("intermediate_size_mlp", "intermediate_size")
"""Where a config keeps the width of its dense MLP layers, the first one set wins: Llama 4's dense layers (those
not in ``moe_layers``) are ``intermediate_size_mlp`` wide, its experts ``intermediate_size``."""
_FAMILY_ALIASES = {"llama4": "llama4_text"}
_GATED_ATTENTION = ("qwen3_next", "qwen3_5_text", "qwen3_5")
"""Families whose attention output is gated by a second query-sized projection (``q_proj`` ``2 H d`` wide)."""
"""A multimodal config's ``model_type`` and its text model's (the family rules are keyed by the latter)."""


@dataclass(frozen=True)
class MoESpec:
    """The mixture-of-experts block of a model's MoE layers (:func:`moe_spec_of`)."""

    num_experts: int
    """Routed experts ``E``."""
    top_k: int
    """Routed experts per token ``k``."""
    expert_intermediate_size: int
    """Each routed expert's MLP width ``I_e``."""
    layers: tuple[bool, ...]
    """Per decoder layer: True when it routes to experts, False when it runs the dense MLP
    (:attr:`ModelSpec.intermediate_size` wide: DeepSeek's ``first_k_dense_replace``, Qwen-MoE's
    ``mlp_only_layers`` and ``decoder_sparse_step``, Llama 4's layers not in ``moe_layers`` /
    ``interleave_moe_layer_step``)."""
    shared_intermediate_size: int = 0
    """Width of the shared experts together (every token uses them), in each MoE layer: ``n_shared_experts x
    moe_intermediate_size``, ``shared_expert_intermediate_size``, or Llama 4's one expert of
    ``intermediate_size``; 0 = none."""
    shared_expert_gate: bool = False
    """A sigmoid gate ``[1, h]`` scales the shared experts' output (Qwen2-MoE's ``shared_expert_gate``)."""
    router_bias: bool = False
    expert_bias: bool = False
    """Each expert's projections have biases (gate/up ``2 I_e``, down ``h``): gpt-oss."""
    expert_widths: int = 4
    """What one routed copy of a token keeps inside its expert for backward, in units of ``I_e`` values of
    the compute dtype: 4 for SwiGLU (gate_up ``2 I_e``, silu(gate), the product), 7 for gpt-oss's clamped
    GLU."""
    router_softmax: str = "all"
    """``all``: softmax over every expert, in fp32 (kept: ``4 E`` per token); ``top_k``: over the ``k``
    chosen logits, in the compute dtype (gpt-oss)."""
    routing_weights_fp32: bool = False
    """The routing weights stay fp32 into the experts' weighted sum (Mixtral); else the compute dtype."""
    norm_topk_prob: bool = False
    """The top-k probabilities are renormalized (keeps them, fp32, and their sum for backward)."""
    router_aux_loss: bool = False
    """The family's loss adds a router load-balancing loss (``router_aux_loss_coef`` in its config): usp
    keeps every MoE layer's router logits, and the loss their fp32 softmax, to the backward
    (:mod:`usp.train.router_loss`)."""
    every_expert_runs: bool = False
    """transformers runs every expert on every token, the ``k`` chosen ones weighted by their score and the
    others by 0 (Llama 4): a MoE layer keeps and computes ``E`` copies of each token where the grouped experts
    keep ``k`` (:func:`usp.plan.memory.moe_bytes_per_token`, :attr:`ModelSpec.executed_matmul_params`). The
    model FLOPs and the MFU still count the ``k`` active experts."""

    @property
    def num_moe_layers(self) -> int:
        return sum(self.layers)


def _first_set(config: dict[str, Any], keys: tuple[str, ...]) -> int:
    for key in keys:
        if config.get(key) is not None:
            return int(config[key])
    return 0


def _dense_width(config: dict[str, Any]) -> int:
    """The dense MLP's width (:data:`DENSE_WIDTH_FIELDS`); LFM2's is derived from ``intermediate_size`` as its
    ``Lfm2MLP`` does (``block_auto_adjust_ff_dim``: two thirds, times ``block_ffn_dim_multiplier``, rounded
    up to ``block_multiple_of``)."""
    width = _first_set(config, DENSE_WIDTH_FIELDS)
    if config.get("model_type") == "lfm2" and config.get("block_auto_adjust_ff_dim", True):
        width = int(2 * width / 3)
        if config.get("block_ffn_dim_multiplier") is not None:
            width = int(config["block_ffn_dim_multiplier"] * width)
            multiple = int(config.get("block_multiple_of") or 256)
            width = multiple * ((width + multiple - 1) // multiple)
    return width


def moe_layer_pattern(config: dict[str, Any], num_layers: int) -> tuple[bool, ...]:
    """Which decoder layers route to experts, by the families' rules: Llama 4's ``moe_layers`` (the list of
    sparse layers) or, without it, ``interleave_moe_layer_step`` (layers ``step - 1, 2 step - 1, ...``, as
    ``Llama4TextConfig`` derives ``moe_layers``); DeepSeek's ``first_k_dense_replace`` (dense below it;
    ``moe_layer_freq``: every n-th layer above); else Qwen-MoE's ``mlp_only_layers`` and
    ``decoder_sparse_step`` (layer ``i`` is sparse when ``(i + 1) % step == 0``), else every layer."""
    if config.get("moe_layers") is not None:
        sparse = {int(i) for i in config["moe_layers"]}
        return tuple(i in sparse for i in range(num_layers))
    if config.get("interleave_moe_layer_step") is not None:
        step = int(config["interleave_moe_layer_step"])
        if step < 1:
            raise ValueError(f"interleave_moe_layer_step={step} must be >= 1.")
        return tuple((i + 1) % step == 0 for i in range(num_layers))
    if config.get("first_k_dense_replace") is not None or config.get("moe_layer_freq") is not None:
        first = int(config.get("first_k_dense_replace") or 0)
        freq = int(config.get("moe_layer_freq") or 1)
        return tuple(i >= first and i % freq == 0 for i in range(num_layers))
    dense = {int(i) for i in config.get("mlp_only_layers") or ()}
    step = int(config.get("decoder_sparse_step") or 1)
    return tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers))


def moe_spec_of(config: dict[str, Any]) -> MoESpec | None:
    """The MoE block of an HF config dict, or None for a dense model (no expert count, no top-k, or no layer
    that routes). Field names by family: experts :data:`EXPERT_COUNT_FIELDS`, top-k :data:`TOP_K_FIELDS`,
    expert width ``moe_intermediate_size`` (Mixtral, gpt-oss and Llama 4: ``intermediate_size``), shared
    experts ``n_shared_experts`` (of ``moe_intermediate_size`` each), ``shared_expert_intermediate_size`` or
    the family's own (:data:`_SHARED_EXPERTS`), dense layers :func:`moe_layer_pattern`; what a family's router
    and experts do: :data:`_MOE_FAMILIES`."""
    experts, top_k = _first_set(config, EXPERT_COUNT_FIELDS), _first_set(config, TOP_K_FIELDS)
    if experts < 1 or top_k < 1:
        return None
    if top_k > experts:
        raise ValueError(f"the model routes each token to {top_k} experts but has {experts}.")
    layers = moe_layer_pattern(config, int(config["num_hidden_layers"]))
    if not any(layers):
        return None
    model_type = str(config.get("model_type"))
    model_type = _FAMILY_ALIASES.get(model_type, model_type)
    width_field = _EXPERT_WIDTH_FIELD.get(model_type, "moe_intermediate_size")
    width = int(config.get(width_field) or config["intermediate_size"])
    shared, gate = 0, False
    if config.get("n_shared_experts"):
        shared = int(config["n_shared_experts"]) * width
    elif config.get("shared_expert_intermediate_size"):
        shared, gate = int(config["shared_expert_intermediate_size"]), True
    elif model_type in _SHARED_EXPERTS:
        shared = _SHARED_EXPERTS[model_type] * width
    family = {
        "norm_topk_prob": bool(config.get("norm_topk_prob", False)),
        "router_aux_loss": config.get("router_aux_loss_coef") is not None,
    }
    family |= _MOE_FAMILIES.get(model_type, {})
    return MoESpec(
        num_experts=experts,
        top_k=top_k,
        expert_intermediate_size=width,
        layers=layers,
        shared_intermediate_size=shared,
        shared_expert_gate=gate,
        **family,
    )


def text_config_of(config: dict[str, Any]) -> dict[str, Any]:
    """The text model's fields of a multimodal ``config.json`` (Llama 4's ``text_config``: its ``model_type``
    ``llama4_text``, and the outer ``tie_word_embeddings`` when the inner one is unset); ``config`` itself
    when it holds them at the top."""
    text = config.get("text_config")
    if config.get("hidden_size") is not None or not isinstance(text, dict):
        return config
    out = dict(text)
    if out.get("model_type") is None and config.get("model_type") is not None:
        model_type = str(config["model_type"])
        out["model_type"] = _FAMILY_ALIASES.get(model_type, model_type)
    if out.get("tie_word_embeddings") is None and config.get("tie_word_embeddings") is not None:
        out["tie_word_embeddings"] = config["tie_word_embeddings"]
    return out


@dataclass(frozen=True)
class ModelSpec:
    """A Llama-family decoder: the shapes that set parameter count, FLOPs and activation sizes (with
    :attr:`moe`, a mixture of experts: module docstring)."""

    name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    """The dense MLP's width: every layer of a dense model, the layers of a MoE that do not route
    (:data:`DENSE_WIDTH_FIELDS`: Llama 4's ``intermediate_size_mlp``)."""
    vocab_size: int
    tie_word_embeddings: bool = False
    max_position_embeddings: int | None = None
    """The checkpoint's own context (``config.json``); None when unknown. Only the overrides the planner
    prints read it (a longer ``trainer.seq_len`` needs ``model.max_position_embeddings``)."""
    layer_attention: tuple[tuple[int | None, int | None], ...] = ()
    """Each layer's ``(sliding window, chunk)`` (:func:`usp.model.capabilities.layer_specs`); empty when every
    layer is full causal attention. The attention FLOPs count what each layer attends."""
    moe: MoESpec | None = None
    """The mixture-of-experts block (:func:`moe_spec_of`); None for a dense model, whose counts are the
    Llama ones."""
    mixer: MixerSpec | None = None
    """A hybrid model's recurrent mixer (:mod:`usp.plan.mixers`): it replaces attention in the layers
    :attr:`MixerSpec.layers` marks; None when every layer attends."""
    attention_output_gate: bool = False
    """The attention output is gated by a sigmoid of a second query-sized projection (Qwen3-Next, Qwen3.5:
    ``q_proj`` is ``2 H d`` wide)."""

    @classmethod
    def from_hf_config(cls, config: dict[str, Any], name: str = "model") -> ModelSpec:
        """Build from an HF config dict (a multimodal one's ``text_config``: :func:`text_config_of`); ``head_dim``
        defaults to ``hidden_size / num_attention_heads``."""
        config = text_config_of(config)
        try:
            mixer = mixer_spec_of(config)
        except ValueError as err:
            raise ValueError(f"model {name!r}: {err}") from None
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
            intermediate_size=_dense_width(config),
            vocab_size=int(config["vocab_size"]),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            max_position_embeddings=config.get("max_position_embeddings"),
            layer_attention=layer_attention_of(config),
            moe=moe_spec_of(config),
            mixer=mixer,
            attention_output_gate=str(config.get("model_type")) in _GATED_ATTENTION,
        )

    # --- parameter counts ---------------------------------------------------------------------------------
    @property
    def layer_params(self) -> int:
        """Parameters of one decoder layer: q, k, v, o projections, gated MLP, two RMSNorm weights. A MoE's
        largest layer (one that routes, with all of its experts and its router): the FSDP unit each layer
        gathers."""
        if self.moe is not None or self.mixer is not None:
            return max(self._layer_params(routed, mixer) for routed, mixer in set(self.layer_keys))
        h, d = self.hidden_size, self.head_dim
        attn = h * self.num_heads * d * 2 + h * self.num_kv_heads * d * 2
        mlp = 3 * h * self.intermediate_size
        return attn + mlp + 2 * h

    @property
    def attention_params(self) -> int:
        """One layer's q, k, v, o projections (with an output gate, ``q_proj`` is twice as wide)."""
        h, d = self.hidden_size, self.head_dim
        gate = h * self.num_heads * d if self.attention_output_gate else 0
        return h * self.num_heads * d * 2 + h * self.num_kv_heads * d * 2 + gate

    @property
    def moe_block_params(self) -> int:
        """One MoE layer's router, every routed expert and the shared experts, biases included (0 when
        dense)."""
        if self.moe is None:
            return 0
        expert, router = self._expert_and_router_params
        return self.moe.num_experts * expert + router + self._shared_params

    @property
    def moe_block_active_params(self) -> int:
        """What one token uses of a MoE layer's block: the router, its ``k`` experts, the shared experts."""
        if self.moe is None:
            return 0
        expert, router = self._expert_and_router_params
        return self.moe.top_k * expert + router + self._shared_params

    @property
    def _expert_and_router_params(self) -> tuple[int, int]:
        """One routed expert's parameters and the router's, biases included (a MoE model)."""
        m, h = self.moe, self.hidden_size
        assert m is not None
        width = m.expert_intermediate_size
        expert = 3 * h * width + ((2 * width + h) if m.expert_bias else 0)
        router = m.num_experts * h + (m.num_experts if m.router_bias else 0)
        return expert, router

    @property
    def moe_block_matmul_params(self) -> int:
        """The matmul weights one token goes through in a MoE layer's block (no biases): router ``E h``,
        ``k`` experts ``3 h I_e`` each, shared experts ``3 h I_s`` (and their gate ``h``)."""
        m, h = self.moe, self.hidden_size
        if m is None:
            return 0
        return m.num_experts * h + m.top_k * 3 * h * m.expert_intermediate_size + self._shared_params

    @property
    def _shared_params(self) -> int:
        m, h = self.moe, self.hidden_size
        assert m is not None
        return 3 * h * m.shared_intermediate_size + (h if m.shared_expert_gate else 0)

    def _mixing_params(self, mixer: bool) -> int:
        """A layer's token mixer: attention's projections, or a hybrid's recurrent mixer (every parameter)."""
        return self.mixer.params(self.hidden_size) if mixer and self.mixer else self.attention_params

    def _mixing_matmul_params(self, mixer: bool) -> int:
        return self.mixer.matmul_params(self.hidden_size) if mixer and self.mixer else self.attention_params

    def _layer_params(self, routed: bool, mixer: bool = False) -> int:
        """One layer: attention (or the mixer), its MLP (the MoE block when ``routed``), two norms."""
        mlp = self.moe_block_params if routed else 3 * self.hidden_size * self.intermediate_size
        return self._mixing_params(mixer) + mlp + 2 * self.hidden_size

    def _layer_active_params(self, routed: bool, mixer: bool = False) -> int:
        mlp = self.moe_block_active_params if routed else 3 * self.hidden_size * self.intermediate_size
        return self._mixing_params(mixer) + mlp + 2 * self.hidden_size

    def _layer_matmul_params(self, routed: bool, mixer: bool = False) -> int:
        mlp = self.moe_block_matmul_params if routed else 3 * self.hidden_size * self.intermediate_size
        return self._mixing_matmul_params(mixer) + mlp

    def params_of_layer(self, index: int) -> int:
        """Parameters of decoder layer ``index`` (its kind's: a MoE layer with every expert, or dense; a
        mixer layer or an attention one)."""
        if self.moe is None and self.mixer is None:
            return self.layer_params
        return self._layer_params(*self.layer_keys[index])

    @property
    def layer_kinds(self) -> tuple[bool, ...]:
        """Per decoder layer, whether it routes to experts (all False for a dense model)."""
        return self.moe.layers if self.moe is not None else (False,) * self.num_layers

    @property
    def layer_mixers(self) -> tuple[bool, ...]:
        """Per decoder layer, whether a recurrent mixer replaces its attention (all False unless hybrid)."""
        return self.mixer.layers if self.mixer is not None else (False,) * self.num_layers

    @property
    def layer_keys(self) -> tuple[tuple[bool, bool], ...]:
        """Per decoder layer, ``(routes to experts, runs a mixer)``: what sets its parameters and
        activations."""
        return tuple(zip(self.layer_kinds, self.layer_mixers, strict=True))

    @property
    def num_attention_layers(self) -> int:
        """Layers that run softmax attention (all but a hybrid's mixer layers): what the all-to-alls and the
        ring run in."""
        return self.num_layers - (self.mixer.num_layers if self.mixer is not None else 0)

    @property
    def is_moe(self) -> bool:
        return self.moe is not None

    @property
    def decoder_params(self) -> int:
        """Parameters of all decoder layers (every expert)."""
        if self.moe is None and self.mixer is None:
            return self.num_layers * self.layer_params
        return sum(self._layer_params(*key) for key in self.layer_keys)

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def head_params(self) -> int:
        """The output projection (zero extra parameters when tied to the embedding)."""
        return 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size

    @property
    def num_params(self) -> int:
        """Total parameters, every expert of a MoE counted: what the states take and FSDP moves."""
        return self.embedding_params + self.decoder_params + self.hidden_size + self.head_params

    @property
    def active_params(self) -> int:
        """Parameters one token uses: :attr:`num_params` less the routed experts it is not sent to (the
        embedding table included, as Qwen and Mistral count their active figures; OpenAI's gpt-oss figures
        leave the embedding out: ``active_params - embedding_params``). Equal to :attr:`num_params` when
        dense."""
        if self.moe is None and self.mixer is None:
            return self.num_params
        decoder = sum(self._layer_active_params(*key) for key in self.layer_keys)
        return self.embedding_params + decoder + self.hidden_size + self.head_params

    @property
    def active_layer_params(self) -> int:
        """One decoder layer's parameters one token uses (a MoE: the mean over its layers, rounded down);
        :attr:`layer_params` when dense."""
        if self.moe is None and self.mixer is None:
            return self.layer_params
        return sum(self._layer_active_params(*key) for key in self.layer_keys) // self.num_layers

    @property
    def layer_matmul_params(self) -> int:
        """Weights of one decoder layer's linear layers (``layer_params`` less the two RMSNorm weights); a
        MoE's: those one token goes through (attention, router, ``k`` experts, shared experts), the mean over
        its layers rounded down (what a recomputed layer's forward costs)."""
        if self.moe is None and self.mixer is None:
            return self.layer_params - 2 * self.hidden_size
        return (self.matmul_params - self.vocab_size * self.hidden_size) // self.num_layers

    @property
    def matmul_params(self) -> int:
        """Parameters that take part in a matmul per token: every linear layer and the LM head (tied or not);
        not the input embedding (a lookup) nor the norm weights (elementwise). The model-FLOP count's ``N``
        (:func:`usp.plan.compute.training_flops`). A MoE's are its active ones: the router, the ``k`` experts
        a token is routed to and the shared experts, not the others (no biases)."""
        if self.moe is None and self.mixer is None:
            return self.num_layers * self.layer_matmul_params + self.vocab_size * self.hidden_size
        layers = sum(self._layer_matmul_params(*key) for key in self.layer_keys)
        return layers + self.vocab_size * self.hidden_size

    @property
    def idle_expert_matmul_params(self) -> int:
        """Matmul weights of the experts a token is not routed to that its MoE layers run anyway, over all
        layers (:attr:`MoESpec.every_expert_runs`, Llama 4 in transformers: ``(E - k) 3 h I_e`` per MoE layer);
        0 for the grouped experts and dense models."""
        m = self.moe
        if m is None or not m.every_expert_runs:
            return 0
        return (
            m.num_moe_layers * (m.num_experts - m.top_k) * 3 * self.hidden_size * m.expert_intermediate_size
        )

    @property
    def executed_matmul_params(self) -> int:
        """The matmul weights each token's forward executes: :attr:`matmul_params` plus
        :attr:`idle_expert_matmul_params`. Sets the compute time; the model FLOPs and the MFU count
        :attr:`matmul_params`."""
        return self.matmul_params + self.idle_expert_matmul_params

    @property
    def executed_layer_matmul_params(self) -> int:
        """:attr:`layer_matmul_params` with the idle experts that run anyway: what a recomputed layer's
        forward executes (the mean over the layers, rounded down)."""
        if self.moe is None and self.mixer is None:
            return self.layer_matmul_params
        return (self.executed_matmul_params - self.vocab_size * self.hidden_size) // self.num_layers

    # --- per-token sizes ----------------------------------------------------------------------------------
    def kv_bytes_per_token(self, bytes_per_elem: int = 2) -> int:
        """K and V of one token, all attention layers, all KV heads."""
        return 2 * self.num_kv_heads * self.head_dim * self.num_attention_layers * bytes_per_elem

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
