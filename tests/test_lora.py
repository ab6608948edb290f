"""LoRA under USP and FSDP2 (:mod:`usp.model.lora`): exact against ``peft`` in one process, and end to end.

Exactness (float64, :mod:`tests.exact_model`): the tiny Llama with adapters (non-zero ``A`` and ``B``, so that
every adapter gradient is non-zero) is trained two steps of two micro-batches of packed documents with the
trainer's own step and AdamW under world 1, u2r2, u1r4, u4r1 (balanced layout) and dp2 x u1r2. The reference is
one process running ``peft.get_peft_model`` on the plain model, each document alone, the same AdamW. Compared:
each step's loss, every trainable parameter's gradient and value after each update (``EXACT_TOL``); the base
weights must be bit-identical after training and get no gradient.

End to end (fp32, :func:`usp.train.trainer.run`, 4 ranks u2r2): a LoRA run checkpoints the trainable tensors
only, resumes to the same losses, and exports a ``peft`` adapter directory holding the trained values, which
``PeftModel.from_pretrained`` loads to the same logits as the merged Hugging Face export.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, distribute_tensor

from tests.exact_model import float64_loss_model, load_float64
from tests.mesh_cache import cached_sp_mesh
from tests.run_errors import run_expecting_error
from tests.tolerance import EXACT_DTYPE, assert_close_scaled, assert_exact, rounding_tolerance
from usp.config import TrainConfig
from usp.data.batch import IGNORE_INDEX, collate_rows
from usp.model.lora import LoraSpec, is_adapter_key, peft_adapter_state
from usp.tiny import build_tiny_llama
from usp.train.step import train_step
from usp.train.trainer import run

SEQ_LEN = 64
LR, BETAS, WEIGHT_DECAY = 1e-2, (0.9, 0.95), 0.1
SPECS = {  # name -> the adapters
    "default": LoraSpec(rank=4, alpha=8.0, train_embeddings_and_norms=True),
    "qv": LoraSpec(rank=2, alpha=4.0, target_modules=("q_proj", "v_proj")),
}
DOCS = [[20, 30, 14], [64], [9, 41, 14], [33, 31]]  # four packed rows' document lengths


def make_rows(vocab: int) -> list[dict]:
    gen = torch.Generator().manual_seed(7)
    return [
        {"input_ids": torch.randint(3, vocab, (SEQ_LEN,), generator=gen).tolist(), "document_lengths": docs}
        for docs in DOCS
    ]


def steps_for(dp: int) -> list[list[list[int]]]:
    """Per step, per micro-batch, the row index of each dp replica (grad accumulation 2)."""
    if dp == 1:
        return [[[0], [1]], [[2], [3]]]
    return [[[0, 1], [2, 3]], [[3, 0], [1, 2]]]


def adapter_values(model: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """Non-zero values for every adapter tensor (``peft`` starts ``B`` at zero: ``A`` would get no gradient)."""
    gen = torch.Generator().manual_seed(seed)
    return {
        name: torch.randn(p.shape, generator=gen, dtype=EXACT_DTYPE) * 0.2
        for name, p in model.named_parameters()
        if is_adapter_key(name)
    }


class RecordingAdamW(torch.optim.AdamW):
    """torch AdamW that records the full gradients and the full parameters after each step (collective)."""

    def __init__(self, named: list[tuple[str, torch.nn.Parameter]], **kw):
        decay = [p for _, p in named if p.ndim >= 2]
        no_decay = [p for _, p in named if p.ndim < 2]
        super().__init__(
            [{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": no_decay, "weight_decay": 0.0}], **kw
        )
        self.named = named
        self.records: list[dict] = []

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ARG002 - the Optimizer signature
        grads = {n: _full(p.grad) for n, p in self.named}
        super().step()
        self.records.append({"grads": grads, "params": {n: _full(p) for n, p in self.named}})


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of an FSDP2 parameter, or the plain parameter (a world of one without FSDP2)."""
    return t.to_local() if isinstance(t, DTensor) else t


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def lora_worker(model_dir: str, rows: list[dict], ulysses: int, ring: int, dp: int) -> dict:
    mesh = cached_sp_mesh(ulysses, ring, "balanced", dp)
    out = {}
    for key, spec in SPECS.items():
        model, loss_model = float64_loss_model(model_dir, mesh, loss_chunk_size=9, lora=spec)
        with torch.no_grad():
            for name, value in adapter_values(model, seed=1).items():
                p = dict(model.named_parameters())[name]
                if isinstance(p, DTensor):
                    value = distribute_tensor(value, p.device_mesh, p.placements, src_data_rank=None)
                _local(p).copy_(_local(value))
        frozen = {n: _local(p).clone() for n, p in model.named_parameters() if not p.requires_grad}
        trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        optimizer = RecordingAdamW(trainable, lr=LR, betas=BETAS, eps=1e-8)
        losses = []
        for step in steps_for(mesh.dp_degree):
            micro = [collate_rows([rows[m[mesh.dp_rank]]], mesh=mesh, document_masking=True) for m in step]
            losses.append(train_step(loss_model, optimizer, None, micro, mesh=mesh, grad_clip=0.0).loss)
        base_unchanged = all(
            torch.equal(_local(p), frozen[n]) and p.grad is None
            for n, p in model.named_parameters()
            if not p.requires_grad
        )
        out[key] = {"losses": losses, "records": optimizer.records, "base_unchanged": base_unchanged}
    return (
        out if dist.get_rank() == 0 else {k: {"base_unchanged": v["base_unchanged"]} for k, v in out.items()}
    )


def reference_run(model_dir: str, rows: list[dict], spec: LoraSpec, dp: int) -> dict:
    """One process: ``peft`` on the plain float64 model, each document alone, loss = target CE sum / count."""
    from peft import LoraConfig, get_peft_model

    model = load_float64(model_dir)
    values = adapter_values(_injected(model_dir, spec), seed=1)
    peft_model = get_peft_model(
        model,
        LoraConfig(
            r=spec.rank,
            lora_alpha=spec.alpha,
            lora_dropout=0.0,
            target_modules=list(
                spec.target_modules
                or ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
            ),
        ),
    )
    named = dict(model.named_parameters())  # the names of the injected model: what usp trains
    with torch.no_grad():
        for name, value in values.items():
            named[name].copy_(value)
    if spec.train_embeddings_and_norms:
        for name, p in named.items():
            if "embed_tokens" in name or "norm" in name:
                p.requires_grad_(True)
    trainable = [(n, p) for n, p in named.items() if p.requires_grad]
    optimizer = RecordingAdamW(trainable, lr=LR, betas=BETAS, eps=1e-8)
    losses = []
    for step in steps_for(dp):
        optimizer.zero_grad(set_to_none=True)
        terms, count = [], 0
        for micro in step:
            for i in micro:
                batch = collate_rows([rows[i]], mesh=None, document_masking=True)
                ids, labels = batch["input_ids"][0], batch["labels"][0]
                start = 0
                for n in rows[i]["document_lengths"]:
                    lab = labels[start : start + n]
                    logits = peft_model(input_ids=ids[start : start + n][None]).logits[0]
                    terms.append(F.cross_entropy(logits, lab, ignore_index=IGNORE_INDEX, reduction="sum"))
                    count += int((lab != IGNORE_INDEX).sum())
                    start += n
        loss = torch.stack(terms).sum() / count
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    return {"losses": losses, "records": optimizer.records}


def _injected(model_dir: str, spec: LoraSpec) -> torch.nn.Module:
    """The model as usp injects it (the names and shapes of its adapter tensors)."""
    from usp.model.lora import apply_lora

    model = load_float64(model_dir)
    apply_lora(model, spec)
    return model


@pytest.fixture(scope="module")
def exact_setup(tmp_path_factory) -> dict:
    model_dir = str(build_tiny_llama(tmp_path_factory.mktemp("lora_exact") / "llama"))
    vocab = json.loads(Path(model_dir, "config.json").read_text())["vocab_size"]
    rows = make_rows(vocab)
    refs = {
        (key, dp): reference_run(model_dir, rows, spec, dp) for key, spec in SPECS.items() for dp in (1, 2)
    }
    return {"model": model_dir, "rows": rows, "refs": refs}


LAYOUTS = [
    pytest.param(1, 1, 1, 1, id="world1"),
    pytest.param(4, 2, 2, 1, id="u2r2"),
    pytest.param(4, 1, 4, 1, id="u1r4"),
    pytest.param(4, 4, 1, 1, id="u4r1"),
    pytest.param(4, 1, 2, 2, id="dp2-u1r2"),
]


@pytest.mark.parametrize("world, ulysses, ring, dp", LAYOUTS)
def test_lora_losses_gradients_and_updates_match_peft_in_one_process(
    dist_pools, exact_setup, world, ulysses, ring, dp
):
    results = dist_pools(world).run(lora_worker, exact_setup["model"], exact_setup["rows"], ulysses, ring, dp)
    for key in SPECS:
        assert all(r[key]["base_unchanged"] for r in results), (
            f"{key}: a frozen base weight changed on some rank"
        )
        got, ref = results[0][key], exact_setup["refs"][(key, dp)]
        assert_exact(
            torch.tensor(got["losses"], dtype=EXACT_DTYPE),
            torch.tensor(ref["losses"], dtype=EXACT_DTYPE),
            f"{key}: losses",
        )
        for k, (step, ref_step) in enumerate(zip(got["records"], ref["records"])):
            assert set(step["grads"]) == set(ref_step["grads"]), f"{key}: the trainable parameters differ"
            for name in ref_step["grads"]:
                assert_exact(step["grads"][name], ref_step["grads"][name], f"{key} step {k} grad {name}")
                assert_exact(step["params"][name], ref_step["params"][name], f"{key} step {k} update {name}")
        names = set(got["records"][0]["grads"])
        assert any(".lora_A." in n for n in names) and any(".lora_B." in n for n in names)
        assert ("model.embed_tokens.weight" in names) == SPECS[key].train_embeddings_and_norms


# --- end to end ------------------------------------------------------------------------------------------


def make_config(model_dir: str, run_dir: str, cache_dir: str) -> TrainConfig:
    cfg = TrainConfig()
    cfg.model.path = model_dir
    cfg.model.dtype = "float32"
    cfg.model.lora.rank = 4
    cfg.model.lora.alpha = 8.0
    cfg.model.lora.train_embeddings_and_norms = True
    cfg.model.lora.export_merged = True
    cfg.data.build_tiny_corpus = True
    cfg.data.cache_dir = cache_dir
    cfg.trainer.seq_len = 64
    cfg.trainer.max_steps = 4
    cfg.trainer.grad_accum_steps = 2
    cfg.trainer.loss_chunk_size = 24
    cfg.trainer.checkpoint_every = 2
    cfg.trainer.device = "cpu"
    cfg.optim.lr = 3e-2
    cfg.optim.warmup_steps = 1
    cfg.logging.progress_bar = False
    cfg.cluster.gpu = "cpu"
    cfg.parallel.ulysses_degree = 2
    cfg.parallel.ring_degree = 2
    cfg.run_dir = run_dir
    return cfg


def run_worker(cfg: TrainConfig) -> dict:
    out = run(cfg)
    return {k: out[k] for k in ("losses", "start_step", "checkpoint", "export_dir", "adapter_dir")}


@pytest.fixture(scope="module")
def lora_run(dist_pools, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("lora_run")
    model_dir = str(build_tiny_llama(root / "model"))
    cfg = make_config(model_dir, str(root / "straight"), str(root / "cache"))
    return {"root": root, "model": model_dir, "out": dist_pools(4).run(run_worker, cfg)[0]}


@pytest.fixture(scope="module")
def tied_run(dist_pools, tmp_path_factory) -> dict:
    """The same run on a model whose LM head is its (trained) input embedding."""
    root = tmp_path_factory.mktemp("lora_tied")
    model_dir = str(build_tiny_llama(root / "model", tie_word_embeddings=True))
    cfg = make_config(model_dir, str(root / "run"), str(root / "cache"))
    cfg.trainer.max_steps = 2
    return {"root": root, "model": model_dir, "out": dist_pools(4).run(run_worker, cfg)[0]}


def _checkpoint_keys(step_dir: Path) -> set[str]:
    from torch.distributed.checkpoint import FileSystemReader

    return set(FileSystemReader(str(step_dir / "dcp")).read_metadata().state_dict_metadata)


def test_lora_checkpoints_hold_the_trainable_tensors_only_and_resume_exactly(dist_pools, lora_run):
    root, out = lora_run["root"], lora_run["out"]
    keys = _checkpoint_keys(Path(out["checkpoint"]))
    model_keys = {k for k in keys if k.startswith("model.")}
    assert model_keys and all(".lora_" in k or "embed_tokens" in k or "norm" in k for k in model_keys), (
        sorted(model_keys)[:5]
    )
    assert not any("base_layer" in k or "lm_head" in k for k in keys)
    # interrupted after step 2, resumed: the same losses (same code and layout: bitwise)
    run_dir = root / "resumed"
    shutil.copytree(root / "straight", run_dir, ignore=shutil.ignore_patterns("hf", "adapter"))
    shutil.rmtree(run_dir / "checkpoints" / "step_4")
    cfg = make_config(lora_run["model"], str(run_dir), str(root / "cache"))
    cfg.trainer.export_hf = False
    second = dist_pools(4).run(run_worker, cfg)[0]
    assert second["start_step"] == 2
    assert second["losses"] == out["losses"][2:]


@pytest.mark.parametrize("which", ["untied", "tied"])
def test_lora_exports_a_peft_adapter_and_a_merged_checkpoint_of_the_trained_model(request, which):
    from peft import PeftModel
    from safetensors.torch import load_file
    from torch.distributed.checkpoint import FileSystemReader, load
    from transformers import AutoModelForCausalLM

    lora_run = request.getfixturevalue("lora_run" if which == "untied" else "tied_run")
    out = lora_run["out"]
    adapter = load_file(str(Path(out["adapter_dir"]) / "adapter_model.safetensors"))
    # the adapter file holds the trained values: those of the last checkpoint (step 4, the end of the run)
    step_dir = Path(out["checkpoint"])
    meta = FileSystemReader(str(step_dir / "dcp")).read_metadata().state_dict_metadata
    trained = {k[len("model.") :]: torch.empty(m.size) for k, m in meta.items() if k.startswith("model.")}
    load({"model": trained}, storage_reader=FileSystemReader(str(step_dir / "dcp")), no_dist=True)
    expected = peft_adapter_state(trained, [])  # the adapters (the trained embeddings and norms: below)
    assert expected and all(torch.equal(adapter[k], v) for k, v in expected.items())
    embed = adapter["base_model.model.model.embed_tokens.weight"]  # modules_to_save: the trained values
    assert torch.equal(embed, trained["model.embed_tokens.weight"])
    if which == "tied":  # the LM head is that embedding: written too, peft ties them (ensure_weight_tying)
        assert torch.equal(adapter["base_model.model.lm_head.weight"], embed)

    ids = torch.randint(3, 300, (2, 48), generator=torch.Generator().manual_seed(0))
    base = AutoModelForCausalLM.from_pretrained(lora_run["model"], dtype=torch.float32)
    with torch.no_grad():
        base_logits = base(input_ids=ids).logits
        peft_logits = PeftModel.from_pretrained(base, out["adapter_dir"]).eval()(input_ids=ids).logits
        merged = AutoModelForCausalLM.from_pretrained(out["export_dir"], dtype=torch.float32)
        merged_logits = merged(input_ids=ids).logits
    tol = rounding_tolerance(torch.float32, base.config.vocab_size)
    assert_close_scaled(merged_logits, peft_logits, tol, "merged export vs the peft adapter on its base")
    assert (peft_logits - base_logits).abs().max() > 100 * tol * base_logits.abs().max(), (
        "training changed nothing"
    )


def test_lora_dropout_with_mlp_tiles_is_refused(dist_pools, lora_run, tmp_path):
    cfg = make_config(lora_run["model"], str(tmp_path / "tiles"), str(lora_run["root"] / "cache"))
    cfg.model.lora.dropout = 0.1
    cfg.parallel.mlp_tiles = 2
    messages = dist_pools(4).run(run_expecting_error, cfg)
    assert all("model.lora.dropout" in m and "parallel.mlp_tiles" in m for m in messages), messages[0]


def test_lora_bad_target_module_is_refused_before_any_step(dist_pools, lora_run, tmp_path):
    cfg = make_config(lora_run["model"], str(tmp_path / "bad"), str(lora_run["root"] / "cache"))
    cfg.model.lora.target_modules = ["q_proj", "qkv"]
    messages = dist_pools(4).run(run_expecting_error, cfg)
    assert all("model.lora.target_modules" in m and "'qkv'" in m and "q_proj" in m for m in messages), (
        messages[0]
    )
    assert not (tmp_path / "bad" / "metrics.jsonl").exists()
