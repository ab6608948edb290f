"""The CUDA SDPA wrappers on fake CUDA tensors (no GPU): schemas, shapes, dtypes, devices, lse layouts.

Every block a ring rank computes (zigzag and contiguous, causal, with and without documents, the per-segment
path, GQA, ``B = 2`` so sliced views have non-dense batch strides, parts of 80 tokens so half-blocks are 40
rows: not a multiple of 32) runs forward and backward through :mod:`usp.attention.kernels` exactly as
:mod:`usp.attention.ring` slices it, under :func:`tests.fake_cuda.fake_cuda`, which checks each torch CUDA
SDPA call against its kernel's contract. Numerics are not checked here (fake tensors hold no data).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.fake_cuda import ContractError, cuda_randn, fake_cuda
from usp.attention import cuda_kernels, segmented
from usp.attention.blocks import plan_banded_blocks, plan_ring_blocks
from usp.attention.kernels import attention_backward, attention_forward, resolve_backend
from usp.attention.masks import RowRanges

SDPA = ["sdpa_flash", "sdpa_efficient", "sdpa_cudnn"]
PART = 80  # tokens per ring part: zigzag half-blocks of 40 rows
CU = torch.tensor([0, 30, 31, 100, 160], dtype=torch.int32)  # documents crossing chunks and parts (S = 160)


def _ring_blocks(layout: str, causal: bool, cu) -> list:
    """Every computed block of a ring of 2 over S = 160 (planned on real CPU tensors, as the ring does)."""
    plans = [plan_ring_blocks(2 * PART, 2, rank, layout, causal, cu) for rank in range(2)]
    return [spec for plan in plans for spec in plan if spec is not None]


def _run_block(spec, backend, *, batch, hq, hkv, d, dtype):
    """Forward and backward of one ring block with the ring's own slicing; returns the outputs' metadata."""
    q = cuda_randn(batch, PART, hq, d, dtype=dtype)
    k, v = cuda_randn(batch, PART, hkv, d, dtype=dtype), cuda_randn(batch, PART, hkv, d, dtype=dtype)
    out_full = cuda_randn(batch, PART, hq, d, dtype=dtype)  # the merged out, as the ring saves it
    lse_full = torch.empty(batch, hq, PART, dtype=torch.float32, device="cuda")
    dout = cuda_randn(batch, PART, hq, d, dtype=dtype)
    qs, ks = spec.q_slice, spec.k_slice
    kw = dict(causal=spec.causal, softmax_scale=d**-0.5, backend=backend, segments=spec.segments)
    out, lse = attention_forward(q[:, qs], k[:, ks], v[:, ks], **kw)
    sq = qs.stop - qs.start
    assert out.shape == (batch, sq, hq, d) and out.dtype == dtype and out.device == q.device
    assert lse.shape == (batch, hq, sq) and lse.dtype == torch.float32 and lse.device == q.device
    dq, dk, dv = attention_backward(
        dout[:, qs], q[:, qs], k[:, ks], v[:, ks], out_full[:, qs], lse_full[:, :, qs], **kw
    )
    for g, x in ((dq, q[:, qs]), (dk, k[:, ks]), (dv, v[:, ks])):
        assert g.shape == x.shape and g.dtype == x.dtype and g.device == x.device


CASES = [  # (layout, causal, documents, per-segment calls, batch, hq, hkv, d)
    ("zigzag", True, False, False, 2, 8, 2, 64),
    ("zigzag", True, False, False, 1, 4, 4, 128),
    ("contiguous", True, False, False, 2, 8, 2, 64),
    ("zigzag", False, False, False, 2, 4, 1, 64),
    ("zigzag", True, True, False, 1, 8, 2, 64),
    ("contiguous", True, True, False, 1, 8, 2, 64),
    ("zigzag", True, True, True, 1, 8, 2, 64),
    ("contiguous", True, True, True, 1, 8, 2, 64),
]


def _case_id(case) -> str:
    layout, causal, docs, per_segment, batch, hq, hkv, d = case
    docs_id = ("docs_per_segment" if per_segment else "docs_small_mask") if docs else "dense"
    return f"{layout}-{'causal' if causal else 'full'}-{docs_id}-B{batch}-H{hq}/{hkv}-D{d}"


@pytest.mark.parametrize("case", CASES, ids=_case_id)
@pytest.mark.parametrize("backend", SDPA)
def test_every_ring_block_meets_the_kernel_contracts(monkeypatch, backend, case):
    layout, causal, docs, per_segment, batch, hq, hkv, d = case
    if per_segment:  # what a GPU-sized block (> 2**22 elements) does with documents
        monkeypatch.setattr(segmented, "DENSE_MASK_MAX_ELEMENTS", 0)
    dtypes = [torch.bfloat16, torch.float32] if backend == "sdpa_efficient" else [torch.bfloat16]
    blocks = _ring_blocks(layout, causal, CU if docs else None)
    for dtype in dtypes:
        with fake_cuda() as contracts:
            for spec in blocks:
                _run_block(spec, backend, batch=batch, hq=hq, hkv=hkv, d=d, dtype=dtype)
        assert contracts.calls, "no CUDA SDPA op ran"
        want = {"sdpa_flash": "flash", "sdpa_efficient": "efficient", "sdpa_cudnn": "cudnn"}[backend]
        ops = {op.removeprefix("_scaled_dot_product_").split("_")[0] for op in contracts.ops()}
        if (
            docs and not per_segment
        ):  # small segmented blocks: mem-efficient with a bias, whatever the backend
            assert ops == {want, "efficient"}, ops
        elif docs and backend == "sdpa_cudnn":  # the 1-token document: cuDNN takes no key length 1
            assert ops == {want, "efficient"}, ops
        else:
            assert ops == {want}, ops


def test_the_ops_have_meta_kernels():
    """FakeTensorMode runs an op's Meta kernel: all six SDPA CUDA ops have one (no CUDA kernel is needed)."""
    for name in ("flash", "efficient", "cudnn"):
        for suffix in ("", "_backward"):
            op = getattr(torch.ops.aten, f"_scaled_dot_product_{name}_attention{suffix}").default
            assert torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "Meta"), op


def test_contracts_catch_a_bad_call():
    """The checker can fail: mem-efficient attention has no grouped heads, lse of the wrong layout."""
    with fake_cuda():
        q, k = cuda_randn(1, 4, 40, 64), cuda_randn(1, 2, 40, 64)
        with pytest.raises(ContractError, match="no grouped heads"):
            torch.ops.aten._scaled_dot_product_efficient_attention(q, k, k, None, True, 0.0, True, scale=0.1)
        q2 = cuda_randn(1, 4, 40, 64)
        out, lse, *_ = torch.ops.aten._scaled_dot_product_flash_attention(q2, q2, q2, 0.0, True, False)
        seed = torch.zeros((), dtype=torch.int64, device="cuda")
        with pytest.raises(ContractError, match="lse shape"):
            torch.ops.aten._scaled_dot_product_flash_attention_backward(
                out, q2, q2, q2, out, lse[..., :32], None, None, 40, 40, 0.0, True, seed, seed
            )


# --- defects found by this tier (each test failed before its fix) -------------------------------------------


def test_sdpa_flash_does_not_expand_kv():
    """torch's flash kernels take num_heads % num_heads_k == 0: K/V reach them with Hkv heads, unexpanded."""
    with fake_cuda() as contracts:
        q, k = cuda_randn(2, 40, 8, 64), cuda_randn(2, 40, 2, 64)
        out, lse = attention_forward(q, k, k, causal=True, softmax_scale=0.1, backend="sdpa_flash")
        dq, dk, dv = attention_backward(
            q, q, k, k, out, lse, causal=True, softmax_scale=0.1, backend="sdpa_flash"
        )
    assert [c.shapes["key"] for c in contracts.calls] == [(2, 2, 40, 64)] * 2  # [B, Hkv, S, D]
    assert dk.shape == k.shape and dv.shape == k.shape


@pytest.mark.parametrize("backend", ["sdpa_cudnn", "sdpa_efficient"])
def test_kv_still_expanded_where_the_kernel_needs_it(backend):
    with fake_cuda() as contracts:
        q, k = cuda_randn(1, 40, 8, 64), cuda_randn(1, 40, 2, 64)
        out, lse = attention_forward(q, k, k, causal=True, softmax_scale=0.1, backend=backend)
        _, dk, _ = attention_backward(q, q, k, k, out, lse, causal=True, softmax_scale=0.1, backend=backend)
    assert all(c.shapes["key"][1] == 8 for c in contracts.calls) and dk.shape == k.shape


@pytest.mark.parametrize("lse_rank", [4, 3], ids=["torch_2.13_lse_BHS1", "older_torch_lse_BHS"])
def test_cudnn_backward_gets_the_lse_rank_its_forward_returns(lse_rank):
    cuda_kernels.cudnn_lse_rank.cache_clear()
    try:
        with fake_cuda(cudnn_lse_rank=lse_rank if lse_rank == 3 else None):
            q = cuda_randn(1, 40, 4, 64)
            out, lse = attention_forward(q, q, q, causal=True, softmax_scale=0.1, backend="sdpa_cudnn")
            assert lse.shape == (1, 4, 40)
            attention_backward(q, q, q, q, out, lse, causal=True, softmax_scale=0.1, backend="sdpa_cudnn")
    finally:
        cuda_kernels.cudnn_lse_rank.cache_clear()


def test_cudnn_backward_gets_dense_o_and_do():
    """A zigzag half-block of B = 2: out[:, qs] and dout[:, qs] are views with a non-dense batch stride."""
    with fake_cuda():
        q, k = cuda_randn(2, PART, 4, 64), cuda_randn(2, PART, 4, 64)
        out, lse = cuda_randn(2, PART, 4, 64), torch.empty(2, 4, PART, device="cuda")
        qs = slice(PART // 2, PART)  # second half of Q only (zigzag, src > r)
        attention_backward(
            q[:, qs],
            q[:, qs],
            k,
            k,
            out[:, qs],
            lse[:, :, qs],
            causal=False,
            softmax_scale=0.1,
            backend="sdpa_cudnn",
        )
        one = cuda_randn(1, PART, 4, 64)  # B = 1: the batch stride of the slice is the only non-dense one
        attention_backward(
            one[:, qs],
            one[:, qs],
            one,
            one,
            one[:, qs],
            lse[:1, :, qs],
            causal=False,
            softmax_scale=0.1,
            backend="sdpa_cudnn",
        )


@pytest.mark.parametrize("backend", ["flash_attn", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "auto"])
def test_head_dim_not_multiple_of_8_is_refused_or_works(monkeypatch, backend):
    """Flash and cuDNN need head_size % 8 == 0 (their backward checks it): refused up front, naming what works."""
    from usp.attention import kernels

    monkeypatch.setattr(kernels, "flash_attn_import_error", lambda: None)  # as if flash_attn were installed
    device = torch.device("cuda")
    if backend in ("flash_attn", "sdpa_flash", "sdpa_cudnn"):
        with pytest.raises(ValueError, match="head_dim=12.*sdpa_efficient"):
            resolve_backend(backend, device, torch.bfloat16, head_dim=12)
        return
    kernel = resolve_backend(backend, device, torch.bfloat16, head_dim=12)
    assert kernel == "sdpa_efficient"
    with fake_cuda():
        q = cuda_randn(1, 40, 4, 12)
        out, lse = attention_forward(q, q, q, causal=True, softmax_scale=0.1, backend=kernel)
        attention_backward(q, q, q, q, out, lse, causal=True, softmax_scale=0.1, backend=kernel)


def test_fp32_is_refused_by_the_half_precision_kernels():
    for backend in ("sdpa_flash", "sdpa_cudnn"):
        with pytest.raises(ValueError, match="float32.*sdpa_efficient"):
            resolve_backend(backend, torch.device("cuda"), torch.float32, head_dim=64)


@pytest.mark.parametrize("backend", SDPA)
def test_causal_blocks_must_be_square(backend):
    """Flash aligns a causal mask bottom-right, mem-efficient and cuDNN top-left: the wrappers refuse Sq != Sk."""
    with fake_cuda():
        q, k = cuda_randn(1, 40, 4, 64), cuda_randn(1, 80, 4, 64)
        with pytest.raises(AssertionError, match="square"):
            attention_forward(q, k, k, causal=True, softmax_scale=0.1, backend=backend)
        out, lse = cuda_randn(1, 40, 4, 64), torch.empty(1, 4, 40, device="cuda")
        with pytest.raises(AssertionError, match="square"):
            attention_backward(q, q, k, k, out, lse, causal=True, softmax_scale=0.1, backend=backend)


# --- usp-bench under nccl --------------------------------------------------------------------------------


def _cuda_only_process_group():
    """A 2-rank process group whose backend, like nccl, is registered for CUDA tensors only (no-op collectives):
    a CPU tensor fails with nccl's own error, "No backend type associated with device type cpu"."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    fake_pg = torch._C._distributed_c10d.FakeProcessGroup
    if "cuda_only" not in dist.Backend.backend_list:
        dist.Backend.register_backend(
            "cuda_only",
            lambda store, rank, size, timeout: fake_pg._create_internal(rank, size),
            devices=["cuda"],
        )
    dist.init_process_group("cuda_only", store=FakeStore(), rank=0, world_size=2)


def test_bench_collectives_run_on_a_cuda_only_backend(monkeypatch):
    """usp-bench all-reduced and all-gathered CPU tensors on the default group: nccl refuses those."""
    import torch.distributed as dist

    from usp.bench import attention as bench

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    _cuda_only_process_group()
    try:
        with pytest.raises(RuntimeError, match="No backend type associated with device type cpu"):
            dist.all_reduce(torch.zeros(1))  # the failure mode being emulated
        monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
        with fake_cuda():
            # fake tensors hold no values: read them as zeros (what is checked is where the tensors live)
            monkeypatch.setattr(torch.Tensor, "tolist", lambda self: [0] * self.numel())
            monkeypatch.setattr(torch.Tensor, "item", lambda self: 0.0)
            device = torch.device("cuda", 0)
            assert bench._timed(lambda: None, 1, 0, device) == 0.0
            assert bench._gather_ints(7, device) == [0, 0]
    finally:
        dist.destroy_process_group()


# --- the kernel benchmark's SDPA baseline -------------------------------------------------------------------


class _Output:
    def __init__(self, shape):
        self.shape = shape

    def backward(self, grad):
        assert grad.shape == self.shape


@pytest.mark.parametrize(
    "dtype, want", [(torch.float32, "efficient_attention"), (torch.bfloat16, "flash_attention")]
)
def test_bench_sdpa_baseline_is_a_pinned_fused_kernel(monkeypatch, dtype, want):
    """The fp32 GQA baseline ran unpinned, i.e. the math kernel. scaled_dot_product_attention itself cannot run
    on fake CUDA tensors (its CPU-build backend choice aborts), so a stand-in applies torch's selection rules
    for the enabled backends: flash has no fp32, mem-efficient no grouped heads, math is what we must avoid."""
    from usp.bench import kernels as bench

    calls = []

    def sdpa(q, k, v, *, is_causal, scale, enable_gqa=False):
        on = {
            n
            for n in ("flash", "mem_efficient", "math", "cudnn")
            if getattr(torch.backends.cuda, f"{n}_sdp_enabled")()
        }
        usable = set(on)
        if q.dtype == torch.float32:
            usable -= {"flash", "cudnn"}
        if k.size(1) != q.size(1):
            usable -= {"mem_efficient"}
        calls.append((on, usable, k.size(1)))
        if not usable:
            raise RuntimeError("No available kernel. Aborting execution.")
        assert usable == on and len(on) == 1 and "math" not in on, f"baseline may fall back: enabled {on}"
        return _Output(q.shape)  # autograd on fake CUDA tensors needs a CUDA stream: stand in for it too

    monkeypatch.setattr(bench.F, "scaled_dot_product_attention", sdpa)
    with fake_cuda():
        q, k = cuda_randn(1, 40, 8, 64, dtype=dtype), cuda_randn(1, 40, 2, 64, dtype=dtype)
        dout = cuda_randn(1, 40, 8, 64, dtype=dtype)
        step, info = bench.sdpa_baseline(q, k, k, dout, 0.125)
        step()
    assert info["sdpa_backend"] == want
    assert info["sdpa_gqa"] == (dtype != torch.float32)  # mem-efficient gets K/V expanded to 8 heads
    assert calls[-1][2] == (8 if dtype == torch.float32 else 2)


def test_bench_sdpa_baseline_is_none_when_no_fused_kernel_takes_the_shape(monkeypatch):
    """E.g. head_dim 12 in bf16 (flash and mem-efficient want multiples of 8): no figure rather than math's."""
    from usp.bench import kernels as bench

    def refuse(*args, **kwargs):
        raise RuntimeError("No available kernel. Aborting execution.")

    monkeypatch.setattr(bench.F, "scaled_dot_product_attention", refuse)
    with fake_cuda():
        q, k = cuda_randn(1, 40, 8, 12), cuda_randn(1, 40, 2, 12)
        step, info = bench.sdpa_baseline(q, k, k, q, 0.3)
    assert step is None and info == {"sdpa_backend": None, "sdpa_gqa": None}


def _banded_blocks(layout: str, window: int | None, chunk: int | None, cu) -> list:
    plans = [plan_banded_blocks(2 * PART, 2, rank, layout, cu, window, chunk) for rank in range(2)]
    return [spec for plan in plans for spec in plan if spec is not None]


@pytest.mark.parametrize("backend", [*SDPA, "flash_attn"])
@pytest.mark.parametrize(
    "layout, window, chunk, docs",
    [("zigzag", 24, None, False), ("contiguous", 50, None, True), ("zigzag", None, 32, True)],
)
def test_windowed_and_chunked_blocks_meet_the_kernel_contracts(backend, layout, window, chunk, docs):
    """Sliding-window and chunked ring blocks (banded masks) on the CUDA kernels: a banded block runs on
    mem-efficient SDPA with a bias (flash-attn, which takes no mask, too), an unmasked one on the backend."""
    blocks = _banded_blocks(layout, window, chunk, CU if docs else None)
    assert any(isinstance(spec.segments, RowRanges) for spec in blocks), "some blocks are banded"
    with fake_cuda() as contracts:
        for spec in blocks:
            if backend == "flash_attn" and spec.segments is None:
                continue  # unmasked blocks go to flash-attn itself (not installed here)
            _run_block(spec, backend, batch=2, hq=8, hkv=2, d=64, dtype=torch.bfloat16)
    ops = {op.removeprefix("_scaled_dot_product_").split("_")[0] for op in contracts.ops()}
    assert "efficient" in ops, ops


def test_softcapped_blocks_run_the_math_kernel_on_cuda():
    """Softcapped blocks (Gemma 2) run the math kernel on CUDA tensors: no SDPA op, the shapes of every
    output and gradient as the ring needs them."""
    blocks = [  # as the ring plans them: each block's band (tiles) read on the host at planning
        dataclasses.replace(
            spec,
            causal=False,
            softcap=30.0,
            segments=RowRanges.of_block(
                spec.q_end - spec.q_start, spec.k_end - spec.k_start, spec.causal, spec.segments
            ),
        )
        for spec in _ring_blocks("zigzag", True, CU)
    ]
    with fake_cuda() as contracts:
        for spec in blocks:
            q = cuda_randn(1, PART, 8, 64, dtype=torch.bfloat16)
            k, v = (
                cuda_randn(1, PART, 2, 64, dtype=torch.bfloat16),
                cuda_randn(1, PART, 2, 64, dtype=torch.bfloat16),
            )
            qs, ks = spec.q_slice, spec.k_slice
            kw = dict(causal=spec.causal, softmax_scale=0.125, backend="sdpa_flash", segments=spec.segments)
            out, lse = attention_forward(q[:, qs], k[:, ks], v[:, ks], softcap=spec.softcap, **kw)
            assert out.shape == q[:, qs].shape and lse.dtype == torch.float32
            grads = attention_backward(
                out, q[:, qs], k[:, ks], v[:, ks], out, lse, softcap=spec.softcap, **kw
            )
            assert [g.shape for g in grads] == [q[:, qs].shape, k[:, ks].shape, v[:, ks].shape]
    assert not contracts.calls, "softcapped blocks call no SDPA kernel"
