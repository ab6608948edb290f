"""usp-launch: the exact command lines of --dry-run, and the errors it gives before launching anything."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from usp.launch import cli, commands
from usp.launch.overrides import check_degrees, find_override, has_override, override_key, parse_overrides

REPO = Path(__file__).resolve().parents[1]
# What a real recipe needs from the user (composition stops on ??? values before anything is launched).
USER = ("model.path=/ckpt/m", "data.prepared_path=/data/d")
SLURM_VARS = (
    "SLURM_JOB_ID",
    "SLURM_NNODES",
    "SLURM_JOB_NODELIST",
    "SLURM_GPUS_ON_NODE",
    "SLURM_GPUS_PER_NODE",
    "SLURM_CPUS_ON_NODE",
)


@pytest.fixture(autouse=True)
def _no_slurm_no_launch(monkeypatch):
    """No SLURM allocation unless a test sets one, the repo as cwd, and nothing may actually be started."""
    for var in SLURM_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.chdir(REPO)

    def refuse(*args, **kwargs):
        raise AssertionError(f"usp-launch tried to run {args}")

    monkeypatch.setattr(cli.subprocess, "run", refuse)
    monkeypatch.setattr(commands, "count_gpus", lambda: 0)


def dry_run(capsys, *argv: str) -> str:
    rc = cli.main([*argv, "--dry-run"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    # nothing on stderr but the note that the memory check was skipped (no config.json here, or auto degrees)
    assert all(line.startswith("usp-launch: memory: not checked here: ") for line in err.splitlines()), err
    return out


def fails(capsys, *argv: str) -> str:
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    assert rc == 2
    assert out == ""
    return err


# --- the command lines --------------------------------------------------------------------------------
def test_local_is_one_plain_process(capsys):
    out = dry_run(capsys, "local", "trainer.max_steps=5")
    assert out == shlex.join([sys.executable, "-m", "usp.train", "trainer.max_steps=5"]) + "\n"


def test_local_cpu_pins_device_and_backend(capsys):
    out = dry_run(capsys, "local", "--cpu", "model=tiny")
    expected = [
        sys.executable,
        "-m",
        "usp.train",
        "trainer.device=cpu",
        "parallel.backend=gloo",
        "model=tiny",
    ]
    assert out == shlex.join(expected) + "\n"


def test_torchrun_cpu_tiny_demo(capsys):
    out = dry_run(
        capsys,
        "torchrun",
        "--cpu",
        "--nproc-per-node",
        "4",
        "recipe=tiny",
        "parallel.ulysses_degree=2",
        "parallel.ring_degree=2",
        "parallel.node_size=2",
    )
    assert out == (
        "torchrun --standalone --nproc-per-node 4 -m usp.train trainer.device=cpu parallel.backend=gloo "
        "recipe=tiny parallel.ulysses_degree=2 parallel.ring_degree=2 parallel.node_size=2\n"
    )


def test_torchrun_user_override_wins_over_cpu_default(capsys):
    assert (
        cli.main(
            [
                "torchrun",
                "--dry-run",
                "--cpu",
                "--nproc-per-node=4",
                "trainer.device=cpu",
                "--",
                "recipe=tiny",
            ]
        )
        == 0
    )
    assert capsys.readouterr().out == (
        "torchrun --standalone --nproc-per-node 4 -m usp.train parallel.backend=gloo trainer.device=cpu recipe=tiny\n"
    )


def test_torchrun_uses_detected_gpus(capsys, monkeypatch):
    monkeypatch.setattr(commands, "count_gpus", lambda: 8)
    out = dry_run(capsys, "torchrun", "recipe=llama2_7b_rope_32k", *USER)
    assert (
        out
        == f"torchrun --standalone --nproc-per-node 8 -m usp.train recipe=llama2_7b_rope_32k {' '.join(USER)}\n"
    )


def test_sbatch_outside_slurm(capsys):
    out = dry_run(
        capsys,
        "slurm",
        "--nodes",
        "2",
        "--gpus-per-node",
        "8",
        "--partition",
        "gpu",
        "--time",
        "04:00:00",
        "--account",
        "proj1",
        "--job-name",
        "ctx128k",
        "recipe=llama31_8b_128k",
        "parallel.ulysses_degree=8",
        "parallel.ring_degree=2",
        *USER,
    )
    assert out == (
        "sbatch --nodes=2 --ntasks-per-node=1 --gpus-per-node=8 --partition=gpu --time=04:00:00 --account=proj1 "
        "--job-name=ctx128k launch/slurm.sbatch --nproc-per-node 8 recipe=llama31_8b_128k "
        f"parallel.ulysses_degree=8 parallel.ring_degree=2 {' '.join(USER)}\n"
    )


def test_sbatch_defaults_and_gres(capsys):
    out = dry_run(capsys, "slurm", "--gres", "recipe=llama2_7b_rope_32k", *USER)
    assert out == (
        "sbatch --nodes=1 --ntasks-per-node=1 --gres=gpu:8 --job-name=usp launch/slurm.sbatch "
        f"--nproc-per-node 8 recipe=llama2_7b_rope_32k {' '.join(USER)}\n"
    )


@pytest.mark.parametrize(
    ("recipe", "nodes"), [("llama31_8b_1m", 8), ("llama3_70b_128k", 4), ("llama31_8b_128k", 2)]
)
def test_sbatch_takes_the_recipes_declared_size(capsys, recipe, nodes):
    out = dry_run(capsys, "slurm", f"recipe={recipe}", *USER)
    assert out.startswith(f"sbatch --nodes={nodes} --ntasks-per-node=1 --gpus-per-node=8 --job-name=usp ")


def test_recipe_degrees_checked_against_the_job(capsys):
    err = fails(capsys, "slurm", "--nodes", "4", "recipe=llama31_8b_1m", *USER, "--dry-run")
    assert "parallel.ulysses_degree=8 x parallel.ring_degree=8 = 64 does not divide the world size" in err
    assert "4 node(s) x 8 process(es) per node = 32 ranks" in err
    # the same degrees, from a recipe, on a machine with 4 GPUs
    err = fails(capsys, "torchrun", "--nproc-per-node", "4", "recipe=llama2_7b_rope_32k", *USER, "--dry-run")
    assert "parallel.ulysses_degree=8 x parallel.ring_degree=1 = 8 does not divide the world size" in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["slurm", "recipe=x"],
            "Could not find 'recipe/x' - valid recipe options: gemma3_12b_128k, llama2_7b_rope_128k, ",
        ),
        (
            ["slurm", "recipe=llama31_8b_128k", *USER, "parallel.ulysess_degree=8"],
            "unknown config key 'parallel.ulysess_degree': did you mean parallel.ulysses_degree?",
        ),
        (
            ["torchrun", "--nproc-per-node", "8", "recipe=llama31_8b_128k", "trainer.seq_len=long", *USER],
            "trainer.seq_len=long",
        ),
        (["slurm", "recipe=llama31_8b_1m"], "model.path=/ckpt/"),
    ],
)
def test_bad_recipe_or_override_exits_2_before_launch(capsys, argv, message):
    err = fails(capsys, *argv, "--dry-run")
    assert err.startswith("usp-launch: error: ") and err.count("\n") == 1
    assert message in err


def test_sbatch_script_path_outside_cwd_is_absolute(capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    out = dry_run(capsys, "slurm", "--nodes", "4", "recipe=llama3_70b_128k", *USER)
    script = str(REPO / "launch" / "slurm.sbatch")
    assert out.startswith(f"sbatch --nodes=4 --ntasks-per-node=1 --gpus-per-node=8 --job-name=usp {script} ")


def _allocation(monkeypatch, **extra: str) -> None:
    env = {"SLURM_JOB_ID": "4242", "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "gpu[007-008]", **extra}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(cli.shutil, "which", lambda name, path=None: None)  # no scontrol: parse the list


def test_srun_inside_allocation(capsys, monkeypatch):
    _allocation(monkeypatch, SLURM_GPUS_ON_NODE="8")
    out = dry_run(
        capsys,
        "slurm",
        "recipe=llama31_8b_128k",
        "parallel.ulysses_degree=8",
        "parallel.ring_degree=2",
        *USER,
    )
    assert out == (
        "srun --nodes=2 --ntasks-per-node=1 --kill-on-bad-exit=1 torchrun --nnodes 2 --nproc-per-node 8 "
        "--rdzv-id 4242 --rdzv-backend c10d --rdzv-endpoint gpu007:24242 --max-restarts 0 "
        "--signals-to-handle SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1 --shutdown-timeout 240 -m usp.train "
        "recipe=llama31_8b_128k parallel.ulysses_degree=8 parallel.ring_degree=2 "
        f"{' '.join(USER)}\n"
    )


def test_srun_keeps_given_run_dir_and_reads_gpus_per_node(capsys, monkeypatch):
    _allocation(monkeypatch, SLURM_GPUS_PER_NODE="h100:4")
    out = dry_run(capsys, "slurm", "hydra.run.dir=outputs/slurm-4000", "trainer.resume=auto")
    assert out == (
        "srun --nodes=2 --ntasks-per-node=1 --kill-on-bad-exit=1 torchrun --nnodes 2 --nproc-per-node 4 "
        "--rdzv-id 4242 --rdzv-backend c10d --rdzv-endpoint gpu007:24242 --max-restarts 0 "
        "--signals-to-handle SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1 --shutdown-timeout 240 -m usp.train "
        "hydra.run.dir=outputs/slurm-4000 trainer.resume=auto\n"
    )


@pytest.mark.parametrize("allocated", [False, True], ids=["sbatch", "srun"])
def test_slurm_adds_no_run_dir_so_a_pinned_recipe_keeps_its_own(capsys, monkeypatch, allocated):
    """The staged llama2_7b_rope_* recipes chain through their pinned run dirs (outputs/<stage>/hf)."""
    if allocated:
        _allocation(monkeypatch, SLURM_GPUS_ON_NODE="8", SLURM_NNODES="1", SLURM_JOB_NODELIST="gpu007")
    out = dry_run(capsys, "slurm", "recipe=llama2_7b_rope_32k", *USER)
    assert "hydra.run.dir" not in out
    assert out.endswith(f"-m usp.train recipe=llama2_7b_rope_32k {' '.join(USER)}\n") or out.endswith(
        f"--nproc-per-node 8 recipe=llama2_7b_rope_32k {' '.join(USER)}\n"
    )


def test_default_run_dir_under_the_slurm_launchers_is_the_job_ids(monkeypatch):
    """Without hydra.run.dir the entry point names the run dir after an id every rank shares: the sbatch's
    torchrun uses --rdzv-id $SLURM_JOB_ID, so torchrun's TORCHELASTIC_RUN_ID and SLURM_JOB_ID are the same."""
    from omegaconf import OmegaConf

    from usp.config.compose import register_configs

    register_configs()  # the ${usp_run_id:} resolver behind conf/train.yaml's default run dir
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "4242")
    monkeypatch.setenv("WORLD_SIZE", "16")
    assert "4242" in OmegaConf.create({"run_dir": "outputs/${usp_run_id:}"}).run_dir


def test_srun_gives_the_task_the_nodes_cores(capsys, monkeypatch):
    """One task per node: without --cpus-per-task, core-binding clusters pin torchrun and its ranks to 1 core."""
    _allocation(monkeypatch, SLURM_GPUS_ON_NODE="8", SLURM_CPUS_ON_NODE="96")
    out = dry_run(capsys, "slurm", "recipe=llama31_8b_128k", *USER)
    assert out.startswith(
        "srun --nodes=2 --ntasks-per-node=1 --cpus-per-task=96 --kill-on-bad-exit=1 torchrun "
    )


def test_submit_inside_allocation_uses_sbatch(capsys, monkeypatch):
    _allocation(monkeypatch, SLURM_GPUS_ON_NODE="8")
    out = dry_run(capsys, "slurm", "--submit", "--nodes", "2", "recipe=llama31_8b_128k", *USER)
    assert out.startswith("sbatch --nodes=2 --ntasks-per-node=1 --gpus-per-node=8 --job-name=usp ")


def test_cluster_overrides_size_the_job(capsys):
    out = dry_run(
        capsys,
        "slurm",
        "recipe=llama31_8b_1m",
        "cluster.num_nodes=4",
        "cluster.gpus_per_node=8",
        "parallel.ring_degree=4",
        *USER,
    )
    assert out == (
        "sbatch --nodes=4 --ntasks-per-node=1 --gpus-per-node=8 --job-name=usp launch/slurm.sbatch "
        "--nproc-per-node 8 recipe=llama31_8b_1m cluster.num_nodes=4 cluster.gpus_per_node=8 parallel.ring_degree=4 "
        f"{' '.join(USER)}\n"
    )


def test_cluster_override_must_agree_with_flag(capsys):
    err = fails(capsys, "slurm", "--nodes", "2", "cluster.num_nodes=4", "--dry-run")
    assert "--nodes=2 but cluster.num_nodes=4" in err


def test_more_processes_than_allocated_gpus(capsys, monkeypatch):
    _allocation(monkeypatch, SLURM_GPUS_ON_NODE="4")
    err = fails(capsys, "slurm", "cluster.gpus_per_node=8", "--dry-run")
    assert "8 processes per node, but SLURM job 4242 has 4 GPUs per node" in err


def test_allocation_uses_all_its_nodes(capsys, monkeypatch):
    _allocation(monkeypatch, SLURM_GPUS_ON_NODE="8", SLURM_NNODES="4", SLURM_JOB_NODELIST="n[10-13]")
    out = dry_run(capsys, "slurm", "cluster.num_nodes=4")
    assert out.startswith("srun --nodes=4 --ntasks-per-node=1 --kill-on-bad-exit=1 torchrun --nnodes 4 ")
    assert "--rdzv-endpoint n10:24242 " in out
    err = fails(capsys, "slurm", "--nodes", "2", "--dry-run")
    assert "2 node(s) asked for, but SLURM job 4242 has 4" in err and "--submit" in err


# --- errors before launch ----------------------------------------------------------------------------
def test_degrees_not_dividing_world(capsys):
    err = fails(
        capsys, "torchrun", "--cpu", "--nproc-per-node", "4", "parallel.ulysses_degree=3", "--dry-run"
    )
    assert "parallel.ulysses_degree=3 x parallel.ring_degree=1 = 3 does not divide the world size 4" in err
    assert "1 node(s) x 4 process(es) per node = 4 ranks" in err
    assert "[1, 2, 4]" in err


def test_ulysses_across_nodes_rejected(capsys):
    err = fails(
        capsys,
        "slurm",
        "--nodes",
        "2",
        "--gpus-per-node",
        "8",
        "parallel.ulysses_degree=16",
        "parallel.ring_degree=1",
        "--dry-run",
    )
    assert "parallel.ulysses_degree=16 would make Ulysses groups span nodes of 8 ranks" in err
    assert "[1, 2, 4, 8]" in err and "node size 8 = LOCAL_WORLD_SIZE" in err
    assert "parallel.allow_cross_node_ulysses=true" in err


def test_ulysses_checked_against_node_size_override(capsys):
    err = fails(
        capsys,
        "torchrun",
        "--cpu",
        "--nproc-per-node",
        "4",
        "parallel.ulysses_degree=4",
        "parallel.node_size=2",
        "--dry-run",
    )
    assert "parallel.ulysses_degree=4 would make Ulysses groups span nodes of 2 ranks" in err
    assert "node size parallel.node_size=2" in err


def test_auto_degrees_accepted(capsys):
    out = dry_run(
        capsys,
        "torchrun",
        "--nproc-per-node",
        "8",
        "parallel.ulysses_degree=auto",
        "parallel.ring_degree=auto",
    )
    assert out.endswith("-m usp.train parallel.ulysses_degree=auto parallel.ring_degree=auto\n")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["local", "parallel.ring_degree=2"], "parallel.ring_degree=2 = 2 does not divide the world size 1"),
        (
            [
                "slurm",
                "--nodes",
                "2",
                "--gpus-per-node",
                "8",
                "parallel.ulysses_degree=4",
                "parallel.ring_degree=2",
                "parallel.dp_degree=4",
            ],
            "parallel.dp_degree=4 x ulysses_degree=4 x ring_degree=2 = 32 != world size 16",
        ),
        (
            ["torchrun", "--nproc-per-node", "4", "parallel.ring_degree=two"],
            "parallel.ring_degree='two' is invalid",
        ),
        (["torchrun", "--nproc-per-node", "0"], "--nproc-per-node=0 is invalid"),
        (["torchrun", "recipe=tiny"], "no GPUs found"),
        (["torchrun", "--cpu", "recipe=tiny"], "--cpu needs --nproc-per-node N"),
        (
            ["torchrun", "--nproc-per-node", "2", "--partition", "gpu"],
            "--partition: only for `usp-launch slurm`",
        ),
        (["local", "--nproc-per-node", "4"], "`local` runs one process"),
        (
            ["torchrun", "--nodes", "2", "--nproc-per-node", "8"],
            "For 2 nodes use `usp-launch slurm --nodes 2`",
        ),
        (["slurm", "--cpu"], "--cpu applies to local and torchrun"),
        (["local", "tiny"], "'tiny' is not a Hydra override"),
        (["local", "--bogus", "recipe=tiny"], "unknown option '--bogus'"),
        (["slurm", "--script", "nowhere.sbatch"], "--script nowhere.sbatch: no such file"),
    ],
)
def test_bad_input_exits_2_with_message(capsys, argv, message):
    err = fails(capsys, *argv, "--dry-run")
    assert err.startswith("usp-launch: error: ")
    assert message in err


def test_sbatch_option_inside_allocation_rejected(capsys, monkeypatch):
    _allocation(monkeypatch, SLURM_GPUS_ON_NODE="8")
    err = fails(capsys, "slurm", "--partition", "gpu", "--dry-run")
    assert "inside SLURM job 4242" in err and "--submit" in err


def test_unknown_mode_is_a_usage_error(capsys):
    assert cli.main(["kubernetes", "recipe=tiny"]) == 2
    assert "invalid choice: 'kubernetes'" in capsys.readouterr().err


# --- Hydra's own flags after `--` ---------------------------------------------------------------------
def test_hydra_flags_after_dashes_pass_through_unchanged(capsys):
    """`--cfg job` prints a recipe's config: no model.path needed, and the 64-GPU layout is not held against
    the one process that prints it."""
    out = dry_run(capsys, "local", "recipe=llama31_8b_1m", "--", "--cfg", "job")
    assert (
        out == shlex.join([sys.executable, "-m", "usp.train", "recipe=llama31_8b_1m", "--cfg", "job"]) + "\n"
    )
    out = dry_run(capsys, "torchrun", "--cpu", "--nproc-per-node", "4", "--", "recipe=tiny", "--help")
    assert out.endswith("-m usp.train trainer.device=cpu parallel.backend=gloo recipe=tiny --help\n")
    # the usage's trailing --dry-run stays usp-launch's, even after --
    assert cli.main(["local", "--", "--info", "defaults", "--dry-run"]) == 0
    assert capsys.readouterr().out.endswith("-m usp.train --info defaults\n")


def test_hydra_flags_to_sbatch_follow_the_scripts_dashes(capsys):
    out = dry_run(
        capsys,
        "slurm",
        "--nodes",
        "2",
        "--gpus-per-node",
        "8",
        "recipe=llama31_8b_128k",
        "--",
        "--cfg",
        "job",
    )
    assert out.endswith("launch/slurm.sbatch --nproc-per-node 8 -- recipe=llama31_8b_128k --cfg job\n")
    err = fails(capsys, "slurm", "recipe=llama31_8b_128k", "--", "--cfg", "job", "--dry-run")
    assert "pass --nodes N --gpus-per-node G" in err


def test_hydra_flags_still_rejected_before_dashes(capsys):
    err = fails(capsys, "local", "recipe=tiny", "--cfg", "job", "--dry-run")
    assert "unknown option '--cfg'" in err
    err = fails(capsys, "local", "--", "parallel.ring_degree=2", "--cfg", "job", "--dry-run")
    assert "parallel.ring_degree=2 = 2 does not divide the world size 1" in err


# --- running --------------------------------------------------------------------------------------------
def test_run_returns_the_commands_exit_status(capsys, monkeypatch):
    seen = []

    def fake_run(cmd, env):
        seen.append(cmd)
        return subprocess.CompletedProcess(cmd, 3)

    monkeypatch.setattr(cli.subprocess, "run", fake_run)
    assert cli.main(["local", "model=tiny"]) == 3
    assert seen == [[sys.executable, "-m", "usp.train", "model=tiny"]]
    assert "usp-launch: " in capsys.readouterr().err


def test_run_without_sbatch_says_where_to_run(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(cli.sys, "executable", str(tmp_path / "python"))
    err = fails(capsys, "slurm", "recipe=llama31_8b_128k", *USER)
    assert "`sbatch` is not on PATH: run this on a SLURM login node" in err


# --- helpers --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("nodelist", "head"),
    [("gpu[001-004]", "gpu001"), ("a1,b2", "a1"), ("node[3,5-7]-ib,x9", "node3-ib"), ("solo", "solo")],
)
def test_first_hostname(nodelist, head):
    assert commands.first_hostname(nodelist) == head


def test_first_hostname_empty():
    with pytest.raises(ValueError, match="SLURM_JOB_NODELIST is empty"):
        commands.first_hostname(" ")


def test_rdzv_port():
    assert commands.rdzv_port("4242") == 24242
    assert commands.rdzv_port("123456") == 23456


def test_override_parsing_is_hydras():
    """Keys and values as Hydra's override parser reads them (typed values, quotes, lists, +/++/~ forms)."""
    assert override_key("++parallel.ring_degree=2") == "parallel.ring_degree"
    assert override_key("+parallel.ring_degree=2") == "parallel.ring_degree"
    assert override_key("~logging.wandb") == "logging.wandb"
    assert override_key("hydra/job_logging=none") == "hydra/job_logging"
    assert find_override(["a.b=1", "+a.b=2", "c=3"], "a.b") == 2
    assert find_override(["a.b='2'"], "a.b") == "2"  # a quoted value stays a string, as the trainer gets it
    inputs = 'data.inputs=["/d/a=1.jsonl",/d/b.jsonl]'  # a quoted '=' inside a list value
    assert find_override([inputs], "data.inputs") == ["/d/a=1.jsonl", "/d/b.jsonl"]
    assert find_override(["a.b=1", "~a.b"], "a.b") is None and find_override(["c=3"], "a.b") is None
    assert find_override(["--cfg", "job", "a.b=3"], "a.b") == 3  # Hydra's flags and their values are skipped
    assert has_override(["+trainer.device=cpu"], "trainer.device") and not has_override(
        ["a=1"], "trainer.device"
    )


@pytest.mark.parametrize(
    ("word", "message"),
    [
        ("tiny", "'tiny' is not a Hydra override (missing EQUAL"),
        ("=3", "'=3' has an empty key"),
        ("data.inputs=[a.jsonl", "'data.inputs=[a.jsonl' is not a Hydra override"),
        ("--cfg", "unknown option '--cfg'"),
    ],
)
def test_parse_overrides_names_the_bad_word(word, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_overrides(["recipe=tiny", word])


def test_check_degrees_is_parallel_dims_on_the_command_lines_values():
    """Without a composed config (Hydra flags after --): the command line's integer degrees, ParallelLayout's rules."""
    check_degrees(
        ["parallel.ulysses_degree=2", "parallel.ring_degree=2", "parallel.node_size=2"],
        nodes=1,
        nproc_per_node=4,
    )
    with pytest.raises(
        ValueError, match=r"parallel.ulysses_degree=1 x parallel.ring_degree=3 = 3 does not divide"
    ):
        check_degrees(["parallel.ring_degree=3"], nodes=1, nproc_per_node=4)
    with pytest.raises(
        ValueError,
        match=r"node size 3 \(parallel.node_size, or the launcher's LOCAL_WORLD_SIZE when that is unset\) does not divide the world size 4",
    ):
        check_degrees(["--cfg", "job", "parallel.node_size=3"], nodes=1, nproc_per_node=4)
    # dp only when both sequence degrees are known; auto and non-integers are usp.train's to report
    check_degrees(["parallel.dp_degree=4", "parallel.ring_degree=2"], nodes=1, nproc_per_node=8)
    check_degrees(["parallel.ulysses_degree=auto", "parallel.ring_degree='2'"], nodes=1, nproc_per_node=1)


# --- values the old string rules misread ---------------------------------------------------------------
def test_interpolated_degree_is_resolved_not_rejected(capsys):
    interpolated = "parallel.ulysses_degree=${parallel.ring_degree}"
    out = dry_run(
        capsys, "torchrun", "--cpu", "--nproc-per-node", "4", "parallel.ring_degree=2", interpolated
    )
    assert out.endswith(f"parallel.ring_degree=2 {shlex.quote(interpolated)}\n")
    err = fails(
        capsys,
        "torchrun",
        "--cpu",
        "--nproc-per-node",
        "2",
        "parallel.ring_degree=2",
        interpolated,
        "--dry-run",
    )
    assert "parallel.ulysses_degree=2 x parallel.ring_degree=2 = 4 does not divide the world size 2" in err


@pytest.mark.parametrize("value", ["'2'", "0x2", "2.0", "true"])
def test_a_degree_the_trainer_would_refuse_is_refused_in_its_words(capsys, value):
    """Hydra reads '2' as a string, 0x2 as a string, 2.0 as a float: the trainer's config refuses them all."""
    err = fails(
        capsys, "torchrun", "--cpu", "--nproc-per-node", "2", f"parallel.ulysses_degree={value}", "--dry-run"
    )
    assert "parallel.ulysses_degree=" in err and "is invalid: use an integer >= 1 or 'auto'" in err


def test_append_syntax_on_a_degree(capsys):
    err = fails(capsys, "torchrun", "--cpu", "--nproc-per-node", "4", "+parallel.ring_degree=2", "--dry-run")
    assert "An item is already at 'parallel.ring_degree'" in err and "'++parallel.ring_degree=2'" in err
    err = fails(capsys, "torchrun", "--cpu", "--nproc-per-node", "4", "++parallel.ring_degree=3", "--dry-run")
    assert "parallel.ring_degree=3 = 3 does not divide the world size 4" in err
    out = dry_run(capsys, "torchrun", "--cpu", "--nproc-per-node", "4", "++parallel.ring_degree=2")
    assert out.endswith(" ++parallel.ring_degree=2\n")


def _recipe(tmp_path: Path, name: str, parallel: str) -> str:
    """A recipe file outside the repository, found through Hydra's search path; returns its override."""
    (tmp_path / "recipe").mkdir(exist_ok=True)
    (tmp_path / "recipe" / f"{name}.yaml").write_text(f"# @package _global_\nparallel:\n{parallel}")
    return f"hydra.searchpath=[file://{tmp_path}]"


def test_degrees_set_in_a_recipe_file(capsys, tmp_path):
    """What the recipe sets counts, not only what the command line says: the old command-line check refused
    ulysses 16 on 8-GPU nodes although the recipe allows Ulysses across nodes."""
    search = _recipe(tmp_path, "xnode", "  allow_cross_node_ulysses: true\n")
    _recipe(tmp_path, "u16", "  ulysses_degree: 16\n  ring_degree: 1\n")
    two_nodes = ("slurm", "--nodes", "2", "--gpus-per-node", "8", search)
    out = dry_run(capsys, *two_nodes, "recipe=xnode", "parallel.ulysses_degree=16")
    assert out.endswith("recipe=xnode parallel.ulysses_degree=16\n")
    err = fails(capsys, *two_nodes, "recipe=u16", "--dry-run")
    assert "parallel.ulysses_degree=16 would make Ulysses groups span nodes of 8 ranks" in err
    dry_run(capsys, *two_nodes, "recipe=u16", "parallel.allow_cross_node_ulysses=yes")  # OmegaConf's true
    err = fails(
        capsys,
        *two_nodes,
        "recipe=xnode",
        "parallel.ulysses_degree=16",
        "parallel.allow_cross_node_ulysses=false",
        "--dry-run",
    )
    assert "span nodes of 8 ranks" in err


def test_fixed_degree_next_to_auto_still_checked_against_the_node(capsys):
    err = fails(
        capsys,
        "slurm",
        "--nodes",
        "2",
        "--gpus-per-node",
        "8",
        "parallel.ulysses_degree=16",
        "parallel.ring_degree=auto",
        "--dry-run",
    )
    assert "parallel.ulysses_degree=16 would make Ulysses groups span nodes of 8 ranks" in err


def test_quoted_cluster_size_is_read_as_the_config_reads_it(capsys):
    out = dry_run(
        capsys, "slurm", "recipe=llama31_8b_1m", "cluster.num_nodes='4'", "parallel.ring_degree=4", *USER
    )
    assert out.startswith("sbatch --nodes=4 --ntasks-per-node=1 --gpus-per-node=8 ")
    err = fails(capsys, "slurm", "--nodes", "2", "cluster.num_nodes='4'", "--dry-run")
    assert "--nodes=2 but cluster.num_nodes=4" in err


def test_module_entry_out_of_process(monkeypatch):
    """``python -m usp.launch.cli`` (what the usp-launch console script calls) prints the command and exits 0."""
    monkeypatch.undo()  # a real subprocess: drop the in-process guards
    argv = ["torchrun", "--cpu", "--nproc-per-node", "4", "recipe=tiny", "--dry-run"]
    result = subprocess.run(
        [sys.executable, "-m", "usp.launch.cli", *argv], capture_output=True, text=True, cwd=REPO, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == (
        "torchrun --standalone --nproc-per-node 4 -m usp.train trainer.device=cpu parallel.backend=gloo recipe=tiny\n"
    )


def test_launcher_overrides_are_valid_run_config_keys(tmp_path):
    """What the launchers add (--cpu pinning) composes into the trainer's typed config."""
    from usp.config.compose import compose_config

    overrides = commands.with_defaults(["recipe=tiny"], commands.cpu_defaults())
    assert overrides == ["trainer.device=cpu", "parallel.backend=gloo", "recipe=tiny"]
    cfg = compose_config(overrides, run_dir=str(tmp_path))
    assert (cfg.trainer.device, cfg.parallel.backend) == ("cpu", "gloo")
