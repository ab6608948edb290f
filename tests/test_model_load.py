"""Loading local checkpoints: clear errors for bad dirs, RoPE overrides in both spellings, dtype."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaConfig

from tests.exact_model import whole
from usp.model import (
    apply_rope_overrides,
    check_heads,
    check_model_dir,
    load_causal_lm,
    parse_dtype,
    rope_settings,
)
from usp.tiny import build_tiny_llama


def test_bad_model_dirs(tmp_path, tiny_llama):
    with pytest.raises(ValueError, match="model.path is not set"):
        check_model_dir("???")
    with pytest.raises(ValueError, match="does not exist"):
        check_model_dir(tmp_path / "missing")
    with pytest.raises(ValueError, match="has no config.json"):
        check_model_dir(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json could not be read"):
        check_model_dir(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert", "hidden_size": 8}))
    with pytest.raises(ValueError, match="(?s)no 'bert' model.*config.json: transformers cannot build"):
        check_model_dir(tmp_path)
    (tmp_path / "config.json").write_text(
        (__import__("pathlib").Path(tiny_llama) / "config.json").read_text()
    )
    with pytest.raises(ValueError, match="no weight files"):
        check_model_dir(tmp_path)
    assert check_model_dir(tiny_llama).model_type == "llama"


def test_rope_overrides_both_spellings():
    config = LlamaConfig(hidden_size=64, num_attention_heads=4)
    apply_rope_overrides(
        config, rope_theta=8e6, rope_scaling={"type": "linear", "factor": 4.0}, max_position_embeddings=65536
    )
    assert rope_settings(config) == {"rope_theta": 8e6, "rope_type": "linear", "factor": 4.0}
    assert config.max_position_embeddings == 65536

    class Legacy:  # transformers 4.x: top-level rope_theta / rope_scaling
        rope_theta = 5e5
        rope_scaling = None

    legacy = apply_rope_overrides(
        Legacy(), rope_theta=1e6, rope_scaling={"rope_type": "llama3", "factor": 8.0}
    )
    assert legacy.rope_theta == 1e6 and legacy.rope_scaling == {"rope_type": "llama3", "factor": 8.0}
    with pytest.raises(ValueError, match="model.rope_theta"):
        apply_rope_overrides(config, rope_theta=-1.0)


def test_load_applies_overrides_and_dtype(tiny_llama):
    model = load_causal_lm(tiny_llama, dtype=torch.bfloat16, rope_theta=123456.0)
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert model.config.rope_parameters["rope_theta"] == 123456.0
    inv_freq = model.model.rotary_emb.inv_freq
    head_dim = model.config.head_dim
    expected = 1.0 / (123456.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    torch.testing.assert_close(inv_freq.float(), expected)
    with pytest.raises(ValueError, match="model.dtype='int8'"):
        parse_dtype("int8")


def test_check_heads():
    config = LlamaConfig(hidden_size=64, num_attention_heads=8, num_key_value_heads=2, head_dim=8)
    check_heads(config, 4)  # kv heads repeated over the degree
    check_heads(config, 2)
    check_heads(config, 3)  # uneven: 3 / 3 / 2 query heads (usp.attention.heads)
    check_heads(LlamaConfig(hidden_size=96, num_attention_heads=12, num_key_value_heads=3, head_dim=8), 8)
    with pytest.raises(ValueError, match=r"ulysses_degree=9 does not fit num_heads=8.*1\.\.8"):
        check_heads(config, 9)
    with pytest.raises(ValueError, match="not a multiple of num_kv_heads"):
        check_heads(LlamaConfig(hidden_size=96, num_attention_heads=12, num_key_value_heads=5, head_dim=8), 4)


def sharded_load_matches(model_dir: str, rope_theta: float, degree: int = 2) -> dict:
    """Worker: meta model -> FSDP2 over ``degree**2`` ranks (one rank: the plain module, no FSDP2) -> sharded
    load; compare with from_pretrained on every rank."""
    from tests.mesh_cache import cached_sp_mesh
    from usp.model import build_empty_causal_lm, load_sharded_weights
    from usp.train.parallelize import parallelize

    mesh = cached_sp_mesh(degree, degree, "zigzag", 1)
    config = apply_rope_overrides(check_model_dir(model_dir), rope_theta=rope_theta)
    model = build_empty_causal_lm(config)
    parallelize(model, mesh, param_dtype=torch.float32)
    load_sharded_weights(model, model_dir, device=torch.device("cpu"))
    ref = load_causal_lm(model_dir, dtype=torch.float32, rope_theta=rope_theta)
    params = dict(model.named_parameters())
    mismatched = [n for n, p in ref.named_parameters() if not torch.equal(whole(params[n]), p)]
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    same_rope = torch.equal(model.model.rotary_emb.inv_freq, ref.model.rotary_emb.inv_freq)
    return {"mismatched": mismatched, "tied": tied, "same_rope": same_rope, "n": len(params)}


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_sharded_load_equals_from_pretrained(dist_pools, tmp_path, tie):
    model_dir = str(build_tiny_llama(tmp_path / "llama", tie_word_embeddings=tie))
    for out in dist_pools(4).run(sharded_load_matches, model_dir, 77777.0):
        assert out["mismatched"] == [] and out["same_rope"] and out["n"] > 0
        assert out["tied"] == tie


def test_world1_plain_load_keeps_tied_embeddings(dist_pools, tmp_path):
    """One rank in fp32 trains the plain module (usp.train.parallelize.needs_fsdp): materializing it must keep
    ``lm_head`` tied to the embedding (``to_empty`` would give each its own uninitialised copy, and the load fills
    the embedding only)."""
    model_dir = str(build_tiny_llama(tmp_path / "llama", tie_word_embeddings=True))
    out = dist_pools(1).run(sharded_load_matches, model_dir, 77777.0, 1)[0]
    assert out["mismatched"] == [] and out["same_rope"] and out["n"] > 0
    assert out["tied"]


def test_weight_devices_put_offloaded_params_on_the_cpu_and_buffers_on_the_compute_device():
    from usp.model import weight_devices

    cuda = torch.device("cuda", 0)  # a device object only: nothing is allocated
    assert weight_devices(cuda, cpu_offload=True) == (torch.device("cpu"), cuda)
    assert weight_devices(cuda, cpu_offload=False) == (cuda, cuda)
    cpu = torch.device("cpu")
    assert weight_devices(cpu) == (cpu, cpu)


def test_materialize_empty_splits_params_and_rope_buffers(tiny_llama):
    from usp.model import build_empty_causal_lm, materialize_empty

    model = build_empty_causal_lm(check_model_dir(tiny_llama))
    # "meta" stands in for the compute device: the buffers go there, the parameters to param_device
    materialize_empty(model, device=torch.device("meta"), param_device=torch.device("cpu"))
    assert {p.device.type for p in model.parameters()} == {"cpu"}
    assert model.model.rotary_emb.inv_freq.device.type == "meta"


def load_truncated_weights(model_dir: str) -> str:
    """Worker: sharded load of a checkpoint whose model.safetensors is truncated; return the error message."""
    from tests.mesh_cache import cached_sp_mesh
    from usp.model import build_empty_causal_lm, load_sharded_weights
    from usp.train.parallelize import parallelize

    mesh = cached_sp_mesh(2, 1, "zigzag", 1)
    model = build_empty_causal_lm(check_model_dir(model_dir))
    parallelize(model, mesh, param_dtype=torch.float32)
    try:
        load_sharded_weights(model, model_dir, device=torch.device("cpu"))
    except ValueError as e:
        return str(e)
    return "loaded"


def test_truncated_weights_raise_on_every_rank(dist_pools, tmp_path):
    model_dir = build_tiny_llama(tmp_path / "llama")
    weights = model_dir / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    messages = dist_pools(2).run(load_truncated_weights, str(model_dir), timeout=120)
    for m in messages:
        assert "model.path=" in m and "could not read the weights" in m, m


def test_sequence_length_dependent_rope_is_made_global_not_refused():
    """RoPE types that transformers recomputes from the longest position a call sees are computed from the
    whole sequence's (apply_usp, tests/test_global_positions.py), so the gate lets them through."""
    from tests.family_models import family_config
    from usp.model import model_capabilities

    config = LlamaConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=1, intermediate_size=64)
    apply_rope_overrides(config, rope_scaling={"type": "dynamic", "factor": 4.0})
    for cfg, need in ((config, "dynamic_rope"), (family_config("phi3"), "longrope")):
        caps = model_capabilities(cfg)
        caps.check("train")
        assert caps.global_positions == (need,)


def test_weights_that_do_not_match_the_config_raise_on_every_rank(dist_pools, tmp_path):
    from safetensors.torch import load_file, save_file

    model_dir = build_tiny_llama(tmp_path / "llama")
    weights = model_dir / "model.safetensors"
    state = load_file(str(weights))
    del state["model.norm.weight"]
    state["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(4)  # old exports: ignored
    save_file(state, str(weights), metadata={"format": "pt"})
    for m in dist_pools(2).run(load_truncated_weights, str(model_dir), timeout=120):
        assert "model.path=" in m and "missing ['model.norm.weight'], unexpected []" in m, m


def sharded_read_volume(model_dir: str) -> dict:
    """Worker: sharded load over 4 ranks, counting the elements this rank read from the safetensors files."""
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    from tests.mesh_cache import cached_sp_mesh
    from usp.model import build_empty_causal_lm, load_sharded_weights
    from usp.train.parallelize import parallelize

    read = {"elements": 0}
    original = HuggingFaceStorageReader._process_read_request

    def counting(self, f, req, planner):
        read["elements"] += int(torch.Size(req.lengths).numel())
        return original(self, f, req, planner)

    HuggingFaceStorageReader._process_read_request = counting
    try:
        mesh = cached_sp_mesh(2, 2, "zigzag", 1)
        model = build_empty_causal_lm(check_model_dir(model_dir))
        parallelize(model, mesh, param_dtype=torch.float32)
        load_sharded_weights(model, model_dir, device=torch.device("cpu"))
    finally:
        HuggingFaceStorageReader._process_read_request = original
    local = sum(p.to_local().numel() for p in model.parameters())
    return {"read": read["elements"], "local": local}


def test_each_rank_reads_only_its_own_shards(dist_pools, tiny_llama):
    """Every stored element is read once over the 4 ranks, and each rank reads what it holds (not the model)."""
    from safetensors import safe_open

    with safe_open(f"{tiny_llama}/model.safetensors", framework="pt") as f:
        total = sum(torch.Size(f.get_slice(k).get_shape()).numel() for k in f.keys())
    out = dist_pools(4).run(sharded_read_volume, tiny_llama)
    assert sum(o["read"] for o in out) == total
    for o in out:
        assert o["read"] <= o["local"] < total / 2, o


def test_bin_checkpoint_loads_through_rank0_broadcast(dist_pools, tmp_path):
    """``pytorch_model.bin`` (no slicing possible) still loads, bit-identical to from_pretrained."""
    from safetensors.torch import load_file

    model_dir = build_tiny_llama(tmp_path / "llama")
    weights = model_dir / "model.safetensors"
    torch.save(load_file(str(weights)), model_dir / "pytorch_model.bin")
    weights.unlink()
    for out in dist_pools(4).run(sharded_load_matches, str(model_dir), 10000.0):
        assert out["mismatched"] == [] and out["same_rope"] and out["n"] > 0
