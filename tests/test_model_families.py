"""Every supported family through ``apply_usp``: logits and every gradient equal the unsharded model's.

Tiny random models of transformers' own classes (:mod:`tests.family_models`: sliding windows, chunked
attention, softcapping, sinks, MLA, LongRoPE, attention temperature tuning, NoPE and partial-rotary layers,
LM-head transforms, MoE), float64, on 4 gloo ranks under u2r2, u4r1 and u1r4, the zigzag, contiguous and
balanced layouts, with and without packed documents. The reference is the same model unsharded with
transformers' eager attention, run on each packed document alone (a packed row trains as if its documents
were separate sequences; transformers' own packed-row masks miss documents in some families, e.g. gpt-oss),
except :data:`ROW_REFERENCE`'s row-level terms.
Exact at ``EXACT_TOL``. The unsupported families are refused by
the capability gate before any weight is read, naming the config field.
"""

from __future__ import annotations

import copy

import pytest
import torch

from tests.exact_model import KeepFloat64
from tests.family_models import FAMILIES, REFUSED, SEQ_LEN, build_family, family_config
from tests.mesh_cache import cached_sp_mesh
from tests.tolerance import assert_close_scaled, assert_exact, rounding_tolerance
from usp.model import apply_usp, model_capabilities, packed_sequence_kwargs
from usp.parallel import gather_sequence, shard_sequence
from usp.train.loss import ChunkedCausalLMLoss, count_targets, global_target_count

ROW_REFERENCE = {"llama4_text"}
"""Families whose packed-row reference is the unsharded model on the whole row, not each document alone: Llama
4's attention temperature grows with the token's index in the row (transformers counts the row, and so does
usp); their documents' attention is still masked per document by transformers' own packed-row masks."""
DOCS = [0, 11, 12, 27, 32]  # a 1-token document; documents crossing ring parts
LAYOUTS = [  # (ulysses, ring, layout, documents)
    (2, 2, "zigzag", False),
    (4, 1, "zigzag", True),
    (1, 4, "contiguous", False),
    (1, 4, "balanced", True),
    (2, 2, "zigzag", True),
]


def _batch(vocab: int, docs: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(3, vocab, (1, SEQ_LEN), generator=g)
    if not docs:
        return ids, torch.arange(SEQ_LEN)[None], None
    cu = torch.tensor(DOCS, dtype=torch.int32)
    pos = torch.cat([torch.arange(int(b - a)) for a, b in zip(cu[:-1], cu[1:])])[None]
    return ids, pos, cu


def _labels(ids: torch.Tensor, cu: torch.Tensor | None) -> torch.Tensor:
    """The trainer's targets: the next token, none at each document's last token."""
    labels = torch.full_like(ids, -100)
    labels[:, :-1] = ids[:, 1:]
    for end in [] if cu is None else cu[1:].tolist():
        labels[:, end - 1] = -100
    return labels


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        n: (p.grad.clone() if p.grad is not None else torch.zeros_like(p))
        for n, p in model.named_parameters()
    }


def run_family(family: str) -> list[dict] | None:
    """Worker: the unsharded reference and every layout's sharded run; sp rank 0 returns both."""
    with KeepFloat64():
        return _run_family(family)


def _run_family(family: str) -> list[dict] | None:
    reference = build_family(family)
    w = torch.linspace(-1, 2, SEQ_LEN, dtype=torch.float64)[None, :, None]  # sums to no zero
    results = []
    for docs in (False, True):
        ids, pos, cu = _batch(reference.config.vocab_size, docs)
        bounds = [0, SEQ_LEN] if cu is None else cu.tolist()
        reference.zero_grad()
        if docs and family in ROW_REFERENCE:  # the packed row through the unsharded model, as one call
            logits = reference(input_ids=ids, position_ids=pos).logits
            (logits * w).sum().backward()
            loss = torch.nn.functional.cross_entropy(
                logits[0].detach(), _labels(ids, cu)[0], ignore_index=-100
            )
            results.append(
                {"docs": docs, "logits": logits.detach(), "grads": _grads(reference), "loss": loss}
            )
            continue
        pieces = []
        loss, targets = 0.0, 0
        for a, b in zip(bounds[:-1], bounds[1:]):  # each packed document on its own
            out = reference(input_ids=ids[:, a:b], position_ids=pos[:, a:b], labels=ids[:, a:b])
            (out.logits * w[:, a:b]).sum().backward()
            pieces.append(out.logits.detach())
            if (
                b - a > 1
            ):  # the model's own loss (its LM-head transform included), mean over b - a - 1 targets
                loss, targets = loss + out.loss.detach() * (b - a - 1), targets + b - a - 1
        results.append(
            {"docs": docs, "logits": torch.cat(pieces, 1), "grads": _grads(reference), "loss": loss / targets}
        )
    for u, r, layout, docs in LAYOUTS:
        mesh = cached_sp_mesh(u, r, layout, 1)
        model = apply_usp(copy.deepcopy(reference), mesh)
        model.zero_grad()
        ids, pos, cu = _batch(model.config.vocab_size, docs)

        def shard(t: torch.Tensor, mesh=mesh, cu=cu) -> torch.Tensor:
            return shard_sequence(t, mesh, cu_seqlens=cu)

        logits = model(input_ids=shard(ids), position_ids=shard(pos), **packed_sequence_kwargs(cu)).logits
        (logits * shard(w)).sum().backward()
        grads = _grads(model)
        for g in grads.values():
            torch.distributed.all_reduce(g, group=mesh.sp_group)  # each rank holds its tokens' share
        full = gather_sequence(logits.detach(), mesh, cu_seqlens=cu)
        labels = shard(_labels(ids, cu))
        total = global_target_count(count_targets(labels), mesh.sp_group)
        with (
            torch.no_grad()
        ):  # the trainer's loss: decoder + chunked lm_head cross-entropy on this rank's slice
            loss = ChunkedCausalLMLoss(model, chunk_size=3)(
                shard(ids), labels, position_ids=shard(pos), cu_seqlens=cu, num_targets=total
            )
        torch.distributed.all_reduce(loss, group=mesh.sp_group)
        results.append({"layout": (u, r, layout, docs), "logits": full, "grads": grads, "loss": loss})
    return results if torch.distributed.get_rank() == 0 else None


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_is_exact_under_every_layout(dist_pools, family):
    got = dist_pools(4).run(run_family, family)[0]
    refs = {r["docs"]: r for r in got[:2]}
    for case in got[2:]:
        u, r, layout, docs = case["layout"]
        ref = refs[docs]
        name = f"{family} u{u}r{r} {layout} docs={docs}"
        assert_exact(case["logits"], ref["logits"], f"logits {name}")
        assert_exact(
            case["loss"].reshape(1), ref["loss"].reshape(1), f"trainer loss vs the model's own {name}"
        )
        for param, g in ref["grads"].items():
            if g.dtype == torch.float64:
                assert_exact(case["grads"][param], g, f"grad {param} {name}")
            else:  # parameters the family keeps in fp32 (routers): the rule over the tokens summed
                tol = rounding_tolerance(g.dtype, SEQ_LEN)
                assert_close_scaled(case["grads"][param], g, tol, f"grad {param} {name}")


@pytest.mark.parametrize("family", sorted(REFUSED))
def test_unsupported_family_is_refused_naming_the_field(family):
    overrides, field = REFUSED[family]
    caps = model_capabilities(family_config(family, overrides))
    with pytest.raises(ValueError, match=field.replace("[", r"\[")) as err:
        caps.check("forward")
    assert family in str(err.value)


def test_moe_trains_when_usp_computes_its_router_loss():
    """qwen3_moe's router loss is the one usp computes sharded (tests/test_moe_router_loss.py): it trains. Doge's
    is another formula: its forward is served, its training refused, naming the field."""
    from transformers import DogeConfig

    model_capabilities(family_config("qwen3_moe")).check("train")
    doge = DogeConfig(
        is_moe=True,
        num_experts=4,
        num_experts_per_tok=2,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    with pytest.raises(ValueError, match="num_experts: a mixture-of-experts model whose router loss"):
        model_capabilities(doge).check("train")


def test_docs_models_page_holds_the_generated_matrix():
    """docs/models.md's matrix and refusal list are this suite's families, as generated now."""
    from pathlib import Path

    from tests.family_models import refusal_list, support_matrix

    page = (Path(__file__).resolve().parents[1] / "docs" / "models.md").read_text()
    assert support_matrix() in page, "regenerate docs/models.md's matrix: python -m tests.family_models"
    assert refusal_list() in page, "regenerate docs/models.md's refusal list: python -m tests.family_models"


def test_lm_heads_the_chunked_loss_cannot_reproduce_are_refused():
    """An LM head with layers before its vocabulary projection (RoBERTa-style decoders) would be skipped by
    usp's chunked losses: refused, naming ``lm_head``."""
    from transformers import RobertaConfig

    config = RobertaConfig(
        is_decoder=True, hidden_size=16, num_attention_heads=2, num_hidden_layers=1, intermediate_size=16
    )
    with pytest.raises(ValueError, match="lm_head: .*vocabulary projection"):
        model_capabilities(config).check("forward")
