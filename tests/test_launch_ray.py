"""``usp-launch ray`` (issue 33): the run under Ray Train equals the torchrun run, a killed worker resumes, and
a layout that cannot keep Ulysses groups inside a node is refused before Ray starts.

The end-to-end case starts a real local Ray cluster with 4 CPU workers (gloo) on the tiny recipe, next to a
``torchrun`` run of the same overrides (the demo's layout: Ulysses 2 x ring 2, 2 emulated nodes of 2): the
session's shared run (``tiny_torchrun_run``), which the demo test checks as well.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.records import complete_records
from tests.tiny_run import OVERRIDES as TINY_RUN
from tests.tiny_run import STEPS, launch_env
from usp.launch import cli, ray_job
from usp.launch.ray_train import pinned_run_name

pytestmark = pytest.mark.serial  # Ray's raylet waits a fixed 30 s to start; the shared torchrun run

BIN = Path(sys.executable).parent
TINY = [*TINY_RUN, "trainer.export_hf=false"]


def _steps(run_dir: Path) -> list[dict]:
    return complete_records(run_dir / "metrics.jsonl")


def _losses(run_dir: Path) -> torch.Tensor:
    return torch.tensor([r["loss"] for r in _steps(run_dir)], dtype=torch.float64)


def _rank_pid(run_dir: Path, rank: int) -> int | None:
    """The pid of the ``usp.train`` process of ``rank`` writing into ``run_dir``, if it runs."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
            if "usp.train" not in argv or f"hydra.run.dir={run_dir}" not in argv:
                continue
            env = (entry / "environ").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if f"RANK={rank}" in env:
            return int(entry.name)
    return None


def test_the_job_command_and_the_pinned_run_dir(capsys):
    args = ["ray", "--cpu", "--nproc-per-node", "4", *TINY, "--dry-run"]
    assert cli.main(args) == 0
    words = capsys.readouterr().out.split()
    cut = words.index("--")
    assert words[:3] == ["python", "-m", "usp.launch.ray_job"]
    flags = ["--nodes", "1", "--nproc-per-node", "4", "--cpu", "--module", "usp.train", "--name"]
    assert words[3 : cut - 1] == flags
    overrides = words[cut + 1 :]
    assert overrides[:2] == ["trainer.device=cpu", "parallel.backend=gloo"]  # --cpu's, as under torchrun
    assert overrides[2:-1] == TINY and overrides[-1].startswith("run_name=ray-")
    assert words[cut - 1] == overrides[-1].removeprefix("run_name=")
    # the parse of the printed command is what the job runs
    parsed = ray_job.build_parser().parse_args(words[3:])
    assert (parsed.nodes, parsed.nproc_per_node, parsed.cpu, parsed.max_restarts) == (1, 4, True, 0)
    assert parsed.overrides == overrides
    # a run dir given on the command line is kept; none given: one for every node and restart
    assert pinned_run_name(["hydra.run.dir=/shared/run"]) == ["hydra.run.dir=/shared/run"]
    assert pinned_run_name(["run_name=mine"]) == ["run_name=mine"]
    assert pinned_run_name([], now=0.0)[0].startswith("run_name=ray-19")


@pytest.mark.parametrize(
    "words, message",
    [
        (
            ["--cpu", "--nproc-per-node", "4", "parallel.ulysses_degree=4", "parallel.ring_degree=1"],
            "parallel.ulysses_degree=4 would make Ulysses groups span nodes of 2 ranks",
        ),
        (
            [
                "--address",
                "auto",
                "--nodes",
                "2",
                "--gpus-per-node",
                "2",
                "parallel.node_size=null",
                "parallel.ulysses_degree=4",
                "parallel.ring_degree=1",
            ],
            "parallel.ulysses_degree=4 would make Ulysses groups span nodes of 2 ranks",
        ),
        (
            ["--cpu", "--nproc-per-node", "4", "--nodes", "2"],
            "without --address the Ray cluster is a local one",
        ),
        (["--cpu"], "--cpu needs --nproc-per-node N"),
        (
            ["--cpu", "--nproc-per-node", "4", "--partition", "gpu"],
            "--partition: only for `usp-launch slurm`",
        ),
    ],
)
def test_bad_layouts_and_flags_are_refused_before_ray_starts(words, message, capsys, monkeypatch):
    import usp.launch.common as common

    def no_run(cmd):  # nothing may start
        raise AssertionError(f"started {cmd}")

    monkeypatch.setattr(common, "run_command", no_run)
    assert cli.main(["ray", *words, "recipe=tiny"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("usp-launch: error:") and len(err.strip().splitlines()) == 1, err
    assert message in err


def test_placement_and_worker_environment():
    ray_job.check_placement(local_world_size=8, nproc_per_node=8, node_rank=1, local_rank=3, rank=11)
    with pytest.raises(ray_job.PlacementError, match="Ray placed 6 of the run's workers on node 1"):
        ray_job.check_placement(local_world_size=6, nproc_per_node=8, node_rank=1, local_rank=0, rank=8)
    with pytest.raises(ray_job.PlacementError, match="the ranks of a node are not consecutive"):
        ray_job.check_placement(local_world_size=8, nproc_per_node=8, node_rank=1, local_rank=3, rank=3)
    env = ray_job.worker_env(
        {"MASTER_ADDR": "ray's", "MASTER_PORT": "1", "PATH": "/bin"},
        rank=5,
        world_size=8,
        local_rank=1,
        local_world_size=4,
        node_rank=1,
        master_addr="10.0.0.1",
        master_port=29400,
    )
    assert env == {
        "PATH": "/bin",
        "RANK": "5",
        "WORLD_SIZE": "8",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "4",
        "GROUP_RANK": "1",
        "NODE_RANK": "1",
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "29400",
    }


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_ray_run_equals_torchrun_and_a_killed_worker_resumes(tmp_path, tiny_torchrun_run):
    """4 CPU workers on a local Ray cluster, ``--max-restarts 1``: rank 1's process is killed after step 4 (a
    checkpoint every 3 steps); Ray Train restarts the group, the ranks resume from the last checkpoint and the run reaches step
    8 with every step's loss equal to an uninterrupted torchrun run of the same overrides (fp32: bitwise up to
    the JSON round trip)."""
    pytest.importorskip("ray.train", reason="Ray Train is the optional extra usp[ray]")
    ray_dir = tmp_path / "ray"
    ref = tiny_torchrun_run  # the session's torchrun run of the same overrides (tests/tiny_run.py)
    assert ref.returncode == 0, ref.output[-6000:]
    reference = _losses(ref.run_dir)
    assert len(reference) == STEPS

    launch = [str(BIN / "usp-launch"), "ray", "--cpu", "--nproc-per-node", "4", "--max-restarts", "1"]
    log = (tmp_path / "ray.log").open("w")
    job = subprocess.Popen(
        [*launch, *TINY, f"hydra.run.dir={ray_dir}"],
        cwd=tmp_path,
        env=launch_env(),
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 400
        while not (_steps(ray_dir) and _steps(ray_dir)[-1]["step"] >= 4):
            assert job.poll() is None, (tmp_path / "ray.log").read_text()[-4000:]
            assert time.monotonic() < deadline, "no step 4 within 400 s"
            time.sleep(0.05)
        killed = _rank_pid(ray_dir, 1)
        assert killed is not None
        os.kill(killed, signal.SIGKILL)
        rc = job.wait(timeout=500)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait(timeout=30)
        log.close()
    out = (tmp_path / "ray.log").read_text()
    assert rc == 0, out[-4000:]
    # from step 3's checkpoint, or step 6's if the kill came that late
    assert f"resumed from {ray_dir / 'checkpoints' / 'step_'}" in (ray_dir / "usp-train.log").read_text()
    assert [r["step"] for r in _steps(ray_dir)] == list(range(1, STEPS + 1))
    torch.testing.assert_close(_losses(ray_dir), reference, rtol=0, atol=1e-6 * float(reference.abs().max()))
