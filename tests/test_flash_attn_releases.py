"""The flash_attn backend against the real Python interface of released flash-attn versions (no GPU).

Each release's ``flash_attn_interface.py`` is fetched from PyPI at test time and run over a stub of its
compiled extension built from its own ``csrc/flash_attn/flash_api.cpp`` (:mod:`tests.flash_attn_stub`), on
fake CUDA tensors. This checks our calls (arity, keyword names, types) and the lse layouts per release:
2.5.x's varlen kernels write ``[num_seqs, H, max_seqlen_q]``, 2.6+ ``[H, total_q]``. A release that cannot
be fetched (offline) is skipped with the reason. Covered: 2.5.9.post1 (the oldest accepted), 2.6.3 (the
first packed lse), 2.8.3.post2 (current; its kernels are ``torch.library`` custom ops). 2.7.x registers the
same op names as 2.8, which a process can hold once, so it is not loaded alongside.
"""

from __future__ import annotations

import sys

import pytest
import torch

from tests.fake_cuda import cuda_randn, fake_cuda
from tests.flash_attn_stub import fetch, release
from usp.attention import kernels
from usp.attention.blocks import plan_ring_blocks
from usp.attention.kernels import attention_backward, attention_forward, resolve_backend

VERSIONS = ["2.5.9.post1", "2.6.3", "2.8.3.post2"]
PART = 80
CU = torch.tensor([0, 30, 31, 100, 160], dtype=torch.int32)

pytestmark = pytest.mark.network


@pytest.fixture(params=VERSIONS)
def flash_attn_release(request, monkeypatch):
    version = request.param
    try:
        modules = release(version)
    except RuntimeError as exc:
        print(f"flash-attn {version} not fetched: {exc}")
        pytest.skip(f"flash-attn {version} could not be fetched: {exc}")
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    kernels.flash_attn_import_error.cache_clear()
    yield modules
    kernels.flash_attn_import_error.cache_clear()


def test_stub_reads_each_release_lse_layout(flash_attn_release):
    """The stub's layouts come from the release's own source: 2.5 padded per sequence, 2.6+ packed."""
    api = flash_attn_release["flash_attn_2_cuda"].api
    old = flash_attn_release["flash_attn"].__version__.startswith("2.5.")
    assert api["varlen_fwd"]["lse"] == (
        ["batch_size", "num_heads", "max_seqlen_q"] if old else ["num_heads", "total_q"]
    )
    assert api["fwd"]["lse"] == ["batch_size", "num_heads", "seqlen_q"]
    assert api["bwd"]["head8"] and api["varlen_bwd"]["head8"]


def test_stub_agrees_with_the_release_own_fake_kernels(flash_attn_release):
    """Releases with torch.library ops ship fake kernels: their out/lse shapes match the stub's (from the C++)."""
    fai = flash_attn_release["flash_attn.flash_attn_interface"]
    if not fai._release_fakes:
        pytest.skip(f"flash-attn {flash_attn_release['flash_attn'].__version__} has no fake kernels")
    with fake_cuda():
        q, k = cuda_randn(30, 8, 64), cuda_randn(30, 2, 64)  # packed: 2 sequences of 10 and 20 tokens
        cu = torch.tensor([0, 10, 30], dtype=torch.int32).to(q.device)
        q4, k4 = cuda_randn(2, 40, 8, 64), cuda_randn(2, 40, 2, 64)
        for name, args in (
            ("_flash_attn_varlen_forward", (q, k, k, cu, cu, 20, 20, 0.0, 0.125, True)),
            ("_flash_attn_forward", (q4, k4, k4, 0.0, 0.125, True, -1, -1, 0.0, None, False)),
        ):
            theirs = fai._release_fakes[name](*args)
            ours = getattr(fai, name)._init_fn(*args)
            for a, b in zip(theirs[:2], ours[:2]):  # out, softmax_lse
                assert (a.shape, a.dtype) == (b.shape, b.dtype), (name, a.shape, b.shape)


def test_auto_picks_each_checked_release(flash_attn_release):
    assert resolve_backend("auto", torch.device("cuda"), torch.bfloat16, head_dim=64) == "flash_attn"


@pytest.mark.parametrize("layout, docs", [("zigzag", False), ("zigzag", True), ("contiguous", True)])
def test_every_ring_block_through_the_release(flash_attn_release, layout, docs):
    """Dense (B = 2, GQA) and document (varlen, B = 1) ring blocks, forward and backward, as the ring slices."""
    batch = 1 if docs else 2
    plans = [plan_ring_blocks(2 * PART, 2, r, layout, True, CU if docs else None) for r in range(2)]
    blocks = [spec for plan in plans for spec in plan if spec is not None]
    assert any(spec.segments is not None for spec in blocks) == docs
    with fake_cuda():
        q = cuda_randn(batch, PART, 8, 64)
        k, v = cuda_randn(batch, PART, 2, 64), cuda_randn(batch, PART, 2, 64)
        out_full, dout = cuda_randn(batch, PART, 8, 64), cuda_randn(batch, PART, 8, 64)
        lse_full = torch.empty(batch, 8, PART, device="cuda")
        for spec in blocks:
            qs, ks = spec.q_slice, spec.k_slice
            kw = dict(causal=spec.causal, softmax_scale=0.125, backend="flash_attn", segments=spec.segments)
            out, lse = attention_forward(q[:, qs], k[:, ks], v[:, ks], **kw)
            sq = qs.stop - qs.start
            assert out.shape == (batch, sq, 8, 64) and out.dtype == torch.bfloat16 and out.device == q.device
            assert lse.shape == (batch, 8, sq) and lse.dtype == torch.float32
            dq, dk, dv = attention_backward(
                dout[:, qs], q[:, qs], k[:, ks], v[:, ks], out_full[:, qs], lse_full[:, :, qs], **kw
            )
            assert dq.shape == (batch, sq, 8, 64) and dk.shape == k[:, ks].shape and dv.shape == dk.shape


def test_causal_blocks_must_be_square(flash_attn_release):
    with fake_cuda():
        q, k = cuda_randn(1, 40, 4, 64), cuda_randn(1, 80, 4, 64)
        with pytest.raises(AssertionError, match="square"):
            attention_forward(q, k, k, causal=True, softmax_scale=0.1, backend="flash_attn")


def test_releases_older_than_checked_are_refused(tmp_path, monkeypatch):
    package = tmp_path / "flash_attn"
    package.mkdir()
    (package / "__init__.py").write_text("__version__ = '2.4.2'\n")
    (package / "flash_attn_interface.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("flash_attn", "flash_attn.flash_attn_interface"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    kernels.flash_attn_import_error.cache_clear()
    try:
        assert resolve_backend("auto", torch.device("cuda"), torch.bfloat16) == "sdpa_flash"
        with pytest.raises(ValueError, match="flash_attn 2.4.2 is older than .* 2.5.9"):
            resolve_backend("flash_attn", torch.device("cuda"), torch.bfloat16)
    finally:
        kernels.flash_attn_import_error.cache_clear()


def test_fetch_reports_a_missing_release(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    with pytest.raises(RuntimeError, match="pip download flash-attn==0.0.0"):
        fetch("0.0.0")
