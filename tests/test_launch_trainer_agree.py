"""``usp-launch --dry-run`` and the trainer's start-up validation accept and refuse the same configs.

Both build the planner's input with :class:`usp.plan.request.PlanRequest`. Configs with an ``auto`` degree are
planned by both (the launcher as the trainer will at start-up); a layout the trainer's planner picks, pinned in
the config, is one the launcher's memory check accepts. The configs that differ only by
``parallel.attn_head_chunks`` are the drift this guards against: the launcher used to drop the head chunks,
overestimate memory and refuse the layout the trainer had chosen (and it accepted every ``auto`` config,
including those the trainer refuses).

The device memory of the head-chunk cases is found from the trainer itself (halfway between the smallest
``cluster.memory_gib`` it accepts with and without head chunks), so the test holds when the planner's memory
terms change.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from usp.launch import cli, commands
from usp.parallel import ParallelLayout
from usp.train.checks import check_training_run

WORLD = 8


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    """A 1B-class GQA Llama's config (16 query, 8 K/V heads) and an empty weight file: what both checks read."""
    path = tmp_path_factory.mktemp("agree") / "model"
    LlamaConfig(
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=8,
        vocab_size=32000,
        max_position_embeddings=65536,
    ).save_pretrained(path)
    (path / "model.safetensors").write_bytes(b"")
    return str(path)


@pytest.fixture(autouse=True)
def _nothing_started(monkeypatch, tmp_path):
    for key in ("LOCAL_WORLD_SIZE", "WORLD_SIZE", "RANK", "SLURM_JOB_ID"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.chdir(tmp_path)

    def refuse(*args, **kwargs):
        raise AssertionError(f"usp-launch tried to run {args}")

    monkeypatch.setattr(cli.subprocess, "run", refuse)
    monkeypatch.setattr(commands, "count_gpus", lambda: 0)


def overrides(model_dir: str, memory_gib: float, **parallel) -> list[str]:
    base = {"node_size": WORLD, **parallel}
    return [
        f"model.path={model_dir}",
        f"data.prepared_path={model_dir}/../data",
        "model.dtype=bfloat16",
        "trainer.seq_len=65536",
        "cluster.gpu=h100-80g",
        f"cluster.memory_gib={memory_gib}",
        *(f"parallel.{k}={v}" for k, v in base.items()),
    ]


def trainer_layout(argv: list[str]) -> ParallelLayout | None:
    """The trainer's start-up checks on the config ``usp.train`` composes from ``argv`` (on CUDA ranks)."""
    cfg = cli.compose_run_config(argv)
    try:
        return check_training_run(cfg, WORLD, torch.device("cuda"))[1]
    except ValueError:
        return None


def launcher(capsys, argv: list[str]) -> tuple[bool, str]:
    """``usp-launch torchrun --nproc-per-node 8 ... --dry-run``: (accepted, its stderr)."""
    rc = cli.main(["torchrun", "--nproc-per-node", str(WORLD), *argv, "--dry-run"])
    err = capsys.readouterr().err
    assert rc in (0, 2), err
    return rc == 0, err


def pinned(layout: ParallelLayout) -> dict:
    """``layout`` as fixed settings."""
    return dict(
        ulysses_degree=layout.ulysses_degree,
        ring_degree=layout.ring_degree,
        fsdp_mode=layout.fsdp_mode,
        activation_checkpointing=layout.activation_checkpointing,
        ac_every_k=layout.ac_every_k,
        mlp_tiles=layout.mlp_tiles,
        attn_head_chunks=layout.attn_head_chunks,
    )


def smallest_memory(model_dir: str, **parallel) -> float:
    """The smallest ``cluster.memory_gib`` (to 1 MiB) at which the trainer accepts ``parallel``."""
    cfg = cli.compose_run_config(overrides(model_dir, 1.0, **parallel))
    lo, hi = 0.25, 80.0

    def accepted(mem: float) -> bool:
        cfg.cluster.memory_gib = mem
        try:
            check_training_run(cfg, WORLD, torch.device("cuda"))
        except ValueError:
            return False
        return True

    assert not accepted(lo) and accepted(hi), parallel
    while hi - lo > 1 / 1024:
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if accepted(mid) else (mid, hi)
    return hi


def head_chunks_memory(model_dir: str, chunks: int) -> float:
    """A memory at which the trainer accepts ``ulysses 2, ring auto, full checkpointing, 8 MLP tiles`` with
    ``chunks`` head chunks but refuses it without (halfway between the two smallest memories). The tiles make
    the attention backward the layer's peak, the part head chunks divide."""
    fixed = dict(ulysses_degree=2, ring_degree="auto", activation_checkpointing="full", mlp_tiles=8)
    with_chunks = smallest_memory(model_dir, **fixed, attn_head_chunks=chunks)
    without = smallest_memory(model_dir, **fixed, attn_head_chunks=1)
    assert with_chunks < without, f"head chunks save nothing: {with_chunks} vs {without} GiB"
    return round((with_chunks + without) / 2, 4)


def test_configs_that_differ_only_by_head_chunks(capsys, model_dir):
    mem = head_chunks_memory(model_dir, 2)
    for chunks, accepted in ((2, True), (1, False)):
        argv = overrides(
            model_dir,
            mem,
            ulysses_degree=2,
            ring_degree="auto",
            activation_checkpointing="full",
            mlp_tiles=8,
            attn_head_chunks=chunks,
        )
        layout = trainer_layout(argv)
        assert (layout is not None) == accepted
        ok, err = launcher(capsys, argv)
        assert ok == accepted, f"attn_head_chunks={chunks} at {mem} GiB: usp-launch says {err!r}"
        if accepted:  # the launcher names the trainer's layout
            assert (
                f"ulysses {layout.ulysses_degree} x ring {layout.ring_degree} x dp {layout.dp_degree}" in err
            )
            # the trainer's pick, pinned: accepted by the launcher's memory check (refused before: no head chunks)
            ok, err = launcher(capsys, overrides(model_dir, mem, **pinned(layout)))
            assert ok and "memory: the planner estimates" in err, err
            # ... and the same layout without head chunks does not fit, for the launcher and the trainer's planner
            ok, err = launcher(capsys, overrides(model_dir, mem, **{**pinned(layout), "attn_head_chunks": 1}))
            assert not ok and "would run out of memory" in err, err


@pytest.mark.slow
@pytest.mark.parametrize(
    "parallel",
    [
        dict(ulysses_degree="auto", ring_degree="auto"),
        dict(ulysses_degree="auto", ring_degree="auto", attn_head_chunks=2, mlp_tiles="auto"),
        dict(ulysses_degree=4, ring_degree="auto", activation_checkpointing="full"),
        dict(ulysses_degree="auto", ring_degree=2, activation_checkpointing="full", attn_head_chunks=2),
        dict(
            ulysses_degree="auto",
            ring_degree="auto",
            fsdp_mode="hybrid_shard",
            activation_checkpointing="full",
        ),
    ],
    ids=lambda p: "-".join(f"{k}={v}" for k, v in p.items()),
)
def test_auto_configs_get_the_same_verdict_and_layout(capsys, model_dir, parallel):
    """Over a range of device memories (refused below some size, accepted above): the same verdict, and the
    launcher names the layout the trainer resolves; that layout, pinned, passes the launcher's memory check."""
    verdicts = []
    for mem in (1, 3, 6, 40):
        argv = overrides(model_dir, mem, **parallel)
        layout = trainer_layout(argv)
        ok, err = launcher(capsys, argv)
        assert ok == (layout is not None), f"{parallel} at {mem} GiB: trainer {layout}, usp-launch {err!r}"
        verdicts.append(ok)
        if ok:
            assert (
                f"ulysses {layout.ulysses_degree} x ring {layout.ring_degree} x dp {layout.dp_degree}, "
                f"{layout.fsdp_mode}, activation checkpointing {layout.activation_checkpointing}"
            ) in err
            if (
                layout.activation_checkpointing != "offload"
            ):  # offload: the trainer also checks this host's memory
                ok, err = launcher(capsys, overrides(model_dir, mem, **pinned(layout)))
                assert ok, f"{parallel} at {mem} GiB: the trainer's layout {layout} pinned: {err!r}"
    assert not verdicts[0] and verdicts[-1], (
        f"{parallel}: the memory range should cover both verdicts: {verdicts}"
    )
