"""Checkpoints under FSDP2 on gloo: save at world 4, resume at world 4, 2 and 1; a failing rank mid-save.

float64 (``tests.exact_model``'s RMSNorm, the loss by ``F.cross_entropy``), so the steps after a resume at
another world size equal the saved run's at ``tests.tolerance.EXACT_TOL``."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)

from tests.exact_model import norms_in_input_dtype
from tests.mesh_cache import cached_sp_mesh
from tests.test_checkpoint import assert_tree_equal
from tests.tolerance import EXACT_DTYPE, assert_exact
from usp.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from usp.tiny import build_tiny_llama

BATCH, SEQ = 2, 16


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    return str(build_tiny_llama(tmp_path_factory.mktemp("ckpt_model") / "llama"))


def _setup(model_dir: str, *, sharded: bool, perturb: bool, hsdp: bool = False):
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=EXACT_DTYPE, attn_implementation="sdpa")
    assert norms_in_input_dtype(model) > 0  # sdpa, not eager: eager softmaxes in fp32
    if perturb:  # make the fresh model differ from the saved one, so the load has to do something
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.5)
    if sharded:
        if hsdp:  # 2-D mesh: replicate over dp, shard over the (ulysses) ranks of a node
            mesh = cached_sp_mesh(2, 1).device_mesh["dp", "ulysses"]
        else:  # dp = world: FSDP2 shards over every rank
            mesh = cached_sp_mesh(1, 1).fsdp_mesh
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4))
    return model, opt, sched


def _step(model, opt, sched, step: int) -> float:
    """One AdamW step; every rank feeds the same batch (FSDP2 averages gradients -> the single-process step)."""
    vocab = model.config.vocab_size
    ids = torch.randint(3, vocab, (BATCH, SEQ), generator=torch.Generator().manual_seed(1000 + step))
    logits = model(input_ids=ids).logits  # [B, S, V]; HF's own loss would compute in fp32
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    loss.backward()
    opt.step()
    sched.step()
    opt.zero_grad()
    return loss.item()


def _full_state(model, opt) -> dict:
    full = StateDictOptions(full_state_dict=True)
    return copy.deepcopy(
        {  # a plain model's state dict aliases the live tensors
            "model": get_model_state_dict(model, options=full),
            "optim": get_optimizer_state_dict(model, opt, options=full),
        }
    )


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _train_and_save(model_dir: str, root: str, hsdp: bool = False) -> dict:
    model, opt, sched = _setup(model_dir, sharded=True, perturb=False, hsdp=hsdp)
    for s in range(3):
        _step(model, opt, sched, s)
    torch.manual_seed(100 + _rank())  # a per-rank RNG state, as the trainer stores it
    extra = {"rank": _rank(), "rng": torch.get_rng_state(), "loader": {"samples": 3 * BATCH}}
    path = save_checkpoint(root, 3, model=model, optimizer=opt, scheduler=sched, extra=extra, keep_last=2)
    saved = _full_state(model, opt)
    saved["scheduler"] = sched.state_dict()
    saved["extra"] = extra
    saved["path"] = str(path)
    saved["next_losses"] = [_step(model, opt, sched, s) for s in (3, 4)]
    return saved


def _load_and_continue(model_dir: str, path: str, sharded: bool) -> dict:
    model, opt, sched = _setup(model_dir, sharded=sharded, perturb=True)
    out = load_checkpoint(path, model=model, optimizer=opt, scheduler=sched)
    loaded = _full_state(model, opt)
    loaded["scheduler"] = sched.state_dict()
    loaded["result"] = {k: out[k] for k in ("step", "extra", "saved_world_size", "extra_rank")}
    loaded["next_losses"] = [_step(model, opt, sched, s) for s in (3, 4)]
    return loaded


def test_save_world4_resume_world4_2_1(dist_pools, tiny_dir, tmp_path):
    root = str(tmp_path / "ckpt")
    saved = dist_pools(4).run(_train_and_save, tiny_dir, root)
    path = saved[0]["path"]
    assert latest_checkpoint(root) == tmp_path / "ckpt" / "step_3"
    ref = saved[0]

    # same world: every rank gets its own state back exactly, and training continues bit for bit
    same = dist_pools(4).run(_load_and_continue, tiny_dir, path, True)
    for r in range(4):
        for key in ("model", "optim", "scheduler"):
            assert_tree_equal(same[r][key], ref[key], f"world4 rank{r} {key}")
        assert same[r]["result"]["step"] == 3 and same[r]["result"]["extra_rank"] == r
        assert_tree_equal(same[r]["result"]["extra"], saved[r]["extra"])
        assert same[r]["next_losses"] == saved[r]["next_losses"]

    # other layouts: FSDP2 over 2 ranks, and a plain model in this process (no process group)
    other = dist_pools(2).run(_load_and_continue, tiny_dir, path, True) + [
        _load_and_continue(tiny_dir, path, False)
    ]
    for i, res in enumerate(other):
        for key in ("model", "optim", "scheduler"):
            assert_tree_equal(res[key], ref[key], f"resharded #{i} {key}")
        assert res["result"]["saved_world_size"] == 4 and res["result"]["extra_rank"] == 0
        assert_tree_equal(res["result"]["extra"], saved[0]["extra"])
        # gradient reductions sum in another order at another world size: float64 rounding only
        assert_exact(
            torch.tensor(res["next_losses"], dtype=EXACT_DTYPE),
            torch.tensor(ref["next_losses"], dtype=EXACT_DTYPE),
            f"resharded #{i}: losses after the resume",
        )


def test_hsdp_checkpoint_loads_into_plain_model(dist_pools, tiny_dir, tmp_path):
    saved = dist_pools(4).run(_train_and_save, tiny_dir, str(tmp_path / "ckpt"), True)
    res = _load_and_continue(tiny_dir, saved[0]["path"], False)
    for key in ("model", "optim", "scheduler"):
        assert_tree_equal(res[key], saved[0][key], f"hsdp -> plain {key}")
    assert_exact(
        torch.tensor(res["next_losses"], dtype=EXACT_DTYPE),
        torch.tensor(saved[0]["next_losses"], dtype=EXACT_DTYPE),
        "hsdp -> plain: losses after the resume",
    )


def _failing_rank_mid_save(model_dir: str, root: str, bad_rank: int) -> dict:
    import usp.checkpoint.save as c

    model, opt, sched = _setup(model_dir, sharded=True, perturb=False)
    _step(model, opt, sched, 0)
    good = save_checkpoint(root, 1, model=model, optimizer=opt, scheduler=sched, extra={}, keep_last=1)
    good_state = _full_state(model, opt)
    _step(model, opt, sched, 1)

    original = c.write_file
    if _rank() == bad_rank:

        def boom(*args, **kwargs):
            raise OSError("disk full (simulated)")

        c.write_file = boom
    error = None
    try:
        save_checkpoint(root, 2, model=model, optimizer=opt, scheduler=sched, extra={}, keep_last=1)
    except RuntimeError as e:
        error = str(e)
    finally:
        c.write_file = original
    latest = latest_checkpoint(root)
    dist.barrier()
    fresh, fresh_opt, fresh_sched = _setup(model_dir, sharded=True, perturb=True)
    step = load_checkpoint(root, model=fresh, optimizer=fresh_opt, scheduler=fresh_sched)["step"]
    return {
        "error": error,
        "latest": str(latest),
        "good": str(good),
        "step": step,
        "match": _full_state(fresh, fresh_opt),
        "good_state": good_state,
    }


def test_failing_rank_mid_save_raises_everywhere_and_keeps_previous(dist_pools, tiny_dir, tmp_path):
    root = str(tmp_path / "ckpt")
    results = dist_pools(4).run(_failing_rank_mid_save, tiny_dir, root, 2, timeout=240)
    for r, res in enumerate(results):
        assert (
            res["error"] is not None
            and "failed on rank 2: OSError" in res["error"]
            and "disk full" in res["error"]
        ), r
        assert res["latest"] == res["good"] and res["step"] == 1
        assert_tree_equal(res["match"], res["good_state"], f"rank {r}")
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [".tmp-step_2", "step_1"]
