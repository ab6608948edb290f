"""The router load-balancing loss of MoE families under sequence and data parallelism (:mod:`usp.train.router_loss`).

Float64 (:class:`tests.exact_model.KeepFloat64`: transformers' own ``load_balancing_loss_func`` then accumulates in
float64 too), 4 gloo ranks. The reference is the unsharded model: its own ``outputs.loss`` (cross-entropy plus
``router_aux_loss_coef`` times its own ``aux_loss``, ``output_router_logits=True``) on the same tokens, and its
gradients. The sharded side is the trainer's loss module (:class:`usp.train.loss.ChunkedCausalLMLoss`) on the
``apply_usp`` model, each rank backpropagating its share; the summed gradients must equal the reference's at
``EXACT_TOL``, the routing counts exactly. Packed documents: the reference runs each document alone and
pools the router logits of all documents into transformers' function (one forward of the packed row).
"""

from __future__ import annotations

import copy
import importlib

import pytest
import torch

from tests.exact_model import KeepFloat64, whole
from tests.family_models import SEQ_LEN, build_family
from tests.mesh_cache import cached_sp_mesh
from tests.tolerance import assert_exact
from usp.model import apply_usp
from usp.parallel import shard_sequence
from usp.train.loss import ChunkedCausalLMLoss, count_targets, global_target_count
from usp.train.router_loss import router_aux_spec, router_metrics

ROUTED = ["gpt_oss", "mixtral", "qwen3_moe"]
COEF = 0.3  # large, so that a wrong router-loss gradient shows far above the rounding
DOCS = [0, 9, 10, 27, 32]
LAYOUTS = [  # (ulysses, ring, layout, dp, documents)
    (2, 2, "zigzag", 1, False),
    (4, 1, "zigzag", 1, True),
    (1, 4, "contiguous", 1, True),
    (2, 1, "zigzag", 2, False),  # two data-parallel replicas: the reference sees both rows in one batch
]


def _model(family: str) -> torch.nn.Module:
    model = build_family(family)
    with torch.no_grad():  # routers with spread logits: an uneven routing, so the loss's terms all matter
        for name, p in model.named_parameters():
            if "router" in name or name.endswith("gate.weight"):
                p.copy_(torch.randn_like(p) * 2.0)
    return model


def _rows(vocab: int, dp: int) -> torch.Tensor:
    return torch.randint(3, vocab, (dp, SEQ_LEN), generator=torch.Generator().manual_seed(5))


def _labels(ids: torch.Tensor, cu: torch.Tensor | None) -> torch.Tensor:
    labels = torch.full_like(ids, -100)
    labels[:, :-1] = ids[:, 1:]
    for end in [] if cu is None else cu[1:].tolist():
        labels[:, end - 1] = -100
    return labels


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        n: p.grad.clone() if p.grad is not None else torch.zeros_like(p) for n, p in model.named_parameters()
    }


def _reference(model: torch.nn.Module, ids: torch.Tensor, cu: torch.Tensor | None) -> dict:
    """The model's own loss (cross-entropy + coef x its aux loss) on these rows, and its gradients."""
    balance = importlib.import_module(type(model).__module__).load_balancing_loss_func
    spec = router_aux_spec(model)
    model.zero_grad()
    if cu is None:
        out = model(input_ids=ids, labels=ids, output_router_logits=True)
        aux, loss = out.aux_loss, out.loss
        router_logits = out.router_logits
    else:  # each document alone; the aux loss over the router logits of all of them, as one forward
        bounds = cu.tolist()
        ce, targets, per_doc = 0.0, 0, []
        for a, b in zip(bounds[:-1], bounds[1:]):
            out = model(
                input_ids=ids[:, a:b],
                position_ids=torch.arange(b - a)[None],
                labels=ids[:, a:b],
                output_router_logits=True,
            )
            if b - a > 1:  # outputs.loss holds the document's own aux term: the cross-entropy alone here
                doc_ce = out.loss - spec.coef * out.aux_loss
                ce, targets = ce + doc_ce * (b - a - 1), targets + b - a - 1
            per_doc.append(out.router_logits)
        router_logits = tuple(torch.cat(layer) for layer in zip(*per_doc))
        aux = balance(router_logits, spec.num_experts, spec.top_k)
        loss = ce / targets + spec.coef * aux
    counts = torch.stack(
        [
            torch.bincount(torch.topk(lg, spec.top_k).indices.reshape(-1), minlength=spec.num_experts)
            for lg in router_logits
        ]
    )
    (loss - spec.coef * aux + COEF * aux).backward()  # the model's own loss with the test's coefficient
    return {
        "aux": aux.detach(),
        "ce": (loss - spec.coef * aux).detach(),
        "grads": _grads(model),
        "counts": counts,
    }


def run_routed(family: str) -> list[dict] | None:
    with KeepFloat64():
        reference = _model(family)
        results = []
        for u, r, layout, dp, docs in LAYOUTS:
            cu = torch.tensor(DOCS, dtype=torch.int32) if docs else None
            rows = _rows(reference.config.vocab_size, dp)
            ref = _reference(reference, rows, cu)
            mesh = cached_sp_mesh(u, r, layout, dp)
            model = apply_usp(copy.deepcopy(reference), mesh)
            model.zero_grad()
            loss_model = ChunkedCausalLMLoss(
                model,
                chunk_size=5,
                router_aux=router_aux_spec(model, COEF),
                aux_group=torch.distributed.group.WORLD,
            )
            ids = rows[mesh.dp_rank : mesh.dp_rank + 1]
            pos = (
                torch.arange(SEQ_LEN)[None]
                if cu is None
                else torch.cat([torch.arange(int(b - a)) for a, b in zip(cu[:-1], cu[1:])])[None]
            )

            def shard(t: torch.Tensor, mesh=mesh, cu=cu) -> torch.Tensor:
                return shard_sequence(t, mesh, cu_seqlens=cu)

            labels = shard(_labels(ids, cu))
            total = global_target_count(count_targets(labels), torch.distributed.group.WORLD)
            loss = loss_model(
                shard(ids),
                labels,
                position_ids=shard(pos),
                num_targets=total,
                **({"cu_seqlens": cu} if docs else {}),
            )
            loss.backward()
            grads = _grads(model)
            for g in grads.values():
                torch.distributed.all_reduce(g)  # each rank holds its tokens' share
            ce = loss_model.last_cross_entropy.clone()
            torch.distributed.all_reduce(ce)
            stats = loss_model.last_router_stats
            results.append(
                {
                    "case": (u, r, layout, dp, docs),
                    "ref": ref,
                    "grads": grads,
                    "ce": ce,
                    "aux": stats.aux,
                    "counts": stats.expert_tokens,
                }
            )
            loss_model._router_recorder.remove()
        return results if torch.distributed.get_rank() == 0 else None


@pytest.mark.parametrize("family", ROUTED)
def test_router_loss_and_gradients_equal_the_unsharded_models(dist_pools, family):
    for case in dist_pools(4).run(run_routed, family, timeout=600)[0]:
        name = f"{family} u{case['case'][0]}r{case['case'][1]} {case['case'][2]} dp{case['case'][3]} docs={case['case'][4]}"
        ref = case["ref"]
        assert torch.equal(case["counts"].round().long(), ref["counts"]), f"expert counts {name}"
        assert_exact(case["aux"].reshape(1), ref["aux"].reshape(1), f"aux loss {name}")
        assert_exact(case["ce"].reshape(1), ref["ce"].reshape(1), f"cross-entropy {name}")
        for param, g in ref["grads"].items():
            assert_exact(case["grads"][param], g, f"grad {param} {name}")


def test_router_spec_follows_the_family():
    from transformers import AutoModelForCausalLM

    from tests.family_models import family_config

    qwen = build_family("qwen3_moe")
    spec = router_aux_spec(qwen)
    assert (spec.num_experts, spec.top_k, spec.coef) == (4, 2, qwen.config.router_aux_loss_coef)
    assert router_aux_spec(qwen, 0.5).coef == 0.5
    assert router_aux_spec(build_family("llama")) is None  # dense
    with torch.device("meta"):  # a family whose causal LM adds no router loss (bias-balanced routing)
        deepseek = AutoModelForCausalLM.from_config(family_config("deepseek_v3", {"n_routed_experts": 4}))
    assert router_aux_spec(deepseek) is None


def test_router_metrics_show_a_collapsed_router():
    even = router_metrics(0.5, [[5, 5, 5, 5], [4, 6, 5, 5]])
    assert even["expert_tokens"] == [9, 11, 10, 10] and even["expert_load_max_mean"] == pytest.approx(1.2)
    collapsed = router_metrics(2.0, [[5, 5, 5, 5], [0, 0, 10, 10]])
    assert collapsed["expert_load_max_mean"] == pytest.approx(2.0)  # E / k: every token to the same 2 experts


def _one_train_step(family: str, checkpointing: str, scope: str = "micro_batch") -> dict:
    from usp.train.parallelize import parallelize
    from usp.train.step import train_step

    reference = _model(family)
    mesh = cached_sp_mesh(2, 1, "zigzag", 2)
    rows = _rows(reference.config.vocab_size, 4)  # micro-batch m of replica d: row 2 m + d
    model = copy.deepcopy(reference)
    loss_model = parallelize(
        model,
        mesh,
        param_dtype=torch.float64,
        reduce_dtype=torch.float64,
        activation_checkpointing=checkpointing,
        loss_chunk_size=5,
        router_aux_loss_coef=COEF,
        router_loss_scope=scope,
    )
    batches = []
    for m in range(2):
        ids = rows[2 * m + mesh.dp_rank][None]
        full = {"input_ids": ids, "labels": _labels(ids, None), "position_ids": torch.arange(SEQ_LEN)[None]}
        batches.append({k: shard_sequence(v, mesh) for k, v in full.items()})
    optimizer = torch.optim.SGD(loss_model.parameters(), lr=1.0)
    res = train_step(loss_model, optimizer, None, batches, mesh=mesh, grad_clip=0.0)
    return {"res": res, "after": {n: whole(p).detach() for n, p in model.named_parameters()}}


def run_train_step(family: str, scope: str = "micro_batch") -> dict | None:
    """Worker: one ``train_step`` (FSDP2, 2 micro-batches, dp 2 x u2) with SGD at lr 1, so that the new weights
    are the old minus the summed gradients, in float64 end to end; rank 0 returns the figures."""
    with KeepFloat64():
        out = _one_train_step(family, "none", scope)
    return out if torch.distributed.get_rank() == 0 else None


def run_checkpointed_steps(family: str) -> dict | None:
    """Worker: the same step without and with full and offloaded activation checkpointing (whose recomputation
    in backward must record no router logits a second time). Without :class:`KeepFloat64`, which checkpointing's
    recomputation does not run under: the family's fp32 router and norms, identical in both runs."""
    out = {mode: _one_train_step(family, mode) for mode in ("none", "full", "offload")}
    return out if torch.distributed.get_rank() == 0 else None


def test_train_step_adds_the_mean_router_loss_of_the_micro_batches(dist_pools):
    family = "qwen3_moe"
    got = dist_pools(4).run(run_train_step, family, timeout=300)[0]
    with KeepFloat64():
        reference = _model(family)
        rows = _rows(reference.config.vocab_size, 4)
        before = {n: p.detach().clone() for n, p in reference.named_parameters()}
        spec = router_aux_spec(reference)
        ce_sum, auxes, counts = 0.0, [], 0
        for m in range(2):  # one forward per micro-batch over both replicas' rows, as the trainer's step
            out = reference(
                input_ids=rows[2 * m : 2 * m + 2], labels=rows[2 * m : 2 * m + 2], output_router_logits=True
            )
            ce_sum = ce_sum + (out.loss - spec.coef * out.aux_loss) * 2 * (SEQ_LEN - 1)
            auxes.append(out.aux_loss)
            counts = counts + torch.stack(
                [
                    torch.bincount(torch.topk(lg, spec.top_k).indices.reshape(-1), minlength=4)
                    for lg in out.router_logits
                ]
            )
        ce = ce_sum / (4 * (SEQ_LEN - 1))
        aux = (auxes[0] + auxes[1]) / 2
        (ce + COEF * aux).backward()
    res = got["res"]
    assert_exact(
        torch.tensor([res.loss], dtype=torch.float64),
        ce.detach().reshape(1),
        "the step's loss is the cross-entropy",
    )
    assert_exact(
        torch.tensor([res.aux_loss], dtype=torch.float64), aux.detach().reshape(1), "the step's aux_loss"
    )
    assert res.expert_tokens == counts.tolist()
    for name, p in reference.named_parameters():
        assert_exact(got["after"][name], before[name] - p.grad, f"SGD step of {name}")


def test_activation_checkpointing_records_each_router_once(dist_pools):
    got = dist_pools(4).run(run_checkpointed_steps, "mixtral", timeout=300)[0]
    plain = got["none"]
    for mode in ("full", "offload"):  # offload: the checkpoints' inputs kept on the host
        checkpointed = got[mode]
        assert checkpointed["res"].expert_tokens == plain["res"].expert_tokens, mode
        for key in ("loss", "aux_loss", "grad_norm"):
            assert getattr(checkpointed["res"], key) == getattr(plain["res"], key), (mode, key)
        for name, value in plain["after"].items():
            assert torch.equal(checkpointed["after"][name], value), f"{mode}: SGD step of {name}"


def run_tiny_moe(cfg) -> dict:
    from usp.train.trainer import run

    out = run(cfg)
    return {k: out[k] for k in ("losses", "final_step", "export_dir", "val_losses")}


def test_trainer_logs_the_router_loss_and_expert_loads(dist_pools, tmp_path):
    """``usp.train.trainer.run`` on a tiny Qwen3-MoE (u2r2, 2 micro-batches, validation): each step's record holds
    ``aux_loss``, ``expert_tokens`` (every routed token of every MoE layer, counted once) and the max/mean load;
    ``loss`` and ``val_loss`` stay the cross-entropy; the export loads back into transformers."""
    import json

    from transformers import AutoModelForCausalLM

    from tests.test_train_run import make_config
    from usp.tiny import build_tiny_llama

    moe = dict(model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    model_dir = str(build_tiny_llama(tmp_path / "model", **moe))
    cfg = make_config(
        model_dir, str(tmp_path / "run"), str(tmp_path / "cache"), ulysses_degree=2, ring_degree=2
    )
    cfg.trainer.max_steps, cfg.trainer.eval_every, cfg.model.router_aux_loss_coef = 4, 2, 0.05
    out = dist_pools(4).run(run_tiny_moe, cfg, timeout=300)[0]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    layers, tokens, top_k = 2, cfg.trainer.grad_accum_steps * cfg.trainer.seq_len, 2
    for r in records:
        assert sum(r["expert_tokens"]) == layers * tokens * top_k and len(r["expert_tokens"]) == 4
        assert 1.0 <= r["expert_load_max_mean"] <= 4 / top_k
        assert (
            0.0 < r["aux_loss"] <= 4.0 + 1e-9
        )  # k when the counts are balanced, E when all go to the same k
    assert [r["loss"] for r in records] == pytest.approx(out["losses"])
    assert sorted(out["val_losses"]) == [2, 4]
    exported = AutoModelForCausalLM.from_pretrained(out["export_dir"], local_files_only=True)
    assert exported.config.num_experts == 4


def test_mlp_tiles_are_refused_for_moe_before_anything_runs():
    """``parallel.mlp_tiles`` > 1 on a MoE is a ``ValueError`` naming the setting at the layout check (start-up
    and ``usp-launch``); ``auto`` resolves to 1 tile there (a dense model of the same shape gets several)."""
    from tests.family_models import family_config
    from usp.config import TrainConfig
    from usp.startup.degrees import plan_layout

    def layout(family: str, tiles):
        cfg = TrainConfig()
        cfg.trainer.seq_len, cfg.parallel.ulysses_degree, cfg.parallel.ring_degree = 4096, 2, 1
        cfg.parallel.mlp_tiles = tiles
        return plan_layout(cfg, family_config(family).to_dict(), world_size=2, node_size=2, gpu="cpu")

    with pytest.raises(
        ValueError, match="parallel.mlp_tiles=4: MLP tiles are not supported for mixture-of-experts"
    ):
        layout("qwen3_moe", 4)
    assert layout("qwen3_moe", "auto").mlp_tiles == 1
    assert layout("llama", "auto").mlp_tiles > 1


def test_step_scope_router_loss_is_the_whole_steps(dist_pools):
    """``model.router_loss_scope=step``: the router loss of the step's 4 rows (2 micro-batches x 2 replicas) is the
    unsharded model's on all 4 rows in one forward (the counts of every micro-batch, from the routing pass), and
    the step's gradients are that loss's."""
    family = "mixtral"
    got = dist_pools(4).run(run_train_step, family, "step", timeout=300)[0]
    with KeepFloat64():
        reference = _model(family)
        rows = _rows(reference.config.vocab_size, 4)
        before = {n: p.detach().clone() for n, p in reference.named_parameters()}
        spec = router_aux_spec(reference)
        out = reference(input_ids=rows, labels=rows, output_router_logits=True)
        ce = out.loss - spec.coef * out.aux_loss
        (ce + COEF * out.aux_loss).backward()
        counts = torch.stack(
            [
                torch.bincount(torch.topk(lg, spec.top_k).indices.reshape(-1), minlength=4)
                for lg in out.router_logits
            ]
        )
    res = got["res"]
    assert_exact(torch.tensor([res.loss], dtype=torch.float64), ce.detach().reshape(1), "the step's loss")
    assert_exact(
        torch.tensor([res.aux_loss], dtype=torch.float64),
        out.aux_loss.detach().reshape(1),
        "the step's aux_loss",
    )
    assert res.expert_tokens == counts.tolist()
    for name, p in reference.named_parameters():
        assert_exact(got["after"][name], before[name] - p.grad, f"SGD step of {name}")


def test_router_loss_scope_is_checked_at_composition():
    from usp.config import TrainConfig
    from usp.config.checks import validate_choices

    cfg = TrainConfig()
    cfg.model.path, cfg.data.build_tiny_corpus = "/ckpt/m", True
    validate_choices(cfg)
    cfg.model.router_loss_scope = "global"
    with pytest.raises(ValueError, match="model.router_loss_scope"):
        validate_choices(cfg)
