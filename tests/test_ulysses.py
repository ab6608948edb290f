"""Ulysses all-to-all: exact layout after seq_to_head, inverse, autograd, GQA replication, bytes counted."""

from __future__ import annotations

import pytest
import torch

from tests.mesh_cache import cached_sp_mesh
from usp.attention import record_comm
from usp.attention.heads import ulysses_heads
from usp.attention.ulysses import head_to_seq, kv_seq_to_head, seq_to_head
from usp.parallel import shard_sequence


def run_all_to_all(ulysses: int, hkv: int) -> dict:
    mesh = cached_sp_mesh(ulysses, 1, "zigzag")
    u, group = mesh.ulysses_rank, mesh.ulysses_group
    x = torch.arange(2 * 8 * 4 * 3, dtype=torch.float32).reshape(2, 8, 4, 3)  # global [B, S, H, D]
    local = shard_sequence(x, mesh).requires_grad_()  # [B, S/U, H, D]
    with record_comm() as stats:
        heads = seq_to_head(local, group)  # [B, S, H/U, D]
    hl = 4 // ulysses
    # the whole sequence (ring rank 0's part = everything), for this rank's head group
    assert torch.equal(heads, x[:, :, u * hl : (u + 1) * hl])
    assert stats.bytes_sent == local.numel() * 4 * (ulysses - 1) // ulysses
    assert torch.equal(head_to_seq(heads, group), local)
    (heads * (u + 1)).sum().backward()  # grad of head group j is j + 1
    expected = torch.arange(1, ulysses + 1, dtype=torch.float32).repeat_interleave(hl)
    assert torch.equal(local.grad[0, 0, :, 0], expected)
    # GQA: hkv KV heads, replicated when fewer than the degree
    kv = x[:, :, :hkv].clone()
    kv_local = shard_sequence(kv, mesh).requires_grad_()
    layout = ulysses_heads(4, hkv, ulysses)
    rep = max(1, ulysses // hkv)  # the classic layout: each KV head sent to U / Hkv ranks
    kv_heads = kv_seq_to_head(kv_local, group, layout, "k")
    per_rank = max(hkv, ulysses) // ulysses
    owner = u * hkv // ulysses if hkv < ulysses else u * per_rank  # the first KV head this rank's queries use
    assert torch.equal(kv_heads, kv[:, :, owner : owner + per_rank])
    kv_heads.sum().backward()
    return {"kv_grad": kv_local.grad[0, 0, :, 0].tolist(), "rep": rep}


@pytest.mark.parametrize("ulysses, hkv", [(4, 4), (4, 2), (4, 1), (2, 4)])
def test_all_to_all_world4(dist_pools, ulysses, hkv):
    results = dist_pools(4).run(run_all_to_all, ulysses, hkv)
    rep = results[0]["rep"]
    assert rep == (ulysses // hkv if hkv < ulysses else 1)
    # every KV head's gradient is the sum over its copies (rep copies, each contributing 1 per element)
    for r in results:
        assert r["kv_grad"] == [float(rep)] * hkv


def test_classic_layouts_and_errors():
    assert ulysses_heads(8, 2, 4).kv_send_index() == [0, 0, 1, 1]  # 2 KV heads, ulysses 4: each to 2 ranks
    assert ulysses_heads(4, 1, 4).kv_send_index() == [0, 0, 0, 0]
    assert ulysses_heads(8, 8, 4).kv_send_index() == list(range(8))
    assert ulysses_heads(32, 8, 8).kv_send_index() == list(range(8))
    assert ulysses_heads(8, 8, 3).q_counts == (3, 3, 2)  # uneven now works
    with pytest.raises(ValueError, match=r"ulysses_degree in 1\.\.8"):
        ulysses_heads(8, 8, 9)
    with pytest.raises(ValueError, match="not a multiple of num_kv_heads"):
        ulysses_heads(8, 3, 1)
