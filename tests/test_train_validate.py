"""The run is resolved once (:func:`usp.train.checks.check_training_run`): a frozen layout, the config never changed,
the same layout for usp-train and usp-eval, the node size from the launcher, the planner's MLP tiles as is.

Pure: no process group, no weights (only the tiny model's config and tokenizer are read).
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from usp.config import TrainConfig
from usp.parallel import ParallelLayout
from usp.startup import resolve_layout
from usp.train.checks import check_training_run

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def no_launcher(monkeypatch):
    for key in ("LOCAL_WORLD_SIZE", "WORLD_SIZE", "RANK"):
        monkeypatch.delenv(key, raising=False)


def make_config(model_dir: str, **parallel) -> TrainConfig:
    cfg = TrainConfig()
    cfg.model.path, cfg.model.dtype = model_dir, "float32"
    cfg.data.build_tiny_corpus = True
    cfg.trainer.seq_len, cfg.trainer.device, cfg.trainer.resume = 256, "cpu", None
    cfg.cluster.gpu = "cpu"
    for key, value in parallel.items():
        setattr(cfg.parallel, key, value)
    return cfg


CASES = [
    dict(ulysses_degree=2, ring_degree=2),
    dict(ulysses_degree=2, ring_degree=1, mlp_tiles="auto"),  # 128 local tokens, hidden 64 -> 2 tiles
    dict(ulysses_degree="auto", ring_degree="auto", mlp_tiles="auto"),
    dict(ulysses_degree=2, ring_degree="auto", fsdp_mode="hybrid_shard", node_size=2, mlp_tiles="auto"),
]


@pytest.mark.parametrize("parallel", CASES, ids=lambda p: "-".join(f"{k}={v}" for k, v in p.items()))
def test_validation_leaves_the_config_unchanged_and_the_layout_frozen(tiny_llama, parallel):
    cfg = make_config(tiny_llama, **parallel)
    before = copy.deepcopy(cfg)
    _, layout = check_training_run(cfg, 4, CPU)
    assert cfg == before  # deep equality of the dataclasses: auto stays auto, no dp or tiles written back
    assert dataclasses.asdict(cfg) == dataclasses.asdict(before)
    assert all(
        isinstance(getattr(layout, f), int)
        for f in (
            "ulysses_degree",
            "ring_degree",
            "dp_degree",
            "node_size",
            "ac_every_k",
            "mlp_tiles",
            "attn_head_chunks",
        )
    )
    assert layout.ulysses_degree * layout.ring_degree * layout.dp_degree == 4
    with pytest.raises(dataclasses.FrozenInstanceError):
        layout.mlp_tiles = 8  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        layout.dp_degree = 1  # type: ignore[misc]
    assert (
        check_training_run(cfg, 4, CPU)[1] == layout
    )  # nothing left over from the first call changes the second


def test_explicit_mlp_tiles_auto_uses_the_hidden_size_rule(tiny_llama):
    # 256 tokens / (u2 x r1) = 128 local tokens, hidden_size 64: tiles of about 64 tokens -> 2
    _, layout = check_training_run(
        make_config(tiny_llama, ulysses_degree=2, ring_degree=1, mlp_tiles="auto"), 2, CPU
    )
    assert layout.mlp_tiles == 2 and layout.dp_degree == 1 and layout.reason == "set in the config"


def test_a_degree_given_as_text_is_refused_and_the_config_kept(tiny_llama):
    """``ParallelLayout`` is the one validator: a string degree is refused there (the old trainer converted it
    and wrote the integer back into the config)."""
    cfg = make_config(tiny_llama, ulysses_degree="2", ring_degree=1)
    before = copy.deepcopy(cfg)
    with pytest.raises(ValueError, match=r"parallel.ulysses_degree='2' is invalid"):
        check_training_run(cfg, 2, CPU)
    assert cfg == before and cfg.parallel.ulysses_degree == "2"


def test_planner_tiles_are_used_as_planned(tiny_llama, monkeypatch):
    """With ``auto`` degrees and ``mlp_tiles=auto`` the planner's tile count is the layout's, even where the
    hidden-size rule would choose another (here 1: 64 local tokens = hidden_size)."""
    import usp.plan.request

    def plan(model_config, **kw):
        assert kw["mlp_tiles"] == "auto" and kw["node_size"] == 4
        return ParallelLayout(
            world_size=4,
            ulysses_degree=2,
            ring_degree=2,
            node_size=4,
            activation_checkpointing="full",
            mlp_tiles=4,
            reason="stub",
        )

    monkeypatch.setattr(usp.plan.request, "auto_degrees", plan)  # what PlanRequest.plan_auto calls
    cfg = make_config(tiny_llama, ulysses_degree="auto", ring_degree="auto", mlp_tiles="auto")
    model_config = check_training_run(make_config(tiny_llama), 1, CPU)[0]
    layout = resolve_layout(cfg, model_config, 4, CPU)
    assert layout == ParallelLayout(
        world_size=4,
        ulysses_degree=2,
        ring_degree=2,
        dp_degree=1,
        node_size=4,
        ring_layout=cfg.parallel.ring_layout,
        fsdp_mode="full_shard",
        activation_checkpointing="full",
        ac_every_k=2,
        mlp_tiles=4,
        attn_head_chunks=1,
        reason="planner: stub",
    )


def test_node_size_comes_from_the_setting_then_the_launcher(tiny_llama, monkeypatch):
    cfg = make_config(tiny_llama, ulysses_degree=2, ring_degree=2)
    assert check_training_run(cfg, 4, CPU)[1].node_size == 4  # no launcher: one node
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert check_training_run(cfg, 4, CPU)[1].node_size == 2
    cfg.parallel.node_size = 4
    assert check_training_run(cfg, 4, CPU)[1].node_size == 4
    with pytest.raises(ValueError, match=r"ulysses_degree=4 would make Ulysses groups span nodes of 2"):
        check_training_run(make_config(tiny_llama, ulysses_degree=4, ring_degree=1), 4, CPU)


@pytest.mark.parametrize("parallel", CASES[:1] + CASES[2:], ids=["explicit", "auto", "ring-auto"])
def test_eval_resolves_the_layout_training_gets(tiny_llama, parallel):
    """usp-eval calls the trainer's resolve_layout: the same degrees, dp, node size for the same config (the
    planner's choice included: usp-eval used to refuse auto degrees)."""
    from usp.eval import runner

    assert runner.resolve_layout is resolve_layout  # the same function, not a copy
    cfg = make_config(tiny_llama, **parallel)
    before = copy.deepcopy(cfg)
    _, train_layout = check_training_run(cfg, 4, CPU)
    lengths, eval_layout, _, _ = runner.prepare(cfg, 4, CPU)
    assert eval_layout == train_layout and lengths == [cfg.trainer.seq_len]
    assert cfg == before
