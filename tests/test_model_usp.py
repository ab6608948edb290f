"""apply_usp: an apply_usp'd model fed this rank's slice returns the unsharded model's logits at that slice."""

from __future__ import annotations

import pytest
import torch

from tests.mesh_cache import cached_sp_mesh
from usp.model import apply_usp, load_causal_lm
from usp.parallel import gather_sequence, shard_sequence
from usp.tiny import build_tiny_llama

SEQ_LEN = 32


def _inputs(vocab: int, batch: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, vocab, (batch, SEQ_LEN), generator=g)
    pos = torch.arange(SEQ_LEN).expand(batch, -1).clone()
    return ids, pos


def usp_logits(model_dir: str, ulysses: int, ring: int, layout: str) -> dict | None:
    """Worker: sharded forward + backward of sum(logits * w); rank 0 returns gathered logits and grads."""
    mesh = cached_sp_mesh(ulysses, ring, layout, 1)
    model = apply_usp(load_causal_lm(model_dir, dtype=torch.float32), mesh)
    ids, pos = _inputs(model.config.vocab_size)
    logits = model(input_ids=shard_sequence(ids, mesh), position_ids=shard_sequence(pos, mesh)).logits
    w = shard_sequence(torch.linspace(-1, 1, SEQ_LEN)[None, :, None], mesh)
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


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> str:
    return str(build_tiny_llama(tmp_path_factory.mktemp("tiny") / "llama"))


@pytest.mark.parametrize(
    "ulysses, ring, layout",
    [(2, 2, "zigzag"), (4, 1, "zigzag"), (1, 4, "zigzag"), (2, 2, "contiguous")],
    ids=["u2r2", "u4r1", "u1r4", "u2r2-contiguous"],
)
def test_apply_usp_logits_and_grads_match_unsharded(dist_pools, tiny_llama, ulysses, ring, layout):
    out = dist_pools(4).run(usp_logits, tiny_llama, ulysses, ring, layout)[0]
    model = load_causal_lm(tiny_llama, dtype=torch.float32)
    ids, pos = _inputs(model.config.vocab_size)
    logits = model(input_ids=ids, position_ids=pos).logits
    (logits * torch.linspace(-1, 1, SEQ_LEN)[None, :, None]).sum().backward()
    torch.testing.assert_close(out["logits"], logits.detach(), rtol=1e-5, atol=1e-5)
    for name, p in model.named_parameters():
        torch.testing.assert_close(out["grads"][name], p.grad, rtol=1e-4, atol=1e-5, msg=name)
