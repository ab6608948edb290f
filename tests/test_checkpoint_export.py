"""Hugging Face export: from FSDP2 at world 2 and from a plain model; from_pretrained reproduces the logits."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from tests.mesh_cache import cached_sp_mesh
from tests.tolerance import assert_close_scaled, rounding_tolerance
from usp.tiny import build_tiny_llama
from usp.train.export import EXPORT_MARKER, export_hf

CUSTOM_ATTN = "usp_export_test"  # stands in for the trainer's registered "usp" attention


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    return str(build_tiny_llama(tmp_path_factory.mktemp("export_model") / "llama"))


def _probe_ids(vocab: int) -> torch.Tensor:
    return torch.randint(3, vocab, (2, 24), generator=torch.Generator().manual_seed(7))


def _train_and_export(model_dir: str, out_dir: str, sharded: bool) -> dict | None:
    from torch.distributed.fsdp import fully_shard
    from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    AttentionInterface.register(CUSTOM_ATTN, sdpa_attention_forward)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.set_attn_implementation(CUSTOM_ATTN)
    if sharded:
        mesh = cached_sp_mesh(1, 1).fsdp_mesh
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(2):
        ids = torch.randint(
            3, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(step)
        )
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        logits = model(input_ids=_probe_ids(model.config.vocab_size)).logits
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    export_hf(model, tokenizer=AutoTokenizer.from_pretrained(model_dir), out_dir=out_dir)
    if dist.is_initialized() and dist.get_rank() != 0:
        return None
    return {"logits": logits, "state": {k: v.clone() for k, v in full.items()}}


def _check_export(model_dir: str, out_dir, ref: dict) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = json.loads((out_dir / "config.json").read_text())
    assert CUSTOM_ATTN not in json.dumps(config)
    assert (out_dir / "model.safetensors").is_file() and (out_dir / EXPORT_MARKER).is_file()
    loaded = AutoModelForCausalLM.from_pretrained(str(out_dir), dtype=torch.float32)
    assert loaded.config._attn_implementation != CUSTOM_ATTN
    state = loaded.state_dict()
    for k, v in ref["state"].items():
        torch.testing.assert_close(state[k], v, rtol=0, atol=0, msg=lambda m, k=k: f"{k}: {m}")
    with torch.no_grad():
        logits = loaded(input_ids=_probe_ids(loaded.config.vocab_size)).logits
    # same weights, same fp32 model: only summation order differs (the longest reduction: the MLP's)
    assert_close_scaled(
        logits, ref["logits"], rounding_tolerance(torch.float32, loaded.config.intermediate_size)
    )
    text = "the ring 12 13 14 ulysses"
    assert (
        AutoTokenizer.from_pretrained(str(out_dir))(text)["input_ids"]
        == (AutoTokenizer.from_pretrained(model_dir)(text)["input_ids"])
    )


def test_export_from_fsdp2_world2_loads_with_from_pretrained(dist_pools, tiny_dir, tmp_path):
    out_dir = tmp_path / "hf"
    results = dist_pools(2).run(_train_and_export, tiny_dir, str(out_dir), True)
    assert results[1] is None
    _check_export(tiny_dir, out_dir, results[0])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no temp dir left beside it


def test_export_plain_model_and_replace_previous_export(tiny_dir, tmp_path):
    out_dir = tmp_path / "hf"
    _train_and_export(tiny_dir, str(out_dir), False)
    (out_dir / "stale.txt").write_text("from the previous export")
    ref = _train_and_export(tiny_dir, str(out_dir), False)  # an earlier export is replaced atomically
    assert not (out_dir / "stale.txt").exists()
    _check_export(tiny_dir, out_dir, ref)


def test_export_failing_mid_write_keeps_the_previous_export_whole(tiny_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    out_dir = tmp_path / "hf"
    ref = _train_and_export(tiny_dir, str(out_dir), False)
    before = {p.name: p.read_bytes() for p in out_dir.iterdir()}

    class FailingTokenizer:  # the weights and config are already written when this fails
        def save_pretrained(self, path):
            raise OSError("disk full (simulated)")

    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    with pytest.raises(RuntimeError, match="disk full"):
        export_hf(model, tokenizer=FailingTokenizer(), out_dir=out_dir)
    assert {p.name: p.read_bytes() for p in out_dir.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no half-written temp dir left beside it
    _check_export(tiny_dir, out_dir, ref)


def test_export_refuses_foreign_directory(tiny_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    with pytest.raises(ValueError, match="refusing to replace"):
        export_hf(model, tokenizer=None, out_dir=tiny_dir)  # e.g. the input checkpoint itself
    (tmp_path / "f").write_text("x")
    with pytest.raises(ValueError, match="is a file"):
        export_hf(model, tokenizer=None, out_dir=tmp_path / "f")


def test_export_tied_embeddings_stored_once(tmp_path):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    from usp.tiny import TINY_LLAMA_DEFAULTS

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, **{**TINY_LLAMA_DEFAULTS, "tie_word_embeddings": True})
    model = LlamaForCausalLM(config)
    out_dir = export_hf(model, tokenizer=None, out_dir=tmp_path / "hf")
    with safe_open(str(out_dir / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in f.keys() and "model.embed_tokens.weight" in f.keys()
    loaded = AutoModelForCausalLM.from_pretrained(str(out_dir), dtype=torch.float32)
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    ids = _probe_ids(64)
    with torch.no_grad():
        tol = rounding_tolerance(torch.float32, config.intermediate_size)
        assert_close_scaled(loaded(input_ids=ids).logits, model(input_ids=ids).logits, tol)


def test_export_casts_to_requested_dtype(tiny_dir, tmp_path):
    """fp32 master weights exported as bf16: every tensor is the bf16 rounding of the trained fp32 value."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    out_dir = tmp_path / "hf_bf16"
    export_hf(model, tokenizer=None, out_dir=out_dir, dtype=torch.bfloat16)
    assert json.loads((out_dir / "config.json").read_text())["dtype"] == "bfloat16"
    loaded = AutoModelForCausalLM.from_pretrained(str(out_dir), dtype="auto")
    ref = model.state_dict()
    for k, v in loaded.state_dict().items():
        assert v.dtype == torch.bfloat16, k
        torch.testing.assert_close(v, ref[k].to(torch.bfloat16), rtol=0, atol=0)


def test_export_cast_frees_each_fp32_tensor_as_it_goes(tiny_dir, tmp_path, monkeypatch):
    """Casting to bf16 replaces the gathered fp32 tensors one by one: none is alive when the files are written
    (peak one copy plus one tensor, not the fp32 copy plus a full bf16 copy)."""
    import weakref

    from transformers import AutoModelForCausalLM

    import usp.train.export as export

    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    originals: list[weakref.ref] = []

    def gathered(m, options=None):  # stands in for the gathered full state dict: fresh fp32 tensors
        sd = {k: v.detach().clone() for k, v in m.state_dict().items()}
        originals.extend(weakref.ref(v) for v in sd.values())
        return sd

    alive_at_write: list[int] = []
    write = export.save_torch_state_dict

    def spy(state_dict, tmp, **kwargs):
        alive_at_write.append(sum(r() is not None for r in originals))
        write(state_dict, tmp, **kwargs)

    monkeypatch.setattr(export, "get_model_state_dict", gathered)
    monkeypatch.setattr(export, "save_torch_state_dict", spy)
    export_hf(model, tokenizer=None, out_dir=tmp_path / "hf", dtype=torch.bfloat16)
    assert originals and alive_at_write == [0]


def test_export_in_several_shards_loads_with_from_pretrained(tiny_dir, tmp_path):
    """A small max_shard_size writes several safetensors files and the index; from_pretrained reads them."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    out = export_hf(model, tokenizer=None, out_dir=tmp_path / "hf", max_shard_size="20KB")
    assert len(list(out.glob("model-*.safetensors"))) > 1 and (out / "model.safetensors.index.json").is_file()
    loaded = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    for (name, a), b in zip(loaded.state_dict().items(), model.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=lambda m, name=name: f"{name}: {m}")
