"""The planner on mixture-of-experts models: total and active parameters (against the published figures and
against transformers' own models on the meta device), what a MoE layer keeps for backward (against autograd),
FLOPs from the active parameters, memory and FSDP traffic from the total ones, dense models unchanged."""

from __future__ import annotations

import pytest
import torch

from usp.plan.comm import fsdp_comm, fsdp_layer_balance
from usp.plan.compute import compute_time, model_flops_per_token, training_flops
from usp.plan.hardware import GB, GPUS
from usp.plan.maxlen import max_seq_lens
from usp.plan.memory import (
    activation_bytes_per_token_layer,
    held_activation_bytes,
    moe_bytes_per_token,
    training_memory,
)
from usp.plan.models import PRESETS, ModelSpec, load_model_spec, moe_layer_pattern
from usp.plan.search import plan_layouts

H100 = GPUS["h100-80g"]

# Published figures (billions): Qwen3-30B-A3B's model card (30.5B total, 3.3B activated), Mistral's
# Mixtral-8x7B announcement (46.7B total, 12.9B active), OpenAI's gpt-oss model card (20.91B / 3.61B and
# 116.83B / 5.13B), Meta's Llama 4 model card (Scout 109B total / 17B activated, Maverick 400B / 17B; the
# released multimodal checkpoints, the presets are their text models). Qwen, Mistral and Meta count the
# embedding table among the active parameters; OpenAI does not (its active figures are the ones a token's
# matmuls go through, the unembedding included).
PUBLISHED = {
    "qwen3-30b-a3b": (30.5, 3.3, True),
    "mixtral-8x7b": (46.7, 12.9, True),
    "gpt-oss-20b": (21.0, 3.6, False),
    "gpt-oss-120b": (117.0, 5.1, False),
    "llama4-scout": (109.0, 17.0, True),
    "llama4-maverick": (400.0, 17.0, True),
}
NO_ROUTER_LOSS = {"llama4-scout", "llama4-maverick"}
"""Presets whose causal LM adds no router loss (Llama4ForCausalLM), whatever ``router_aux_loss_coef`` says."""


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_preset_parameter_counts_match_the_published_figures(name):
    total, active, embedding_counted = PUBLISHED[name]
    spec = load_model_spec(name)
    assert spec.is_moe
    counted_active = spec.active_params - (0 if embedding_counted else spec.embedding_params)
    assert spec.num_params / 1e9 == pytest.approx(total, rel=0.03)
    assert counted_active / 1e9 == pytest.approx(active, rel=0.03)
    assert spec.active_params < spec.num_params / 3  # sparse: most parameters sit in idle experts


def test_preset_shapes_from_their_configs():
    qwen = load_model_spec("qwen3-30b-a3b")
    assert (qwen.moe.num_experts, qwen.moe.top_k, qwen.moe.expert_intermediate_size) == (128, 8, 768)
    assert all(qwen.moe.layers) and len(qwen.moe.layers) == 48 and qwen.moe.norm_topk_prob
    mixtral = load_model_spec("mixtral-8x7b")
    assert (mixtral.moe.num_experts, mixtral.moe.top_k, mixtral.moe.expert_intermediate_size) == (8, 2, 14336)
    oss = load_model_spec("gpt-oss-120b")
    assert (oss.moe.num_experts, oss.moe.top_k, oss.moe.expert_intermediate_size) == (128, 4, 2880)
    assert oss.moe.expert_bias and oss.moe.router_bias
    # gpt-oss alternates a 128-token sliding window with full attention, starting with the window
    assert oss.layer_attention[:2] == ((128, None), (None, None)) and len(oss.layer_attention) == 36
    for name in PUBLISHED:
        own_loss = name not in NO_ROUTER_LOSS
        assert PRESETS[name]["router_aux_loss_coef"] > 0
        assert load_model_spec(name).moe.router_aux_loss is own_loss


def _llama4_by_formula(h, L, V, heads, kv, d, E, k, width, dense_width, step) -> tuple[int, int]:
    """(total, active) of a Llama 4 text model from its shapes: attention, two norms per layer; a MoE layer
    (``(i + 1) % step == 0``) holds ``E`` experts of ``width``, the router ``E h`` and one shared expert of
    ``width``; the others a dense MLP of ``dense_width``; untied embedding and LM head, the final norm."""
    attention = 2 * h * heads * d + 2 * h * kv * d
    expert = 3 * h * width
    total = active = 2 * V * h + h
    for i in range(L):
        if (i + 1) % step == 0:
            total += attention + E * expert + E * h + expert + 2 * h
            active += attention + k * expert + E * h + expert + 2 * h
        else:
            total += attention + 3 * h * dense_width + 2 * h
            active += attention + 3 * h * dense_width + 2 * h
    return total, active


def test_llama4_presets_interleave_moe_and_dense_layers():
    scout, maverick = load_model_spec("llama4-scout"), load_model_spec("llama4-maverick")
    assert (scout.num_params, scout.active_params) == _llama4_by_formula(
        5120, 48, 202048, 40, 8, 128, 16, 1, 8192, 16384, 1
    )
    assert (maverick.num_params, maverick.active_params) == _llama4_by_formula(
        5120, 48, 202048, 40, 8, 128, 128, 1, 8192, 16384, 2
    )
    assert scout.moe.layers == (True,) * 48 and scout.moe.shared_intermediate_size == 8192
    assert maverick.moe.layers == tuple(i % 2 == 1 for i in range(48))  # layers 1, 3, ..., 47
    assert maverick.moe.num_moe_layers == 24 and maverick.intermediate_size == 16384
    assert maverick.moe.expert_intermediate_size == 8192 and maverick.moe.shared_intermediate_size == 8192
    # the largest FSDP unit: a MoE layer; a dense layer is its own width (intermediate_size_mlp)
    h, attention = 5120, 2 * 5120 * 40 * 128 + 2 * 5120 * 8 * 128
    assert maverick.params_of_layer(0) == attention + 3 * h * 16384 + 2 * h
    assert maverick.layer_params == maverick.params_of_layer(1) > maverick.params_of_layer(0)
    # Meta's figures: 17B active for both, Maverick ~4x Scout's total
    assert scout.active_params == pytest.approx(maverick.active_params, rel=0.01)
    # chunked attention (8192) on three layers of four, every fourth global
    assert scout.layer_attention[:4] == ((None, 8192),) * 3 + ((None, None),)


# --- against transformers' own models ---------------------------------------------------------------------

TINY = {
    # a dense first layer (mlp_only_layers) among sparse ones, renormalized top-k
    "qwen3_moe": dict(
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        num_hidden_layers=4,
        mlp_only_layers=[0],
        norm_topk_prob=True,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=128,
    ),
    "mixtral": dict(
        hidden_size=64,
        intermediate_size=48,
        num_local_experts=4,
        num_experts_per_tok=2,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=128,
    ),
    # expert and router biases (attention biases and sinks: not counted, module docstring)
    "gpt_oss": dict(
        hidden_size=64,
        intermediate_size=48,
        num_local_experts=4,
        num_experts_per_tok=2,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=128,
    ),
    # gated shared experts, every second layer sparse (q/k/v biases: not counted)
    "qwen2_moe": dict(
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=80,
        num_experts=8,
        num_experts_per_tok=2,
        num_hidden_layers=4,
        decoder_sparse_step=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
    ),
    # Llama 4: every second layer sparse (interleave_moe_layer_step), the others a dense MLP of
    # intermediate_size_mlp; the experts (and the one ungated shared expert) intermediate_size wide
    "llama4_text": dict(
        hidden_size=64,
        intermediate_size=32,
        intermediate_size_mlp=96,
        num_local_experts=4,
        num_experts_per_tok=2,
        interleave_moe_layer_step=2,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=128,
    ),
}
NOT_COUNTED = ("q_norm.weight", "k_norm.weight", "self_attn.sinks", "_proj.bias")
"""Parameters the planner leaves out, dense or MoE (models module docstring): per-head q/k norms, attention
sinks and attention biases (``q_proj.bias`` ...; expert biases are ``gate_up_proj_bias``, counted)."""


def _meta_model(model_type: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, **TINY[model_type])
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return config, model


def _by_hand(model_type: str) -> tuple[int, int, int]:
    """(total, active, matmul) from the config's numbers alone."""
    c = TINY[model_type]
    h, L, V = c["hidden_size"], c["num_hidden_layers"], c["vocab_size"]
    d = c.get("head_dim", h // c["num_attention_heads"])
    E = c.get("num_experts") or c["num_local_experts"]
    k = c["num_experts_per_tok"]
    width = c.get("moe_intermediate_size") or c["intermediate_size"]
    attention = 2 * h * c["num_attention_heads"] * d + 2 * h * c["num_key_value_heads"] * d
    biased = model_type == "gpt_oss"
    expert = 3 * h * width + (2 * width + h if biased else 0)
    router = E * h + (E if biased else 0)
    shared = 3 * h * c.get("shared_expert_intermediate_size", 0)
    gate = h if c.get("shared_expert_intermediate_size") else 0
    dense_mlp = 3 * h * c["intermediate_size"]
    step = c.get("decoder_sparse_step", 1)
    if (
        model_type == "llama4_text"
    ):  # one shared expert of the expert width; dense layers intermediate_size_mlp
        shared, dense_mlp, step = (
            3 * h * width,
            3 * h * c["intermediate_size_mlp"],
            c["interleave_moe_layer_step"],
        )
    sparse = [i not in c.get("mlp_only_layers", []) and (i + 1) % step == 0 for i in range(L)]
    total = active = matmul = 0
    for routed in sparse:
        norms = 2 * h
        if routed:
            total += attention + E * expert + router + shared + gate + norms
            active += attention + k * expert + router + shared + gate + norms
            matmul += attention + k * 3 * h * width + E * h + shared + gate
        else:
            total += attention + dense_mlp + norms
            active += attention + dense_mlp + norms
            matmul += attention + dense_mlp
    root = 2 * V * h + h  # embedding, LM head (untied), final norm
    return total + root, active + root, matmul + V * h


@pytest.mark.parametrize("model_type", sorted(TINY))
def test_tiny_moe_counts_match_transformers(model_type):
    config, model = _meta_model(model_type)
    named = list(model.named_parameters())
    assert any(p.dim() == 3 for _, p in named), "the experts are stacked 3D parameters"
    counted = sum(p.numel() for n, p in named if not n.endswith(NOT_COUNTED))
    spec = ModelSpec.from_hf_config(config.to_dict(), name=model_type)
    assert spec.num_params == counted
    if model_type == "llama4_text":  # a config.json without the moe_layers Llama4TextConfig derives: the same
        raw = {k: v for k, v in config.to_dict().items() if k != "moe_layers"}
        assert ModelSpec.from_hf_config(raw, name=model_type) == spec
        assert spec.moe.layers == (False, True, False, True)
    total, active, matmul = _by_hand(model_type)
    assert counted == total  # the hand count is the model's own
    assert spec.active_params == active
    assert spec.matmul_params == matmul
    from usp.train.flops import count_matmul_params

    assert count_matmul_params(model) == matmul  # the trainer's MFU count on the same module
    assert spec.active_params < spec.num_params
    # the largest layer is the FSDP unit: a sparse layer with all of its experts, as the model holds it
    layers = model.model.layers
    for i, layer in enumerate(layers):
        own = sum(p.numel() for n, p in layer.named_parameters() if not n.endswith(NOT_COUNTED))
        assert spec.params_of_layer(i) == own
    assert spec.layer_params == max(spec.params_of_layer(i) for i in range(len(layers)))


def test_llama4_moe_layers_follow_its_config():
    """Llama 4's sparse layers: ``moe_layers`` when set, else every ``interleave_moe_layer_step``-th layer,
    exactly the list ``Llama4TextConfig`` derives (what its decoder layers read)."""
    from transformers import Llama4TextConfig

    for layers in (1, 4, 7, 48):
        for step in (1, 2, 3, 4):
            own = Llama4TextConfig(num_hidden_layers=layers, interleave_moe_layer_step=step).moe_layers
            raw = {"interleave_moe_layer_step": step}  # a config.json without moe_layers
            assert moe_layer_pattern(raw, layers) == tuple(i in own for i in range(layers))
    # moe_layers wins over the step, as in Llama4TextConfig
    assert moe_layer_pattern({"moe_layers": [0, 3], "interleave_moe_layer_step": 2}, 4) == (
        True,
        False,
        False,
        True,
    )
    config = Llama4TextConfig(**(TINY["llama4_text"] | {"moe_layers": [0, 3]}))
    spec = ModelSpec.from_hf_config(config.to_dict())
    assert spec.moe.layers == (True, False, False, True)
    # no MoE layer at all: a dense model of intermediate_size_mlp
    dense = ModelSpec.from_hf_config(Llama4TextConfig(**(TINY["llama4_text"] | {"moe_layers": []})).to_dict())
    assert dense.moe is None and dense.intermediate_size == 96
    # the multimodal config.json (Llama4Config): its text_config, the same counts
    from transformers import Llama4Config

    nested = Llama4Config(text_config=TINY["llama4_text"]).to_dict()
    assert "hidden_size" not in nested and nested["model_type"] == "llama4"
    text = ModelSpec.from_hf_config(_llama4_text_config().to_dict())
    whole = ModelSpec.from_hf_config(nested)
    assert (whole.num_params, whole.active_params, whole.matmul_params) == (
        text.num_params,
        text.active_params,
        text.matmul_params,
    )
    assert whole.moe == text.moe and not whole.moe.router_aux_loss


def _llama4_text_config(**overrides):
    from transformers import AutoConfig

    return AutoConfig.for_model("llama4_text", **(TINY["llama4_text"] | overrides))


def test_dense_layers_of_a_moe_follow_the_family_rules():
    assert moe_layer_pattern({"first_k_dense_replace": 3}, 6) == (False,) * 3 + (True,) * 3
    assert moe_layer_pattern({"first_k_dense_replace": 1, "moe_layer_freq": 2}, 5) == (
        False,
        False,
        True,
        False,
        True,
    )
    assert moe_layer_pattern({"decoder_sparse_step": 2, "mlp_only_layers": [3]}, 4) == (
        False,
        True,
        False,
        False,
    )
    assert moe_layer_pattern({}, 3) == (True,) * 3
    # shared experts DeepSeek-style: n_shared_experts of the expert width
    cfg = dict(
        PRESETS["mixtral-8x7b"],
        model_type="deepseek_v3",
        n_routed_experts=8,
        n_shared_experts=2,
        moe_intermediate_size=512,
        first_k_dense_replace=1,
    )
    spec = ModelSpec.from_hf_config(cfg)
    assert spec.moe.shared_intermediate_size == 1024 and spec.moe.layers[0] is False
    h = 4096
    attention = 2 * h * 32 * 128 + 2 * h * 8 * 128
    sparse = attention + 8 * 3 * h * 512 + 8 * h + 3 * h * 1024 + 2 * h  # experts, router, shared, norms
    assert spec.params_of_layer(1) == sparse
    # here the dense first layer (an MLP of 14336) is the largest FSDP unit
    assert spec.layer_params == spec.params_of_layer(0) == attention + 3 * h * 14336 + 2 * h > sparse
    # no expert count, or none of the layers routing: a dense model
    assert ModelSpec.from_hf_config(dict(PRESETS["mixtral-8x7b"], num_local_experts=0)).moe is None


# --- what a MoE layer keeps for backward --------------------------------------------------------------------


def _moe_block(model_type: str, dtype: torch.dtype, **overrides):
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type, **(TINY[model_type] | overrides))
    config._experts_implementation = "grouped_mm"  # transformers' default for a loaded model
    if model_type == "gpt_oss":
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP as Block
    elif model_type == "llama4_text":
        from transformers.models.llama4.modeling_llama4 import Llama4TextMoe as Block
    elif model_type == "mixtral":
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock as Block
    else:
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock as Block
    block = Block(config).to(dtype)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.05)
    return config, block


def _saved_bytes(module, x, skip=(), **kwargs) -> int:
    """Bytes autograd saves in ``module(x)``, the parameters, the input and ``skip`` left out (as
    tests/test_plan_memory.py counts a dense layer)."""
    ignored = {t.untyped_storage().data_ptr() for t in [*module.parameters(), x, *skip]}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() not in ignored:
            saved[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(x, **kwargs)
    return sum(saved.values())


@pytest.mark.parametrize(
    "model_type,overrides",
    [
        ("qwen3_moe", {}),
        ("qwen3_moe", {"norm_topk_prob": False}),
        ("mixtral", {}),
        ("gpt_oss", {}),
        ("llama4_text", {}),
        ("llama4_text", {"num_experts_per_tok": 1, "num_local_experts": 8}),
    ],
    ids=["qwen3_moe", "qwen3_moe-unnormalized", "mixtral", "gpt_oss", "llama4", "llama4-top1-of-8"],
)
@pytest.mark.parametrize(
    "dtype,compute_bytes", [(torch.bfloat16, 2), (torch.float32, 4)], ids=["bf16", "fp32"]
)
def test_moe_block_bytes_match_what_autograd_saves(model_type, overrides, dtype, compute_bytes):
    config, block = _moe_block(model_type, dtype, **overrides)
    T = 64
    x = torch.randn(1, T, config.hidden_size, dtype=dtype, requires_grad=True)
    spec = ModelSpec.from_hf_config(config.to_dict())
    E = spec.moe.num_experts
    # per token, and the grouped matmuls' int32 offsets once per layer (4 E bytes; Llama 4 runs every expert
    # on every token, by batched matmuls: no offsets, E copies of each token)
    offsets = 0 if spec.moe.every_expert_runs else 4 * E
    assert spec.moe.every_expert_runs is (model_type == "llama4_text")
    assert _saved_bytes(block, x) == T * moe_bytes_per_token(spec, compute_bytes) + offsets
    # the dense MLP's 4 I B is not what a MoE layer keeps: its k experts' and the router's instead
    assert moe_bytes_per_token(spec, compute_bytes) > 4 * spec.moe.top_k * spec.moe.expert_intermediate_size


def test_mixtral_decoder_layer_bytes_match_what_autograd_saves():
    """A whole Mixtral decoder layer (Llama attention, SDPA) against the planner's per-token formula of a
    MoE layer: the norms and attention as a dense layer's, the MoE block in place of the MLP's."""
    from transformers import AutoConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralDecoderLayer, MixtralRotaryEmbedding

    config = AutoConfig.for_model("mixtral", **TINY["mixtral"])
    config._attn_implementation = "sdpa"
    config._experts_implementation = "grouped_mm"
    layer = MixtralDecoderLayer(config, 0).to(torch.bfloat16)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.05)
    T = 64
    x = torch.randn(1, T, config.hidden_size, dtype=torch.bfloat16, requires_grad=True)
    pos = torch.arange(T)[None]
    cos, sin = MixtralRotaryEmbedding(config)(x, pos)
    saved = _saved_bytes(
        layer, x, skip=(cos, sin), position_embeddings=(cos, sin), attention_mask=None, position_ids=pos
    )
    spec = ModelSpec.from_hf_config(config.to_dict())
    per_token = activation_bytes_per_token_layer(spec, 1, 2, routed=True)
    assert saved == T * per_token + 4 * spec.moe.num_experts
    dense = activation_bytes_per_token_layer(spec, 1, 2, routed=False)
    assert per_token - dense == moe_bytes_per_token(spec, 2) - 4 * spec.intermediate_size * 2


def test_llama4_decoder_layers_bytes_match_what_autograd_saves():
    """Whole Llama 4 decoder layers (SDPA), a dense one (an MLP of intermediate_size_mlp) and a MoE one (every
    expert run on every token, the shared expert), against the planner's per-token formula of each kind. The
    q/k norm (use_qk_norm) and the temperature-tuned queries of the NoPE layers are switched off: what they keep
    is not modelled, for any family (docs/planning.md, known limits)."""
    from transformers.models.llama4.modeling_llama4 import Llama4TextDecoderLayer, Llama4TextRotaryEmbedding

    config = _llama4_text_config(use_qk_norm=False, attn_temperature_tuning=False, attention_chunk_size=None)
    config._attn_implementation = "sdpa"
    spec = ModelSpec.from_hf_config(config.to_dict())
    assert spec.moe.layers == (False, True, False, True)
    T = 64
    pos = torch.arange(T)[None]
    for index in (0, 1):
        layer = Llama4TextDecoderLayer(config, index).to(torch.bfloat16)
        for p in layer.parameters():
            torch.nn.init.normal_(p, std=0.05)
        x = torch.randn(1, T, config.hidden_size, dtype=torch.bfloat16, requires_grad=True)
        freqs = Llama4TextRotaryEmbedding(config)(x, pos)
        saved = _saved_bytes(layer, x, skip=(freqs,), position_embeddings=freqs, attention_mask=None)
        routed = spec.moe.layers[index]
        assert layer.is_moe_layer is routed
        assert saved == T * activation_bytes_per_token_layer(spec, 1, 2, routed=routed)
    # the dense layer keeps its own MLP's 4 I B, of intermediate_size_mlp (96), not the experts' width (32)
    dense = activation_bytes_per_token_layer(spec, 1, 2, routed=False)
    assert dense - activation_bytes_per_token_layer(
        spec, 1, 2, routed=True
    ) == 4 * 96 * 2 - moe_bytes_per_token(spec, 2)


def test_held_bytes_count_each_layer_kind_and_the_router_loss():
    cfg = dict(TINY["qwen3_moe"], model_type="qwen3_moe", router_aux_loss_coef=0.001)
    spec = ModelSpec.from_hf_config(cfg)
    S = 4096
    none = held_activation_bytes(spec, seq_len=S, activation_checkpointing="none")
    dense = activation_bytes_per_token_layer(spec, 1, 2, routed=False)
    routed = activation_bytes_per_token_layer(spec, 1, 2, routed=True)
    assert none["layers"] == (dense + 3 * routed) * S  # layer 0 dense (mlp_only_layers), three sparse
    # every_k=2 checkpoints layers 0 and 2: layer 0 (dense) and layer 2 (sparse) keep their input only
    every2 = held_activation_bytes(spec, seq_len=S, activation_checkpointing="every_k", ac_every_k=2)
    assert every2["layers"] == (2 * routed + 2 * 64 * 2) * S
    # the router loss keeps each sparse layer's logits (bf16) and their fp32 softmax, whatever the checkpointing
    full = held_activation_bytes(spec, seq_len=S, activation_checkpointing="full")
    assert none["router"] == full["router"] == 3 * 8 * (2 + 4) * S
    no_loss = held_activation_bytes(
        ModelSpec.from_hf_config(TINY["qwen3_moe"] | {"model_type": "qwen3_moe"}), seq_len=S
    )
    assert no_loss["router"] == 0


# --- FLOPs, memory, communication ---------------------------------------------------------------------------


def test_flops_and_mfu_use_the_active_parameters():
    spec = load_model_spec("qwen3-30b-a3b")
    h, L, V, E, k, width = 2048, 48, 151936, 128, 8, 768
    attention = 2 * h * 32 * 128 + 2 * h * 4 * 128
    active_matmul = L * (attention + E * h + k * 3 * h * width) + V * h
    assert spec.matmul_params == active_matmul
    S = 32768
    pairs = S * (S + 1) / 2
    expected = 6 * active_matmul * S + 12 * L * 32 * 128 * pairs
    assert model_flops_per_token(spec, S) * S == pytest.approx(expected, rel=1e-12)
    assert model_flops_per_token(spec, S) * S == training_flops(
        matmul_params=active_matmul, num_layers=L, num_heads=32, head_dim=128, document_lengths=[[S]]
    )
    # counting every expert would take the matmul FLOPs 9x higher: MFU would flatter the MoE
    assert 6 * (spec.num_params - spec.embedding_params) > 9 * 6 * active_matmul
    t = compute_time(spec, H100, seq_len=S, ulysses_degree=1, ring_degree=8)
    assert t["dense_s"] == pytest.approx(
        6 * active_matmul * S / 8 / (H100.peak_flops * H100.dense_efficiency)
    )


def test_llama4_time_counts_the_experts_that_run_and_mfu_the_active_ones():
    """transformers' Llama 4 runs every expert on every token: the compute time counts those matmuls (checked
    against torch's FLOP counter on the tiny model), the model FLOPs and MFU only the active ones."""
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import AutoModelForCausalLM

    config = _llama4_text_config(attention_chunk_size=None)
    config._attn_implementation = "eager"
    spec = ModelSpec.from_hf_config(config.to_dict())
    h, E, k, width = 64, 4, 2, 32
    assert spec.idle_expert_matmul_params == 2 * (E - k) * 3 * h * width  # two MoE layers
    assert spec.executed_matmul_params == spec.matmul_params + spec.idle_expert_matmul_params
    model = AutoModelForCausalLM.from_config(config)
    T = 16
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(torch.randint(0, 128, (1, T)))
    # the eager attention: Q K^T and P V over all T x T pairs, 4 T^2 H d per layer
    attention = 4 * 4 * T * T * 4 * 16
    assert counter.get_total_flops() == 2 * spec.executed_matmul_params * T + attention
    # the planner's time of the dense part: the executed weights; the model FLOPs: the active ones
    S = 4096
    t = compute_time(spec, H100, seq_len=S, ulysses_degree=1, ring_degree=1)
    assert t["dense_s"] == pytest.approx(
        6 * spec.executed_matmul_params * S / (H100.peak_flops * H100.dense_efficiency)
    )
    assert model_flops_per_token(spec, S) * S == training_flops(
        matmul_params=spec.matmul_params, num_layers=4, num_heads=4, head_dim=16, document_lengths=[[S]]
    )
    # a family with grouped experts executes what it counts
    qwen = load_model_spec("qwen3-30b-a3b")
    assert qwen.executed_matmul_params == qwen.matmul_params and qwen.idle_expert_matmul_params == 0
    # Scout: 15 idle experts of 3 h I_e per layer, run anyway
    scout = load_model_spec("llama4-scout")
    assert scout.executed_matmul_params - scout.matmul_params == 48 * 15 * 3 * 5120 * 8192


def test_memory_and_fsdp_traffic_grow_with_the_total_parameters():
    base = load_model_spec("qwen3-30b-a3b")
    more = ModelSpec.from_hf_config(dict(PRESETS["qwen3-30b-a3b"], num_experts=256), name="256 experts")
    # twice the experts: nearly twice the parameters, the same experts per token (only the router grows)
    assert more.num_params > 1.9 * base.num_params
    assert more.matmul_params - base.matmul_params == 48 * 128 * 2048
    kw = dict(seq_len=2**17, ulysses_degree=1, ring_degree=8, world_size=8, node_size=8, overhead_frac=0.0)
    mb, mm = training_memory(base, H100, **kw), training_memory(more, H100, **kw)
    assert mb.sharded_states == 12 * base.num_params / 8 and mm.sharded_states == 12 * more.num_params / 8
    assert mm.gathered_params > mb.gathered_params  # one layer with all of its experts, gathered
    assert mm.gathered_params - mb.gathered_params >= 2 * 2 * (more.layer_params - base.layer_params)
    fb = fsdp_comm(base, H100, world_size=8, node_size=8, fsdp_mode="full_shard")
    assert fb["fsdp_bytes"] == base.num_params * 7 / 8 * (2 * 2 + 4)
    # the break-even of expert parallelism: one layer's FSDP seconds over its matmul seconds per token
    bal = fsdp_layer_balance(base, H100, seq_len=2**15, world_size=8, node_size=8)
    layer_bytes = base.layer_params * 7 / 8 * 8
    per_token = 6 * base.layer_matmul_params / (H100.peak_flops * H100.dense_efficiency)
    assert bal["fsdp_s"] == pytest.approx(layer_bytes / (450 * GB))
    assert bal["break_even_tokens"] == pytest.approx(layer_bytes / (450 * GB) / per_token)
    # at 32K tokens on one rank each: the matmuls and the causal attention of one layer (model FLOPs at the
    # planner's efficiencies: a 16K-query block is past the kernel's knee)
    t = compute_time(base, H100, seq_len=2**15, ulysses_degree=1, ring_degree=1)
    assert bal["compute_s"] == pytest.approx(per_token * 2**15 + t["attention_s"] / 48)
    assert bal["fsdp_over_compute"] == pytest.approx(bal["fsdp_s"] / bal["compute_s"])
    more_bal = fsdp_layer_balance(more, H100, seq_len=2**15, world_size=8, node_size=8)
    assert more_bal["break_even_tokens"] > 1.9 * bal["break_even_tokens"]
    # across nodes the network carries it: 9x slower than NVLink here, so 9x the tokens to hide it
    nodes = fsdp_layer_balance(base, H100, seq_len=2**15, world_size=16, node_size=8)
    assert nodes["fsdp_s"] == pytest.approx(base.layer_params * 15 / 16 * 8 / (50 * GB))
    # expert parallelism would send each token's 8 copies out and back, forward and backward, instead
    assert bal["ep_bytes"] == 4 * 8 * 2048 * 2 * 7 / 8 * 2**15
    assert (
        fsdp_layer_balance(load_model_spec("llama-3.1-8b"), H100, seq_len=2**15, world_size=8, node_size=8)[
            "ep_bytes"
        ]
        == 0
    )


def test_moe_layouts_use_no_mlp_tiles():
    spec = load_model_spec("mixtral-8x7b")
    with pytest.raises(ValueError, match="mlp_tiles=4.*mixture-of-experts"):
        training_memory(spec, H100, seq_len=2**16, ulysses_degree=8, world_size=8, node_size=8, mlp_tiles=4)
    with pytest.raises(ValueError, match="mixture-of-experts"):
        plan_layouts(spec, H100, seq_len=2**16, world_size=8, node_size=8, mlp_tiles=2)
    layouts = plan_layouts(
        spec, H100, seq_len=2**16, world_size=16, node_size=8, states=("device", "cpu_offload")
    )
    assert layouts and all(e.mlp_tiles == 1 for e in layouts)
    answers = max_seq_lens(load_model_spec("qwen3-30b-a3b"), H100, world_size=8, node_size=8)
    assert all(a.estimate.mlp_tiles == 1 for a in answers)
    assert answers[0].max_seq_len >= 2**20


# --- dense models unchanged ---------------------------------------------------------------------------------


def test_dense_models_are_counted_as_before():
    llama = load_model_spec("llama-3.1-8b")
    assert llama.moe is None and llama.layer_kinds == (False,) * 32
    layer = 4096 * 4096 * 2 + 4096 * 1024 * 2 + 3 * 4096 * 14336 + 2 * 4096
    assert llama.layer_params == llama.params_of_layer(5) == llama.active_layer_params == layer
    assert llama.num_params == llama.active_params == 2 * 128256 * 4096 + 32 * layer + 4096
    assert llama.decoder_params == 32 * layer
    assert llama.matmul_params == 32 * (layer - 2 * 4096) + 128256 * 4096
    assert moe_bytes_per_token(llama) == 0
    held = held_activation_bytes(llama, seq_len=2**16, ulysses_degree=8)
    assert "router" not in held
    assert held["layers"] == 32 * activation_bytes_per_token_layer(llama, 8) * 2**13
    # a MoE family's config with no experts is the dense model of the same shape, figure for figure
    moe_fields = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "mlp_only_layers")
    plain = {k: v for k, v in TINY["qwen3_moe"].items() if k not in moe_fields}
    no_experts = ModelSpec.from_hf_config(dict(TINY["qwen3_moe"], num_experts=0, model_type="qwen3_moe"))
    dense = ModelSpec.from_hf_config(plain)
    assert no_experts.moe is None and dense.moe is None
    kw = dict(seq_len=4096, ulysses_degree=2, ring_degree=2, world_size=8, node_size=8)
    assert training_memory(no_experts, H100, **kw) == training_memory(dense, H100, **kw)
    assert (
        no_experts.matmul_params
        == dense.matmul_params
        == 4 * (2 * 64 * 4 * 16 + 2 * 64 * 2 * 16 + 3 * 64 * 96) + 128 * 64
    )


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "gpt_oss", "llama4_text"])
def test_trainer_flops_count_the_planners_active_matmul_params(family):
    """The trainer's MFU (``usp.train.flops.count_matmul_params`` on the module) and the planner's
    (``ModelSpec.matmul_params`` from the config) count the same active weights: top-k of the experts and the
    router, on the tiny family models of the exactness matrix (a stray ``moe_intermediate_size`` in Mixtral's
    config, which its experts ignore, included; Llama 4's: a dense first layer, a sparse second one with its
    shared expert). The tiny models of ``TINY`` too (test_tiny_moe_counts_match_transformers), whose Llama 4
    has dense and expert widths that differ."""
    import torch
    from transformers import AutoModelForCausalLM

    from tests.family_models import family_config
    from usp.plan.models import load_model_spec
    from usp.train.flops import count_matmul_params

    config = family_config(family)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    dense = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert count_matmul_params(model) == load_model_spec(config.to_dict()).matmul_params > dense
