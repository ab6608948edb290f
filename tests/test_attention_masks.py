"""Sliding windows, chunks, softcapping and sinks through usp_attention, against single-process attention.

Every case compares the gathered output AND dq, dk, dv (and d sinks) with a float64 single-process reference
(:func:`usp.attention.reference.reference_attention` with the same window / chunk / softcap / sinks) on the
whole sequence, under every Ulysses x ring split of the world, the contiguous, zigzag and balanced layouts,
with and without packed documents. float64 cases are exact (``EXACT_TOL``); a few run in bf16 at the rule's
tolerance. The window and chunk sizes are shorter than a ring part, so blocks are skipped and banded.
"""

from __future__ import annotations

import pytest
import torch

from tests.mesh_cache import cached_sp_mesh
from tests.tolerance import assert_close_scaled, rounding_tolerance
from usp.attention import usp_attention
from usp.attention.blocks import BlockSpec, plan_banded_blocks, plan_ring_blocks, ring_steps_needed
from usp.attention.reference import reference_attention
from usp.parallel import gather_sequence, shard_sequence
from usp.plan.compute import attention_pairs

HEAD_DIM = 8
SEQ_LEN = 48
DOCS = [0, 5, 19, 20, 33, 48]  # a 1-token document, documents crossing ring parts and zigzag chunks
OPTIONS = [
    dict(window=5),
    dict(window=13, cu_seqlens=DOCS),
    dict(chunk=8),
    dict(chunk=20, window=7, cu_seqlens=DOCS),
    dict(softcap=1.5),
    dict(softcap=2.0, window=9, cu_seqlens=DOCS),
    dict(sinks=True),
    dict(sinks=True, window=6, cu_seqlens=DOCS),
]


def _inputs(case: dict):
    g = torch.Generator().manual_seed(case["seed"])
    dtype = getattr(torch, case["dtype"])
    b, s, hq, hkv = 1, SEQ_LEN, case["hq"], case["hkv"]
    q, k, v, dout = (torch.randn(b, s, h, HEAD_DIM, generator=g).to(dtype) for h in (hq, hkv, hkv, hq))
    sinks = torch.randn(hq, generator=g).to(dtype) if case.get("sinks") else None
    return q, k, v, dout, sinks


def _options(case: dict) -> dict:
    return {name: case.get(name) for name in ("window", "chunk", "softcap")}


def run_cases(cases: list[dict]) -> list[list[torch.Tensor] | None]:
    """Worker: each case forward + backward; sp rank 0 returns gathered [out, dq, dk, dv(, dsinks)]."""
    results = []
    for case in cases:
        mesh = cached_sp_mesh(case["ulysses"], case["ring"], case["layout"])
        q, k, v, dout, sinks = _inputs(case)
        cu = case.get("cu_seqlens")
        cu = None if cu is None else torch.tensor(cu, dtype=torch.int32)
        ql, kl, vl = (shard_sequence(t, mesh, cu_seqlens=cu).requires_grad_() for t in (q, k, v))
        if sinks is not None:
            sinks.requires_grad_()
        out = usp_attention(ql, kl, vl, mesh=mesh, cu_seqlens=cu, sinks=sinks, **_options(case))
        out.backward(shard_sequence(dout, mesh, cu_seqlens=cu))
        got = [gather_sequence(t, mesh, cu_seqlens=cu) for t in (out.detach(), ql.grad, kl.grad, vl.grad)]
        if sinks is not None:
            dsinks = sinks.grad.clone()
            torch.distributed.all_reduce(dsinks, group=mesh.sp_group)  # each rank: its rows' share
            got.append(dsinks)
        results.append(got if mesh.sp_rank == 0 else None)
    return results


def reference(case: dict) -> list[torch.Tensor]:
    q, k, v, dout, sinks = _inputs(case)
    q, k, v = (t.double().requires_grad_() for t in (q, k, v))
    if sinks is not None:
        sinks = sinks.double().requires_grad_()
    cu = case.get("cu_seqlens")
    out = reference_attention(
        q, k, v, cu_seqlens=None if cu is None else torch.tensor(cu), sinks=sinks, **_options(case)
    )
    out.backward(dout.double())
    return [out.detach(), q.grad, k.grad, v.grad] + ([sinks.grad] if sinks is not None else [])


def matrix(world: int) -> list[dict]:
    cases, i = [], 0
    splits = [(u, world // u) for u in range(1, world + 1) if world % u == 0]
    heads = [(4, 2), (8, 2), (6, 2), (4, 1)]
    for u, r in splits:
        layouts = ("contiguous", "zigzag", "balanced") if r > 1 else ("zigzag",)
        for layout in layouts:
            for opts in OPTIONS:
                if layout == "balanced" and "cu_seqlens" not in opts:
                    continue  # balanced is placed from documents (zigzag without)
                hq, hkv = heads[i % len(heads)]
                if hq % u and hkv % u and u % hkv:
                    hq, hkv = 4, 2
                dtype = "bfloat16" if i % 9 == 8 else "float64"
                cases.append(
                    dict(ulysses=u, ring=r, layout=layout, hq=hq, hkv=hkv, dtype=dtype, seed=i, **opts)
                )
                i += 1
    return cases


def check(pool, cases: list[dict]) -> None:
    per_rank = pool.run(run_cases, cases)
    for i, case in enumerate(cases):
        ref = reference(case)
        name = " ".join(f"{k}={v}" for k, v in case.items() if k != "seed")
        tol = rounding_tolerance(getattr(torch, case["dtype"]), SEQ_LEN)
        for rank, got in enumerate(per_rank):
            if got[i] is None:
                continue
            assert len(got[i]) == len(ref)
            for what, a, b in zip(("out", "dq", "dk", "dv", "dsinks"), got[i], ref):
                assert_close_scaled(a.double(), b, tol, msg=f"{what} rank={rank} {name}")


@pytest.mark.parametrize("world", [1, 2, 4])
def test_masked_attention_matches_single_process(dist_pools, world):
    check(dist_pools(world), matrix(world))


def test_options_change_the_result():
    """The reference itself differs with each option (so the matrix above can fail)."""
    case = dict(hq=4, hkv=2, dtype="float64", seed=0)
    q, k, v, _, _ = _inputs(case)
    base = reference_attention(q, k, v)
    for opts in (dict(window=5), dict(chunk=8), dict(softcap=0.5), dict(sinks=torch.ones(4, dtype=q.dtype))):
        assert (reference_attention(q, k, v, **opts) - base).abs().max() > 1e-3, opts


def _pairs(plans: list[BlockSpec | None]) -> int:
    return sum(p.pairs() for p in plans if p is not None)


def test_window_skips_blocks_and_ring_steps():
    """Ring 8, contiguous, a window of S/8: every rank computes at most the window's share of the causal
    pairs plus one block, and the ring runs 2 steps (K/V sent once per rank, not 7 times)."""
    seq, ring = 1024, 8
    window, part = seq // 8, seq // ring
    banded = [plan_banded_blocks(seq, ring, r, "contiguous", None, window, None) for r in range(ring)]
    causal = [plan_ring_blocks(seq, ring, r, "contiguous", True) for r in range(ring)]
    assert ring_steps_needed(causal) == ring
    assert ring_steps_needed(banded) == 2
    total = seq * (seq + 1) // 2
    for r in range(ring):
        share = (2 * window / seq) * _pairs(causal[r])
        assert _pairs(banded[r]) <= share + part * part, (r, _pairs(banded[r]), share)
        assert all(p is None for p in banded[r][2:])
    # all ranks together attend exactly the window's pairs
    expected = sum(min(i + 1, window) for i in range(seq))
    assert sum(_pairs(b) for b in banded) == expected < total


def test_window_under_zigzag_and_documents_counts_every_pair_once():
    seq, ring, window = 96, 4, 10
    cu = torch.tensor([0, 7, 40, 41, 96])
    doc = torch.searchsorted(cu, torch.arange(seq), right=True) - 1
    expected = sum(
        int(((j > i - window) & (doc[: i + 1] == doc[i])[j]).item()) for i in range(seq) for j in range(i + 1)
    )
    for layout in ("zigzag", "contiguous", "balanced"):
        plans = [plan_banded_blocks(seq, ring, r, layout, cu, window, None) for r in range(ring)]
        assert sum(_pairs(p) for p in plans) == expected, layout
    # the planner's and the MFU's count of the same work
    assert attention_pairs([[7, 33, 1, 55]], window=window) == expected


def test_chunks_and_windows_count_the_pairs_the_ring_computes():
    seq, ring, cu = 96, 4, torch.tensor([0, 30, 31, 96])
    for window, chunk in ((None, 8), (5, 8), (12, None), (3, 40)):
        for layout in ("zigzag", "contiguous", "balanced"):
            plans = [plan_banded_blocks(seq, ring, r, layout, cu, window, chunk) for r in range(ring)]
            got = sum(_pairs(p) for p in plans)
            assert got == attention_pairs([[30, 1, 65]], window=window, chunk=chunk), (window, chunk, layout)


@pytest.mark.parametrize("backend", ["cpu_flash", "math"])
@pytest.mark.parametrize("softcap", [None, 1.5])
def test_banded_blocks_run_in_tiles_exactly(backend, softcap):
    """A band larger than the dense-mask limit runs one masked call per tile of rows (each mask within the
    limit, keys outside the tile's reach never touched); out, lse and the gradients equal one call's."""
    from usp.attention.kernels import attention_backward, attention_forward
    from usp.attention.masks import RowRanges

    g = torch.Generator().manual_seed(5)
    sq, window = 96, 9
    rows = torch.arange(sq)
    lo, hi = (rows - window + 1).clamp(min=0), rows + 1
    lo[40:44] = hi[40:44] = 40  # rows attending to nothing
    q = torch.randn(2, sq, 4, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, sq, 2, 8, generator=g, dtype=torch.float64) for _ in range(2))
    dout = torch.randn(2, sq, 4, 8, generator=g, dtype=torch.float64)
    whole, tiled = RowRanges.build(lo, hi, max_elements=sq * sq), RowRanges.build(lo, hi, max_elements=256)
    assert not whole.tiles and len(tiled.tiles) > 4
    assert all((b - a) * (k1 - k0) <= 256 for a, b, k0, k1, _ in tiled.tiles)
    kw = dict(causal=False, softmax_scale=0.3, backend=backend, softcap=softcap)
    results = []
    for band in (whole, tiled):
        out, lse = attention_forward(q, k, v, segments=band, **kw)
        grads = attention_backward(dout, q, k, v, out, lse, segments=band, **kw)
        results.append((out, lse, *grads))
    for a, b in zip(*results):
        assert_close_scaled(a, b, rounding_tolerance(torch.float64, sq))
    ref_q, ref_k, ref_v = (t.clone().requires_grad_() for t in (q, k, v))
    mask_ref = reference_attention(ref_q, ref_k, ref_v, softmax_scale=0.3, window=window, softcap=softcap)
    out = results[1][0]
    live = torch.ones(sq, dtype=torch.bool)
    live[40:44] = False
    assert_close_scaled(out[:, live], mask_ref[:, live].detach(), rounding_tolerance(torch.float64, sq))
    assert bool((out[:, ~live] == 0).all()) and bool(torch.isinf(results[1][1][:, :, ~live]).all())
