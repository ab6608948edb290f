"""Issue 22, the frictions and the docs of a newcomer's first hours (rows 7-13, 17, 18, 20, 21): a way to
train your own small checkpoint, planner overrides that paste straight in, the same checks for eval, one
length syntax, labels and help that match behaviour, figures from one measurement."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from usp.tiny import build_tiny_llama

REPO = Path(__file__).resolve().parents[1]
ONE_RANK = ["recipe=tiny", "parallel.ulysses_degree=1", "parallel.ring_degree=1", "parallel.node_size=1"]


@pytest.fixture(scope="module")
def short_context_model(tmp_path_factory) -> Path:
    """A tiny checkpoint whose own context is 256 positions."""
    return build_tiny_llama(tmp_path_factory.mktemp("short") / "m", max_position_embeddings=256)


# --- row 7: your own small checkpoint ----------------------------------------------------------------------
def test_model_hf_and_optim_finetune_train_your_own_checkpoint(tmp_path, short_context_model):
    from usp.config.compose import compose_config
    from usp.train.checks import build_tiny_if_asked, start_up_warnings

    cfg = compose_config(
        [
            *ONE_RANK,
            "model=hf",
            "optim=finetune",
            f"model.path={short_context_model}",
            "trainer.seq_len=256",
            "trainer.max_steps=4",
        ],
        run_dir=str(tmp_path),
    )
    assert (
        not cfg.model.build_tiny and cfg.optim.lr == 2e-5 and cfg.optim.warmup_steps < cfg.trainer.max_steps
    )
    build_tiny_if_asked(cfg, 0)  # nothing to build
    assert start_up_warnings(cfg) == []
    tiny_recipe = compose_config(
        [*ONE_RANK, f"model.path={short_context_model}", "trainer.seq_len=256", "trainer.max_steps=4"],
        run_dir=str(tmp_path),
    )
    (warning,) = start_up_warnings(tiny_recipe)  # optim=tiny: warmup 5 > 4 steps
    assert "optim.warmup_steps=5 > trainer.max_steps=4" in warning
    assert (REPO / "conf" / "model" / "hf.yaml").is_file() and "model=hf" in (
        REPO / "docs" / "training.md"
    ).read_text()


# --- row 10: a sequence longer than the checkpoint's own context --------------------------------------------
def test_seq_len_beyond_the_checkpoints_context_warns_with_its_rope(tmp_path, short_context_model):
    from usp.config.compose import compose_config
    from usp.train.checks import start_up_warnings

    base = [
        *ONE_RANK,
        "model=hf",
        "optim=finetune",
        f"model.path={short_context_model}",
        "trainer.max_steps=20",
    ]
    (warning,) = start_up_warnings(compose_config([*base, "trainer.seq_len=512"], run_dir=str(tmp_path)))
    assert (
        "trainer.seq_len=512 is longer than the checkpoint's own context (max_position_embeddings=256"
        in warning
    )
    assert "model.rope_theta" in warning and "model.rope_scaling" in warning and "rope_theta" in warning
    extended = [*base, "trainer.seq_len=512", "model.rope_theta=80000", "model.max_position_embeddings=512"]
    assert start_up_warnings(compose_config(extended, run_dir=str(tmp_path))) == []


# --- rows 8 and 9: the planner's batch, its ties, and overrides that paste ---------------------------------
def test_plan_prints_the_batch_explains_ties_and_emits_the_batch_settings(capsys):
    from usp.plan.cli import main

    assert main(["--model", "llama-3.1-8b", "--seq-len", "128K", "--nodes", "2", "--gpus-per-node", "8"]) == 0
    out = capsys.readouterr().out
    assert "global batch: one sequence per dp rank" in out and "count as a tie" in out
    overrides = out.strip().splitlines()[-1].split()
    assert "trainer.grad_accum_steps=1" in overrides and "trainer.micro_batch_size=1" in overrides
    assert main(["--model", "llama-3.1-8b", "--seq-len", "128K", "--nodes", "2", "--global-batch", "16"]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if re.match(r"\s+\d+\s+\d+\s+\d+\s+\d+ ", line)]
    assert rows and all(int(r[3]) * int(r[9].split("x")[1] if "x" in r[9] else 1) == 16 for r in rows), out
    best_dp = int(rows[0][3])
    assert f"trainer.grad_accum_steps={16 // best_dp}" in out.strip().splitlines()[-1]


def test_planner_overrides_paste_onto_another_recipe_and_launch(capsys, monkeypatch):
    from usp.launch import cli
    from usp.plan.cli import main

    monkeypatch.setattr(cli.subprocess, "run", lambda *a, **k: pytest.fail("usp-launch ran something"))
    assert main(["--model", "llama-3-70b", "--seq-len", "1M", "--nodes", "8", "--gpus-per-node", "8"]) == 0
    overrides = capsys.readouterr().out.strip().splitlines()[-1].split()
    assert "model.max_position_embeddings=1048576" in overrides and "cluster.num_nodes=8" in overrides
    rc = cli.main(
        [
            "slurm",
            "--dry-run",
            "recipe=llama3_70b_128k",
            "model.path=/ckpt/70b",
            "data.prepared_path=/d",
            *overrides,
        ]
    )
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert "sbatch --nodes=8" in captured.out


def test_plan_help_has_defaults_and_the_length_message_fits(capsys):
    from usp.plan.cli import build_plan_parser, main

    text = build_plan_parser().format_help()
    assert "nodes of the cluster (default 1)" in text and "(default 8)" in text
    assert main(["--model", "llama-3.1-8b"]) == 2
    err = capsys.readouterr().err
    assert "give --seq-len N" in err and "not both" not in err
    assert main(["--model", "llama-3.1-8b", "--seq-len", "1K", "--max-seq-len"]) == 2
    assert "not both" in capsys.readouterr().err


# --- rows 11 and 12: usp-launch's checks for eval, and a skipped memory check ------------------------------
def test_eval_dry_run_runs_the_eval_checks(capsys):
    from usp.launch import cli

    args = [
        "torchrun",
        "--cpu",
        "--nproc-per-node",
        "4",
        "--entry",
        "eval",
        "recipe=tiny",
        "model.path=/m",
        "eval=passkey",
        "--dry-run",
    ]
    assert cli.main([*args, "eval.lengths=[100]"]) == 2  # 100 is no multiple of 2 x ring 2 x ulysses 2
    assert "usp-launch: error: eval.lengths=[100]" in capsys.readouterr().err
    assert cli.main(args) == 0
    assert "heads are checked at start-up" in capsys.readouterr().err  # /m is not readable here: said so


def test_eval_dry_run_checks_the_heads_of_a_readable_model(tmp_path, capsys, monkeypatch):
    from usp.launch import cli, preflight

    model = build_tiny_llama(tmp_path / "m")
    seen: list[int] = []
    monkeypatch.setattr("usp.model.check_heads", lambda config, u: seen.append(u))
    assert (
        cli.main(
            [
                "torchrun",
                "--cpu",
                "--nproc-per-node",
                "4",
                "--entry",
                "eval",
                "recipe=tiny",
                f"model.path={model}",
                "eval=passkey",
                "--dry-run",
            ]
        )
        == 0
    )
    assert seen == [2], "the eval dry run did not check the heads against the Ulysses degree"
    assert preflight.check_eval is not None


def test_a_skipped_memory_check_says_so_and_why(capsys):
    from usp.launch import cli

    assert (
        cli.main(
            ["slurm", "--dry-run", "recipe=llama31_8b_128k", "model.path=/not/here", "data.prepared_path=/d"]
        )
        == 0
    )
    err = capsys.readouterr().err
    assert (
        "memory: not checked here: /not/here/config.json cannot be read on this machine (model.path)" in err
    )


# --- row 13: one length syntax ------------------------------------------------------------------------------
def test_lengths_take_the_same_syntax_everywhere(tmp_path):
    from usp.config.compose import compose_config, compose_eval_config
    from usp.units import expand_length_overrides

    cfg = compose_config(["recipe=tiny", "trainer.seq_len=1K", "model.max_position_embeddings=4K"])
    assert cfg.trainer.seq_len == 1024 and cfg.model.max_position_embeddings == 4096
    assert compose_eval_config(["recipe=tiny", "model.path=/m", "eval.lengths=[512,1K]"]).eval.lengths == [
        512,
        1024,
    ]
    assert expand_length_overrides(
        ["trainer.seq_len=1.5K", "++eval.lengths=[2K, 4k]", "trainer.seq_len=abc", "recipe=tiny"]
    ) == ["trainer.seq_len=1536", "++eval.lengths=[2048,4096]", "trainer.seq_len=abc", "recipe=tiny"]


# --- rows 17 and 18: usp-prepare-data's summary and its --input ------------------------------------------
def test_prepare_summary_counts_cuts_and_input_takes_several_paths():
    from usp.data.cli import build_parser
    from usp.data.pack import PackStats
    from usp.data.prepare import summary

    line = summary(PackStats(seq_len=16, documents_in=157, documents_split=1192, rows=9), "/out")
    assert "1192 row boundaries cut a document" in line and "documents split" not in line
    args = build_parser().parse_args(
        [
            "--input",
            "a.jsonl",
            "b.jsonl",
            "--input",
            "c",
            "--tokenizer",
            "t",
            "--seq-len",
            "1K",
            "--output",
            "o",
        ]
    )
    assert args.input == ["a.jsonl", "b.jsonl", "c"] and args.seq_len == 1024
    data_md = (REPO / "docs" / "data.md").read_text()
    assert not re.search(r"--input /\S*\*", data_md), "an unquoted glob in docs/data.md"


# --- row 20: figures that match -----------------------------------------------------------------------------
def test_demo_figures_match_between_readme_and_the_recipe():
    readme = (REPO / "README.md").read_text()
    recipe = (REPO / "recipes" / "tiny.yaml").read_text()
    demo = re.search(r"the demo takes about (\d+) s", readme)
    header = re.search(r"About (\d+) s on 2 cores", recipe)
    assert demo and header and demo.group(1) == header.group(1), (demo, header)
    from usp.config.compose import compose_config

    layout = compose_config(["recipe=tiny"]).parallel.ring_layout
    assert f"ring 2 ({layout} layout)" in recipe


def test_launch_docs_quote_the_memory_figure_usp_launch_prints(tmp_path):
    from usp.config.compose import compose_config
    from usp.launch import preflight
    from usp.plan.models import PRESETS

    (tmp_path / "config.json").write_text(json.dumps({**PRESETS["llama-3.1-8b"], "model_type": "llama"}))
    cfg = compose_config(["recipe=llama31_8b_128k", f"model.path={tmp_path}", "data.prepared_path=/d"])
    note = preflight.check_memory(cfg, world_size=16, local_world_size=8)
    figure = re.search(r"estimates (\d+\.\d) GiB", note).group(1)
    assert f"the planner estimates {figure} GiB" in (REPO / "docs" / "launch.md").read_text()
    assert f": {figure} GiB/GPU" in (REPO / "recipes" / "llama31_8b_128k.yaml").read_text()


# --- row 21: help that matches behaviour --------------------------------------------------------------------
def test_every_bench_flag_has_help_and_node_size_is_attributed_right():
    from usp.bench.attention import build_parser
    from usp.parallel import ParallelLayout

    missing = [a.option_strings for a in build_parser()._actions if a.option_strings and not a.help]
    assert not missing, missing
    assert build_parser().parse_args(["--seq", "1K,4K"]).seq == [1024, 4096]
    with pytest.raises(
        ValueError, match=r"node size 3 \(parallel.node_size, or the launcher's LOCAL_WORLD_SIZE"
    ):
        ParallelLayout(world_size=4, ulysses_degree=1, ring_degree=1, node_size=3)
