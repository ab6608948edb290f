"""apply_global_positions: LongRoPE / dynamic NTK and Llama 4 temperature tuning are the unsharded model's.

Tiny random models: Phi-3 (``longrope``, short and long factors far apart, ``original_max_position_embeddings``
16 < the 32-token sequence), PhiMoE (``longrope`` factors and mscales), Llama 4 text (temperature tuning with
``floor_scale`` 4 on its default NoPE layer, chunked attention longer than the sequence) and Llama (``dynamic``
NTK, ``max_position_embeddings`` 16). On 4 gloo ranks under u2r2 (zigzag; also with activation checkpointing),
u4r1, u1r4 (contiguous and zigzag) and balanced packed documents: logits and every parameter gradient against
the unsharded model on the same global ``position_ids``, float64, ``tests.tolerance.EXACT_TOL``; and Llama 4
through ``usp.eval.decode``. Without the hooks the same runs are off by 1e-3 and more (the test can fail; only
Phi-3 under u1r4 zigzag is right by luck: every rank holds a position past 16).
"""

from __future__ import annotations

import types
from unittest import mock

import pytest
import torch
from torch import nn

from tests.exact_model import norms_in_input_dtype
from tests.mesh_cache import cached_sp_mesh
from tests.tolerance import EXACT_DTYPE, assert_exact, reference_scale
from usp.attention.reference import document_mask
from usp.model import apply_usp, global_positions, packed_sequence_kwargs
from usp.model.global_positions import (
    apply_global_positions,
    installed_global_positions,
    needs_global_positions,
)
from usp.parallel import gather_sequence, shard_sequence

SEQ_LEN = 32
DOC_LENGTHS = (20, 5, 7)  # one packed row; the first document is longer than original_max_position_embeddings
LAYOUTS = {
    "u2r2": (2, 2, "zigzag"),
    "u4r1": (4, 1, "zigzag"),
    "u1r4-contiguous": (1, 4, "contiguous"),
    "u1r4": (1, 4, "zigzag"),
    "u1r4-balanced-packed": (1, 4, "balanced"),
    # decoder layers recomputed in backward (usp's activation checkpointing): the hooks run again
    "u2r2-checkpointed": (2, 2, "zigzag"),
}
FAMILIES = ("phi3", "llama4", "phimoe", "dynamic")
CASES = [(f, layout) for f in ("phi3", "llama4") for layout in LAYOUTS] + [
    ("phimoe", "u2r2"),
    ("dynamic", "u2r2"),
]
UNFIXED = [(f, "u2r2") for f in FAMILIES]  # the same runs without the hooks


def _configs() -> dict:
    from transformers import Llama4TextConfig, LlamaConfig, Phi3Config, PhimoeConfig

    shape = dict(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    half = 64 // 4 // 2  # head_dim / 2 factors
    llama4_shape = dict(
        shape,
        head_dim=16,
        intermediate_size=64,
        intermediate_size_mlp=128,
        num_hidden_layers=4,  # layer 3 is NoPE (no_rope_layer_interval 4, the default)
        num_local_experts=2,
        interleave_moe_layer_step=2,  # dense and MoE layers
        max_position_embeddings=256,
        attn_temperature_tuning=True,
        floor_scale=4,
        attn_scale=0.5,
    )
    return {
        "phi3": Phi3Config(
            **shape,
            intermediate_size=128,
            num_hidden_layers=2,
            max_position_embeddings=64,
            original_max_position_embeddings=16,
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "short_factor": [1.0 + 0.05 * i for i in range(half)],
                "long_factor": [3.0 + 2.0 * i for i in range(half)],
            },
        ),
        "llama4": Llama4TextConfig(
            **llama4_shape,
            attention_chunk_size=64,  # longer than the sequence: chunked attention cannot matter
        ),
        # for usp.eval.decode, which decodes full causal attention only: no chunked layer types at all
        "llama4_full": Llama4TextConfig(**llama4_shape, attention_chunk_size=None),
        # Phi-3.5-MoE: its rotary forward also picks long_mscale / short_mscale from max(position_ids)
        "phimoe": PhimoeConfig(
            **shape,
            intermediate_size=64,
            num_hidden_layers=2,
            num_local_experts=2,
            router_jitter_noise=0.0,
            max_position_embeddings=64,
            original_max_position_embeddings=16,
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "short_factor": [1.0 + 0.05 * i for i in range(half)],
                "long_factor": [3.0 + 2.0 * i for i in range(half)],
                "short_mscale": 1.0,
                "long_mscale": 1.5,
                "original_max_position_embeddings": 16,
            },
        ),
        "dynamic": LlamaConfig(
            **shape,
            intermediate_size=128,
            num_hidden_layers=2,
            max_position_embeddings=16,
            rope_parameters={"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0},
        ),
    }


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("global-positions")
    dirs = {}
    for family, config in _configs().items():
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(str(root / family))
        dirs[family] = str(root / family)
    return dirs


def _llama4_norm_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Llama4TextRMSNorm / L2Norm (WeightlessRMSNorm from transformers 5.25) in ``promote_types(input, fp32)`` instead of fp32 (cf. tests.exact_model)."""
    h = x.to(torch.promote_types(x.dtype, torch.float32))
    eps = getattr(self, "variance_epsilon", None) or self.eps  # transformers >= 5.25, older
    out = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return out * self.weight if hasattr(self, "weight") else out


def _load(model_dir: str) -> nn.Module:
    """The checkpoint in float64, sdpa attention, every norm computing in float64."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        model_dir,
        dtype=EXACT_DTYPE,
        attn_implementation="sdpa",
        experts_implementation="eager",  # grouped_mm has no float64
    )
    if model.config.model_type in ("phi3", "llama"):
        assert norms_in_input_dtype(model) > 0  # Llama-style RMSNorm (PhiMoE's LayerNorm keeps float64)
    for m in model.modules():
        if type(m).__name__ in ("Llama4TextRMSNorm", "Llama4TextL2Norm", "Llama4TextWeightlessRMSNorm"):
            m.forward = types.MethodType(_llama4_norm_forward, m)
    model.config.use_cache = False  # as usp.model.load_causal_lm
    return model.eval()  # PhiMoE's router samples in training mode; gradients flow either way


def _batch(vocab: int, packed: bool) -> dict:
    """Two rows 0..31 (``packed=False``), or one row of DOC_LENGTHS documents with restarting positions."""
    g = torch.Generator().manual_seed(3)
    if not packed:
        ids = torch.randint(3, vocab, (2, SEQ_LEN), generator=g)
        return {"ids": ids, "pos": torch.arange(SEQ_LEN).expand(2, -1).clone(), "cu": None}
    ids = torch.randint(3, vocab, (1, SEQ_LEN), generator=g)
    pos = torch.cat([torch.arange(n) for n in DOC_LENGTHS])[None]
    cu = torch.tensor([0, *torch.tensor(DOC_LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    return {"ids": ids, "pos": pos, "cu": cu}


def _weights() -> torch.Tensor:
    # not summing to 0: PhiMoE's final LayerNorm bias gets sum_t w_t x (column sums of lm_head)
    return torch.linspace(-0.5, 1, SEQ_LEN, dtype=EXACT_DTYPE)[None, :, None]  # [1, S, 1]


def sharded_runs(cases: list[tuple[str, str, str, bool]]) -> list[dict] | None:
    """Worker: per ``(model_dir, family, layout, hooked)``, the sharded forward + backward of
    ``sum(logits * w)``; rank 0 returns the gathered logits, the summed gradients and what was installed."""
    results = []
    for model_dir, _family, layout, hooked in cases:
        ulysses, ring, ring_layout = LAYOUTS[layout]
        mesh = cached_sp_mesh(ulysses, ring, ring_layout, 1)
        if hooked:  # apply_usp may install them itself: the second call must then install nothing
            model = apply_usp(_load(model_dir), mesh)
            apply_global_positions(model, mesh)
        else:
            with mock.patch.object(global_positions, "apply_global_positions", lambda model, mesh: []):
                model = apply_usp(_load(model_dir), mesh)
        if layout.endswith("checkpointed"):
            from usp.train.parallelize import apply_activation_checkpointing

            apply_activation_checkpointing(model.model.layers, "full")
        hooks = sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())
        again = apply_global_positions(model, mesh) if hooked else []
        again_hooks = sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())
        installed = installed_global_positions(model)
        b = _batch(model.config.vocab_size, packed=layout.endswith("packed"))
        cu = b["cu"]
        logits = model(
            input_ids=shard_sequence(b["ids"], mesh, cu_seqlens=cu),
            position_ids=shard_sequence(b["pos"], mesh, cu_seqlens=cu),
            **packed_sequence_kwargs(cu),
        ).logits
        (logits * shard_sequence(_weights(), mesh, cu_seqlens=cu)).sum().backward()
        grads = {}
        for name, p in model.named_parameters():
            g = p.grad.clone()
            torch.distributed.all_reduce(g, group=mesh.sp_group)  # each rank holds its slice's share
            grads[name] = g
        results.append(
            {
                "logits": gather_sequence(logits.detach(), mesh, cu_seqlens=cu),
                "grads": grads,
                "installed": installed,
                "again": again,
                "same_hooks": hooks == again_hooks,
            }
        )
    return results if torch.distributed.get_rank() == 0 else None


def _reference(model_dir: str, packed: bool) -> dict:
    """The unsharded model on the whole batch (documents masked by a dense 4-D mask when packed)."""
    model = _load(model_dir)
    b = _batch(model.config.vocab_size, packed)
    mask = None
    if packed:
        mask = document_mask(b["cu"], SEQ_LEN, causal=True, device=torch.device("cpu"))[None, None]
    logits = model(input_ids=b["ids"], position_ids=b["pos"], attention_mask=mask).logits
    (logits * _weights()).sum().backward()
    return {"logits": logits.detach(), "grads": {n: p.grad for n, p in model.named_parameters()}}


@pytest.fixture(scope="module")
def runs(dist_pools, checkpoints) -> dict:
    """Every case (and the unhooked ones) in one pool call."""
    todo = [(checkpoints[f], f, layout, True) for f, layout in CASES]
    todo += [(checkpoints[f], f, layout, False) for f, layout in UNFIXED]
    out = dist_pools(4).run(sharded_runs, todo)[0]
    return {(f, layout, hooked): r for (_, f, layout, hooked), r in zip(todo, out)}


@pytest.fixture(scope="module")
def references(checkpoints) -> dict:
    wanted = {(f, layout.endswith("packed")) for f, layout in CASES + UNFIXED}
    return {(f, packed): _reference(checkpoints[f], packed) for f, packed in wanted}


@pytest.mark.parametrize("family, layout", CASES, ids=[f"{f}-{layout}" for f, layout in CASES])
def test_logits_and_grads_match_unsharded(runs, references, family, layout):
    out = runs[family, layout, True]
    ref = references[family, layout.endswith("packed")]
    assert_exact(out["logits"], ref["logits"], f"{family} {layout} logits")
    for name, g in ref["grads"].items():
        assert_exact(out["grads"][name], g, f"{family} {layout} {name}")
    assert out["installed"] == needs_global_positions(_configs()[family])
    assert out["again"] == [] and out["same_hooks"]  # idempotent


@pytest.mark.parametrize("family, layout", UNFIXED, ids=[f"{f}-{layout}" for f, layout in UNFIXED])
def test_without_hooks_the_sharded_model_differs(runs, references, family, layout):
    out = runs[family, layout, False]
    ref = references[family, False]
    assert out["installed"] == []
    # 1e5 x the exactness tolerance (measured: 2e-3 to 1e-2 of the largest logit)
    assert (out["logits"] - ref["logits"]).abs().max() > 1e-4 * reference_scale(ref["logits"])


def test_needs_global_positions_reads_the_config():
    configs = _configs()
    assert needs_global_positions(configs["phi3"]) == ["longrope"]
    assert needs_global_positions(configs["phimoe"]) == ["longrope"]
    assert needs_global_positions(configs["dynamic"]) == ["dynamic_rope"]
    assert needs_global_positions(configs["llama4"]) == ["attn_temperature_tuning"]
    configs["llama4"].attn_temperature_tuning = False
    assert needs_global_positions(configs["llama4"]) == []
    from transformers import LlamaConfig

    assert needs_global_positions(LlamaConfig(hidden_size=64, num_attention_heads=4)) == []


PROMPT, NEW = 13, 6  # 8 prefilled (a multiple of 2 x ring x ulysses), 5 decoded prompt tokens, 6 generated


def decode_run(model_dir: str) -> dict | None:
    """Worker: usp.eval.decode of the tiny Llama 4 under u2r2 with the hooks; rank 0 returns tokens and logits."""
    from usp.eval.decode import decode

    mesh = cached_sp_mesh(2, 2, "zigzag", 1)
    model = apply_usp(_load(model_dir), mesh)
    apply_global_positions(model, mesh)
    # Llama4ForCausalLM.get_decoder() returns the whole LM (transformers 5.24: its base_model_prefix
    # "language_model" names no attribute); decode needs the text model, whose output has last_hidden_state
    model.get_decoder = lambda: model.model
    prompt = _batch(model.config.vocab_size, packed=False)["ids"][:, :PROMPT]
    res = decode(model, prompt, mesh, NEW, keep_logits=True)
    return {"tokens": res.tokens, "logits": res.logits} if torch.distributed.get_rank() == 0 else None


def test_decode_uses_global_token_indices(dist_pools, checkpoints):
    """The decode steps' temperature scales use the token's index in the sequence, as one forward over the
    prompt and the generated tokens does."""
    out = dist_pools(4).run(decode_run, checkpoints["llama4_full"])[0]
    model = _load(checkpoints["llama4_full"])
    prompt = _batch(model.config.vocab_size, packed=False)["ids"][:, :PROMPT]
    ids = torch.cat([prompt, out["tokens"][:, :-1]], dim=1)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[:, PROMPT - 1 :]
    assert_exact(out["logits"], logits, "decode logits")
