"""Model side: load a local Hugging Face causal LM and wire USP attention into it (``apply_usp``)."""

from usp.model.load import (
    SUPPORTED_MODEL_TYPES,
    apply_rope_overrides,
    check_model_dir,
    load_causal_lm,
    parse_dtype,
    rope_settings,
)
from usp.model.usp_attention_fn import ATTN_IMPLEMENTATION, apply_usp, check_heads, usp_attention_forward

__all__ = [
    "ATTN_IMPLEMENTATION",
    "SUPPORTED_MODEL_TYPES",
    "apply_rope_overrides",
    "apply_usp",
    "check_heads",
    "check_model_dir",
    "load_causal_lm",
    "parse_dtype",
    "rope_settings",
    "usp_attention_forward",
]
