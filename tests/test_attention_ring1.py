"""No ring, no ring buffers: ring degree 1 calls the kernel directly; ring > 1 merges in place.

- exactness in float64 (the CPU flash kernel and ``math``; 1e-12 rounding, a bug is 1e-3) against
  single-process float64 attention, out and dq/dk/dv, for every changed path: ring degree 1 at Ulysses 1, 2, 4
  (plain, GQA and MQA, causal and not, documents on the small-mask and per-segment paths, head chunks,
  strided inputs), ring > 1 (the first block initialising the accumulators, the sliced in-place merge and
  gradient sums, head chunks as views, documents and the balanced layout) and a ring of 4 that documents cut
  to one step;
- ring degree 1 runs the kernel forward and backward once per head chunk and sends nothing;
- the peak bytes of forward + backward at world 1 are within 1.1x those of torch's SDPA with
  ``enable_gqa=True`` on the same tensors (fp32 and bf16; the CPU profiler's counts are deterministic);
- head chunks pass views: the bytes they add are one chunk's kernel outputs, not copies of q, k, v;
- merge_block_ never holds a temporary the size of the block.
"""

from __future__ import annotations

import pytest
import torch

from tests.mesh_cache import cached_sp_mesh
from usp.attention import record_comm, usp_attention
from usp.attention.reference import reference_attention
from usp.attention.ring import merge_block_
from usp.parallel import gather_sequence, shard_sequence

DOCS = [0, 1, 7, 20, 21, 33, 48]  # documents of 1 .. 13 tokens crossing chunks and parts (S = 48)
ALIGNED = [0, *range(3, 49, 3)]  # 3-token documents inside every part and chunk: a ring of 4 needs 1 step
F64 = dict(rtol=1e-10, atol=1e-10)  # float64 end to end: rounding is ~1e-14 here


def _inputs(case: dict) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(case["seed"])
    b, s, hq, hkv, d = case["batch"], case["seq_len"], case["hq"], case["hkv"], case.get("head_dim", 8)
    return [torch.randn(b, s, h, d, generator=g, dtype=torch.float64) for h in (hq, hkv, hkv, hq)]


def run_cases(cases: list[dict]) -> list[list[torch.Tensor] | None]:
    """Worker: forward + backward of each case; sp rank 0 returns the gathered ``[out, dq, dk, dv]``."""
    from usp.attention import ring, segmented

    results = []
    for case in cases:
        saved = segmented.DENSE_MASK_MAX_ELEMENTS, ring.MERGE_SLICE_ELEMENTS
        if case.get("per_segment"):
            segmented.DENSE_MASK_MAX_ELEMENTS = 0  # what GPU-sized blocks do with documents
        if case.get("merge_slice"):
            ring.MERGE_SLICE_ELEMENTS = case["merge_slice"]  # several slices per merge and gradient sum
        try:
            mesh = cached_sp_mesh(case["ulysses"], case["ring"], case.get("layout", "zigzag"))
            q, k, v, dout = _inputs(case)
            cu = case.get("cu_seqlens")
            cu = None if cu is None else torch.tensor(cu, dtype=torch.int32)
            ql, kl, vl = (shard_sequence(t, mesh, cu_seqlens=cu) for t in (q, k, v))
            if case.get("strided"):  # [B, H, S, D] storage viewed as [B, S, H, D], as the model passes them
                ql, kl, vl = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (ql, kl, vl))
            ql, kl, vl = (t.requires_grad_() for t in (ql, kl, vl))
            out = usp_attention(
                ql,
                kl,
                vl,
                mesh=mesh,
                causal=case.get("causal", True),
                backend=case.get("backend", "auto"),
                cu_seqlens=cu,
                attn_head_chunks=case.get("chunks", 1),
            )
            out.backward(shard_sequence(dout, mesh, cu_seqlens=cu))
            got = [gather_sequence(t, mesh, cu_seqlens=cu) for t in (out.detach(), ql.grad, kl.grad, vl.grad)]
            results.append(got if mesh.sp_rank == 0 else None)
        finally:
            segmented.DENSE_MASK_MAX_ELEMENTS, ring.MERGE_SLICE_ELEMENTS = saved
    return results


def _reference(case: dict) -> list[torch.Tensor]:
    q, k, v, dout = _inputs(case)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    cu = case.get("cu_seqlens")
    out = reference_attention(
        q, k, v, causal=case.get("causal", True), cu_seqlens=None if cu is None else torch.tensor(cu)
    )
    out.backward(dout)
    return [out.detach(), q.grad, k.grad, v.grad]


def check(pool, cases: list[dict]) -> None:
    per_rank = pool.run(run_cases, cases)
    for i, case in enumerate(cases):
        ref = _reference(case)
        reports = [got[i] for got in per_rank if got[i] is not None]
        assert reports, f"no sp rank 0 reported {case}"
        name = " ".join(f"{k}={v}" for k, v in case.items() if k != "seed")
        for got in reports:
            for what, a, b in zip(("out", "dq", "dk", "dv"), got, ref):
                assert a.dtype == torch.float64, f"{what} {name}: dtype {a.dtype}"
                torch.testing.assert_close(a, b, **F64, msg=lambda m, w=what, n=name: f"{w} {n}: {m}")


def _case(i: int, **kw) -> dict:
    return dict(dict(batch=2, seq_len=48, hq=8, hkv=2, seed=7000 + i), **kw)


def ring1_cases(ulysses: int) -> list[dict]:
    u = ulysses
    specs = [
        dict(hq=8, hkv=2),
        dict(hq=4 * u, hkv=4 * u, causal=False),
        dict(hq=8, hkv=2, backend="math"),
        dict(hq=4 * u, hkv=2 * u, chunks=2),
        dict(hq=4 * u, hkv=2 * u, chunks=2, causal=False, strided=True),
        dict(hq=8, hkv=2, batch=1, cu_seqlens=DOCS),
        dict(hq=8, hkv=2, batch=1, cu_seqlens=DOCS, per_segment=True),
        dict(hq=4 * u, hkv=2 * u, batch=1, cu_seqlens=DOCS, per_segment=True, chunks=2),
        dict(hq=4 * u, hkv=2 * u, batch=1, cu_seqlens=DOCS, chunks=2, causal=False),
    ]
    if u == 1:
        specs += [
            dict(hq=4, hkv=1),
            dict(hq=8, hkv=8, chunks=4, strided=True),
            dict(hq=8, hkv=2, head_dim=64),
        ]
    return [_case(10 * u + i, ulysses=u, ring=1, **s) for i, s in enumerate(specs)]


def ring_cases() -> list[dict]:
    specs = [
        dict(ulysses=1, ring=4),
        dict(ulysses=1, ring=4, merge_slice=16, chunks=2),
        dict(ulysses=1, ring=4, layout="contiguous", causal=False, merge_slice=40),
        dict(ulysses=2, ring=2, hkv=4, chunks=2, strided=True),
        dict(ulysses=1, ring=4, batch=1, cu_seqlens=DOCS, merge_slice=16),
        dict(ulysses=1, ring=4, batch=1, cu_seqlens=DOCS, layout="balanced", chunks=2),
        dict(ulysses=1, ring=4, batch=1, cu_seqlens=DOCS, layout="contiguous", per_segment=True),
        dict(
            ulysses=2, ring=2, hkv=4, batch=1, cu_seqlens=DOCS, layout="balanced", per_segment=True, chunks=2
        ),
        dict(ulysses=1, ring=4, batch=1, cu_seqlens=ALIGNED),  # one ring step: the direct path at ring 4
        dict(ulysses=1, ring=4, batch=1, cu_seqlens=ALIGNED, layout="contiguous", chunks=2),
    ]
    return [_case(100 + i, **s) for i, s in enumerate(specs)]


def test_ring1_world1_is_exact_in_float64(dist_pools):
    check(dist_pools(1), ring1_cases(1))


def test_ring1_under_ulysses_is_exact_in_float64(dist_pools):
    check(dist_pools(2), ring1_cases(2))
    check(dist_pools(4), ring1_cases(4))


def test_ring_in_place_merge_is_exact_in_float64(dist_pools):
    check(dist_pools(4), ring_cases())


# --- what ring degree 1 runs --------------------------------------------------------------------------------


def count_kernel_calls(chunks: int, documents: bool) -> dict:
    """Worker (world 1): kernel calls and bytes sent of one forward + backward."""
    from usp.attention import ring

    calls = {"fwd": 0, "bwd": 0}
    real_fwd, real_bwd = ring.attention_forward, ring.attention_backward

    def fwd(*a, **kw):
        calls["fwd"] += 1
        return real_fwd(*a, **kw)

    def bwd(*a, **kw):
        calls["bwd"] += 1
        return real_bwd(*a, **kw)

    ring.attention_forward, ring.attention_backward = fwd, bwd
    try:
        mesh = cached_sp_mesh(1, 1)
        q, k, v, dout = _inputs(_case(0, batch=1))
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        cu = torch.tensor(DOCS, dtype=torch.int32) if documents else None
        with record_comm() as stats:
            usp_attention(q, k, v, mesh=mesh, cu_seqlens=cu, attn_head_chunks=chunks).backward(dout)
    finally:
        ring.attention_forward, ring.attention_backward = real_fwd, real_bwd
    return calls | {"bytes_sent": stats.bytes_sent}


@pytest.mark.parametrize("chunks, documents", [(1, False), (2, False), (1, True)])
def test_ring1_calls_the_kernel_once_per_chunk(dist_pools, chunks, documents):
    got = dist_pools(1).run(count_kernel_calls, chunks, documents)[0]
    assert got == {"fwd": chunks, "bwd": chunks, "bytes_sent": 0}


def own_autograd_against_the_ring_function(ulysses: int) -> list[tuple[str, bool, bool]]:
    """Worker (world ``ulysses``, ring 1): each case's forward + backward twice, as a training step runs it and
    inside ``record_comm`` (which keeps the ring's autograd ``Function``); ``(case, took aten's own autograd,
    the same bits)`` per case."""
    from usp.attention import ring

    taken = []
    real = ring.attention_own_autograd

    def counted(*a, **kw):
        taken.append(True)
        return real(*a, **kw)

    ring.attention_own_autograd = counted
    mesh = cached_sp_mesh(ulysses, 1)
    out = []
    try:
        for name, dtype, kw in (
            ("causal fp64", torch.float64, {}),
            ("full fp32", torch.float32, {"causal": False}),
            ("one document", torch.float64, {"cu_seqlens": torch.tensor([0, 48], dtype=torch.int32)}),
            ("documents", torch.float64, {"cu_seqlens": torch.tensor(DOCS, dtype=torch.int32)}),
            ("head chunks", torch.float64, {"attn_head_chunks": 2}),
        ):
            q0, k0, v0, dout = (
                t.to(dtype) for t in _inputs(_case(0, batch=1, hq=4 * ulysses, hkv=2 * ulysses))
            )
            cu = kw.get("cu_seqlens")
            got = []
            for recorded in (False, True):
                q, k, v = (shard_sequence(t, mesh, cu_seqlens=cu).requires_grad_() for t in (q0, k0, v0))
                taken.clear()
                if recorded:
                    with record_comm():
                        o = usp_attention(q, k, v, mesh=mesh, **kw)
                else:
                    o = usp_attention(q, k, v, mesh=mesh, **kw)
                fast = bool(taken)
                o.backward(shard_sequence(dout, mesh, cu_seqlens=cu))
                got.append((fast, [o.detach(), q.grad, k.grad, v.grad]))
            assert not got[1][0], "record_comm keeps the ring's Function (it counts its work)"
            same = all(torch.equal(a, b) for a, b in zip(got[0][1], got[1][1]))
            out.append((name, got[0][0], same))
    finally:
        ring.attention_own_autograd = real
    return out


@pytest.mark.parametrize("ulysses", [1, 2])
def test_ring1_one_unmasked_block_runs_the_kernels_own_autograd_with_the_same_bits(dist_pools, ulysses):
    """Ring degree 1 with one block over every token and no mask (no document, or one): aten's autograd
    formula for the CPU flash kernel, no Python ``Function``; the output and gradients are bitwise those of the
    ring's ``Function`` (the same two kernel calls). Documents and head chunks keep the ``Function``."""
    got = dist_pools(ulysses).run(own_autograd_against_the_ring_function, ulysses)
    for per_rank in got:
        assert [(name, fast) for name, fast, _ in per_rank] == [
            ("causal fp64", True),
            ("full fp32", True),
            ("one document", True),
            ("documents", False),
            ("head chunks", False),
        ]
        assert all(same for _, _, same in per_rank), per_rank


# --- bytes ---------------------------------------------------------------------------------------------------


def ring1_peaks(seq_len: int, dtype_name: str) -> dict:
    """Worker (world 1): peak bytes of forward + backward, usp_attention and torch SDPA (enable_gqa=True)."""
    from usp.bench.ring1 import make_inputs, peak_bytes, sdpa_step, usp_step

    tensors = make_inputs(seq_len, 8, 2, 64, getattr(torch, dtype_name))
    return {
        "usp": peak_bytes(usp_step(cached_sp_mesh(1, 1)), tensors),
        "sdpa": peak_bytes(sdpa_step, tensors),
    }


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_ring1_peak_bytes_match_torch_sdpa(dist_pools, dtype):
    seq_len = 4096
    got = dist_pools(1).run(ring1_peaks, seq_len, dtype)[0]
    # what both must hold at the end of the backward: dq, dk, dv, and the output and lse kept from forward
    e = torch.finfo(getattr(torch, dtype)).bits // 8
    floor = seq_len * 64 * e * (8 + 2 + 2 + 8) + seq_len * 8 * 4
    assert got["sdpa"] >= floor and got["usp"] >= floor, (got, floor)
    assert got["usp"] <= 1.1 * got["sdpa"], f"{dtype}: usp {got['usp']} B vs torch SDPA {got['sdpa']} B"


def chunk_peaks(chunks: int) -> dict:
    """Worker (world 1, bf16, S = 1024, 8 query / 8 KV heads): peaks of forward and backward."""
    from usp.bench.track_memory import track_memory

    mesh = cached_sp_mesh(1, 1)
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(1, 1024, 8, 64, generator=g).to(torch.bfloat16) for _ in range(4))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    with track_memory("cpu") as fwd:
        out = usp_attention(q, k, v, mesh=mesh, attn_head_chunks=chunks)
    with track_memory("cpu") as bwd:
        out.backward(dout)
    return {"fwd": fwd.peak_bytes, "bwd": bwd.peak_bytes}


def test_ring1_head_chunks_add_one_chunk_of_outputs_not_copies(dist_pools):
    plain, chunked = (dist_pools(1).run(chunk_peaks, c)[0] for c in (1, 4))
    tensor = 1024 * 8 * 64 * 2  # one [1, 1024, 8, 64] bf16 tensor: q, k, v, out, dout alike
    lse = 1024 * 8 * 4
    # forward: the full output is written chunk by chunk: one chunk of the kernel's out and lse more
    # (copying the chunk's q, k and v as well would add 3/4 of a tensor more)
    assert chunked["fwd"] - plain["fwd"] <= 1.2 * (tensor + lse) / 4, (plain, chunked)
    # backward: dq, dk, dv written chunk by chunk: one chunk of the kernel's three gradients more, and one
    # chunk of dout, which the CPU flash backward copies when it is a strided view (copying the chunk's q, k,
    # v, out and dout here would add 5/4 of a tensor more)
    assert chunked["bwd"] - plain["bwd"] <= 1.2 * 4 * tensor / 4, (plain, chunked)


def test_merge_holds_no_block_sized_temporary():
    from usp.bench.track_memory import track_memory

    b, s, h, d = 1, 4096, 8, 64
    g = torch.Generator().manual_seed(0)
    out_acc = torch.randn(b, s, h, d, generator=g)
    lse_acc = torch.randn(b, h, s, generator=g)
    o = torch.randn(b, s, h, d, generator=g).to(torch.bfloat16)
    lse = torch.randn(b, h, s, generator=g)
    new = torch.logaddexp(lse_acc.double(), lse.double())  # [B, H, S]
    weight = lambda x: torch.exp(x.double() - new).transpose(1, 2).unsqueeze(-1)  # noqa: E731  [B, S, H, 1]
    want_out = out_acc.double() * weight(lse_acc) + o.double() * weight(lse)
    slice_elements = 1 << 16
    with track_memory("cpu") as mem:
        merge_block_(out_acc, lse_acc, o, lse, max_elements=slice_elements)
    block_fp32 = b * s * h * d * 4
    # one slice of o cast to fp32, plus a few lse-sized temporaries of one slice
    assert mem.peak_bytes <= slice_elements * 4 + 8 * (slice_elements // d) * 4, mem.peak_bytes
    assert mem.peak_bytes < block_fp32 / 16
    torch.testing.assert_close(out_acc.double(), want_out, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(lse_acc.double(), new, rtol=1e-6, atol=1e-6)


# --- flash_attn on a causal diagonal with documents: the pack is q itself ------------------------------------


@pytest.mark.parametrize("segments", [[[0, 5, 0, 5], [5, 12, 5, 12]], [[0, 12, 0, 12]]])
def test_flash_attn_back_to_back_documents_are_packed_without_a_gather(monkeypatch, segments):
    """Documents that tile the rows (every causal diagonal block, so every block at ring degree 1) reach the
    varlen kernel as views of q, k, v (no gather copy) and its results come back as they are (no scatter),
    with the values of the math kernel."""
    import sys

    from tests.test_attention_kernels import _fake_flash_attn
    from usp.attention import cuda_kernels
    from usp.attention.kernels import attention_backward, attention_forward

    fa, iface = _fake_flash_attn()
    monkeypatch.setitem(sys.modules, "flash_attn", fa)
    monkeypatch.setitem(sys.modules, "flash_attn.flash_attn_interface", iface)
    segments = torch.tensor(segments)
    qi, ki, *_ = cuda_kernels._varlen_pack(segments, torch.device("cpu"))
    assert qi == slice(0, 12) and ki == slice(0, 12)
    g = torch.Generator().manual_seed(5)
    q, dout = (torch.randn(1, 12, 4, 8, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(1, 12, 2, 8, generator=g, dtype=torch.float64) for _ in range(2))
    kw = dict(causal=True, softmax_scale=0.3, segments=segments)
    seen = []
    real = fa.flash_attn_varlen_func
    fa.flash_attn_varlen_func = lambda q_, k_, *a, **kws: seen.append((q_, k_)) or real(q_, k_, *a, **kws)
    out, lse = attention_forward(q, k, v, backend="flash_attn", **kw)
    assert seen[0][0].data_ptr() == q.data_ptr() and seen[0][1].data_ptr() == k.data_ptr()  # views, no gather
    out_m, lse_m = attention_forward(q, k, v, backend="math", **kw)
    torch.testing.assert_close(out, out_m, **F64)
    torch.testing.assert_close(lse.double(), lse_m, rtol=1e-6, atol=1e-6)  # flash_attn's lse is fp32
    for a, b in zip(
        attention_backward(dout, q, k, v, out_m, lse_m, backend="flash_attn", **kw),
        attention_backward(dout, q, k, v, out_m, lse_m, backend="math", **kw),
    ):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)  # through the fp32 lse


def run_bench_main() -> dict:
    from usp.bench.ring1 import main

    return main(["--seq", "256", "--dtype", "float32,bfloat16", "--iters", "1", "--json"])


def test_bench_reports_peaks_and_times(dist_pools):
    report = dist_pools(1).run(run_bench_main)[0]
    assert [(p["seq_len"], p["dtype"]) for p in report["points"]] == [(256, "float32"), (256, "bfloat16")]
    for p in report["points"]:
        assert (
            p["peak_ratio"] == p["usp_peak_bytes"] / p["sdpa_peak_bytes"]
            and p["usp_s"] > 0
            and p["sdpa_s"] > 0
        )
