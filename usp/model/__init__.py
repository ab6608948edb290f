"""Model side: load a local Hugging Face causal LM and wire USP attention into it (``apply_usp``)."""

from usp.model.capabilities import LayerSpec, ModelCapabilities, Refusal, decoder_of, model_capabilities
from usp.model.lm_head import LMHeadTransform, lm_head_transform
from usp.model.load import (
    apply_rope_overrides,
    build_empty_causal_lm,
    check_model_dir,
    check_weight_headers,
    load_causal_lm,
    load_sharded_weights,
    materialize_empty,
    parse_dtype,
    read_full_state_dict,
    rope_settings,
    weight_devices,
)
from usp.model.usp_attention_fn import (
    ATTN_IMPLEMENTATION,
    apply_usp,
    check_heads,
    packed_sequence_kwargs,
    usp_attention_forward,
)

__all__ = [
    "ATTN_IMPLEMENTATION",
    "LMHeadTransform",
    "LayerSpec",
    "ModelCapabilities",
    "Refusal",
    "model_capabilities",
    "apply_rope_overrides",
    "apply_usp",
    "build_empty_causal_lm",
    "check_heads",
    "check_model_dir",
    "check_weight_headers",
    "decoder_of",
    "lm_head_transform",
    "load_causal_lm",
    "load_sharded_weights",
    "materialize_empty",
    "packed_sequence_kwargs",
    "parse_dtype",
    "read_full_state_dict",
    "rope_settings",
    "usp_attention_forward",
    "weight_devices",
]
