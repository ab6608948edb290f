"""usp_attention on every ulysses x ring factorization of world 1, 2, 4, 8 vs single-process attention.

Every case compares the gathered output AND dq, dk, dv with a float64 single-process reference on the whole
sequence (the same inputs, rounded to the case dtype first). The factorization matrix runs in float64 (exact:
``tests.tolerance.EXACT_TOL``) and bf16; a few cases in fp32. fp32/bf16 tolerances:
``tests.tolerance.rounding_tolerance`` over the sequence (the softmax's keys, the queries summed into dk/dv),
as rtol and as atol times the reference's largest magnitude.
"""

from __future__ import annotations

import itertools
import time

import pytest
import torch

from tests.dist_pool import DistPool, WorkerError
from tests.mesh_cache import cached_sp_mesh
from tests.tolerance import assert_close_scaled, rounding_tolerance
from usp.attention import usp_attention
from usp.attention.reference import reference_attention
from usp.parallel import gather_sequence, shard_sequence

HEAD_DIM = 8


def case_tolerance(case: dict) -> float:
    """The rule's tolerance for a case: its dtype over its sequence length (float64: the exact tolerance)."""
    return rounding_tolerance(getattr(torch, case["dtype"]), case["seq_len"])


def make_inputs(seed: int, batch: int, seq_len: int, hq: int, hkv: int, dtype: torch.dtype):
    """Global q, k, v, dout, identical in the workers and in the test process."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(batch, seq_len, hq), (batch, seq_len, hkv), (batch, seq_len, hkv), (batch, seq_len, hq)]
    return [torch.randn(*s, HEAD_DIM, generator=g).to(dtype) for s in shapes]


def run_usp_cases(cases: list[dict]) -> list[list[torch.Tensor] | None]:
    """Worker: run each case (fwd + bwd); sp rank 0 of each replica returns the gathered [out, dq, dk, dv]."""
    results = []
    for case in cases:
        mesh = cached_sp_mesh(case["ulysses"], case["ring"], case["layout"])
        q, k, v, dout = make_inputs(
            case["seed"],
            case["batch"],
            case["seq_len"],
            case["hq"],
            case["hkv"],
            getattr(torch, case["dtype"]),
        )
        cu = case.get("cu_seqlens")
        cu = None if cu is None else torch.tensor(cu, dtype=torch.int32)  # places the balanced layout
        ql, kl, vl = (shard_sequence(t, mesh, cu_seqlens=cu) for t in (q, k, v))
        if case.get("strided"):  # as the trainer passes them: [B, H, S, D] storage viewed as [B, S, H, D]
            ql, kl, vl = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (ql, kl, vl))
        ql, kl, vl = (t.requires_grad_() for t in (ql, kl, vl))
        out = usp_attention(
            ql,
            kl,
            vl,
            mesh=mesh,
            causal=case["causal"],
            backend=case.get("backend", "auto"),
            cu_seqlens=cu,
            attn_head_chunks=case.get("attn_head_chunks", 1),
        )
        out.backward(shard_sequence(dout, mesh, cu_seqlens=cu))
        gathered = [
            gather_sequence(t, mesh, cu_seqlens=cu) for t in (out.detach(), ql.grad, kl.grad, vl.grad)
        ]
        results.append(gathered if mesh.sp_rank == 0 else None)  # one report per data-parallel replica
    return results


def reference_results(case: dict) -> list[torch.Tensor]:
    q, k, v, dout = make_inputs(
        case["seed"], case["batch"], case["seq_len"], case["hq"], case["hkv"], getattr(torch, case["dtype"])
    )
    q, k, v = (t.double().requires_grad_() for t in (q, k, v))
    cu = case.get("cu_seqlens")
    out = reference_attention(
        q, k, v, causal=case["causal"], cu_seqlens=None if cu is None else torch.tensor(cu)
    )
    out.backward(dout.double())
    return [out.detach(), q.grad, k.grad, v.grad]


def check_cases(pool: DistPool, cases: list[dict]) -> dict[str, float]:
    """Run all cases in one pool call and assert each against the reference; return max errors by case."""
    per_rank = pool.run(run_usp_cases, cases)
    errors = {}
    for i, case in enumerate(cases):
        ref = reference_results(case)
        reports = [(rank, got[i]) for rank, got in enumerate(per_rank) if got[i] is not None]
        assert len(reports) == pool.world_size // (case["ulysses"] * case["ring"]), (
            "one report per dp replica"
        )
        for rank, results in reports:
            name = f"rank={rank} " + " ".join(f"{k}={v}" for k, v in case.items() if k != "seed")
            for what, a, b in zip(("out", "dq", "dk", "dv"), results, ref):
                assert a.dtype == getattr(torch, case["dtype"]), f"{what} dtype for {name}"
                assert_close_scaled(a.double(), b, case_tolerance(case), msg=f"{what} {name}")
            errors[name] = max(float((a.double() - b).abs().max()) for a, b in zip(results, ref))
    return errors


def factorizations(world: int) -> list[tuple[int, int]]:
    return [(u, world // u) for u in range(1, world + 1) if world % u == 0]


def matrix(world: int, heads: list[tuple[int, int]], seq_len: int) -> list[dict]:
    cases = []
    combos = itertools.product(
        factorizations(world), ("zigzag", "contiguous"), (True, False), heads, ("float64", "bfloat16")
    )
    for i, ((u, r), layout, causal, (hq, hkv), dtype) in enumerate(combos):
        if r == 1 and layout == "contiguous":
            continue  # same as zigzag when there is no ring
        cases.append(
            dict(
                ulysses=u,
                ring=r,
                layout=layout,
                causal=causal,
                hq=hq,
                hkv=hkv,
                dtype=dtype,
                batch=2,
                seq_len=seq_len,
                seed=1000 + i,
            )
        )
    return cases


@pytest.mark.parametrize("world", [1, 2, 4])
def test_usp_matches_single_process(dist_pools, world):
    heads = [(4, 4), (8, 2), (4, 1)]
    check_cases(dist_pools(world), matrix(world, heads, seq_len=32))


@pytest.mark.slow
def test_usp_matches_single_process_world8(dist_pools):
    heads = [(8, 8), (8, 2), (8, 1)]
    check_cases(dist_pools(8), matrix(8, heads, seq_len=32))


def test_usp_with_data_parallel_replicas(dist_pools):
    """World 4 with ulysses x ring = 2: two dp replicas, each its own (non-zero-based) groups."""
    base = dict(layout="zigzag", causal=True, dtype="float32", batch=1, seq_len=32, seed=11)
    cases = [dict(base, ulysses=1, ring=2, hq=4, hkv=1), dict(base, ulysses=2, ring=1, hq=8, hkv=2)]
    check_cases(dist_pools(4), cases)


@pytest.mark.slow
def test_bf16_error_does_not_grow_with_ring_degree(dist_pools):
    """bf16 out/grad error at ring 8 is at most 2x the error at ring 2 (same inputs, fp32 merge)."""
    base = dict(ulysses=1, layout="zigzag", causal=True, hq=4, hkv=2, dtype="bfloat16", batch=1, seq_len=256)
    errs = {}
    for world in (2, 8):
        case = dict(base, ring=world, seed=7)
        got = dist_pools(world).run(run_usp_cases, [case])[0][0]
        ref = reference_results(case)
        errs[world] = max(float((a.double() - b).abs().max() / b.abs().max()) for a, b in zip(got, ref))
    print("bf16 relative max error by ring degree:", errs)
    assert errs[8] <= 2.0 * errs[2], errs


def test_backends_agree_on_cpu(dist_pools):
    """Both CPU backends (math reference, CPU flash), with contiguous and strided inputs, match the reference."""
    cases = [
        dict(
            ulysses=2,
            ring=2,
            layout="zigzag",
            causal=True,
            hq=8,
            hkv=2,
            dtype="float32",
            batch=1,
            seq_len=32,
            seed=5,
            backend=b,
            strided=strided,
        )
        for b in ("math", "cpu_flash")
        for strided in (False, True)
    ]
    check_cases(dist_pools(4), cases)


# --- bad inputs and failures ----------------------------------------------------------------------------


def run_bad_inputs() -> list[str]:
    """Worker (world 2, ulysses 2): every rejected input must raise ValueError before communicating."""
    mesh = cached_sp_mesh(2, 1, "zigzag")
    t = lambda *s: torch.randn(*s)  # noqa: E731
    bad = [
        lambda: usp_attention(t(1, 4, 1, 8), t(1, 4, 1, 8), t(1, 4, 1, 8), mesh=mesh),  # 1 head on ulysses 2
        lambda: usp_attention(t(1, 4, 4, 8), t(1, 4, 3, 8), t(1, 4, 3, 8), mesh=mesh),  # 4 q / 3 kv
        lambda: usp_attention(t(1, 3, 4, 8), t(1, 3, 4, 8), t(1, 3, 4, 8), mesh=mesh),  # S = 6
        lambda: usp_attention(t(4, 4, 8), t(4, 4, 8), t(4, 4, 8), mesh=mesh),  # 3-D
        lambda: usp_attention(t(1, 4, 4, 8), t(1, 4, 2, 8), t(1, 4, 4, 8), mesh=mesh),  # k != v
        lambda: usp_attention(t(1, 4, 4, 8), t(1, 4, 4, 8), t(1, 4, 4, 8), mesh=mesh, backend="nope"),
        lambda: usp_attention(t(1, 4, 4, 8), t(1, 4, 4, 8), t(1, 4, 4, 8), mesh=mesh, backend="sdpa_flash"),
        lambda: usp_attention(t(1, 4, 4, 8), t(1, 4, 4, 8), t(1, 4, 4, 8), mesh=None),
        lambda: usp_attention(
            t(2, 4, 4, 8),
            t(2, 4, 4, 8),
            t(2, 4, 4, 8),
            mesh=mesh,
            cu_seqlens=torch.tensor([0, 8], dtype=torch.int32),
        ),
        lambda: usp_attention(
            t(1, 4, 4, 8),
            t(1, 4, 4, 8),
            t(1, 4, 4, 8),
            mesh=mesh,
            cu_seqlens=torch.tensor([0, 4], dtype=torch.int32),
        ),
        lambda: usp_attention(
            t(1, 4, 4, 8), t(1, 4, 4, 8), t(1, 4, 4, 8), mesh=mesh, cu_seqlens=torch.tensor([0.0, 8.0])
        ),
    ]
    messages = []
    for fn in bad:
        try:
            fn()
        except ValueError as e:
            messages.append(str(e))
        else:
            messages.append("NO ERROR")
    return messages


def test_bad_inputs_raise_value_error(dist_pools):
    messages = dist_pools(2).run(run_bad_inputs)[0]
    expected = [
        r"parallel.ulysses_degree=2 does not fit num_heads=1.*ulysses_degree in 1\.\.1",
        r"num_heads=4 is not a multiple of num_kv_heads=3",
        r"sequence length 6 is not divisible by 4.*trainer.seq_len = 4 or 8",
        r"expects q \[B, S_local, Hq, D\]",
        r"k and v must have the same shape",
        r"backend='nope' is unknown",
        r"backend='sdpa_flash' needs CUDA",
        r"mesh must be a usp.parallel.SPMesh",
        r"needs batch size 1",
        r"rise from 0 to the GLOBAL sequence length 8",
        r"1-D integer tensor",
    ]
    assert len(messages) == len(expected)
    for msg, pattern in zip(messages, expected):
        assert msg != "NO ERROR", pattern
        assert __import__("re").search(pattern, msg), (pattern, msg)


def run_rank_fails_mid_ring() -> None:
    """Worker: ring rank 1 dies before posting its first K/V send; rank 0 must time out, not hang."""
    from usp.attention import comm

    mesh = cached_sp_mesh(1, 2, "zigzag")
    if torch.distributed.get_rank() == 1:

        def broken_start(self, tensors):
            raise RuntimeError("injected failure on ring rank 1")

        comm.RingExchange.start = broken_start
    q = torch.randn(1, 4, 2, 8)
    usp_attention(q, q, q, mesh=mesh)


def test_rank_failing_mid_ring_does_not_hang():
    pool = DistPool(2, timeout=120, collective_timeout_s=5)
    try:
        start = time.monotonic()
        with pytest.raises(WorkerError) as info:
            pool.run(run_rank_fails_mid_ring)
        assert time.monotonic() - start < 60
        assert "injected failure on ring rank 1" in info.value.tracebacks[1]
        assert 0 in info.value.tracebacks, "rank 0 should fail with a timeout, not hang"
    finally:
        pool.close()
