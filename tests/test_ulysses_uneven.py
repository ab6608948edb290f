"""Uneven Ulysses heads: the head layout arithmetic, and usp_attention exact in float64 (output and gradients)
against single-process attention when the Ulysses degree does not divide the query or KV head counts."""

from __future__ import annotations

import pytest
import torch

from tests.mesh_cache import cached_sp_mesh
from tests.tolerance import EXACT_TOL
from usp.attention import check_attn_head_chunks, record_comm, usp_attention
from usp.attention.cost import analytic_bytes_sent
from usp.attention.heads import ulysses_heads
from usp.attention.reference import reference_attention
from usp.attention.ulysses import head_to_seq, kv_seq_to_head, seq_to_head
from usp.parallel import gather_sequence, shard_sequence

HEAD_DIM = 4
# float64 end to end (the ring's accumulators follow the input dtype): rounding ~1e-15, a wrong head or a lost
# gradient copy O(1).
DTYPE = torch.float64
TOL = EXACT_TOL


def test_smollm2_heads_at_two_and_four():
    h2 = ulysses_heads(9, 3, 2)
    assert h2.q_counts == (5, 4) and h2.kv_firsts == (0, 1)
    # rank 0: query heads 0-4 = three of KV head 0, two of KV head 1 (gcd 1: 3 + 2 local copies)
    assert h2.kv_copies == ((3, 2), (1, 3)) and h2.kv_counts() == (2, 2)
    assert h2.kv_send_index() == [0, 1, 1, 2]  # KV head 1 straddles the two ranks: sent to both
    assert h2.kv_expand_index(0) == [0, 0, 0, 1, 1] and not h2.even
    h4 = ulysses_heads(9, 3, 4)
    assert h4.q_counts == (3, 2, 2, 2) and h4.kv_copies == ((1,), (1,), (1, 1), (1,))
    assert h4.kv_send_index() == [0, 1, 1, 2, 2] and h4.kv_expand_index(2) is None
    assert h4.max_q_heads == 3 and h4.busiest_rank() == 0


def test_qwen25_7b_heads_at_eight():
    h = ulysses_heads(28, 4, 8)  # G = 7
    assert h.q_counts == (4, 4, 4, 4, 3, 3, 3, 3)
    assert h.kv_copies[0] == (1,) and h.kv_copies[1] == (3, 1)  # q 4-7: three of KV 0, one of KV 1
    for j in range(8):  # every local layout is a uniform GQA group covering exactly the rank's query heads
        assert h.q_counts[j] % h.local_kv_heads(j) == 0


@pytest.mark.parametrize("hq, hkv, u", [(32, 8, 8), (8, 2, 4), (4, 1, 4), (8, 8, 4), (4, 2, 2), (64, 8, 16)])
def test_even_layouts_are_the_classic_ones(hq, hkv, u):
    h = ulysses_heads(hq, hkv, u)
    assert h.even and h.q_counts == (hq // u,) * u
    assert [h.local_kv_heads(j) for j in range(u)] == [max(hkv, u) // u] * u
    # the classic K/V layout: rank j gets KV heads [j Hkv/U, ...) or, replicated, head j Hkv / U
    firsts = [j * hkv // u for j in range(u)]
    assert list(h.kv_firsts) == firsts


def test_what_still_cannot_work():
    with pytest.raises(
        ValueError, match=r"ulysses_degree=10 does not fit num_heads=9.*ulysses_degree in 1\.\.9"
    ):
        ulysses_heads(9, 3, 10)
    with pytest.raises(ValueError, match="not a multiple of num_kv_heads"):
        ulysses_heads(9, 2, 1)
    with pytest.raises(ValueError, match="parallel.attn_head_chunks=3"):
        check_attn_head_chunks(3, 9, 3, 2)  # rank 0 holds 5 query heads
    check_attn_head_chunks(1, 9, 3, 4)


def test_analytic_bytes_follow_each_ranks_heads():
    kw = dict(
        batch=1, seq_len=64, num_heads=9, num_kv_heads=3, head_dim=HEAD_DIM, ring_degree=1, element_size=8
    )
    r0 = analytic_bytes_sent(ulysses_degree=2, ulysses_rank=0, **kw)
    r1 = analytic_bytes_sent(ulysses_degree=2, ulysses_rank=1, **kw)
    token = 32 * HEAD_DIM * 8  # one head of a rank's 32 tokens
    assert r0["fwd"] == (4 + 2 * 2 + 5) * token and r1["fwd"] == (5 + 2 * 2 + 4) * token
    assert analytic_bytes_sent(ulysses_degree=2, **kw) == r0  # the busiest rank by default


def _inputs(seed, seq_len, hq, hkv):
    g = torch.Generator().manual_seed(seed)
    shapes = [(1, seq_len, hq), (1, seq_len, hkv), (1, seq_len, hkv), (1, seq_len, hq)]
    return [torch.randn(*s, HEAD_DIM, generator=g, dtype=torch.float64).to(DTYPE) for s in shapes]


def run_uneven_cases(cases):
    """Worker: sharded fwd + bwd per case; sp rank 0 of each replica returns gathered [out, dq, dk, dv] and the
    bytes the Ulysses all-to-alls sent, every rank its own bytes and its analytic figure."""
    results = []
    for case in cases:
        u, r = case["ulysses"], case["ring"]
        mesh = cached_sp_mesh(u, r, case["layout"])
        q, k, v, dout = _inputs(case["seed"], case["seq_len"], case["hq"], case["hkv"])
        cu = None if case.get("cu") is None else torch.tensor(case["cu"], dtype=torch.int32)
        ql, kl, vl = (shard_sequence(t, mesh, cu_seqlens=cu).requires_grad_() for t in (q, k, v))
        with record_comm() as stats:
            out = usp_attention(
                ql,
                kl,
                vl,
                mesh=mesh,
                causal=case["causal"],
                cu_seqlens=cu,
                attn_head_chunks=case.get("chunks", 1),
            )
            out.backward(shard_sequence(dout, mesh, cu_seqlens=cu))
        sent = sum(n for kind, n in stats.bytes_by_kind.items() if kind.startswith("ulysses"))
        want = analytic_bytes_sent(  # the Ulysses terms only: one ring rank's part, as if R = 1
            batch=1,
            seq_len=case["seq_len"] // r,
            num_heads=case["hq"],
            num_kv_heads=case["hkv"],
            head_dim=HEAD_DIM,
            ulysses_degree=u,
            ring_degree=1,
            element_size=DTYPE.itemsize,
            ulysses_rank=mesh.ulysses_rank,
        )["fwd_bwd"]
        gathered = [
            gather_sequence(t, mesh, cu_seqlens=cu) for t in (out.detach(), ql.grad, kl.grad, vl.grad)
        ]
        results.append({"tensors": gathered if mesh.sp_rank == 0 else None, "sent": sent, "want": want})
    return results


def _reference(case):
    q, k, v, dout = _inputs(case["seed"], case["seq_len"], case["hq"], case["hkv"])
    q, k, v = (t.double().requires_grad_() for t in (q, k, v))
    cu = None if case.get("cu") is None else torch.tensor(case["cu"])
    out = reference_attention(q, k, v, causal=case["causal"], cu_seqlens=cu)
    out.backward(dout.double())
    return [out.detach(), q.grad, k.grad, v.grad]


def _check(pool, cases):
    per_rank = pool.run(run_uneven_cases, cases)
    for i, case in enumerate(cases):
        expected = _reference(case)
        for rank_results in per_rank:
            res = rank_results[i]
            assert res["sent"] == res["want"], (
                f"{case}: Ulysses bytes sent {res['sent']} != analytic {res['want']}"
            )
            if res["tensors"] is None:
                continue
            for name, got, want in zip(("out", "dq", "dk", "dv"), res["tensors"], expected):
                torch.testing.assert_close(
                    got.double(),
                    want,
                    rtol=TOL,
                    atol=TOL * float(want.abs().max()),
                    msg=lambda m, n=name, c=case: f"{c} {n}: {m}",
                )


def _case(u, r, hq, hkv, seq_len=48, causal=True, layout="zigzag", **extra):
    return dict(
        ulysses=u,
        ring=r,
        hq=hq,
        hkv=hkv,
        seq_len=seq_len,
        causal=causal,
        layout=layout,
        seed=hash((u, r, hq, hkv, causal, layout)) % 1000,
        **extra,
    )


def test_uneven_heads_exact_world4(dist_pools):
    """SmolLM2's 9 / 3 heads at u2r2, u4r1 and u2 x dp2; 5 / 5 (MHA) and 6 / 2 at 4; causal, full, documents."""
    cases = [
        _case(2, 2, 9, 3),
        _case(4, 1, 9, 3),
        _case(2, 1, 9, 3, causal=False),
        _case(4, 1, 5, 5),
        _case(4, 1, 6, 2),
        _case(2, 2, 9, 3, layout="balanced", cu=[0, 10, 31, 48]),
        _case(4, 1, 9, 3, layout="contiguous", cu=[0, 20, 48]),
        _case(2, 2, 9, 3, layout="contiguous", chunks=1),
    ]
    _check(dist_pools(4), cases)


@pytest.mark.slow
def test_qwen25_7b_heads_exact_world8(dist_pools):
    """Qwen2.5-7B's 28 / 4 heads at Ulysses 8 (and u4r2), float64."""
    _check(dist_pools(8), [_case(8, 1, 28, 4, seq_len=32), _case(4, 2, 28, 4, seq_len=32)])


def run_layout(hq, hkv):
    """Worker: each rank's heads after the all-to-all are exactly its range (and the inverse restores them)."""
    mesh = cached_sp_mesh(4, 1, "contiguous")
    heads = ulysses_heads(hq, hkv, 4)
    j, group = mesh.ulysses_rank, mesh.ulysses_group
    x = torch.arange(1 * 8 * hq * 2, dtype=torch.float64).reshape(1, 8, hq, 2)
    kv = x[:, :, :hkv].clone()
    local = shard_sequence(x, mesh)
    qh = seq_to_head(local, group, "q", heads.q_counts)
    first = heads.q_first(j)
    assert torch.equal(qh, x[:, :, first : first + heads.q_counts[j]])
    assert torch.equal(head_to_seq(qh, group, "o", heads.q_counts), local)
    kh = kv_seq_to_head(shard_sequence(kv, mesh), group, heads, "k")
    g = hq // hkv
    read = [(first + i) // g for i in range(heads.q_counts[j])]  # the KV head each local query head reads
    local_g = heads.q_counts[j] // kh.size(2)
    assert torch.equal(kh[:, :, [i // local_g for i in range(heads.q_counts[j])]], kv[:, :, read])
    return True


@pytest.mark.parametrize("hq, hkv", [(9, 3), (6, 2), (7, 7), (10, 2)])
def test_each_rank_gets_its_heads(dist_pools, hq, hkv):
    assert all(dist_pools(4).run(run_layout, hq, hkv))
