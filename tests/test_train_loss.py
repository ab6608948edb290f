"""Chunked cross-entropy vs full-logits cross-entropy; learning-rate schedule; global-norm clipping."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from tests.tolerance import assert_exact, rounding_tolerance
from usp.config import OptimConfig
from usp.train.loss import chunked_cross_entropy_sum
from usp.train.optim import build_optimizer, check_optim_config, clip_grad_norm, lr_factor


@pytest.mark.parametrize("chunk_size", [1, 7, 24, 1000])
@pytest.mark.parametrize("with_bias", [False, True])
def test_chunked_loss_equals_full_cross_entropy(chunk_size, with_bias):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 12, 16, generator=g, dtype=torch.float64, requires_grad=True)  # [B, S, H]
    weight = torch.randn(50, 16, generator=g, dtype=torch.float64, requires_grad=True)  # [V, H]
    bias = torch.randn(50, generator=g, dtype=torch.float64, requires_grad=True) if with_bias else None
    labels = torch.randint(0, 50, (2, 12), generator=g)
    labels[0, 3:8] = -100
    labels[1, -1] = -100

    got = chunked_cross_entropy_sum(hidden, weight, labels, chunk_size=chunk_size, bias=bias)
    got.backward()
    got_grads = [t.grad.clone() for t in (hidden, weight) + ((bias,) if with_bias else ())]
    for t in (hidden, weight) + ((bias,) if with_bias else ()):
        t.grad = None

    logits = F.linear(hidden, weight, bias)  # [B, S, V], materialized in full
    ref = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
    ref.backward()
    ref_grads = [t.grad for t in (hidden, weight) + ((bias,) if with_bias else ())]
    assert_exact(got, ref, "loss")  # float64
    for name, a, b in zip(("hidden", "weight", "bias"), got_grads, ref_grads):
        assert_exact(a, b, f"{name} gradient")


@pytest.mark.parametrize("chunk_size", [5, 24])  # 3 chunks (the last shorter); one chunk
def test_chunked_loss_recomputes_all_chunks_but_the_last_with_the_same_bits(monkeypatch, chunk_size):
    """Every chunk but the last is recomputed in backward (the last one's backward comes first, where its
    recompute would allocate what it keeps); fp32, the loss and gradients are bitwise those of checkpointing
    every chunk."""
    from torch.utils.checkpoint import checkpoint

    from usp.train import loss as loss_module

    g = torch.Generator().manual_seed(0)
    hidden0 = torch.randn(1, 12, 16, generator=g)
    weight0 = torch.randn(50, 16, generator=g)
    labels = torch.randint(0, 50, (1, 12), generator=g)
    labels[0, 2:4] = -100
    inner = loss_module._chunk_ce_sum
    calls: list[int] = []

    def counted(h, *args):
        calls.append(h.size(0))
        return inner(h, *args)

    monkeypatch.setattr(loss_module, "_chunk_ce_sum", counted)
    hidden, weight = hidden0.clone().requires_grad_(), weight0.clone().requires_grad_()
    got = chunked_cross_entropy_sum(hidden, weight, labels, chunk_size=chunk_size)
    got.backward()
    chunks = -(-12 // chunk_size)
    assert len(calls) == 2 * chunks - 1  # forward: every chunk; backward: all but the last

    hidden_ref, weight_ref = hidden0.clone().requires_grad_(), weight0.clone().requires_grad_()
    h, y = hidden_ref.reshape(-1, 16), labels.reshape(-1)
    ref = hidden_ref.new_zeros(())
    for start in range(0, 12, chunk_size):  # the former rule: every chunk checkpointed
        end = min(start + chunk_size, 12)
        ref = ref + checkpoint(inner, h[start:end], weight_ref, None, y[start:end], use_reentrant=False)
    ref.backward()
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
    torch.testing.assert_close(hidden.grad, hidden_ref.grad, rtol=0, atol=0)
    torch.testing.assert_close(weight.grad, weight_ref.grad, rtol=0, atol=0)


def test_chunked_loss_rejects_bad_chunk_size():
    with pytest.raises(ValueError, match="trainer.loss_chunk_size=0"):
        chunked_cross_entropy_sum(
            torch.zeros(1, 2, 3), torch.zeros(4, 3), torch.zeros(1, 2, dtype=torch.long), chunk_size=0
        )


def test_lr_schedule_warmup_then_cosine_to_min():
    kw = dict(warmup_steps=4, max_steps=14, min_lr_ratio=0.1)
    assert [lr_factor(s, **kw) for s in range(4)] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert lr_factor(4, **kw) == pytest.approx(1.0)
    assert lr_factor(9, **kw) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lr_factor(14, **kw) == pytest.approx(0.1)
    assert lr_factor(100, **kw) == pytest.approx(0.1)
    assert lr_factor(0, warmup_steps=0, max_steps=10, min_lr_ratio=0.0) == pytest.approx(1.0)


def test_optimizer_scheduler_and_decay_groups():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    opt, sched = build_optimizer(model, OptimConfig(lr=1.0, warmup_steps=2, weight_decay=0.5), max_steps=10)
    assert [len(g["params"]) for g in opt.param_groups] == [1, 3]  # only the matrix decays
    assert [g["weight_decay"] for g in opt.param_groups] == [0.5, 0.0]
    assert opt.param_groups[0]["lr"] == pytest.approx(0.5)
    opt.step()
    sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(1.0)


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("lr", 0.0, "optim.lr"),
        ("min_lr_ratio", 2.0, "optim.min_lr_ratio"),
        ("grad_clip", -1.0, "optim.grad_clip"),
        ("betas", (0.9, 1.5), "optim.betas"),
        ("warmup_steps", -1, "optim.warmup_steps"),
    ],
)
def test_bad_optim_settings(field, value, match):
    cfg = OptimConfig()
    setattr(cfg, field, value)
    with pytest.raises(ValueError, match=match):
        check_optim_config(cfg, max_steps=10)


def test_clip_grad_norm_plain_tensors():
    p1, p2 = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(4))
    p1.grad, p2.grad = torch.full((3,), 2.0), torch.full((4,), 2.0)
    norm = clip_grad_norm([p1, p2], max_norm=1.0)
    assert norm == pytest.approx(math.sqrt(7 * 4.0))
    total = torch.cat([p1.grad, p2.grad]).norm().item()
    assert total == pytest.approx(1.0, rel=rounding_tolerance(torch.float32, 7))  # fp32 norm of 7 entries
    assert clip_grad_norm([p1, p2], max_norm=0.0) == pytest.approx(total)  # 0 only measures


def test_batches_go_to_the_device_but_cu_seqlens_stay_on_the_host():
    """The attention reads cu_seqlens on the host (docs/attention.md): a device copy would cost a sync."""
    from usp.train.step import batch_to_device

    batch = {k: torch.zeros(1, 8, dtype=torch.int64) for k in ("input_ids", "labels", "position_ids")}
    batch["cu_seqlens"] = torch.tensor([0, 3, 8])
    out = batch_to_device(batch, torch.device("meta"))  # "meta" stands in for a CUDA device
    assert all(out[k].device.type == "meta" for k in ("input_ids", "labels", "position_ids"))
    assert out["cu_seqlens"].device.type == "cpu" and out["cu_seqlens"].dtype == torch.int32
