"""DPO under every layout (:mod:`usp.train.dpo`): exact against one process, float64.

Rows of preference pairs (``prompt + chosen`` then ``prompt + rejected``, two documents of one row, the
completion tokens marked by ``loss_mask``) are trained for two steps of two micro-batches under world 1, u2r2,
u1r4, u4r1 (balanced layout) and dp2 x u1r2 with the trainer's own step. The reference is a plain
transformers model in one process running each sequence alone: each completion's summed target
log-probability, the pair loss of the formula written out here, its mean over the step's pairs, and its
gradient. Compared at ``EXACT_TOL``: each step's loss, rewards and accuracy, and every parameter's gradient,
for the ``sigmoid``, ``ipo`` and ``simpo`` losses. The rows include a pair whose two sequences lie on one rank
(so some shard holds no completion token) and a row of two pairs. With the reference equal to the policy
(computed by :func:`usp.train.reference.compute_reference_logps` on the training mesh) the first loss is ln 2.
The same pairs with each prompt once (``trainer.dpo.shared_prompt``'s rows) give the same losses, gradients and
log-probabilities under u2r2.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.exact_model import CaptureGrads, float64_loss_model, load_float64
from tests.mesh_cache import cached_sp_mesh
from tests.run_errors import run_expecting_error
from tests.tolerance import EXACT_DTYPE, assert_exact, rounding_tolerance
from usp.config import TrainConfig
from usp.data.batch import IGNORE_INDEX, collate_rows
from usp.data.pack_preference import shared_prefix_length
from usp.tiny import build_tiny_llama
from usp.train.dpo import DpoSpec, dpo_step, dpo_validation
from usp.train.reference import ReferenceLogps, compute_reference_logps
from usp.train.trainer import run

SEQ_LEN = 64
# per row: (prompt, chosen, rejected) lengths of each pair; the rest of the row is padding
ROWS = [
    [(12, 8, 10)],
    [(5, 4, 3), (6, 5, 7)],
    [(20, 14, 9)],
    [(3, 4, 2)],  # 13 tokens at the start of the row: most shards hold no completion token
]
SPECS = {
    "sigmoid": DpoSpec(beta=0.5, loss_type="sigmoid"),
    "ipo": DpoSpec(beta=0.5, loss_type="ipo"),
    "simpo": DpoSpec(beta=2.0, loss_type="simpo", simpo_gamma=0.3),
}


def make_rows(vocab: int) -> list[dict]:
    gen = torch.Generator().manual_seed(11)
    rows = []
    for pairs in ROWS:
        ids, mask, lengths, roles = [], [], [], []
        for prompt, chosen, rejected in pairs:
            p = torch.randint(3, vocab, (prompt,), generator=gen).tolist()
            for n, role in ((chosen, 1), (rejected, 2)):
                ids += p + torch.randint(3, vocab, (n,), generator=gen).tolist()
                mask += [0] * prompt + [1] * n
                lengths.append(prompt + n)
                roles.append(role)
        pad = SEQ_LEN - len(ids)
        assert pad >= 0
        if pad:
            ids, mask, lengths, roles = ids + [0] * pad, mask + [0] * pad, lengths + [pad], roles + [0]
        rows.append(
            {
                "input_ids": ids,
                "loss_mask": mask,
                "document_lengths": lengths,
                "document_roles": roles,
                "first_position": 0,
            }
        )
    return rows


def reference_values(rows: list[dict]) -> np.ndarray:
    """Made-up reference log-probabilities per (row, document): not the policy's, so every term counts."""
    gen = np.random.default_rng(3)
    width = max(len(r["document_roles"]) for r in rows)
    return -gen.uniform(5.0, 60.0, size=(len(rows), width))


def steps_for(dp: int) -> list[list[list[int]]]:
    if dp == 1:
        return [[[0], [1]], [[2], [3]]]
    return [[[0, 1], [2, 3]], [[3, 2], [1, 0]]]


def _batch(rows: list[dict], index: list[int], mesh) -> dict:
    batch = collate_rows([rows[i] for i in index], mesh=mesh, document_masking=True)
    batch["row_index"] = list(index)
    return batch


def dpo_worker(model_dir: str, rows: list[dict], ref: np.ndarray, ulysses: int, ring: int, dp: int) -> dict:
    mesh = cached_sp_mesh(ulysses, ring, "balanced", dp)
    model, loss_model = float64_loss_model(model_dir, mesh, loss_chunk_size=7)
    optimizer = CaptureGrads(list(model.named_parameters()))
    out: dict = {}
    for key, spec in SPECS.items():
        reference = None if key == "simpo" else ReferenceLogps(ref)
        steps = []
        for step in steps_for(mesh.dp_degree):
            micro = [_batch(rows, [m[mesh.dp_rank]], mesh) for m in step]
            res = dpo_step(
                loss_model, optimizer, None, micro, mesh=mesh, grad_clip=0.0, spec=spec, reference=reference
            )
            steps.append({"loss": res.loss, "preference": res.preference, "grads": optimizer.grads})
        out[key] = steps
    # the reference equal to the policy, computed on this mesh: the first loss is ln 2 exactly
    dataset = [dict(r) for r in rows]
    own = ReferenceLogps(compute_reference_logps(loss_model, dataset, mesh=mesh, device=torch.device("cpu")))
    micro = [_batch(rows, [m[mesh.dp_rank]], mesh) for m in steps_for(mesh.dp_degree)[0]]
    first = dpo_step(
        loss_model, optimizer, None, micro, mesh=mesh, grad_clip=0.0, spec=SPECS["sigmoid"], reference=own
    )
    out["self_reference"] = {"loss": first.loss, "values": own.values}
    # validation: every row once, this replica's share (the weights are unchanged: CaptureGrads' lr is 0)
    val = [_batch(rows, [i], mesh) for i in range(mesh.dp_rank, len(rows), mesh.dp_degree)]
    out["validation"] = {
        key: dpo_validation(
            loss_model, val, mesh=mesh, spec=spec, reference=None if key == "simpo" else ReferenceLogps(ref)
        )
        for key, spec in SPECS.items()
    }
    out["self_validation"] = dpo_validation(loss_model, val, mesh=mesh, spec=SPECS["sigmoid"], reference=own)
    return out if dist.get_rank() == 0 else {}


def sequence_logps(model, row: dict) -> list[torch.Tensor]:
    """Each document's summed target log-probability, the document run alone (one process)."""
    batch = collate_rows([row], mesh=None, document_masking=True)
    ids, labels = batch["input_ids"][0], batch["labels"][0]
    out, start = [], 0
    for n in row["document_lengths"]:
        logits = model(input_ids=ids[start : start + n][None]).logits[0]
        lab = labels[start : start + n]
        logp = -F.cross_entropy(logits, lab, ignore_index=IGNORE_INDEX, reduction="sum")
        out.append((logp, int((lab != IGNORE_INDEX).sum())))
        start += n
    return out


def formula(key: str, spec: DpoSpec, pc, pr, rc, rr, nc, nr):
    """The pair loss and the two rewards, written out."""
    if key == "simpo":
        a, b = spec.beta * pc / nc, spec.beta * pr / nr
        return -F.logsigmoid(a - b - spec.simpo_gamma), a, b
    a, b = spec.beta * (pc - rc), spec.beta * (pr - rr)
    if key == "ipo":
        return ((pc - rc) - (pr - rr) - 1 / (2 * spec.beta)) ** 2, a, b
    return -F.logsigmoid(a - b), a, b


def reference_validation(model_dir: str, rows: list[dict], ref: np.ndarray) -> dict:
    """Every pair of every row, no gradient: the mean loss, reward accuracy and margin."""
    model = load_float64(model_dir)
    out = {}
    with torch.no_grad():
        seqs = [sequence_logps(model, r) for r in rows]
    for key, spec in SPECS.items():
        losses, margins = [], []
        for i, r in enumerate(rows):
            for c, role in enumerate(r["document_roles"]):
                if role == 1:
                    (pc, nc), (pr, nr) = seqs[i][c], seqs[i][c + 1]
                    loss, a, b = formula(key, spec, pc, pr, float(ref[i, c]), float(ref[i, c + 1]), nc, nr)
                    losses.append(float(loss))
                    margins.append(float(a - b))
        out[key] = {
            "val_loss": float(np.mean(losses)),
            "val_reward_accuracy": float(np.mean([m > 0 for m in margins])),
            "val_reward_margin": float(np.mean(margins)),
        }
    return out


def reference_run(model_dir: str, rows: list[dict], ref: np.ndarray, dp: int) -> dict:
    model = load_float64(model_dir)
    out = {}
    for key, spec in SPECS.items():
        steps = []
        for step in steps_for(dp):
            model.zero_grad(set_to_none=True)
            terms, rewards_c, rewards_r = [], [], []
            for micro in step:
                for i in micro:
                    seqs = sequence_logps(model, rows[i])
                    roles = rows[i]["document_roles"]
                    for c in range(len(roles)):
                        if roles[c] != 1:
                            continue
                        (pc, nc), (pr, nr) = seqs[c], seqs[c + 1]
                        loss, a, b = formula(
                            key, spec, pc, pr, float(ref[i, c]), float(ref[i, c + 1]), nc, nr
                        )
                        terms.append(loss)
                        rewards_c.append(float(a.detach()))
                        rewards_r.append(float(b.detach()))
            total = torch.stack(terms).mean()
            total.backward()
            steps.append(
                {
                    "loss": float(total.detach()),
                    "rewards_chosen": float(np.mean(rewards_c)),
                    "rewards_rejected": float(np.mean(rewards_r)),
                    "reward_accuracy": float(np.mean([a > b for a, b in zip(rewards_c, rewards_r)])),
                    "pairs": len(terms),
                    "grads": {n: p.grad.clone() for n, p in model.named_parameters()},
                }
            )
        out[key] = steps
    return out


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> dict:
    import json
    from pathlib import Path

    model_dir = str(build_tiny_llama(tmp_path_factory.mktemp("dpo_exact") / "llama"))
    vocab = json.loads(Path(model_dir, "config.json").read_text())["vocab_size"]
    rows = make_rows(vocab)
    ref = reference_values(rows)
    return {
        "model": model_dir,
        "rows": rows,
        "ref": ref,
        "refs": {dp: reference_run(model_dir, rows, ref, dp) for dp in (1, 2)},
        "val": reference_validation(model_dir, rows, ref),
    }


LAYOUTS = [
    pytest.param(1, 1, 1, 1, id="world1"),
    pytest.param(4, 2, 2, 1, id="u2r2"),
    pytest.param(4, 1, 4, 1, id="u1r4"),
    pytest.param(4, 4, 1, 1, id="u4r1"),
    pytest.param(4, 1, 2, 2, id="dp2-u1r2"),
]


def _scalar(x: float) -> torch.Tensor:
    return torch.tensor([x], dtype=EXACT_DTYPE)


@pytest.mark.parametrize("world, ulysses, ring, dp", LAYOUTS)
def test_dpo_loss_rewards_and_every_gradient_match_one_process(dist_pools, setup, world, ulysses, ring, dp):
    got = dist_pools(world).run(dpo_worker, setup["model"], setup["rows"], setup["ref"], ulysses, ring, dp)[0]
    refs = setup["refs"][dp]
    for key in SPECS:
        for k, (step, ref) in enumerate(zip(got[key], refs[key])):
            where = f"{key} step {k}"
            assert_exact(_scalar(step["loss"]), _scalar(ref["loss"]), f"{where} loss")
            pref = step["preference"]
            assert pref["pairs"] == ref["pairs"]
            for name in ("rewards_chosen", "rewards_rejected", "reward_accuracy"):
                assert_exact(_scalar(pref[name]), _scalar(ref[name]), f"{where} {name}")
            assert set(step["grads"]) == set(ref["grads"])
            for name, g in ref["grads"].items():
                assert_exact(step["grads"][name], g, f"{where} grad {name}")
            assert any(float(g.abs().max()) > 0 for g in step["grads"].values())
    own = got["self_reference"]
    assert_exact(_scalar(own["loss"]), _scalar(math.log(2.0)), "reference = policy: the loss is ln 2")
    assert_exact(
        _scalar(got["self_validation"]["val_loss"]), _scalar(math.log(2.0)), "validation, reference = policy"
    )
    for key in SPECS:
        for name, value in setup["val"][key].items():
            assert_exact(_scalar(got["validation"][key][name]), _scalar(value), f"{key} {name}")


# --- the prompt once (trainer.dpo.shared_prompt) -------------------------------------------------------------


def shared_rows(rows: list[dict]) -> list[dict]:
    """The same pairs in the same rows with each prompt once (``usp-prepare-data --shared-prompt``'s layout):
    ``prompt + chosen``, then the prompt's last token + ``rejected`` linked to the rest of the prompt."""
    out = []
    for r in rows:
        ids, mask = np.asarray(r["input_ids"]), np.asarray(r["loss_mask"], dtype=np.uint8)
        starts = np.cumsum([0, *r["document_lengths"]])
        row = {
            k: [] for k in ("input_ids", "loss_mask", "document_lengths", "document_roles", "shared_prefix")
        }
        for d, role in enumerate(r["document_roles"]):
            if role != 1:
                continue
            c, j = slice(starts[d], starts[d + 1]), slice(starts[d + 1], starts[d + 2])
            pair = (ids[c], mask[c], ids[j], mask[j])
            shared = shared_prefix_length(pair)
            for part_ids, part_mask, role_, link in (
                (ids[c], mask[c], 1, 0),
                (ids[j][shared:], mask[j][shared:], 2, shared),
            ):
                row["input_ids"] += part_ids.tolist()
                row["loss_mask"] += part_mask.tolist()
                row["document_lengths"].append(len(part_ids))
                row["document_roles"].append(role_)
                row["shared_prefix"].append(link)
        pad = SEQ_LEN - len(row["input_ids"])
        row["input_ids"] += [0] * pad
        row["loss_mask"] += [0] * pad
        row["document_lengths"].append(pad)
        row["document_roles"].append(0)
        row["shared_prefix"].append(0)
        out.append({**row, "first_position": 0})
    return out


SHARED_SPECS = ("sigmoid", "simpo")


def pair_tokens(rows: list[dict]) -> int:
    """The tokens the rows' pairs take (padding left out)."""
    return sum(n for r in rows for n, role in zip(r["document_lengths"], r["document_roles"]) if role)


def dpo_shared_worker(
    model_dir: str, rows: list[dict], ref: np.ndarray, layouts: list[tuple[int, int]]
) -> dict:
    """The trainer's DPO step on shared-prompt rows under each ``(ulysses, ring)`` (balanced), and the
    reference pass's log-probabilities."""
    out: dict = {}
    for ulysses, ring in layouts:
        mesh = cached_sp_mesh(ulysses, ring, "balanced")
        model, loss_model = float64_loss_model(model_dir, mesh, loss_chunk_size=7)
        optimizer = CaptureGrads(list(model.named_parameters()))
        got: dict = {}
        for key in SHARED_SPECS:
            steps = []
            for step in steps_for(1):
                micro = [_batch(rows, m, mesh) for m in step]
                res = dpo_step(
                    loss_model,
                    optimizer,
                    None,
                    micro,
                    mesh=mesh,
                    grad_clip=0.0,
                    spec=SPECS[key],
                    reference=None if key == "simpo" else ReferenceLogps(ref),
                )
                steps.append({"loss": res.loss, "preference": res.preference, "grads": optimizer.grads})
            got[key] = steps
        got["logps"] = compute_reference_logps(
            loss_model, [dict(r) for r in rows], mesh=mesh, device=torch.device("cpu")
        )
        out[f"u{ulysses}r{ring}"] = got
    return out if dist.get_rank() == 0 else {}


def test_shared_prompt_layout_equals_two_sequences(dist_pools, setup):
    """``trainer.dpo.shared_prompt``'s rows: the loss, rewards and every gradient of each step, and each
    document's log-probability, equal one process running each sequence alone (and so the two-sequence
    layout); with fewer tokens (the prompt once)."""
    rows = shared_rows(setup["rows"])
    saved = sum(p - 1 for pairs in ROWS for p, _, _ in pairs)
    assert pair_tokens(rows) == pair_tokens(setup["rows"]) - saved == 158 - 41  # the prompt once
    # u2r2, balanced: Ulysses and the ring (the attention test covers world 1 and u1r4)
    got = dist_pools(4).run(dpo_shared_worker, setup["model"], rows, setup["ref"], [(2, 2)])[0]
    model = load_float64(setup["model"])
    with torch.no_grad():
        logps = [[float(lp) for lp, _ in sequence_logps(model, r)] for r in setup["rows"]]
    for name, result in got.items():
        for key in SHARED_SPECS:
            for k, (step, ref) in enumerate(zip(result[key], setup["refs"][1][key])):
                where = f"{name} {key} step {k}"
                assert_exact(_scalar(step["loss"]), _scalar(ref["loss"]), f"{where} loss")
                assert step["preference"]["pairs"] == ref["pairs"]
                for metric in ("rewards_chosen", "rewards_rejected", "reward_accuracy"):
                    assert_exact(
                        _scalar(step["preference"][metric]), _scalar(ref[metric]), f"{where} {metric}"
                    )
                for param, g in ref["grads"].items():
                    assert_exact(step["grads"][param], g, f"{where} grad {param}")
        for i, row in enumerate(setup["rows"]):
            for d, role in enumerate(row["document_roles"]):
                if role:
                    assert_exact(_scalar(result["logps"][i, d]), _scalar(logps[i][d]), f"{name} logp {i} {d}")


# --- end to end ------------------------------------------------------------------------------------------


def make_config(model_dir: str, run_dir: str, cache_dir: str, **lora) -> TrainConfig:
    cfg = TrainConfig()
    cfg.model.path = model_dir
    cfg.model.dtype = "float32"
    for k, v in lora.items():
        setattr(cfg.model.lora, k, v)
    cfg.data.build_tiny_corpus = True
    cfg.data.format = "preference"
    cfg.data.loss_on = "last_assistant"
    cfg.data.cache_dir = cache_dir
    cfg.trainer.objective = "dpo"
    cfg.trainer.seq_len = 128
    cfg.trainer.max_steps = 3
    cfg.trainer.grad_accum_steps = 2
    cfg.trainer.loss_chunk_size = 48
    cfg.trainer.checkpoint_every = 3
    cfg.trainer.eval_every = 3
    cfg.data.validation_fraction = 0.1
    cfg.trainer.export_hf = False
    cfg.trainer.device = "cpu"
    cfg.optim.lr = 1e-2
    cfg.optim.warmup_steps = 1
    cfg.logging.progress_bar = False
    cfg.cluster.gpu = "cpu"
    cfg.parallel.ulysses_degree = 2
    cfg.parallel.ring_degree = 2
    cfg.run_dir = run_dir
    return cfg


def run_worker(cfg: TrainConfig) -> dict:
    out = run(cfg)
    return {k: out[k] for k in ("losses", "metrics", "run_dir")}


@pytest.fixture(scope="module")
def dpo_runs(dist_pools, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("dpo_run")
    model_dir = str(build_tiny_llama(root / "model"))
    cache = str(root / "cache")
    first = dist_pools(4).run(run_worker, make_config(model_dir, str(root / "first"), cache))[0]
    caches = sorted((root / "cache").rglob("ref-*.npy"))
    stamps = {p: p.stat().st_mtime_ns for p in caches}
    again = dist_pools(4).run(run_worker, make_config(model_dir, str(root / "again"), cache))[0]
    lora = dist_pools(4).run(
        run_worker, make_config(model_dir, str(root / "lora"), cache, rank=4, train_embeddings_and_norms=True)
    )[0]
    return {
        "root": root,
        "model": model_dir,
        "cache": cache,
        "first": first,
        "again": again,
        "lora": lora,
        "caches": caches,
        "stamps": stamps,
    }


def test_dpo_run_starts_at_ln2_logs_rewards_and_caches_the_reference(dpo_runs):
    first, again = dpo_runs["first"], dpo_runs["again"]
    tol = rounding_tolerance(torch.float32, 128)
    assert abs(first["losses"][0] - math.log(2.0)) <= tol, first["losses"]
    assert all(math.isfinite(x) for x in first["losses"]) and first["losses"][-1] != first["losses"][0]
    for record in first["metrics"]:
        assert {"rewards_chosen", "rewards_rejected", "reward_margin", "reward_accuracy", "pairs"} <= set(
            record
        )
        assert 0.0 <= record["reward_accuracy"] <= 1.0 and record["pairs"] > 0
    assert first["metrics"][0]["rewards_chosen"] == pytest.approx(0.0, abs=tol)
    last = first["metrics"][-1]
    assert math.isfinite(last["val_loss"]) and 0.0 <= last["val_reward_accuracy"] <= 1.0
    # one cache file, written by the first run, read (not rewritten) by the second: the same losses
    assert len(dpo_runs["caches"]) == 1
    assert {p: p.stat().st_mtime_ns for p in dpo_runs["caches"]} == dpo_runs["stamps"]
    assert again["losses"] == first["losses"]


def test_dpo_with_lora_uses_the_base_as_reference(dpo_runs):
    losses = dpo_runs["lora"]["losses"]
    assert abs(losses[0] - math.log(2.0)) <= rounding_tolerance(torch.float32, 128), losses
    assert losses[-1] != losses[0]


def test_dpo_reference_path_is_another_model(dist_pools, dpo_runs, tmp_path):
    other = build_tiny_llama(tmp_path / "other", seed=5)
    cfg = make_config(dpo_runs["model"], str(tmp_path / "run"), dpo_runs["cache"])
    cfg.trainer.dpo.reference_path = str(other)
    cfg.trainer.max_steps = 1
    out = dist_pools(4).run(run_worker, cfg)[0]
    assert math.isfinite(out["losses"][0]) and abs(out["losses"][0] - math.log(2.0)) > 1e-3
    assert len(sorted(Path(dpo_runs["cache"]).rglob("ref-*.npy"))) == 2  # its own cache entry


def test_dpo_bad_settings_are_refused_before_any_step(dist_pools, dpo_runs, tmp_path):
    def cfg(**changes) -> TrainConfig:
        c = make_config(dpo_runs["model"], str(tmp_path / f"bad{len(changes)}"), dpo_runs["cache"])
        for key, value in changes.items():
            section, name = key.split("__")
            setattr(getattr(c, section) if section != "dpo" else c.trainer.dpo, name, value)
        return c

    cases = [
        (cfg(data__format="text", data__loss_on=None), "data.format=preference"),
        (cfg(dpo__loss_type="kto"), "trainer.dpo.loss_type"),
        (cfg(dpo__beta=0.0), "trainer.dpo.beta"),
        (cfg(dpo__reference_path=str(tmp_path / "nowhere")), "trainer.dpo.reference_path"),
    ]
    for config, setting in cases:
        messages = dist_pools(4).run(run_expecting_error, config)
        assert all(setting in m for m in messages), (setting, messages[0])


def test_shared_prompt_is_refused_where_the_link_cannot_hold():
    """Start-up: ``trainer.dpo.shared_prompt`` needs attention over the whole row in every layer, and DPO."""
    from transformers import MistralConfig

    from usp.train.checks import check_objective

    cfg = TrainConfig()
    cfg.trainer.objective, cfg.data.format, cfg.trainer.seq_len = "dpo", "preference", 128
    cfg.trainer.dpo.shared_prompt = True
    small = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=99
    )
    with pytest.raises(ValueError, match="shared_prompt=true needs softmax attention.*sliding 16"):
        check_objective(cfg, MistralConfig(**small, num_key_value_heads=2, sliding_window=16))
    check_objective(cfg, MistralConfig(**small, num_key_value_heads=2, sliding_window=4096))  # holds the row
    cfg.trainer.objective, cfg.data.format = "lm", "text"
    with pytest.raises(ValueError, match="trainer.dpo.shared_prompt=true .* trainer.objective=dpo"):
        check_objective(cfg, MistralConfig(**small, num_key_value_heads=2))
