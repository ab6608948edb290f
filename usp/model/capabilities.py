"""What a causal LM needs from usp, read once from its config (and its module skeleton), and the one gate.

:func:`model_capabilities` turns a transformers config into a :class:`ModelCapabilities` record: the
attention kind of every layer (full, sliding window, chunked, or a non-attention mixer), sinks, attention
logit softcapping, query/key vs value head dims (MLA), the RoPE type, terms computed from global positions
(LongRoPE's factor choice, Llama 4's attention temperature), the LM-head transform the loss must apply, and
whether the model routes tokens to experts. The loader's start-up check (:func:`usp.model.check_model_dir`,
before any weight is read), :func:`usp.model.apply_usp` and the attention function read that one record;
:meth:`ModelCapabilities.check` raises a ``ValueError`` naming the family, the config field and the fix for
anything usp does not implement, so a model is trained exactly or refused, never silently wrong.

The module skeleton is built on the meta device (no memory, no weights): it shows what the config alone does
not, e.g. gpt-oss's per-head sink parameters, recurrent mixers in hybrid layers, and whether the family's
attention goes through transformers' ``AttentionInterface`` at all (ALiBi-era families do not).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import nn
from transformers import PretrainedConfig

Purpose = Literal["forward", "train"]

LAYER_KINDS: dict[str, str] = {
    "full_attention": "full",
    "sliding_attention": "sliding",
    "chunked_attention": "chunked",
}
"""transformers' ``layer_types`` values of softmax attention usp implements, and its names for them."""

MIXER_LAYER_TYPES: dict[str, tuple[str, bool]] = {
    "linear_attention": ("mixer", True),
    "mamba": ("mixer", True),
    "conv": ("mixer", True),
    "hybrid": ("full", True),
    "mlp": ("none", False),
    "moe": ("none", False),
}
"""Hybrid models' other ``layer_types`` values -> (usp's kind, whether the layer runs a non-attention mixer):
``mixer`` layers have a recurrent or convolution mixer instead of attention (qwen3_next, nemotron_h, bamba,
lfm2, ...), ``hybrid`` layers run one beside full attention (falcon_h1), ``none`` layers mix no tokens
(nemotron_h's MLP and MoE layers). The mixer's class decides whether usp implements it
(:data:`usp.model.mixers.MIXER_SCHEMES`)."""

_MIXER_CLASSES = re.compile(
    r"Mamba|DeltaNet|DeltaAttention|TextLinearAttention|ShortConv|Rwkv|RWKV|Recurrent|Mlstm|Slstm|Lightning|"
    r"H1Mixer|BambaMixer"
)
MOE_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
_SPARSE_FIELDS = ("index_topk", "index_n_heads")  # DeepSeek sparse attention (V3.2-style indexers)


@dataclass(frozen=True)
class LayerSpec:
    """One decoder layer's token mixer as usp computes it."""

    kind: str
    """``full``, ``sliding``, ``chunked`` (softmax attention), ``mixer`` (a recurrent or convolution mixer
    instead), ``none`` (no token mixing), or a ``layer_types`` value usp does not know."""
    window: int | None = None
    """Sliding window in tokens (transformers' rule: query ``i`` sees keys ``j > i - window``), or None."""
    chunk: int | None = None
    """Chunked attention's chunk size in tokens (Llama 4), or None."""
    mixer: bool = False
    """The layer runs a non-attention mixer (alone, or beside attention: falcon_h1's ``hybrid``)."""

    @property
    def attention(self) -> bool:
        """The layer computes softmax attention (one attention module)."""
        return self.kind in LAYER_KINDS.values()


@dataclass(frozen=True)
class Refusal:
    """A feature usp does not implement: the config field (or module) that shows it, why, and what to do."""

    field: str
    reason: str
    fix: str
    purpose: Purpose = "forward"
    """``forward``: refused everywhere (``apply_usp`` too); ``train``: the forward is exact, training is not."""


@dataclass(frozen=True)
class ModelCapabilities:
    """What one model needs; built by :func:`model_capabilities`, read by the loader, start-up, ``apply_usp``,
    the attention function and the loss."""

    model_type: str
    architecture: str
    layers: tuple[LayerSpec, ...]
    attn_softcap: float | None = None
    sinks: bool = False
    qk_head_dim: int = 0
    v_head_dim: int = 0
    rope_type: str = "default"
    global_positions: tuple[str, ...] = ()
    """Terms transformers computes from the call's own positions that usp computes from global ones."""
    lm_head_fields: tuple[str, ...] = ()
    """Config fields of the LM-head transform the losses apply (:mod:`usp.model.lm_head`)."""
    moe: bool = False
    mixers: tuple[str, ...] = ()
    """Class names of the non-attention token mixers (hybrid models), each once (:mod:`usp.model.mixers`)."""
    refusals: tuple[Refusal, ...] = field(default=())

    @property
    def windows(self) -> tuple[int, ...]:
        """The distinct sliding windows of the model's layers."""
        return tuple(sorted({spec.window for spec in self.layers if spec.window is not None}))

    @property
    def features(self) -> tuple[str, ...]:
        """Short names of what the model uses beyond causal full attention (for logs and docs)."""
        names = sorted({spec.kind for spec in self.layers if spec.kind not in ("full", "mixer", "none")})
        names += list(self.mixers)
        if self.attn_softcap is not None:
            names.append("softcap")
        if self.sinks:
            names.append("sinks")
        if self.qk_head_dim != self.v_head_dim:
            names.append("mla")
        names += list(self.global_positions)
        if self.lm_head_fields:
            names.append("lm_head_transform")
        if self.moe:
            names.append("moe")
        return tuple(names)

    def check(self, purpose: Purpose = "train", *, setting: str = "model.path") -> None:
        """``ValueError`` listing every refusal that applies to ``purpose`` (``train`` includes ``forward``)."""
        found = [r for r in self.refusals if r.purpose == "forward" or purpose == "train"]
        if not found:
            return
        lines = "\n".join(f"  - {r.field}: {r.reason}. {r.fix}".rstrip() for r in found)
        what = "trains" if purpose == "train" else "runs"
        raise ValueError(
            f"{setting}: usp {what} no {self.model_type!r} model ({self.architecture}) as configured, because "
            f"of what usp does not implement:\n{lines}\nNothing was loaded; see docs/models.md for the "
            f"families and features usp supports."
        )


def _text_config(config: PretrainedConfig) -> PretrainedConfig:
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def causal_lm_class(config: PretrainedConfig) -> type | None:
    """The transformers class ``AutoModelForCausalLM`` builds for ``config`` (None when it builds none)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except KeyError:
        return None


ROUTER_LOSS_REFERENCE = "qwen3_moe"
"""The family whose ``load_balancing_loss_func`` usp computes sharded (:mod:`usp.train.router_loss`); 31 families of
transformers 5.24 share its code."""


def _balancing_code(module_name: str) -> tuple | None:
    import importlib

    try:
        fn = getattr(importlib.import_module(module_name), "load_balancing_loss_func", None)
    except ImportError:
        return None
    if fn is None:
        return None
    code = fn.__code__
    return code.co_code, code.co_names, code.co_consts[1:]  # co_consts[0]: the docstring


def router_loss_kind(causal_lm: type | None) -> Literal["none", "load_balancing", "other"]:
    """How a causal LM class adds a router loss to its LM loss: ``none`` (dense, or MoE with bias-balanced
    routing such as deepseek_v3), ``load_balancing`` (the code of :data:`ROUTER_LOSS_REFERENCE`'s
    ``load_balancing_loss_func``, which usp implements) or ``other`` (a formula usp does not implement)."""
    code = None if causal_lm is None else _balancing_code(causal_lm.__module__)
    if code is None:
        return "none"
    reference = _balancing_code(
        f"transformers.models.{ROUTER_LOSS_REFERENCE}.modeling_{ROUTER_LOSS_REFERENCE}"
    )
    return "load_balancing" if code == reference else "other"


def layer_specs(config: PretrainedConfig | dict) -> tuple[LayerSpec, ...]:
    """Every layer's attention kind, window and chunk from a config (object or ``config.json`` dict): the one
    rule the gate, ``apply_usp``, the planner and the MFU count read. ``layer_types`` when the config has it
    (transformers 5 derives it for Qwen2/3's ``use_sliding_window`` + ``max_window_layers``, Gemma's
    patterns, gpt-oss, Llama 4), else one ``sliding_window`` for every layer when it is switched on."""
    get = (
        config.get if isinstance(config, dict) else (lambda key, default=None: getattr(config, key, default))
    )
    n = int(get("num_hidden_layers"))
    window = get("sliding_window", None)
    chunk = get("attention_chunk_size", None)
    types = get("layer_types", None)
    if types is None and isinstance(config, dict) and config.get("model_type"):
        types = _derived_layer_types(config)
    if types is None:  # families without layer_types: one window for every layer when it is switched on
        on = window is not None and get("use_sliding_window", True) is not False
        types = ["sliding_attention" if on else "full_attention"] * n
    specs = []
    for t in types[:n]:
        kind, mixer = MIXER_LAYER_TYPES.get(t, (LAYER_KINDS.get(t, t), False))
        specs.append(
            LayerSpec(
                kind,
                window=window if kind == "sliding" else None,
                chunk=chunk if kind == "chunked" else None,
                mixer=mixer,
            )
        )
    return tuple(specs)


def _derived_layer_types(config: dict) -> list[str] | None:
    """``layer_types`` as the family's config class derives it from a ``config.json`` dict that does not list
    them (Bamba's ``attn_layer_indices``, a Qwen3-Next ``full_attention_interval``); None when transformers
    does not know the family or derives none."""
    from transformers import AutoConfig

    try:
        fields = {k: v for k, v in config.items() if k != "model_type"}
        derived = AutoConfig.for_model(str(config["model_type"]), **fields)
    except (KeyError, ValueError, TypeError):
        return None
    return getattr(derived, "layer_types", None)


def _skeleton(config: PretrainedConfig) -> nn.Module | None:
    """The model on the meta device (no memory, no weights), or None when transformers builds no causal LM."""
    from transformers import AutoModelForCausalLM

    if causal_lm_class(config) is None:
        return None
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def decoder_of(model: nn.Module) -> nn.Module:
    """The causal LM's decoder: the module that holds the decoder layers (``layers``) and returns
    ``last_hidden_state``. ``model.get_decoder()`` where that is right; for families whose ``get_decoder``
    returns the LM itself (Llama 4 in transformers 5.24: its ``base_model_prefix`` names no attribute), the
    LM's ``model`` attribute."""
    decoder = model.get_decoder()
    if decoder is model or getattr(decoder, "lm_head", None) is not None:
        inner = getattr(model, "model", None)
        if isinstance(inner, nn.Module) and isinstance(getattr(inner, "layers", None), nn.ModuleList):
            return inner
    return decoder


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The model's self-attention modules, one per attention layer (``*Attention`` with a ``layer_idx``)."""
    return [
        m
        for m in model.modules()
        if type(m).__name__.endswith("Attention")
        and hasattr(m, "layer_idx")
        and not _MIXER_CLASSES.search(type(m).__name__)
    ]


def mixer_classes(model: nn.Module) -> list[str]:
    """Class names of the model's non-attention token mixers (recurrent, linear-attention, convolution), one
    per mixer module, in module order; decoder layers named after their mixer are not mixers."""
    return [
        type(m).__name__
        for m in model.modules()
        if _MIXER_CLASSES.search(type(m).__name__) and not type(m).__name__.endswith("DecoderLayer")
    ]


def _attention_backend_settable(cls: type) -> bool:
    """Whether transformers lets ``cls`` switch to a registered attention function (its own rule: the
    family's attention calls ``ALL_ATTENTION_FUNCTIONS.get_interface``)."""
    can_set = getattr(cls, "_can_set_attn_implementation", None)
    if callable(can_set):
        return bool(can_set())
    return bool(getattr(cls, "_supports_attention_backend", False))


def model_capabilities(config: PretrainedConfig, model: nn.Module | None = None) -> ModelCapabilities:
    """The record of what ``config``'s model needs, and what usp refuses of it (:class:`Refusal`).

    ``model``: the built model when there is one (``apply_usp``); otherwise a meta-device skeleton is built
    from the config (no weights are read, no memory is used).
    """
    from usp.model.global_positions import needs_global_positions
    from usp.model.lm_head import lm_head_transform

    text = _text_config(config)
    model_type = str(getattr(config, "model_type", "?"))
    refusals: list[Refusal] = []
    cls = causal_lm_class(config) if model is None else type(model)
    architecture = cls.__name__ if cls is not None else "no causal LM class"
    if cls is None:
        refusals.append(
            Refusal(
                "model_type",
                f"transformers builds no causal LM (AutoModelForCausalLM) for {model_type!r}",
                "Use a decoder-only causal LM checkpoint.",
            )
        )
    if getattr(config, "is_encoder_decoder", False):
        refusals.append(
            Refusal(
                "is_encoder_decoder", "encoder-decoder models are not causal LMs", "Use a decoder-only model."
            )
        )
    if text is not config:
        refusals.append(
            Refusal(
                "text_config",
                "a multimodal checkpoint (a text model inside a vision/audio model)",
                "Use the text-only checkpoint of the family (e.g. gemma3_text) or export the language model alone.",
            )
        )
    layers = layer_specs(text)
    for i, spec in enumerate(layers):
        if not spec.attention and spec.kind not in ("mixer", "none"):
            refusals.append(
                Refusal(
                    f"layer_types[{i}]",
                    f"layer {i} is a {spec.kind!r} mixer, not softmax attention; usp would run it on each rank's "
                    f"slice of the sequence as if it were the whole sequence",
                    "usp knows the layer types "
                    f"{', '.join(sorted({*LAYER_KINDS, *MIXER_LAYER_TYPES}))}; this one is not implemented.",
                )
            )
            break
        if spec.kind == "sliding" and spec.window is None:
            layers = tuple(LayerSpec("full") if s is spec else s for s in layers)
    for name in _SPARSE_FIELDS:
        if getattr(text, name, None) is not None:
            refusals.append(
                Refusal(
                    name,
                    "sparse attention with a token indexer (DeepSeek V3.2-style DSA) selects keys per query",
                    "Not implemented under sequence parallelism; use the dense-attention checkpoint.",
                )
            )
            break
    if float(getattr(text, "attention_dropout", 0.0) or 0.0) > 0:
        refusals.append(
            Refusal(
                "attention_dropout",
                f"attention dropout {text.attention_dropout} (usp attention has none)",
                "Set attention_dropout=0 in the model config (model.config_overrides or config.json).",
                purpose="train",
            )
        )
    sinks = False
    found: list[str] = []
    skeleton = model
    if skeleton is None and cls is not None:
        try:
            skeleton = _skeleton(config)
        except Exception as e:  # noqa: BLE001 - any failure is the config's: transformers cannot build it
            refusals.append(
                Refusal(
                    "config.json",
                    f"transformers cannot build {architecture} from it ({type(e).__name__}: {e})",
                    "Fix or replace config.json.",
                )
            )
    if skeleton is not None:
        if not _attention_backend_settable(type(skeleton)):
            refusals.append(
                Refusal(
                    "model_type",
                    f"{architecture}'s attention does not go through transformers' AttentionInterface (e.g. "
                    f"ALiBi or fused attention), so usp cannot run it",
                    "Use a family whose modeling code supports attention backends (Llama, Qwen, Gemma, Mistral, ...).",
                )
            )
        from usp.model.mixers import MIXER_SCHEMES

        found = mixer_classes(skeleton)
        unknown = sorted({name for name in found if name not in MIXER_SCHEMES})
        if unknown:
            refusals.append(
                Refusal(
                    f"modules {', '.join(unknown)}",
                    f"{', '.join(unknown)} is a recurrent / linear-attention / convolution mixer usp does not "
                    f"implement under sequence parallelism (it would run on each rank's slice as if it were the "
                    f"whole sequence)",
                    f"usp implements {', '.join(sorted(MIXER_SCHEMES))} (docs/models.md).",
                )
            )
        owners = [name for name, m in skeleton.named_modules() if _MIXER_CLASSES.search(type(m).__name__)]
        stray = sorted(
            {
                type(skeleton.get_submodule(name.rpartition(".")[0])).__name__
                for name, m in skeleton.named_modules()
                if isinstance(m, nn.Conv1d) and not any(name.startswith(f"{o}.") for o in owners)
            }
        )
        if stray:  # a causal convolution outside every mixer usp knows: a token mixer it would shard blindly
            refusals.append(
                Refusal(
                    f"modules {', '.join(stray)}",
                    f"{', '.join(stray)} holds a convolution over the sequence that is no mixer usp recognises "
                    f"(it would run on each rank's slice as if it were the whole sequence)",
                    f"usp implements {', '.join(sorted(MIXER_SCHEMES))} (docs/models.md).",
                )
            )
        mixer_layers = sum(spec.mixer for spec in layers)
        if not unknown and len(found) != mixer_layers:
            refusals.append(
                Refusal(
                    "layer_types",
                    f"{mixer_layers} layers run a non-attention mixer by the config, but the model has "
                    f"{len(found)} mixer modules usp recognises ({', '.join(sorted(set(found))) or 'none'})",
                    "usp needs one implemented mixer module per recurrent / convolution layer.",
                )
            )
        attn = attention_modules(skeleton)
        sinks = any(isinstance(getattr(m, "sinks", None), nn.Parameter) for m in attn)
        head = skeleton.get_output_embeddings()
        if head is not None and getattr(skeleton, "lm_head", None) is not head:
            refusals.append(
                Refusal(
                    "lm_head",
                    f"{architecture}'s LM head runs layers before its vocabulary projection, which usp's chunked "
                    f"losses (lm_head weight x hidden states, in training and in usp-eval) would skip",
                    "",
                )
            )
        if any(getattr(m, "is_causal", True) is False for m in attn):
            refusals.append(
                Refusal(
                    "is_decoder",
                    "its attention is bidirectional (not causal)",
                    "usp trains causal (decoder-only) language models.",
                )
            )
        attention_layers = sum(spec.attention for spec in layers)
        layer_refused = any(r.field.startswith("layer_types") for r in refusals)
        if not layer_refused and len(attn) != attention_layers:
            refusals.append(
                Refusal(
                    "num_hidden_layers",
                    f"found {len(attn)} attention modules for {attention_layers} attention layers",
                    "usp needs one self-attention module per decoder layer, called through transformers' "
                    "AttentionInterface.",
                )
            )
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    qk = getattr(text, "qk_head_dim", None) or (
        (getattr(text, "qk_nope_head_dim", 0) or 0) + (getattr(text, "qk_rope_head_dim", 0) or 0)
    )
    qk = qk or head_dim
    v = getattr(text, "v_head_dim", None) or head_dim
    rope = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {}
    rope_type = (
        str(rope.get("rope_type", rope.get("type", "default"))) if isinstance(rope, dict) else "default"
    )
    lm_head_fields: tuple[str, ...] = ()
    try:
        lm_head_fields = tuple(lm_head_transform(text).source_fields)
    except ValueError as e:  # a head no transform reproduces (the losses would be wrong)
        refusals.append(Refusal("lm_head", str(e).rstrip("."), ""))  # usp-eval's losses too
    moe = any((getattr(text, f, None) or 0) > 1 for f in MOE_FIELDS)
    if moe and router_loss_kind(causal_lm_class(config)) == "other":
        refusals.append(
            Refusal(
                "num_experts",
                "a mixture-of-experts model whose router loss (its load_balancing_loss_func) is not the one "
                "usp computes under sequence parallelism, so the training loss would not be the model's own "
                "(apply_usp's forward is exact)",
                "Train a family whose router loss usp implements (qwen3_moe, mixtral, olmoe, gpt_oss, ...).",
                purpose="train",
            )
        )
    return ModelCapabilities(
        model_type=model_type,
        architecture=architecture,
        layers=layers,
        attn_softcap=getattr(text, "attn_logit_softcapping", None),
        sinks=sinks,
        qk_head_dim=int(qk),
        v_head_dim=int(v),
        rope_type=rope_type,
        global_positions=tuple(needs_global_positions(text)),
        lm_head_fields=lm_head_fields,
        moe=moe,
        mixers=tuple(dict.fromkeys(found)),
        refusals=tuple(refusals),
    )
