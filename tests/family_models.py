"""Tiny random models of transformers' own causal-LM classes, one per family, every feature switched on.

Each entry builds a config small enough for CPU (hidden 64, 4 query / 2 K/V heads, vocab 256) whose windows
and chunks are shorter than the test sequence (:data:`SEQ_LEN`), so every sliding / chunked layer masks
something, and whose softcaps, sinks, MLA head dims, LongRoPE factors and LM-head transforms are not the
identity. :func:`build_family` makes the same weights in every process (seeded). :data:`REFUSED` lists
families usp must refuse, with the config field its message must name.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

SEQ_LEN = 32
WINDOW = 6
CHUNK = 8

_BASE: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=256,
    max_position_embeddings=256,
    tie_word_embeddings=False,
    attention_dropout=0.0,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
_SLIDING = dict(sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"])
_MOE = dict(num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)

_LINEAR = dict(  # gated DeltaNet
    layer_types=["linear_attention", "full_attention"],
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
)
_MAMBA = dict(  # Mamba2, the mamba_* names (bamba, granitemoehybrid)
    mamba_n_heads=4,
    mamba_d_head=16,
    mamba_n_groups=2,
    mamba_d_state=8,
    mamba_d_conv=4,
    mamba_expand=1,
    mamba_chunk_size=8,
)
_MAMBA2 = dict(  # Mamba2, nemotron_h's names
    mamba_num_heads=4,
    mamba_head_dim=16,
    n_groups=2,
    ssm_state_size=8,
    conv_kernel=4,
    expand=1,
    chunk_size=8,
)

FAMILIES: dict[str, dict[str, Any]] = {
    "llama": {},
    "mistral": dict(sliding_window=WINDOW),
    "ministral": dict(_SLIDING),
    "qwen2": dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
    "qwen3": dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1),
    "mixtral": dict(_MOE, sliding_window=WINDOW),
    "olmo2": {},
    "olmo3": dict(_SLIDING),
    "granite": dict(
        logits_scaling=4.0, residual_multiplier=0.5, embedding_multiplier=2.0, attention_multiplier=0.2
    ),
    "glm4": dict(partial_rotary_factor=0.5),
    "starcoder2": dict(sliding_window=WINDOW, use_bias=True),
    "smollm3": dict(no_rope_layer_interval=2, use_sliding_window=False),
    "gemma": {},
    "gemma2": dict(
        _SLIDING, attn_logit_softcapping=2.0, final_logit_softcapping=5.0, query_pre_attn_scalar=16
    ),
    "gemma3_text": dict(_SLIDING, query_pre_attn_scalar=16, final_logit_softcapping=4.0),
    "cohere": dict(logit_scale=0.25),
    "cohere2": dict(_SLIDING, logit_scale=0.25),
    "gpt_oss": dict(_SLIDING, num_local_experts=4, num_experts_per_tok=2),
    "llama4_text": dict(
        attention_chunk_size=CHUNK,
        no_rope_layers=[1, 0],
        attn_temperature_tuning=True,
        floor_scale=4,
        attn_scale=0.5,
        num_local_experts=2,
        num_experts_per_tok=1,
        intermediate_size_mlp=128,
        interleave_moe_layer_step=2,
    ),
    "phi3": dict(
        max_position_embeddings=64,
        original_max_position_embeddings=16,
        rope_parameters=dict(
            rope_type="longrope",
            rope_theta=10000.0,
            short_factor=[1.0 + 0.1 * i for i in range(8)],
            long_factor=[2.0 + 0.5 * i for i in range(8)],
            original_max_position_embeddings=16,
        ),
    ),
    "deepseek_v3": dict(
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        head_dim=8,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        moe_intermediate_size=32,
        first_k_dense_replace=1,
        num_key_value_heads=4,
    ),
    # hybrid models: recurrent / convolution mixers beside attention (usp.model.mixers)
    "qwen3_next": dict(
        _LINEAR,
        linear_num_key_heads=6,  # 6 key heads over 4 ranks: the head all-to-all's uneven split (2, 2, 1, 1)
        linear_num_value_heads=12,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
    ),
    "qwen3_5_text": dict(_LINEAR, linear_num_key_heads=4, linear_num_value_heads=8),  # one key head per rank
    "olmo_hybrid": dict(_LINEAR),
    "nemotron_h": dict(
        _MAMBA2,
        num_hidden_layers=4,
        layer_types=["linear_attention", "mlp", "full_attention", "mlp"],
    ),  # no MoE layer: nemotron_h's router computes in float32, so its logits move with the batch's shape
    "falcon_h1": dict(
        mamba_d_ssm=64,
        mamba_n_heads=4,
        mamba_d_head=16,
        mamba_n_groups=2,
        mamba_d_state=8,
        mamba_d_conv=4,
        mamba_chunk_size=8,
        mamba_rms_norm=True,
    ),
    "bamba": dict(_MAMBA, attn_layer_indices=[1]),
    "granitemoehybrid": dict(
        _MAMBA, layer_types=["mamba", "attention"], num_local_experts=4, num_experts_per_tok=2
    ),
    "lfm2": dict(layer_types=["conv", "full_attention"], conv_L_cache=3, conv_bias=True),
    "kimi_linear": dict(  # KDA beside MLA attention
        layer_types=["linear_attention", "full_attention"],
        linear_num_heads=4,
        linear_head_dim=16,
        linear_conv_kernel_dim=4,
        kv_lora_rank=16,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        num_key_value_heads=4,
        mlp_layer_types=["dense", "dense"],
    ),  # no MoE layer: kimi_linear's router computes in float32, so its logits move with the batch's shape
    "lfm2_moe": dict(
        layer_types=["conv", "full_attention"],
        conv_L_cache=3,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        num_dense_layers=1,
    ),
    "minimax": dict(  # lightning attention (linear, with decay) beside softmax attention
        layer_types=["linear_attention", "full_attention"],
        block_size=8,
        num_local_experts=4,
        num_experts_per_tok=2,
    ),
    "jamba": dict(
        attn_layer_period=2,
        attn_layer_offset=1,
        expert_layer_period=2,
        expert_layer_offset=1,
        num_experts=4,
        num_experts_per_tok=2,
        mamba_d_state=8,
        mamba_d_conv=4,
        mamba_expand=1,
        mamba_dt_rank=8,
    ),
}
"""family -> config overrides on top of the shared tiny shape."""

REFUSED: dict[str, tuple[dict[str, Any], str]] = {
    "zamba2": (  # Mamba2 inside shared-attention hybrid blocks: not implemented
        dict(
            layer_types=["mamba", "hybrid"],
            mamba_d_state=8,
            mamba_headdim=16,
            n_mamba_heads=4,
            mamba_ngroups=2,
            chunk_size=8,
        ),
        "Zamba2MambaMixer",
    ),
    "bloom": (dict(n_layer=2, n_head=4), "model_type"),
    "deepseek_v32": (
        dict(
            q_lora_rank=32,
            kv_lora_rank=16,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=16,
            index_topk=4,
        ),
        "index_topk",
    ),
    "t5": (dict(num_layers=2), "model_type"),
}
"""family -> (overrides, the config field the refusal names)."""


def family_config(family: str, overrides: dict[str, Any] | None = None) -> PretrainedConfig:
    values = dict(_BASE)
    values.update(FAMILIES.get(family, {}) if overrides is None else overrides)
    config = AutoConfig.for_model(family, **values)
    config.use_cache = False
    return config


def build_family(family: str, dtype: torch.dtype = torch.float64, attn: str = "eager"):
    """The family's tiny model with seeded weights (the same in every process), in ``dtype``, train mode."""
    torch.manual_seed(0)
    config = family_config(family)
    moe = any(getattr(config, f, None) for f in ("num_local_experts", "num_experts", "n_routed_experts"))
    extra = {"experts_implementation": "eager"} if moe else {}  # grouped_mm has no float64
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn, **extra)
    with torch.no_grad():  # parameters an init leaves at zero or one (sinks, norms) get values that matter
        for name, p in model.named_parameters():
            if name.endswith("sinks") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
    return model.train()


FEATURE_NAMES = {
    "sliding": "sliding window",
    "chunked": "chunked attention",
    "softcap": "attention softcap",
    "sinks": "sinks",
    "mla": "MLA (q/k head dim != v head dim)",
    "longrope": "LongRoPE",
    "attn_temperature_tuning": "attention temperature",
    "lm_head_transform": "LM-head transform",
    "moe": "MoE",
}


def support_matrix() -> str:
    """docs/models.md's support matrix, from this module's families and their capability records.

    Every row is a family that ``tests/test_model_families.py::test_family_is_exact_under_every_layout``
    checks under every layout listed there (a row exists only for a tested family)."""
    from usp.model import model_capabilities

    rows = [
        "| family (`model_type`) | class | layers | features switched on in the test | `apply_usp` exact | trains |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for family in sorted(FAMILIES):
        caps = model_capabilities(family_config(family))
        kinds = [spec.kind for spec in caps.layers]
        layers = ", ".join(f"{k} x{kinds.count(k)}" for k in dict.fromkeys(kinds))
        features = ", ".join(FEATURE_NAMES.get(f, f) for f in caps.features) or "-"
        if caps.lm_head_fields:
            features = features.replace("LM-head transform", f"LM-head ({', '.join(caps.lm_head_fields)})")
        train = [r for r in caps.refusals if r.purpose == "train"]
        trains = "yes" if not train else "refused: " + "; ".join(r.field for r in train)
        rows.append(f"| {family} | {caps.architecture} | {layers} | {features} | yes | {trains} |")
    return "\n".join(rows)


def refusal_list() -> str:
    """docs/models.md's refusal list: each refused family with the gate's reasons."""
    from usp.model import model_capabilities

    lines = []
    for family in sorted(REFUSED):
        overrides, _ = REFUSED[family]
        caps = model_capabilities(family_config(family, overrides))
        reasons = "; ".join(f"`{r.field}`: {r.reason}" for r in caps.refusals)
        lines.append(f"- **{family}**: {reasons}.")
    return "\n".join(lines)


if __name__ == "__main__":
    print(support_matrix())
    print()
    print(refusal_list())
