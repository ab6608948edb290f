"""Exact SFT loss under every layout: masked, packed conversations, float64.

Rows of tiny chats (ChatML with the tiny tokenizer's ``<s>``/``</s>``) are packed best-fit with their
``loss_mask`` and trained for one step with grad accumulation 2 under u2r2, u1r4, u4r1 (balanced layout) and
dp2 x u1r2; the step's loss, gradient norm and EVERY parameter's gradient must equal a plain single-process
transformers model run document by document, loss = sum of target-token CE / number of targets (float64,
RMSNorm too: ``tests.exact_model``; ``tests.tolerance.EXACT_TOL``). The second step's rows hold three targets only, so
some sp rank's shard holds none; a third step has no target at all and must be skipped on every rank (no
optimizer step, a NaN loss, no division by zero).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.exact_model import CaptureGrads, float64_loss_model, load_float64
from tests.mesh_cache import cached_sp_mesh
from tests.tolerance import EXACT_DTYPE, assert_exact
from usp.data.batch import IGNORE_INDEX, collate_rows
from usp.data.chat_prepare import MESSAGES, ChatOptions, encode_conversations
from usp.data.pack import PackStats
from usp.data.pack_chat import pack_conversations
from usp.tiny import _chat, build_tiny_llama
from usp.train.step import train_step

SEQ_LEN = 64


def make_rows(tokenizer) -> list[dict]:
    """Packed chat rows; the last two are sparse (3 targets) and empty (none)."""
    import random

    rng = random.Random(3)
    renderer = ChatOptions(chat_template="tiny_chatml").renderer(tokenizer)
    encoded = encode_conversations({MESSAGES: [_chat(rng) for _ in range(40)]}, renderer)
    convs = [(np.asarray(i), np.asarray(m)) for i, m in zip(encoded["input_ids"], encoded["loss_mask"])]
    stats = PackStats(seq_len=SEQ_LEN)
    rows = []
    for b in pack_conversations([convs], SEQ_LEN, pad_id=tokenizer.pad_token_id, stats=stats):
        rows.extend(b.to_pylist())
    rows = [r for r in rows if len(r["document_lengths"]) > 1][:4]  # several conversations (and padding) each
    assert len(rows) == 4
    sparse = dict(rows[0], loss_mask=[1 if 20 <= t < 23 else 0 for t in range(SEQ_LEN)])
    empty = dict(rows[1], loss_mask=[0] * SEQ_LEN)
    return rows + [
        sparse,
        dict(rows[2], loss_mask=[0] * SEQ_LEN),
        empty,
        dict(rows[3], loss_mask=[0] * SEQ_LEN),
    ]


def steps_for(dp: int) -> list[list[list[int]]]:
    """Per step, per micro-batch, the row index of each dp replica (grad accumulation 2)."""
    if dp == 1:
        return [[[0], [1]], [[4], [5]], [[6], [7]]]
    return [[[0, 2], [1, 3]], [[4, 5], [2, 5]], [[6, 7], [7, 6]]]


def sft_worker(model_dir: str, rows: list[dict], ulysses: int, ring: int, dp: int) -> dict | None:
    mesh = cached_sp_mesh(ulysses, ring, "balanced", dp)
    model, loss_model = float64_loss_model(model_dir, mesh, loss_chunk_size=9)
    optimizer = CaptureGrads(list(model.named_parameters()))
    out = []
    for step in steps_for(mesh.dp_degree):
        micro = [collate_rows([rows[m[mesh.dp_rank]]], mesh=mesh, document_masking=True) for m in step]
        local = [int((b["labels"] != IGNORE_INDEX).sum()) for b in micro]
        counts = [None] * dist.get_world_size()
        dist.all_gather_object(counts, local)
        optimizer.grads = {}
        res = train_step(loss_model, optimizer, None, micro, mesh=mesh, grad_clip=0.0)
        out.append(
            {
                "loss": res.loss,
                "grad_norm": res.grad_norm,
                "grads": optimizer.grads,
                "counts": counts,
                "no_targets": res.no_targets,
                "num_targets": res.num_targets,
            }
        )
    flags = [s["no_targets"] for s in out]
    if dist.get_rank() != 0:
        return {"no_targets": flags}
    return {"steps": out, "no_targets": flags}


def reference_step(model, rows: list[dict]) -> dict:
    """One process, plain transformers: each document run alone, sum of target CE over every row / count."""
    model.zero_grad(set_to_none=True)
    total, count = 0.0, 0
    losses = []
    for r in rows:
        batch = collate_rows([r], mesh=None, document_masking=True)
        ids, labels = batch["input_ids"][0], batch["labels"][0]
        start = 0
        for n in r["document_lengths"]:
            lab = labels[start : start + n]
            if (lab != IGNORE_INDEX).any():
                logits = model(input_ids=ids[start : start + n][None]).logits[0]
                losses.append(F.cross_entropy(logits, lab, ignore_index=IGNORE_INDEX, reduction="sum"))
                count += int((lab != IGNORE_INDEX).sum())
            start += n
    if count == 0:
        return {"loss": math.nan, "count": 0}
    total = torch.stack(losses).sum() / count
    total.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    norm = float(torch.sqrt(sum((g**2).sum() for g in grads.values())))
    return {"loss": float(total.detach()), "grad_norm": norm, "grads": grads, "count": count}


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> dict:
    from transformers import AutoTokenizer

    model_dir = str(build_tiny_llama(tmp_path_factory.mktemp("sft_exact") / "llama"))
    rows = make_rows(AutoTokenizer.from_pretrained(model_dir))
    model = load_float64(model_dir)
    refs = {}
    for dp in (1, 2):
        refs[dp] = [reference_step(model, [rows[i] for m in step for i in m]) for step in steps_for(dp)]
    return {"model": model_dir, "rows": rows, "refs": refs}


LAYOUTS = [
    pytest.param(1, 1, 1, 1, id="world1"),
    pytest.param(4, 2, 2, 1, id="u2r2"),
    pytest.param(4, 1, 4, 1, id="u1r4", marks=pytest.mark.slow),
    pytest.param(4, 4, 1, 1, id="u4r1", marks=pytest.mark.slow),
    pytest.param(4, 1, 2, 2, id="dp2-u1r2", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("world, ulysses, ring, dp", LAYOUTS)
def test_sft_loss_and_every_gradient_match_one_process(dist_pools, setup, world, ulysses, ring, dp):
    results = dist_pools(world).run(sft_worker, setup["model"], setup["rows"], ulysses, ring, dp)
    got, refs = results[0], setup["refs"][dp]
    assert all(r["no_targets"] == [False, False, True] for r in results), "every rank skips the empty step"
    sparse_counts = got["steps"][1]["counts"]
    if world > 1:  # the sparse step: some rank's shard holds no target in some micro-batch
        assert min(c[0] for c in sparse_counts) == 0 < max(c[0] for c in sparse_counts)
    for k, (step, ref) in enumerate(zip(got["steps"][:2], refs[:2])):
        assert step["num_targets"] == ref["count"] > 0
        assert math.isfinite(step["loss"])
        for key in ("loss", "grad_norm"):
            assert_exact(
                torch.tensor([step[key]], dtype=EXACT_DTYPE),
                torch.tensor([ref[key]], dtype=EXACT_DTYPE),
                f"step {k} {key}",
            )
        assert set(step["grads"]) == set(ref["grads"])
        for name, g in ref["grads"].items():
            assert_exact(step["grads"][name], g, f"step {k} {name}")
    empty = got["steps"][2]
    assert (
        math.isnan(empty["loss"]) and empty["num_targets"] == 0 == refs[2]["count"] and empty["grads"] == {}
    )
