"""MoE checkpoints: the sharded loader builds fused expert parameters from per-expert stored tensors.

transformers 5 stores each expert's tensors apart (``mlp.experts.3.gate_proj.weight``, mixtral's
``block_sparse_moe.experts.3.w1.weight``) and holds them fused (``mlp.experts.gate_up_proj`` ``[E, 2I, H]``).
Tiny random checkpoints of several families (``save_pretrained``, safetensors, one as ``pytorch_model.bin``) load
with ``usp.model.load_sharded_weights`` into FSDP2 models on gloo worlds of 1, 2 and 4 ranks (3 experts too:
uneven shards) bit-identical to ``AutoModelForCausalLM.from_pretrained``, state dict and logits; each rank reads
the expert tensors of its own shard only; an unmappable layout names the tensor; the Hugging Face export writes
``save_pretrained``'s layout back, which ``from_pretrained`` loads to the same logits.
"""

from __future__ import annotations

import functools
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM

_BASE = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    vocab_size=64,
    max_position_embeddings=128,
    tie_word_embeddings=False,
    num_experts_per_tok=2,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
FAMILIES: dict[str, tuple[str, dict]] = {
    # case -> (model_type, config overrides)
    "qwen3_moe": ("qwen3_moe", dict(num_experts=4, moe_intermediate_size=16, decoder_sparse_step=1)),
    "qwen3_moe_3": ("qwen3_moe", dict(num_experts=3, moe_intermediate_size=16, decoder_sparse_step=1)),
    "mixtral": ("mixtral", dict(num_local_experts=4)),  # block_sparse_moe.experts.e.w1/w3/w2 -> mlp.experts
    "olmoe": ("olmoe", dict(num_experts=4)),
    "phimoe": (
        "phimoe",
        dict(num_local_experts=4),
    ),  # renames the router too: block_sparse_moe.gate -> mlp.router
    "deepseek_v3": (  # a dense first layer, shared experts, MLA
        "deepseek_v3",
        dict(
            q_lora_rank=16,
            kv_lora_rank=16,
            qk_nope_head_dim=8,
            qk_rope_head_dim=8,
            v_head_dim=8,
            n_routed_experts=4,
            n_group=1,
            topk_group=1,
            moe_intermediate_size=16,
            first_k_dense_replace=1,
            num_key_value_heads=4,
        ),
    ),
    "gpt_oss": (  # stored fused already: the identity path
        "gpt_oss",
        dict(num_local_experts=4, sliding_window=8, layer_types=["sliding_attention", "full_attention"]),
    ),
}
BF16 = {"olmoe"}  # stored in bfloat16: the loader upcasts to the fp32 parameters, as from_pretrained does
EXPORTED = ("qwen3_moe", "mixtral", "phimoe", "deepseek_v3", "gpt_oss")
PER_EXPERT = re.compile(r"layers\.(\d+)\..*experts\.(\d+)\.")


def _ids() -> torch.Tensor:
    return torch.randint(3, 64, (2, 12), generator=torch.Generator().manual_seed(5))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    """case -> checkpoint dir; ``mixtral_bin`` holds mixtral's tensors as ``pytorch_model.bin``."""
    root = tmp_path_factory.mktemp("moe")
    dirs = {}
    for case, (model_type, overrides) in FAMILIES.items():
        torch.manual_seed(0)
        config = AutoConfig.for_model(model_type, **{**_BASE, **overrides})
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        with torch.no_grad():  # norms and biases an init leaves at one or zero get values that matter
            for p in model.parameters():
                if p.ndim == 1:
                    p.add_(torch.randn_like(p) * 0.3)
        if case in BF16:
            model = model.to(torch.bfloat16)
        dirs[case] = str(root / case)
        model.save_pretrained(dirs[case], max_shard_size="40KB" if case == "mixtral" else "5GB")
    bin_dir = root / "mixtral_bin"
    shutil.copytree(dirs["mixtral"], bin_dir)
    state = {}
    for f in sorted(bin_dir.glob("*.safetensors")):
        state.update(load_file(str(f)))
        f.unlink()
    (bin_dir / "model.safetensors.index.json").unlink()
    torch.save(state, bin_dir / "pytorch_model.bin")
    dirs["mixtral_bin"] = str(bin_dir)
    return dirs


@functools.cache
def _reference(model_dir: str) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    from usp.model.load import _loading_attention

    config = AutoConfig.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation=_loading_attention(config)
    ).eval()
    with torch.no_grad():
        return model.state_dict(), model(input_ids=_ids()).logits


def _stored_keys(model_dir: str) -> set[str]:
    keys: set[str] = set()
    for f in Path(model_dir).glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as handle:
            keys.update(handle.keys())
    return keys


class _Recording:
    """``safetensors.safe_open`` recording the names it reads with ``get_tensor``."""

    names: list[str] = []

    def __init__(self, *args, **kwargs):
        self._handle = _Recording.real(*args, **kwargs)

    def __enter__(self):
        self._handle.__enter__()
        return self

    def __exit__(self, *exc):
        return self._handle.__exit__(*exc)

    def get_tensor(self, name: str) -> torch.Tensor:
        _Recording.names.append(name)
        return self._handle.get_tensor(name)

    def __getattr__(self, name: str):
        return getattr(self._handle, name)


@functools.cache
def _hsdp_mesh():
    from tests.mesh_cache import cached_sp_mesh

    return cached_sp_mesh(1, 1).hsdp_mesh(2)  # (replicate, shard): 2 "nodes" of 2 ranks


def _sharded(model_dir: str, hsdp: bool = False):
    """Meta model from the checkpoint's config -> FSDP2 per decoder layer and root over every rank (HSDP: shard
    in pairs, replicate across them) -> usp's load."""
    from torch.distributed.fsdp import fully_shard

    from tests.mesh_cache import cached_sp_mesh
    from usp.model import build_empty_causal_lm, check_model_dir, load_sharded_weights

    mesh = _hsdp_mesh() if hsdp else cached_sp_mesh(1, 1).fsdp_mesh
    model = build_empty_causal_lm(check_model_dir(model_dir, purpose="forward"))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    load_sharded_weights(model, model_dir, device=torch.device("cpu"))
    return model


def load_cases(dirs: dict[str, str], export_root: str | None, hsdp: tuple[str, ...] = ()) -> dict:
    """Worker: load every case sharded (and the ``hsdp`` ones under HSDP too, as ``hsdp:<case>``); rank 0
    returns the full state dicts, every rank its logits and the per-expert tensors it read; with
    ``export_root``, export the EXPORTED cases there."""
    import safetensors
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from usp.train.export import export_hf

    out: dict = {}
    _Recording.real = safetensors.safe_open
    safetensors.safe_open = _Recording
    try:
        for case, model_dir, on_hsdp in [(c, d, False) for c, d in dirs.items()] + [
            (f"hsdp:{c}", dirs[c], True) for c in hsdp
        ]:
            _Recording.names = []
            model = _sharded(model_dir, on_hsdp)
            read = sorted(n for n in _Recording.names if PER_EXPERT.search(n))
            full = {
                k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()
            }
            with torch.no_grad():
                logits = model.eval()(input_ids=_ids()).logits
            if export_root is not None and case in EXPORTED:
                export_hf(model, tokenizer=None, out_dir=f"{export_root}/{case}")
            out[case] = {"read": read, "logits": logits, "state": full if dist.get_rank() == 0 else None}
    finally:
        safetensors.safe_open = _Recording.real
    return out


def _my_experts(num_experts: int, shards: int, shard: int) -> set[int]:
    chunk = -(-num_experts // shards)  # FSDP2's Shard(0): torch.chunk's split, the last shards hold fewer
    return set(range(min(shard * chunk, num_experts), min((shard + 1) * chunk, num_experts)))


def _assert_equal(case: str, state: dict, ref: dict) -> None:
    assert sorted(state) == sorted(ref), case
    for k, v in ref.items():
        torch.testing.assert_close(state[k], v, rtol=0, atol=0, msg=lambda m, k=k: f"{case} {k}: {m}")


@pytest.mark.parametrize("world", [1, 2, 4])
def test_sharded_load_equals_from_pretrained(dist_pools, checkpoints, tmp_path, world):
    """World 2 exports too; world 4 loads two cases under HSDP as well (rows by the shard coordinate)."""
    export_root = tmp_path / "export" if world == 2 else None
    hsdp = ("qwen3_moe_3", "mixtral") if world == 4 else ()
    results = dist_pools(world).run(
        load_cases, checkpoints, str(export_root) if export_root else None, hsdp, timeout=240
    )
    for case in [*checkpoints, *(f"hsdp:{c}" for c in hsdp)]:
        model_dir = checkpoints[case.removeprefix("hsdp:")]
        ref_state, ref_logits = _reference(model_dir)
        _assert_equal(case, results[0][case]["state"], ref_state)
        for rank, out in enumerate(results):
            torch.testing.assert_close(out[case]["logits"], ref_logits, rtol=0, atol=0, msg=f"{case} {rank}")
        if case in ("mixtral_bin", "gpt_oss"):  # rank 0 reads the .bin whole; gpt_oss stores fused
            assert all(not out[case]["read"] for out in results), case
            continue
        stored = sorted(k for k in _stored_keys(model_dir) if PER_EXPERT.search(k))
        config = AutoConfig.from_pretrained(model_dir)
        n = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
        n = n or config.n_routed_experts
        shards = 2 if case.startswith("hsdp:") else world
        for rank, out in enumerate(results):  # each rank read the tensors of its own experts, each once
            mine = _my_experts(n, shards, rank % shards)
            assert out[case]["read"] == [k for k in stored if int(PER_EXPERT.search(k)[2]) in mine], (
                case,
                rank,
            )
    for case in EXPORTED if export_root else ():
        exported = str(export_root / case)
        assert _stored_keys(exported) == _stored_keys(checkpoints[case]), case  # save_pretrained's layout
        ref_state, ref_logits = _reference(checkpoints[case])
        state, logits = _reference(exported)
        _assert_equal(f"export {case}", state, ref_state)
        torch.testing.assert_close(logits, ref_logits, rtol=0, atol=0, msg=case)


def load_error(model_dir: str) -> str:
    """Worker: the sharded load's ValueError message (or ``loaded``)."""
    try:
        _sharded(model_dir)
    except ValueError as e:
        return str(e)
    return "loaded"


def _edited(src: str, dst: Path, edit) -> str:
    shutil.copytree(src, dst)
    state = load_file(str(dst / "model.safetensors"))
    edit(state)
    save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return str(dst)


def test_unmappable_expert_layouts_name_the_tensor_on_every_rank(dist_pools, checkpoints, tmp_path):
    expert = "model.layers.1.mlp.experts.2"
    renamed = _edited(
        checkpoints["qwen3_moe"],
        tmp_path / "renamed",
        lambda s: s.update({f"{expert}.upproj.weight": s.pop(f"{expert}.up_proj.weight")}),
    )
    missing = _edited(
        checkpoints["qwen3_moe"],
        tmp_path / "missing",
        lambda s: s.pop("model.layers.0.mlp.experts.3.down_proj.weight"),
    )
    reshaped = _edited(
        checkpoints["qwen3_moe"],
        tmp_path / "reshaped",
        lambda s: s.update({f"{expert}.gate_proj.weight": s[f"{expert}.gate_proj.weight"][:8]}),
    )
    for m in dist_pools(2).run(load_error, renamed, timeout=120):
        assert "model.path=" in m and "model.layers.1.mlp.experts.gate_up_proj" in m, m
        assert "none for [2]" in m and f"{expert}.upproj.weight" in m, m
    for m in dist_pools(2).run(load_error, missing, timeout=120):
        assert "model.path=" in m and "model.layers.0.mlp.experts.down_proj" in m and "none for [3]" in m, m
    for m in dist_pools(2).run(load_error, reshaped, timeout=120):
        assert "model.path=" in m and "build model.layers.1.mlp.experts.gate_up_proj differ in shape" in m, m
        assert f"{expert}.gate_proj.weight is [8, 32], the other experts' [16, 32]" in m, m


def _meta_model(model_dir: str):
    from usp.model import build_empty_causal_lm

    return build_empty_causal_lm(AutoConfig.from_pretrained(model_dir))


def test_rules_usp_does_not_implement_are_refused(checkpoints, monkeypatch):
    """A rule with other operations, or per-expert tensors no rule maps: ValueError naming the tensor."""
    from transformers.core_model_loading import MergeModulelist, Transpose, WeightConverter

    from usp.model import moe_weights
    from usp.model.load import _weights_mismatch

    model = _meta_model(checkpoints["qwen3_moe"])
    stored = _stored_keys(checkpoints["qwen3_moe"])
    transposed = WeightConverter(
        "mlp.experts.*.down_proj.weight",
        "mlp.experts.down_proj",
        operations=[MergeModulelist(0), Transpose(1, 2)],
    )
    monkeypatch.setattr(moe_weights, "conversion_rules", lambda model, legacy=True: [transposed])
    _, _, error = _weights_mismatch(model, stored)
    assert "Transpose" in error and "model.layers.0.mlp.experts.down_proj" in error, error
    assert "does not implement" in error, error
    monkeypatch.setattr(moe_weights, "conversion_rules", lambda model, legacy=True: [])
    _, _, error = _weights_mismatch(model, stored)
    assert "model.layers.0.mlp.experts.down_proj is a fused expert parameter" in error, error
    assert "no transformers conversion rule for model_type 'qwen3_moe'" in error, error


def test_plans():
    """What the mapping says: fused parameters from per-expert tensors (mixtral's and phimoe's renamings too);
    a checkpoint stored fused under the model's own names (gpt_oss; any family) is identity throughout."""
    from usp.model.moe_weights import plan_weights

    with torch.device("meta"):
        for case, (model_type, overrides) in FAMILIES.items():
            model = AutoModelForCausalLM.from_config(
                AutoConfig.for_model(model_type, **{**_BASE, **overrides})
            )
            fused = plan_weights(model, model.state_dict())
            assert not fused.experts and fused.identity == {k: k for k in model.state_dict()}, case
            if case not in ("mixtral", "phimoe"):
                continue
            stored = {  # the MoE blocks of both layers, as save_pretrained names them
                f"model.layers.{i}.block_sparse_moe.{name}.weight"
                for i in range(2)
                for name in ("gate", *(f"experts.{e}.w{w}" for e in range(4) for w in (1, 2, 3)))
            }
            plan = plan_weights(model, stored)
            layer = "model.layers.0"
            gate_up = plan.experts[f"{layer}.mlp.experts.gate_up_proj"]
            assert gate_up.cat_dim == 1 and gate_up.parts == tuple(
                tuple(f"{layer}.block_sparse_moe.experts.{e}.w{i}.weight" for e in range(4)) for i in (1, 3)
            )
            assert plan.experts[f"{layer}.mlp.experts.down_proj"].cat_dim is None
            router = f"{layer}.mlp.{'router' if case == 'phimoe' else 'gate'}.weight"
            assert plan.identity[router] == f"{layer}.block_sparse_moe.gate.weight"
            assert not plan.unexpected and all(".mlp." not in k for k in plan.missing)
