"""usp-launch --entry eval: the same checks and command forms as training, starting usp.eval; slurm.sbatch
--entry eval runs usp.eval inside the job (stub srun). The default entry stays usp.train."""

from __future__ import annotations

import pytest

from tests.test_launch_scripts import SLURM_ENV, SLURM_SBATCH, run_script, stubs  # noqa: F401 - fixture
from usp.launch import cli, commands


def _dry_run(capsys, argv: list[str]) -> tuple[int, str, str]:
    code = cli.main([*argv, "--dry-run"])
    out = capsys.readouterr()
    return code, out.out.strip(), out.err


def test_usp_launch_entry_eval_torchrun_and_local(capsys):
    code, out, err = _dry_run(
        capsys,
        [
            "torchrun",
            "--cpu",
            "--nproc-per-node",
            "4",
            "--entry",
            "eval",
            "recipe=tiny",
            "model.path=outputs/demo/hf",
            "eval=passkey",
        ],
    )
    assert code == 0, err
    assert out == (
        "torchrun --standalone --nproc-per-node 4 -m usp.eval trainer.device=cpu parallel.backend=gloo "
        "recipe=tiny model.path=outputs/demo/hf eval=passkey"
    )
    code, out, err = _dry_run(capsys, ["local", "--cpu", "--entry", "eval", "model.path=/x"])
    assert code == 0 and " -m usp.eval " in out, err
    code, out, _ = _dry_run(capsys, ["torchrun", "--cpu", "--nproc-per-node", "4", "recipe=tiny"])
    assert code == 0 and " -m usp.train " in out  # the default entry is unchanged


def test_usp_launch_entry_eval_checks_the_eval_config(capsys):
    # a real recipe: the prepared data may stay unset for eval, the model may not; degrees checked as for training
    code, out, err = _dry_run(
        capsys, ["slurm", "--entry", "eval", "recipe=llama31_8b_128k", "model.path=/ckpt/run/hf"]
    )
    assert code == 0, err
    assert out.endswith(
        "launch/slurm.sbatch --nproc-per-node 8 --entry eval recipe=llama31_8b_128k model.path=/ckpt/run/hf"
    )
    code, _, err = _dry_run(capsys, ["slurm", "--entry", "eval", "recipe=llama31_8b_128k"])
    assert code == 2 and "model.path" in err
    code, _, err = _dry_run(
        capsys, ["torchrun", "--cpu", "--nproc-per-node", "4", "--entry", "eval", "recipe=tiny", "eval=nope"]
    )
    assert code == 2 and "passkey" in err and "ppl" in err  # the valid eval options are listed
    code, _, err = _dry_run(
        capsys, ["torchrun", "--cpu", "--nproc-per-node", "3", "--entry", "eval", "recipe=tiny"]
    )
    assert code == 2 and "parallel." in err


def test_sbatch_script_entry_eval_runs_usp_eval(stubs, tmp_path):  # noqa: F811 - the fixture
    overrides = ["recipe=llama31_8b_128k", "model.path=/ckpt/run/hf", "eval=passkey"]
    result = run_script(
        SLURM_SBATCH, ["--entry", "eval", *overrides], stubs, tmp_path, SLURM_GPUS_ON_NODE="8", **SLURM_ENV
    )
    assert result.returncode == 0, result.stderr
    expected = commands.srun_command(
        overrides, nodes=2, nproc_per_node=8, job_id="4242", head="gpu007", module="usp.eval"
    )
    assert stubs.calls("srun") == [expected[1:]]


@pytest.mark.parametrize("entry", ["bogus", ""])
def test_sbatch_script_bad_entry_starts_nothing(stubs, tmp_path, entry):  # noqa: F811
    result = run_script(
        SLURM_SBATCH, ["--entry", entry, "recipe=tiny"], stubs, tmp_path, SLURM_GPUS_ON_NODE="8", **SLURM_ENV
    )
    assert result.returncode == 1 and "--entry" in result.stderr
    assert stubs.calls("srun") == []


def test_torchrun_script_entry_eval_matches_usp_launch(stubs, tmp_path):  # noqa: F811
    from tests.test_launch_scripts import TORCHRUN_SH

    overrides = ["recipe=tiny", "model.path=outputs/demo/hf", "eval=passkey"]
    result = run_script(
        TORCHRUN_SH, ["--cpu", "--nproc-per-node", "4", "--entry", "eval", *overrides], stubs, tmp_path
    )
    assert result.returncode == 0, result.stderr
    expected = commands.torchrun_command(
        commands.with_defaults(overrides, commands.cpu_defaults()), nproc_per_node=4, module="usp.eval"
    )
    assert stubs.calls("torchrun") == [expected[1:]]
