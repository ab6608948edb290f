"""The planner on hybrid models (:mod:`usp.plan.mixers`): counts against transformers' own modules, FLOPs
against torch's FLOP counter, kept bytes against autograd, and what the estimate does with mixer layers.

Single process, no gloo world: the bytes the head all-to-all sends are checked against ``record_comm`` in
``tests/test_mixers.py::test_mixer_bytes_are_counted``.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.family_models import family_config
from usp.plan import evaluate_layout, get_device, load_model_spec
from usp.plan.comm import ulysses_comm
from usp.plan.memory import held_activation_bytes
from usp.plan.mixers import GATED_DELTANET, MAMBA2, SHORT_CONV, UNMODELLED_HYBRIDS

NOT_COUNTED = ("q_norm.weight", "k_norm.weight", "q_layernorm.weight", "k_layernorm.weight", "_proj.bias")
"""What the planner leaves out (as in ``tests/test_plan_moe.py``; LFM2 spells its q/k norms ``*_layernorm``)."""
HYBRIDS = {"qwen3_next": GATED_DELTANET, "qwen3_5_text": GATED_DELTANET, "bamba": MAMBA2, "lfm2": SHORT_CONV}


def _meta(config):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def _counted(module: torch.nn.Module) -> int:
    return sum(p.numel() for n, p in module.named_parameters() if not n.endswith(NOT_COUNTED))


@pytest.mark.parametrize("family", sorted(HYBRIDS))
def test_hybrid_counts_match_transformers(family):
    """Total, per-layer and matmul parameters of each modelled family equal its module's, layer by layer
    (mixer layers, attention layers with Qwen's output gate, dense and MoE MLPs); the trainer's MFU count
    (``count_matmul_params``) is the planner's."""
    from usp.train.flops import count_matmul_params

    config = family_config(family)
    model = _meta(config)
    spec = load_model_spec(config.to_dict())
    assert spec.mixer is not None and spec.mixer.kind == HYBRIDS[family]
    assert spec.num_params == _counted(model)
    for i, layer in enumerate(model.model.layers):
        assert spec.params_of_layer(i) == _counted(layer), i
    assert spec.layer_params == max(_counted(layer) for layer in model.model.layers)
    assert spec.matmul_params == count_matmul_params(model)
    assert spec.num_attention_layers == sum(not m for m in spec.mixer.layers) > 0


def test_a_config_json_without_layer_types_is_read_as_its_family_derives_it():
    """Bamba's ``config.json`` lists its attention layers (``attn_layer_indices``), not ``layer_types``:
    the planner derives the layer kinds as ``BambaConfig`` does instead of taking every layer for attention."""
    raw = {k: v for k, v in family_config("bamba").to_dict().items() if k != "layer_types"}
    raw |= {"num_hidden_layers": 6, "attn_layer_indices": [2, 5]}
    spec = load_model_spec(raw)
    assert spec.mixer.layers == (True, True, False, True, True, False)


def test_the_qwen3_next_preset_is_the_published_model():
    """``qwen3-next-80b-a3b``: the module transformers builds from it has the planner's count, which is the
    published 80B total and 3B active (without the embedding and the LM head)."""
    from transformers import AutoConfig

    from usp.plan.models import PRESETS

    preset = dict(PRESETS["qwen3-next-80b-a3b"])
    spec = load_model_spec("qwen3-next-80b-a3b")
    model = _meta(AutoConfig.for_model(**preset))
    assert spec.num_params == _counted(model)
    assert abs(spec.num_params / 80e9 - 1) < 0.01
    active = spec.active_params - spec.embedding_params - spec.head_params
    assert abs(active / 3e9 - 1) < 0.1
    assert spec.num_attention_layers == 12 and spec.mixer.scheme(16) == "heads"
    assert spec.mixer.scheme(32) == "gather"  # 16 key heads: more ranks than heads


def test_the_bamba_preset_is_the_published_model():
    """``bamba-9b`` from its ``config.json`` fields (no ``layer_types``: ``attn_layer_indices``): the module
    transformers builds has the planner's count, the model card's 9.78B; 29 Mamba2 layers, 3 attention."""
    from transformers import AutoConfig

    from usp.plan.models import PRESETS

    spec = load_model_spec("bamba-9b")
    assert spec.num_params == _counted(_meta(AutoConfig.for_model(**PRESETS["bamba-9b"])))
    assert round(spec.num_params / 1e9, 2) == 9.78
    assert spec.num_attention_layers == 3 and spec.mixer.kind == MAMBA2
    assert spec.mixer.scheme(8) == "heads" and spec.mixer.scheme(3) == "gather"  # 128 heads in 1 group


def test_the_lfm2_preset_is_the_published_model():
    """``lfm2-1.2b``: 10 short-convolution layers and 6 attention layers, the MLP width LFM2 derives from its
    ``intermediate_size`` (8192 of 12288), tied embeddings: the module's count, the model card's 1.17B."""
    from transformers import AutoConfig

    from usp.plan.models import PRESETS

    spec = load_model_spec("lfm2-1.2b")
    assert spec.num_params == _counted(_meta(AutoConfig.for_model(**PRESETS["lfm2-1.2b"])))
    assert round(spec.num_params / 1e9, 2) == 1.17 and spec.intermediate_size == 8192
    assert spec.num_attention_layers == 6 and spec.mixer.scheme(64) == "halo"


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5_text", "lfm2"])
def test_mixer_flops_match_the_flop_counter_match_the_flop_counter(family):
    """Forward FLOPs per token of a gated DeltaNet (transformers' torch code, which torch's FLOP counter
    sees): the projections' ``2 x`` matmul weights plus the convolution and the chunked rule, less the
    triangular solve the counter does not count. The slope between two lengths (the convolution's padding is
    per call)."""
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import AutoModelForCausalLM

    from usp.model.mixers import mixer_modules

    config = family_config(family)
    torch.manual_seed(0)
    mixer = mixer_modules(AutoModelForCausalLM.from_config(config, dtype=torch.float32))[0][1]
    m, h = load_model_spec(config.to_dict()).mixer, config.hidden_size
    flops = []
    for tokens in (128, 256):
        with FlopCounterMode(display=False) as counter:
            mixer(torch.randn(1, tokens, h))
        flops.append(counter.get_total_flops())
    solve = m.heads * m.chunk * (m.key_dim + m.head_dim) if m.kind == GATED_DELTANET else 0
    assert (flops[1] - flops[0]) / 128 == 2 * m.matmul_params(h) + m.scan_flops_per_token() - solve


def _kept_per_token(mixer: torch.nn.Module, hidden: int) -> float:
    """Bytes autograd keeps per token for ``mixer``'s forward in bf16 (its input aside: the norm's output,
    counted with the norms), the slope between 128 and 256 tokens."""

    def kept(tokens: int) -> int:
        x = torch.randn(1, tokens, hidden, dtype=torch.bfloat16, requires_grad=True)
        storages: dict[int, int] = {}

        def pack(t):
            if t.data_ptr() != x.data_ptr():
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            mixer(x)
        return sum(storages.values())

    return (kept(256) - kept(128)) / 128


def test_short_conv_kept_bytes_match_autograd():
    """LFM2's short convolution keeps ``6 h B`` per token: B, C, x (one projection), the convolution's input
    and output and the output projection's input."""
    from transformers import AutoModelForCausalLM

    from usp.model.mixers import mixer_modules

    config = family_config("lfm2")
    torch.manual_seed(0)
    mixer = mixer_modules(AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16))[0][1]
    m = load_model_spec(config.to_dict()).mixer
    assert _kept_per_token(mixer, config.hidden_size) == m.kept_bytes_per_token(4, config.hidden_size, 2)


def test_gated_deltanet_kept_bytes_match_autograd(monkeypatch):
    """What a gated DeltaNet keeps for backward per token, in bf16, equals the planner's figure less the
    fused kernels' own saves: transformers' torch convolution and chunked rule are replaced by recomputing
    stand-ins that keep their inputs only, as the fused kernels do (their extras, flash-linear-attention's q/k
    norms and chunk matrix, are the formula's ``8 Hk + 64 B Hv``: a GPU measures them)."""
    import transformers.models.qwen3_next.modeling_qwen3_next as family
    from torch.utils.checkpoint import checkpoint
    from transformers import AutoModelForCausalLM

    from usp.model.mixers import mixer_modules

    conv, rule = family.causal_conv1d_forward, family.torch_chunk_gated_delta_rule

    def conv_inputs_only(module, x, *args, **kwargs):
        return checkpoint(lambda t: conv(module, t, *args, **kwargs), x, use_reentrant=False)

    def rule_inputs_only(q, k, v, g, beta, **kwargs):
        def run(*t):
            return rule(*t[:3], g=t[3], beta=t[4], **kwargs)

        return checkpoint(run, q, k, v, g, beta, use_reentrant=False)

    monkeypatch.setattr(family, "causal_conv1d_forward", conv_inputs_only)
    monkeypatch.setattr(family, "torch_chunk_gated_delta_rule", rule_inputs_only)
    config = family_config("qwen3_next")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    mixer, h = mixer_modules(model)[0][1], config.hidden_size
    m = load_model_spec(config.to_dict()).mixer
    kernel_extras = 8 * m.key_heads + 64 * 2 * m.heads
    assert _kept_per_token(mixer, h) == m.kept_bytes_per_token(1, h, 2) - kernel_extras


def test_the_estimate_counts_mixer_layers_apart_from_attention():
    """On Qwen3-Next-80B: the all-to-alls run in the 12 attention layers only (a quarter of an all-attention
    model's), the mixer's time grows linearly with the length on the heads scheme, the gather (32 ranks, 16
    key heads) costs more time and memory per rank than the heads scheme would, and the held activations
    add up layer by layer."""
    spec = load_model_spec("qwen3-next-80b-a3b")
    device = get_device("h200")
    from dataclasses import replace

    attention_only = replace(spec, mixer=None)
    kw = dict(seq_len=65536, ulysses_degree=8, ring_degree=2, compute_bytes=2)
    assert ulysses_comm(spec, device, **kw)["ulysses_bytes"] * 4 == pytest.approx(
        ulysses_comm(attention_only, device, **kw)["ulysses_bytes"]
    )
    layout = dict(world_size=16, node_size=8, activation_checkpointing="full")
    short = evaluate_layout(spec, device, seq_len=65536, ulysses_degree=8, ring_degree=2, **layout)
    long = evaluate_layout(spec, device, seq_len=131072, ulysses_degree=8, ring_degree=2, **layout)
    assert short.mixer_scheme == "heads" and short.to_dict()["mixer_scheme"] == "heads"
    assert long.time_s["mixer_s"] == pytest.approx(2 * short.time_s["mixer_s"])
    assert long.time_s["mixer_comm_s"] == pytest.approx(2 * short.time_s["mixer_comm_s"])
    wide = dict(world_size=32, node_size=8, activation_checkpointing="full")
    gathered = evaluate_layout(spec, device, seq_len=131072, ulysses_degree=8, ring_degree=4, **wide)
    assert gathered.mixer_scheme == "gather"
    # per rank, the gather runs the whole sequence: more scan time than the heads scheme on half the ranks
    assert gathered.time_s["mixer_s"] > long.time_s["mixer_s"]
    held = held_activation_bytes(spec, seq_len=65536, ulysses_degree=8, ring_degree=2, compute_bytes=2)
    from usp.plan.memory import activation_bytes_per_token_layer

    per_layer = sum(
        activation_bytes_per_token_layer(spec, 8, 2, routed=r, mixer=m, sp_degree=16)
        for r, m in spec.layer_keys
    )
    assert held["layers"] == pytest.approx(per_layer * 65536 / 16)
    mixer_layer = activation_bytes_per_token_layer(spec, 8, 2, routed=True, mixer=True, sp_degree=32)
    assert mixer_layer > activation_bytes_per_token_layer(spec, 8, 2, routed=True, mixer=True, sp_degree=16)


@pytest.mark.parametrize("family", ["falcon_h1", "nemotron_h", "jamba", "lfm2_moe"])
def test_unmodelled_hybrids_are_refused_not_estimated(family):
    """A hybrid family whose layers the planner does not describe gets a ``ValueError`` naming the family and
    the fix, never an estimate that counts its mixers as attention."""
    with pytest.raises(ValueError, match=rf"{family}.*parallel.ulysses_degree"):
        load_model_spec(family_config(family).to_dict())
    assert family in UNMODELLED_HYBRIDS


def test_lora_and_mlp_tiles_on_a_hybrid_are_refused():
    spec = load_model_spec("qwen3-next-80b-a3b")
    device = get_device("h200")
    layout = dict(seq_len=65536, ulysses_degree=8, ring_degree=1, world_size=8, node_size=8)
    with pytest.raises(ValueError, match="parallel.mlp_tiles=4"):
        evaluate_layout(spec, device, mlp_tiles=4, **layout)
    from usp.plan import LoraPlan

    with pytest.raises(ValueError, match="model.lora.rank"):
        evaluate_layout(spec, device, lora=LoraPlan(rank=16), **layout)


def test_inference_planning_refuses_hybrids():
    """usp refuses sharded generation for hybrids, so ``usp-plan --inference`` has no layout to give."""
    from usp.plan import plan_inference

    with pytest.raises(ValueError, match="hybrid model"):
        plan_inference(
            load_model_spec("bamba-9b"), get_device("h200"), seq_len=8192, world_size=8, node_size=8
        )


def test_usp_plan_json_on_the_hybrid_preset(capsys):
    """``usp-plan --json`` on the Qwen3-Next preset: every row names its mixer scheme and times the mixer."""
    from usp.plan import cli

    args = ["--model", "qwen3-next-80b-a3b", "--seq-len", "131072", "--nodes", "4", "--gpu", "h200"]
    assert cli.main([*args, "--json", "--top", "3"]) == 0
    out = json.loads(capsys.readouterr().out)
    rows = out["layouts"] if isinstance(out, dict) else out
    assert rows and all(r["mixer_scheme"] in ("heads", "gather") for r in rows)
    assert all(r["time_s"]["mixer_s"] > 0 for r in rows)


def test_usp_launch_checks_a_hybrid_recipes_memory(tmp_path):
    """``usp-launch``'s memory check gives the hybrid recipe the figure its comment quotes; with LoRA (not
    modelled on mixer layers) it says why it has no figure instead of failing the launch."""
    import re
    from pathlib import Path

    from usp.config.compose import compose_config
    from usp.launch import preflight
    from usp.plan.models import PRESETS

    (tmp_path / "config.json").write_text(json.dumps(PRESETS["qwen3-next-80b-a3b"]))
    base = ["recipe=qwen3_next_80b_a3b_1m", f"model.path={tmp_path}", "data.prepared_path=/d"]
    note = preflight.check_memory(compose_config(base), world_size=64, local_world_size=8)
    figure = re.search(r"estimates (\d+\.\d) GiB", note).group(1)
    recipe = Path(__file__).resolve().parents[1] / "recipes" / "qwen3_next_80b_a3b_1m.yaml"
    assert f"{figure} GiB/GPU" in recipe.read_text()
    lora = compose_config([*base, "model.lora.rank=8"])
    assert preflight.check_memory(lora, world_size=64, local_world_size=8) is None
    assert "LoRA on mixer layers is not modelled" in preflight.memory_skipped_reason(lora)
