"""The model's own LM-head transforms (softcap, logit scales, a padded vocab) inside usp's chunked losses.

usp's losses run ``lm_head`` chunk by chunk and skip the model's ``ForCausalLM.forward``, so they must apply
the transform that forward applies (:func:`usp.model.lm_head_transform`). For a tiny random model of every
family with such a transform (transformers' own classes, float64, the transform set far from the identity
and ``lm_head`` weights large enough that the logits reach the softcap): the trainer's loss and its parameter
gradients equal the cross-entropy of the model's own logits (exact) and ``model(ids, labels=...).loss`` (which
transformers computes in fp32: the fp32 rounding rule); :func:`usp.eval.token_losses` equals the per-token
cross-entropy of the model's logits. Without the transform every comparison misses by about 10 nats.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

from tests.tolerance import EXACT_DTYPE, assert_close_scaled, assert_exact, rounding_tolerance
from usp.model import LMHeadTransform, lm_head_transform
from usp.train.loss import ChunkedCausalLMLoss, chunked_cross_entropy_sum

SHAPE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=256,
    tie_word_embeddings=False,
)
TARGET_VOCAB = 200  # token ids in [0, 200): below Inkling's unpadded vocab
# model_type -> the transform's fields, far from the identity (one model per distinct form of transform)
FAMILIES: dict[str, dict] = {
    "gemma2": dict(final_logit_softcapping=5.0),
    "gemma3_text": dict(final_logit_softcapping=5.0),
    "vaultgemma": dict(final_logit_softcapping=5.0),
    "nanochat": dict(final_logit_softcapping=5.0),
    "granite": dict(logits_scaling=4.0),
    "granitemoe": dict(logits_scaling=4.0, num_local_experts=4, num_experts_per_tok=2),
    "cohere": dict(logit_scale=0.25),
    "cohere2": dict(logit_scale=0.25),
    "hyperclovax": dict(logits_scaling=0.25),  # multiplies (Granite divides)
    # divides the hidden states by hidden_size / dim_model_base = 4 before its bias-free lm_head
    "minicpm3": dict(
        dim_model_base=16,
        num_key_value_heads=4,
        kv_lora_rank=16,
        q_lora_rank=32,
        qk_nope_head_dim=8,
        qk_rope_head_dim=8,
        v_head_dim=16,
    ),
    # divides the hidden states by 4, then keeps the first 200 of 256 logits
    "inkling_text": dict(
        logits_mup_width_multiplier=4.0,
        unpadded_vocab_size=TARGET_VOCAB,
        swa_num_attention_heads=4,
        swa_num_key_value_heads=2,
        swa_head_dim=16,
        moe_intermediate_size=32,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        rel_extent=32,
        sliding_window_size=8,
    ),
}
B, S = 2, 16


def build_tiny(model_type: str) -> torch.nn.Module:
    """A tiny random float64 causal LM of ``model_type`` with :data:`FAMILIES`' transform; logits of order 10."""
    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, **{**SHAPE, **FAMILIES[model_type]})
    model = AutoModelForCausalLM.from_config(
        config, attn_implementation="eager", experts_implementation="eager", dtype=EXACT_DTYPE
    )
    with torch.no_grad():
        model.get_output_embeddings().weight.normal_(0.0, 1.0)  # |logits| ~ 8: past the softcap of 5
    return model.eval()


def _ids() -> torch.Tensor:
    return torch.randint(0, TARGET_VOCAB, (B, S), generator=torch.Generator().manual_seed(1))


def _reference_token_losses(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """``[B, S - 1]`` cross-entropy of the model's own (transformed) logits against the next tokens."""
    logits = model(input_ids=ids).logits[:, :-1]  # [B, S - 1, V']
    assert logits.dtype == EXACT_DTYPE
    return F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten(), reduction="none").view(B, S - 1)


# --- the transform read from configs ------------------------------------------------------------------------
@pytest.mark.parametrize(
    "config", [LlamaConfig(), AutoConfig.for_model("qwen3"), AutoConfig.for_model("mistral")]
)
def test_llama_family_is_the_identity(config):
    t = lm_head_transform(config)
    assert t.is_identity and t == LMHeadTransform()


@pytest.mark.parametrize(
    "model_type, fields, cap, scale, vocab_limit",
    [
        ("gemma2", {"final_logit_softcapping": 5.0}, 5.0, 1.0, None),
        ("gemma3", {"text_config": {"final_logit_softcapping": 5.0}}, 5.0, 1.0, None),  # multimodal
        ("gemma4", {"text_config": {"final_logit_softcapping": 5.0}}, 5.0, 1.0, None),
        (
            "paligemma",
            {"text_config": {"model_type": "gemma2", "final_logit_softcapping": 7.0}},
            7.0,
            1.0,
            None,
        ),
        ("beam", {"final_logit_softcapping": 5.0}, 5.0, 1.0, None),
        ("mistral_large4", {"text_config": {"final_logit_softcapping": 5.0}}, 5.0, 1.0, None),
        ("recurrent_gemma", {"logits_soft_cap": 5.0}, 5.0, 1.0, None),
        ("xlstm", {"output_logit_soft_cap": 5.0}, 5.0, 1.0, None),
        (
            "muse_spark",
            {"text_config": {"output_multiplier": 0.5, "final_logit_softcapping": 20.0}},
            20.0,
            0.5,
            None,
        ),
        ("granite", {"logits_scaling": 4.0}, None, 0.25, None),
        ("granitemoehybrid", {"logits_scaling": 4.0}, None, 0.25, None),
        ("granite_docling", {"text_config": {"logits_scaling": 8.0}}, None, 0.125, None),
        ("hyperclovax", {"logits_scaling": 4.0}, None, 4.0, None),
        ("minicpm3", {"hidden_size": 64, "num_attention_heads": 4, "dim_model_base": 16}, None, 0.25, None),
        ("cohere", {"logit_scale": 0.25}, None, 0.25, None),
        ("cohere2_moe", {"logit_scale": 0.25}, None, 0.25, None),
        ("cohere_compass", {"text_config": {"logit_scale": 0.25}}, None, 0.25, None),
        ("falcon_h1", {"lm_head_multiplier": 0.5}, None, 0.5, None),
        ("inkling_text", {"logits_mup_width_multiplier": 4.0, "unpadded_vocab_size": 200}, None, 0.25, 200),
        ("inkling2_text", {"final_logit_softcapping": 5.0, "unpadded_vocab_size": 300}, 5.0, 1.0, 300),
        ("mpt", {"logit_scale": 0.5}, None, 1.0, None),  # transformers' MPT ignores its logit_scale
        ("cohere_compass", {}, None, 1.0, None),  # logit_scale None: none
    ],
)
def test_transform_read_from_config(model_type, fields, cap, scale, vocab_limit):
    t = lm_head_transform(AutoConfig.for_model(model_type, **fields))
    assert (t.final_softcap, t.scale, t.vocab_limit) == (cap, scale, vocab_limit)
    assert t.is_identity == (cap is None and scale == 1.0 and vocab_limit is None)


@pytest.mark.parametrize("model_type", ["dory", "chameleon"])
def test_heads_no_transform_reproduces_are_refused(model_type):
    with pytest.raises(ValueError, match=f"cannot reproduce a '{model_type}' model's logits"):
        lm_head_transform(AutoConfig.for_model(model_type))


@pytest.mark.parametrize(
    "model_type, fields, match",
    [
        ("gemma2", {"final_logit_softcapping": 0.0}, "final_logit_softcapping=0.0 must be > 0"),
        ("granite", {"logits_scaling": 0.0}, "logits_scaling=0.0 must be a finite non-zero number"),
    ],
)
def test_bad_config_values_name_the_field(model_type, fields, match):
    with pytest.raises(ValueError, match=match):
        lm_head_transform(AutoConfig.for_model(model_type, **fields))


def test_apply_scales_then_caps_the_kept_vocab():
    x = torch.randn(3, 5, dtype=EXACT_DTYPE, requires_grad=True)
    got = LMHeadTransform(final_softcap=2.0, scale=3.0, vocab_limit=4).apply(x)
    assert_exact(got, 2.0 * torch.tanh(3.0 * x[:, :4] / 2.0))
    got.sum().backward()  # differentiable
    assert x.grad is not None and bool((x.grad[:, 4] == 0).all())


def test_identity_transform_changes_nothing():
    g = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(2, 9, 16, generator=g), torch.randn(50, 16, generator=g)
    labels = torch.randint(0, 50, (2, 9), generator=g)
    plain = chunked_cross_entropy_sum(hidden, weight, labels, chunk_size=4)
    same = chunked_cross_entropy_sum(hidden, weight, labels, chunk_size=4, transform=LMHeadTransform())
    assert torch.equal(plain, same)  # bit-identical: the identity is skipped


# --- the trainer's loss and gradients vs the model's own ----------------------------------------------------
@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_trainer_loss_and_gradients_equal_the_models_own(model_type):
    model = build_tiny(model_type)
    assert not lm_head_transform(model.config).is_identity
    ids = _ids()
    hf_labels = ids.clone()
    hf_labels[0, 4:7] = -100  # some tokens without a target
    labels = torch.full_like(ids, -100)
    labels[:, :-1] = hf_labels[:, 1:]  # usp's labels: shifted on the global sequence
    n = int((labels != -100).sum())
    params = [p for p in model.parameters() if p.requires_grad]

    loss = ChunkedCausalLMLoss(model, chunk_size=5)(
        ids, labels, position_ids=torch.arange(S).expand(B, -1), num_targets=n
    )
    grads = torch.autograd.grad(loss, params, allow_unused=True)

    logits = model(input_ids=ids).logits  # the model's own forward, transform included, float64
    ref = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum") / n
    ref_grads = torch.autograd.grad(ref, params, allow_unused=True)
    assert_exact(loss, ref, f"{model_type} loss")
    for (name, _), a, b in zip(model.named_parameters(), grads, ref_grads):
        assert (a is None) == (b is None), name
        if a is not None:  # (Inkling keeps its conv weights in fp32: their gradients round to fp32)
            tol = rounding_tolerance(a.dtype, B * S)  # float64: EXACT_TOL; fp32: a sum over the tokens
            assert_close_scaled(a, b, tol, f"{model_type} gradient of {name}")

    with torch.no_grad():
        hf = model(input_ids=ids, labels=hf_labels).loss  # transformers' loss: fp32 log-softmax
    tol = rounding_tolerance(torch.float32, logits.size(-1))
    assert_close_scaled(loss.detach().to(hf.dtype), hf, tol, f"{model_type} vs model(..., labels=...).loss")


# --- token_losses (one rank: the loss path, not the sharded attention) --------------------------------------
def token_losses_worker(model_types: list[str]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Worker (world 1): ``{model_type: (token_losses, reference [B, S - 1])}``."""
    from tests.mesh_cache import cached_sp_mesh
    from usp.eval import token_losses

    mesh = cached_sp_mesh(1, 1)
    out = {}
    for model_type in model_types:
        model = build_tiny(model_type)
        ids = _ids()
        with torch.no_grad():
            out[model_type] = (
                token_losses(model, ids, mesh, chunk_size=7),
                _reference_token_losses(model, ids),
            )
    return out


def test_token_losses_equal_the_models_own(dist_pools):
    results = dist_pools(1).run(token_losses_worker, list(FAMILIES))[0]
    for model_type, (got, ref) in results.items():
        assert got.shape == (B, S) and got.dtype == EXACT_DTYPE
        assert_exact(got[:, :-1], ref, f"{model_type} token losses")
        assert bool((got[:, -1] == 0).all()), f"{model_type}: the last column has no target"
