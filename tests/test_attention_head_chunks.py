"""``parallel.attn_head_chunks``: the ring runs over groups of heads in turn; exact, and its buffers shrink.

- usp_attention with 2 and 4 head chunks equals single-process attention (out, dq, dk, dv; float64,
  ``tests.tolerance.EXACT_TOL``) under u1r4, u2r2 and u4r1, with GQA, with and without documents (cu_seqlens);
- the measured peak of the ring's forward and backward (bf16 inputs, fp32 accumulators) falls with chunks;
- the trainer's loss, grad norms and gradients with ``attn_head_chunks=2`` equal the plain run (float64);
- values that do not split the heads per rank fail with a ``ValueError`` naming the setting and what works.
"""

from __future__ import annotations

import pytest
import torch

from tests.mesh_cache import cached_sp_mesh
from tests.test_attention_documents import DOCUMENTS
from tests.test_attention_usp import check_cases
from tests.test_train_layouts import GRAD_PARAMS, OPTIM, make_batches, train_then_grads
from tests.test_train_memory_run import make_config
from tests.test_train_memory_tricks import assert_same
from usp.attention import check_attn_head_chunks, usp_attention
from usp.config import validate_choices
from usp.train.checks import check_training_run


def chunk_cases() -> list[dict]:
    cases, i = [], 0
    for u, r in ((1, 4), (2, 2), (4, 1)):
        for chunks in (2, 4):
            for cu in (None, DOCUMENTS[0]):
                # per rank after Ulysses: 8 query heads, 4 KV heads (GQA groups of 2), or 4 and 4 (no GQA)
                hq, hkv = (8 * u, 4 * u) if i % 2 == 0 else (4 * u, 4 * u)
                case = dict(
                    ulysses=u,
                    ring=r,
                    layout="zigzag",
                    causal=True,
                    hq=hq,
                    hkv=hkv,
                    dtype="float64",
                    batch=1 if cu else 2,
                    seq_len=48,
                    seed=3000 + i,
                    attn_head_chunks=chunks,
                )
                if cu:
                    case["cu_seqlens"] = cu
                cases.append(case)
                i += 1
    return cases


def test_head_chunks_match_single_process_attention(dist_pools):
    check_cases(dist_pools(4), chunk_cases())


def ring_peaks(chunks_list: list[int]) -> dict[int, dict[str, int]] | None:
    """Worker (u1r4): peak bytes of one bf16 usp_attention forward, and of its backward, per chunk count."""
    from usp.bench.track_memory import track_memory

    mesh = cached_sp_mesh(1, 4, "zigzag")
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(1, 256, 8, 64, generator=g).to(torch.bfloat16) for _ in range(4))
    out = {}
    for chunks in chunks_list:
        ql, kl, vl = (t.clone().requires_grad_() for t in (q, k, v))
        with track_memory("cpu") as fwd:
            o = usp_attention(ql, kl, vl, mesh=mesh, attn_head_chunks=chunks)
        with track_memory("cpu") as bwd:
            o.backward(dout)
        out[chunks] = {"fwd": fwd.peak_bytes, "bwd": bwd.peak_bytes, "held": fwd.held_bytes}
    return out if mesh.ring_rank == 0 else None


def test_measured_ring_buffers_fall_with_head_chunks(dist_pools):
    m = next(r for r in dist_pools(4).run(ring_peaks, [1, 4]) if r is not None)
    # what backward needs is the same tensors (q, k, v, out, lse), chunked or not
    assert m[4]["held"] == m[1]["held"]
    # forward: the bf16 output (1/2 of an fp32 accumulator) stays, the fp32 accumulator and block work shrink
    assert m[4]["fwd"] < 0.6 * m[1]["fwd"]
    # backward: fp32 dq and the travelling fp32 dK/dV accumulators shrink; the bf16 dq, dk, dv returned stay
    assert m[4]["bwd"] < 0.6 * m[1]["bwd"]


def run_chunked_training(model_dir: str, ulysses: int, ring: int) -> dict | None:
    """Worker: two optimizer steps and the gradients of the first batch, with 1 and 2 head chunks."""
    from tests.exact_model import load_float64, whole
    from tests.tolerance import EXACT_DTYPE
    from usp.train.optim import build_optimizer
    from usp.train.parallelize import parallelize

    mesh = cached_sp_mesh(ulysses, ring, "zigzag", 1)
    out = {}
    for chunks in (1, 2):
        model = load_float64(model_dir)
        loss_model = parallelize(
            model,
            mesh,
            param_dtype=EXACT_DTYPE,
            reduce_dtype=EXACT_DTYPE,
            loss_chunk_size=7,
            attn_head_chunks=chunks,
        )
        optimizer, scheduler = build_optimizer(loss_model, OPTIM, max_steps=4)
        batches = make_batches(model.config.vocab_size)[:2]
        losses, norms, params = train_then_grads(loss_model, model, mesh, optimizer, scheduler, batches)
        grads = {name: whole(params[name].grad) for name in GRAD_PARAMS}
        out[chunks] = {"losses": losses, "grad_norms": norms, "grads": grads}
    return out if mesh.device_mesh.get_rank() == 0 else None


def test_trainer_with_head_chunks_equals_the_plain_run(dist_pools, tiny_llama):
    out = dist_pools(4).run(run_chunked_training, tiny_llama, 1, 4)[0]
    assert_same(out[2], out[1], "u1r4 parallel.attn_head_chunks=2")


def test_bad_head_chunks_fail_naming_the_setting():
    # Llama-3.1-8B on Ulysses 4: 8 query and 2 KV heads per rank -> 1 or 2
    check_attn_head_chunks(2, 32, 8, 4)
    with pytest.raises(ValueError, match=r"parallel.attn_head_chunks=4 .*\[1, 2\]"):
        check_attn_head_chunks(4, 32, 8, 4)
    with pytest.raises(ValueError, match=r"parallel.attn_head_chunks=3"):
        check_attn_head_chunks(3, 32, 8, 1)
    # Ulysses 8 with 8 KV heads: one KV head per rank, a chunk cannot split its GQA group
    with pytest.raises(ValueError, match=r"use one of \[1\]"):
        check_attn_head_chunks(2, 32, 8, 8)
    for bad in (0, -1, True, "2"):
        with pytest.raises(ValueError, match="parallel.attn_head_chunks"):
            check_attn_head_chunks(bad, 32, 8, 1)
    cfg = make_config("/m", "/r", attn_head_chunks=0)
    with pytest.raises(ValueError, match=r"parallel.attn_head_chunks=0 is invalid"):
        validate_choices(cfg)


def test_trainer_validation_checks_head_chunks_before_any_weights(tiny_llama, tmp_path):
    cpu = torch.device("cpu")
    # tiny Llama (4 query, 2 KV heads) on Ulysses 2: 2 query and 1 KV head per rank -> only 1
    cfg = make_config(tiny_llama, str(tmp_path), ulysses_degree=2, ring_degree=1, attn_head_chunks=2)
    with pytest.raises(ValueError, match=r"parallel.attn_head_chunks=2 .* use one of \[1\]"):
        check_training_run(cfg, 2, cpu)
    cfg.parallel.ulysses_degree, cfg.parallel.ring_degree = 1, 2
    assert check_training_run(cfg, 2, cpu)[1].attn_head_chunks == 2
