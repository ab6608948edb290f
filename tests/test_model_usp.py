"""apply_usp: an apply_usp'd model fed this rank's slice returns the unsharded model's logits at that slice.

Logits, losses and every gradient against the unsharded model: float64, ``tests.tolerance.EXACT_TOL``.
"""

from __future__ import annotations

import pytest
import torch

from tests.exact_model import load_float64
from tests.mesh_cache import cached_sp_mesh
from tests.tolerance import assert_exact
from usp.model import apply_usp, load_causal_lm
from usp.parallel import gather_sequence, shard_sequence

SEQ_LEN = 32


def _inputs(vocab: int, batch: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, vocab, (batch, SEQ_LEN), generator=g)
    pos = torch.arange(SEQ_LEN).expand(batch, -1).clone()
    return ids, pos


def usp_logits(model_dir: str, ulysses: int, ring: int, layout: str) -> dict | None:
    """Worker: sharded forward + backward of sum(logits * w); rank 0 returns gathered logits and grads."""
    mesh = cached_sp_mesh(ulysses, ring, layout, 1)
    model = apply_usp(load_float64(model_dir), mesh)
    ids, pos = _inputs(model.config.vocab_size)
    logits = model(input_ids=shard_sequence(ids, mesh), position_ids=shard_sequence(pos, mesh)).logits
    w = shard_sequence(torch.linspace(-1, 1, SEQ_LEN, dtype=torch.float64)[None, :, None], mesh)
    (logits * w).sum().backward()
    full = gather_sequence(logits.detach(), mesh)
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad.clone()
        torch.distributed.all_reduce(g, group=mesh.sp_group)  # each rank holds its slice's share
        grads[name] = g
    if mesh.device_mesh.get_rank() != 0:
        return None
    return {"logits": full, "grads": grads}


def _build_family(path, family: str) -> str:
    """A tiny random Qwen2 (q/k/v bias) or Mistral checkpoint with GQA, saved like a hub checkpoint."""
    from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

    cls, config_cls = {
        "qwen2": (Qwen2ForCausalLM, Qwen2Config),
        "mistral": (MistralForCausalLM, MistralConfig),
    }[family]
    config = config_cls(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=384,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    cls(config).save_pretrained(str(path))
    return str(path)


@pytest.mark.parametrize("family", ["qwen2", "mistral"])
def test_apply_usp_other_families(dist_pools, tmp_path, family):
    model_dir = _build_family(tmp_path / family, family)
    out = dist_pools(4).run(usp_logits, model_dir, 2, 2, "zigzag")[0]
    model = load_float64(model_dir)
    ids, pos = _inputs(model.config.vocab_size)
    logits = model(input_ids=ids, position_ids=pos).logits
    (logits * torch.linspace(-1, 1, SEQ_LEN, dtype=torch.float64)[None, :, None]).sum().backward()
    assert_exact(out["logits"], logits.detach(), "logits")
    for name, p in model.named_parameters():
        assert_exact(out["grads"][name], p.grad, name)


@pytest.mark.parametrize(
    "ulysses, ring, layout",
    [(2, 2, "zigzag"), (4, 1, "zigzag"), (1, 4, "zigzag"), (2, 2, "contiguous")],
    ids=["u2r2", "u4r1", "u1r4", "u2r2-contiguous"],
)
def test_apply_usp_logits_and_grads_match_unsharded(dist_pools, tiny_llama, ulysses, ring, layout):
    out = dist_pools(4).run(usp_logits, tiny_llama, ulysses, ring, layout)[0]
    model = load_float64(tiny_llama)
    ids, pos = _inputs(model.config.vocab_size)
    logits = model(input_ids=ids, position_ids=pos).logits
    (logits * torch.linspace(-1, 1, SEQ_LEN, dtype=torch.float64)[None, :, None]).sum().backward()
    assert_exact(out["logits"], logits.detach(), "logits")
    for name, p in model.named_parameters():
        assert_exact(out["grads"][name], p.grad, name)


DOC_LENGTHS = (5, 11, 9, 7)  # one packed sequence of 32 tokens


def _packed(vocab: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(3, vocab, (1, SEQ_LEN), generator=g)
    pos, labels = [], []
    start = 0
    for n in DOC_LENGTHS:
        pos.append(torch.arange(n))
        doc_labels = ids[0, start + 1 : start + n].tolist() + [-100]  # no target across a boundary
        labels.append(torch.tensor(doc_labels))
        start += n
    cu = torch.tensor([0, *torch.tensor(DOC_LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    return {
        "input_ids": ids,
        "position_ids": torch.cat(pos)[None],
        "labels": torch.cat(labels)[None],
        "cu": cu,
    }


def packed_loss(model_dir: str, ulysses: int, ring: int) -> dict | None:
    """Worker: packed documents through the apply_usp'd model + chunked loss; rank 0 gets loss and grads."""
    from usp.train.loss import ChunkedCausalLMLoss

    mesh = cached_sp_mesh(ulysses, ring, "zigzag", 1)
    model = apply_usp(load_float64(model_dir), mesh)
    b = _packed(model.config.vocab_size)
    n = int((b["labels"] != -100).sum())
    loss = ChunkedCausalLMLoss(model, chunk_size=5)(
        shard_sequence(b["input_ids"], mesh),
        shard_sequence(b["labels"], mesh),
        position_ids=shard_sequence(b["position_ids"], mesh),
        cu_seqlens=b["cu"],
        num_targets=n,
    )
    loss.backward()
    total = loss.detach().clone()
    torch.distributed.all_reduce(total, group=mesh.sp_group)
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad.clone()
        torch.distributed.all_reduce(g, group=mesh.sp_group)
        grads[name] = g
    return {"loss": total, "grads": grads} if mesh.device_mesh.get_rank() == 0 else None


@pytest.mark.parametrize("ulysses, ring", [(2, 2), (1, 4)], ids=["u2r2", "u1r4"])
def test_packed_documents_do_not_leak(dist_pools, tiny_llama, ulysses, ring):
    out = dist_pools(4).run(packed_loss, tiny_llama, ulysses, ring)[0]
    model = load_float64(tiny_llama)
    b = _packed(model.config.vocab_size)
    n = int((b["labels"] != -100).sum())
    total = 0.0
    start = 0
    for length in DOC_LENGTHS:  # each document alone through the plain model
        ids = b["input_ids"][:, start : start + length]
        logits = model(input_ids=ids).logits
        total = total + torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:], reduction="sum")
        start += length
    ref = total / n
    ref.backward()
    assert_exact(out["loss"], ref.detach(), "loss")
    for name, p in model.named_parameters():
        assert_exact(out["grads"][name], p.grad, name)
    # and it differs from attending across documents (the test can fail)
    cross = torch.nn.functional.cross_entropy(
        model(input_ids=b["input_ids"]).logits[0], b["labels"][0], ignore_index=-100
    )
    assert abs(cross.item() - ref.item()) > 1e-3


def misuse_errors(model_dir: str) -> list[str]:
    """Worker: forwards an apply_usp'd model must refuse (no position ids, a padding mask)."""
    mesh = cached_sp_mesh(2, 2, "zigzag", 1)
    model = apply_usp(load_causal_lm(model_dir, dtype=torch.float32), mesh)
    ids, pos = _inputs(model.config.vocab_size)
    ids, pos = shard_sequence(ids, mesh), shard_sequence(pos, mesh)
    messages = []
    for kwargs in (
        {"input_ids": ids},
        {"input_ids": ids, "position_ids": pos, "attention_mask": torch.ones_like(ids)},
    ):
        try:
            model(**kwargs)
            messages.append("accepted")
        except ValueError as e:
            messages.append(str(e))
    return messages


def test_apply_usp_refuses_misuse(dist_pools, tiny_llama):
    for missing_pos, padding in dist_pools(4).run(misuse_errors, tiny_llama):
        assert "needs position_ids" in missing_pos
        assert "take no attention_mask" in padding


def packed_names(model_dir: str) -> dict:
    """Worker: the boundaries reach the attention function under transformers' names (cu_seq_lens_q/k,
    max_length_q/k); the ``cu_seqlens`` alias gives the same logits; unequal q/k boundaries are refused."""
    from usp.model import packed_sequence_kwargs
    from usp.model import usp_attention_fn as fn

    mesh = cached_sp_mesh(2, 2, "zigzag", 1)
    model = apply_usp(load_causal_lm(model_dir, dtype=torch.float32), mesh)
    b = _packed(model.config.vocab_size)
    ids, pos = shard_sequence(b["input_ids"], mesh), shard_sequence(b["position_ids"], mesh)
    seen: list[set] = []
    original = fn.usp_attention_forward

    def spy(*args, **kwargs):
        seen.append({k for k in kwargs if k.startswith(("cu_seq", "max_length"))})
        return original(*args, **kwargs)

    from transformers import AttentionInterface

    AttentionInterface.register(fn.ATTN_IMPLEMENTATION, spy)
    try:
        named = model(input_ids=ids, position_ids=pos, **packed_sequence_kwargs(b["cu"])).logits
    finally:
        AttentionInterface.register(fn.ATTN_IMPLEMENTATION, original)
    alias = model(input_ids=ids, position_ids=pos, cu_seqlens=b["cu"]).logits
    try:
        other = b["cu"].clone()
        other[1] += 1
        model(input_ids=ids, position_ids=pos, cu_seq_lens_q=b["cu"], cu_seq_lens_k=other)
        refused = "accepted"
    except ValueError as e:
        refused = str(e)
    return {
        "seen": seen[0],
        "same": torch.equal(named, alias),
        "refused": refused,
        "kwargs": {k: v for k, v in packed_sequence_kwargs(b["cu"]).items() if k.startswith("max")},
    }


def test_boundaries_travel_under_transformers_names(dist_pools, tiny_llama):
    for out in dist_pools(4).run(packed_names, tiny_llama):
        assert out["seen"] == {"cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"}
        assert out["same"] and out["kwargs"] == {
            "max_length_q": max(DOC_LENGTHS),
            "max_length_k": max(DOC_LENGTHS),
        }
        assert "cu_seq_lens_k must equal cu_seq_lens_q" in out["refused"]
