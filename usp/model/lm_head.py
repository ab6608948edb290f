"""What a causal LM does to its logits between ``lm_head`` and the loss, read from its config.

usp's losses (:mod:`usp.train.loss`, :mod:`usp.eval.losses`) run ``lm_head`` chunk by chunk and compute the
cross-entropy themselves, bypassing the model's ``ForCausalLM.forward``. Some families transform the logits
there; :func:`lm_head_transform` reads that transform from the config once, and the losses apply it to every
chunk, so their loss is the model's own. transformers' families, by the config field they read:

- ``final_logit_softcapping``: ``cap * tanh(logits / cap)`` (Gemma 2/3/3n/4, VaultGemma, NanoChat, Beam,
  Mistral Large 4, Inkling2, MuseSpark/MuseGlimmer, PaliGemma's text config); ``logits_soft_cap``
  (RecurrentGemma) and ``output_logit_soft_cap`` (xLSTM) are the same cap.
- ``logit_scale`` (Cohere, Cohere2, Cohere2-MoE, CohereCompass): ``logits * logit_scale``. MPT's config has the
  field too, but transformers' MPT ignores it, so only the Cohere families read it here.
- ``logits_scaling``: ``logits / logits_scaling`` in the Granite families (granite, granitemoe*, granite_swa,
  the Granite vision/docling text configs); ``logits * logits_scaling`` in HyperCLOVAX; MiniCPM3 divides the
  hidden states by it before its bias-free ``lm_head``, which is the same linear map as dividing the logits.
- ``lm_head_multiplier`` (FalconH1) and ``output_multiplier`` (MuseSpark/MuseGlimmer, before the softcap):
  ``logits * multiplier``; ``logits_mup_width_multiplier`` (Inkling): the hidden states divided by it before
  the bias-free ``lm_head``.
- ``unpadded_vocab_size`` (Inkling): only the first ``unpadded_vocab_size`` logits enter the softmax.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from transformers import PretrainedConfig

# Fields with one meaning in every transformers family that declares them: (field, "multiply" | "divide").
_SCALE_FIELDS: tuple[tuple[str, str], ...] = (
    ("lm_head_multiplier", "multiply"),
    ("output_multiplier", "multiply"),
    ("logits_mup_width_multiplier", "divide"),
)
_SOFTCAP_FIELDS: tuple[str, ...] = ("final_logit_softcapping", "logits_soft_cap", "output_logit_soft_cap")
# Fields whose meaning depends on the family: (text config model_type prefix, field, "multiply" | "divide").
_FAMILY_SCALE_FIELDS: tuple[tuple[str, str, str], ...] = (
    ("cohere", "logit_scale", "multiply"),
    ("granite", "logits_scaling", "divide"),
    ("hyperclovax", "logits_scaling", "multiply"),
    ("minicpm3", "logits_scaling", "divide"),
)
# Families whose logits depend on more than the config: no LMHeadTransform reproduces them.
_UNREPRODUCIBLE: dict[str, str] = {
    "dory": "its lm_head (DoryLMHead) multiplies each token's logit by a learned per-token scale",
    "chameleon": "its forward sets the image tokens' logits to the dtype's minimum",
}


@dataclass(frozen=True)
class LMHeadTransform:
    """``logits -> final_softcap * tanh(scale * logits[..., :vocab_limit] / final_softcap)``, in that order (the
    order of every family's ``forward``); each part is skipped when it is the identity.

    Built by :func:`lm_head_transform`; the default is the identity (Llama, Mistral, Qwen).
    """

    final_softcap: float | None = None
    """Gemma-style cap applied last (``None``: none)."""
    scale: float = 1.0
    """Multiplier applied before the cap (a divisor ``d`` in the config is ``scale = 1 / d``)."""
    vocab_limit: int | None = None
    """Keep only the first ``vocab_limit`` logits (a padded ``lm_head``); ``None`` keeps them all."""
    source_fields: tuple[str, ...] = ()
    """The config fields the transform came from (for messages and docs)."""

    def __post_init__(self) -> None:
        assert self.final_softcap is None or self.final_softcap > 0, f"softcap {self.final_softcap}"
        assert math.isfinite(self.scale) and self.scale != 0, f"scale {self.scale}"
        assert self.vocab_limit is None or self.vocab_limit >= 1, f"vocab_limit {self.vocab_limit}"

    @property
    def is_identity(self) -> bool:
        """True when :meth:`apply` would return its input: callers then skip it (no extra op)."""
        return self.final_softcap is None and self.scale == 1.0 and self.vocab_limit is None

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """The model's logits from ``lm_head``'s output ``[..., V]`` (``[..., vocab_limit]`` when that is set and
        smaller). Differentiable; computes in ``logits.dtype`` (the losses pass fp32, or float64)."""
        if self.vocab_limit is not None and self.vocab_limit < logits.size(-1):
            logits = logits[..., : self.vocab_limit]
        if self.scale != 1.0:
            logits = logits * self.scale
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits


def lm_head_transform(config: PretrainedConfig) -> LMHeadTransform:
    """The transform ``config``'s ``ForCausalLM.forward`` applies to ``lm_head``'s output before its loss.

    Reads the text config (``config.get_text_config()``) of a multimodal config. Raises ``ValueError`` for a
    family whose logits no config-read transform reproduces, a non-positive softcap or a zero scale.
    """
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for model_type in {getattr(config, "model_type", ""), getattr(text, "model_type", "")}:
        if model_type in _UNREPRODUCIBLE:
            raise ValueError(
                f"usp's chunked loss cannot reproduce a {model_type!r} model's logits: "
                f"{_UNREPRODUCIBLE[model_type]}. Train a family without that head."
            )
    text_type = getattr(text, "model_type", "") or ""
    scales = list(_SCALE_FIELDS)
    scales += [(field, how) for prefix, field, how in _FAMILY_SCALE_FIELDS if text_type.startswith(prefix)]
    scale, sources = 1.0, []
    for field, how in scales:
        value = getattr(text, field, None)
        if value is not None and float(value) != 1.0:
            if not (math.isfinite(float(value)) and float(value) != 0):
                raise ValueError(f"{text_type} config: {field}={value} must be a finite non-zero number.")
            scale = scale * float(value) if how == "multiply" else scale / float(value)
            sources.append(field)
    caps = [
        (field, getattr(text, field)) for field in _SOFTCAP_FIELDS if getattr(text, field, None) is not None
    ]
    assert len(caps) <= 1, f"{text_type}: more than one logit softcap field {caps}"
    cap = None
    if caps:
        field, cap = caps[0][0], float(caps[0][1])
        if not cap > 0:
            raise ValueError(f"{text_type} config: {field}={cap} must be > 0 (or null: no softcap).")
        sources.append(field)
    vocab_limit = getattr(text, "unpadded_vocab_size", None)
    if vocab_limit is not None:
        sources.append("unpadded_vocab_size")
    return LMHeadTransform(
        final_softcap=cap, scale=scale, vocab_limit=vocab_limit, source_fields=tuple(sources)
    )
