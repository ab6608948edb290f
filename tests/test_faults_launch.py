"""Faults around the launch (issue 12, defects 4, 5, 6, 10, 11, 14): signals and requeue, elastic restarts,
errors said once, bad data, a stuck rank, checks before the queue.

The end-to-end cases start real ``torchrun`` jobs of the tiny recipe on 2 CPU processes (gloo) and kill,
stop or signal their ranks; each is bounded by a timeout and cleans up the processes it started.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from datetime import timedelta
from pathlib import Path

import datasets
import pytest
import torch
import torch.distributed as dist

from tests.records import complete_records
from usp.config import WandbConfig
from usp.config.compose import run_id
from usp.data.cli import main as prepare_main
from usp.data.sources import load_text_sources
from usp.launch import cli, commands
from usp.parallel.process_group import launcher_store
from usp.tiny import build_tiny_tokenizer
from usp.train.__main__ import REQUEUE_EXIT_CODE
from usp.train.signals import StopRequest
from usp.train.watchdog import WARMUP_STEPS, StepWatchdog

pytestmark = pytest.mark.serial  # step timing: the watchdog and the seconds a stopped rank takes to fail

REPO = Path(__file__).resolve().parents[1]
TORCHRUN = Path(sys.executable).parent / "torchrun"
SLURM_SBATCH = REPO / "launch" / "slurm.sbatch"
TORCHRUN_SH = REPO / "launch" / "torchrun.sh"
# the tiny recipe on 2 ranks (Ulysses 2 inside one emulated node); fp32, so reruns are bit-identical
TINY2 = [
    "recipe=tiny",
    "parallel.ulysses_degree=2",
    "parallel.ring_degree=1",
    "parallel.node_size=2",
    "trainer.export_hf=false",
    "logging.progress_bar=false",
    "trainer.checkpoint_every=10",
]
STEPS = 40


def _env() -> dict[str, str]:
    return {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
    }


class Job:
    """A torchrun job started in its own session; ``close`` kills whatever of it is left (by its ids)."""

    def __init__(self, args: list[str], cwd: Path, torchrun_args: tuple[str, ...] = ()) -> None:
        cmd = [
            str(TORCHRUN),
            "--standalone",
            "--nproc-per-node",
            "2",
            *torchrun_args,
            "-m",
            "usp.train",
            *args,
        ]
        self.log = cwd / f"torchrun-{time.monotonic_ns()}.log"
        self._out = self.log.open("w")
        self.proc = subprocess.Popen(
            cmd, cwd=cwd, env=_env(), stdout=self._out, stderr=subprocess.STDOUT, start_new_session=True
        )
        self.pids: set[int] = set()

    def workers(self) -> dict[int, int]:
        """``{rank: pid}`` of the agent's current workers."""
        out: dict[int, int] = {}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                if ppid != self.proc.pid:
                    continue
                env = dict(
                    kv.split("=", 1)
                    for kv in (entry / "environ").read_bytes().decode(errors="replace").split("\0")
                    if "=" in kv
                )
            except (OSError, IndexError, ValueError):
                continue
            if "RANK" in env:
                out[int(env["RANK"])] = int(entry.name)
        self.pids.update(out.values())
        return out

    def wait(self, timeout: float) -> tuple[int, str]:
        try:
            rc = self.proc.wait(timeout=timeout)
        finally:
            self.close()
        return rc, self.log.read_text()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.workers()  # torchrun starts its workers in their own sessions: kill them one by one
        for pid in [self.proc.pid, *self.pids]:
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.kill(pid, sig) if pid != self.proc.pid else os.killpg(pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass
        self.proc.wait(timeout=30)
        if not self._out.closed:
            self._out.close()


def _steps(run_dir: Path) -> list[dict]:
    return complete_records(run_dir / "metrics.jsonl")


def _wait_for_step(job: Job, run_dir: Path, step: int, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done = _steps(run_dir)
        if done and done[-1]["step"] >= step:
            return
        if job.proc.poll() is not None:
            raise AssertionError(f"the job ended before step {step}:\n{job.log.read_text()[-4000:]}")
        time.sleep(0.02)
    raise AssertionError(f"no step {step} within {timeout} s")


def _losses(run_dir: Path) -> torch.Tensor:
    return torch.tensor([r["loss"] for r in _steps(run_dir)], dtype=torch.float64)


def _assert_same_losses(run_dir: Path, reference: torch.Tensor) -> None:
    """fp32 tiny runs resume bit-identically; the tolerance only absorbs the JSON round trip."""
    steps = [r["step"] for r in _steps(run_dir)]
    assert steps == list(range(1, STEPS + 1)), steps
    torch.testing.assert_close(_losses(run_dir), reference, rtol=0, atol=1e-6 * float(reference.abs().max()))


@pytest.fixture(scope="module")
def reference_losses(tmp_path_factory) -> torch.Tensor:
    """The uninterrupted run every interrupted one must reproduce."""
    root = tmp_path_factory.mktemp("reference")
    rc, out = Job([*TINY2, f"trainer.max_steps={STEPS}", f"hydra.run.dir={root / 'run'}"], root).wait(600)
    assert rc == 0, out[-4000:]
    losses = _losses(root / "run")
    assert len(losses) == STEPS
    return losses


# --- 5. elastic restarts ----------------------------------------------------------------------------------
def test_launcher_store_keys_are_private_to_each_restart():
    """torchrun's agent keeps one store for the whole job: a restarted attempt must not see the last one's keys."""
    server = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timedelta(seconds=10))
    env = {
        "RANK": "0",
        "WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(server.port),
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_RESTART_COUNT": "0",
    }
    first = launcher_store(timedelta(seconds=10), env)
    first.set("default_pg/0//cpu//0/rank_0", b"dead peer")
    again = launcher_store(timedelta(seconds=10), env)
    assert again.check(["default_pg/0//cpu//0/rank_0"])  # the same attempt shares its keys
    restarted = launcher_store(timedelta(seconds=10), {**env, "TORCHELASTIC_RESTART_COUNT": "1"})
    assert not restarted.check(["default_pg/0//cpu//0/rank_0"])


_RESTART_SCRIPT = textwrap.dedent(
    """
    import os, sys, time, torch, torch.distributed as dist
    from usp.parallel.process_group import init_distributed
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    rank = int(os.environ["RANK"])
    if attempt == 1 and rank == 0:
        time.sleep(3)  # the restarted rank 1 looks up rank 0's address first: it must not find the dead one
    init_distributed(torch.device("cpu"), "gloo", timeout_minutes=1)
    t = torch.ones(1)
    dist.all_reduce(t)
    if attempt == 0 and rank == 1:
        os.kill(os.getpid(), 9)
    dist.barrier()
    print(f"attempt {attempt} rank {rank} sum {t.item():.0f}", flush=True)
    dist.destroy_process_group()
    """
)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_restarted_gloo_ranks_meet_again(tmp_path):
    """torchrun --max-restarts 1 after a killed rank: the new ranks form a gloo group (on main: connectFullMesh
    refused, the dead attempt's address read from the agent's store)."""
    script = tmp_path / "restart.py"
    script.write_text(_RESTART_SCRIPT)
    cmd = [str(TORCHRUN), "--standalone", "--nproc-per-node", "2", "--max-restarts", "1", str(script)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "attempt 1 rank 0 sum 2" in out and "attempt 1 rank 1 sum 2" in out


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_elastic_restart_resumes_and_reaches_the_uninterrupted_losses(tmp_path, reference_losses):
    run_dir = tmp_path / "run"
    job = Job(
        [*TINY2, f"trainer.max_steps={STEPS}", f"hydra.run.dir={run_dir}"], tmp_path, ("--max-restarts", "1")
    )
    try:
        _wait_for_step(job, run_dir, 12)
        os.kill(job.workers()[1], signal.SIGKILL)
        rc, out = job.wait(600)
    finally:
        job.close()
    assert rc == 0, out[-4000:]
    log = (run_dir / "usp-train.log").read_text()
    assert "resumed from" in log, "the restarted ranks did not resume from a checkpoint"
    _assert_same_losses(run_dir, reference_losses)


# --- 4. preemption and requeue ----------------------------------------------------------------------------
def test_stop_request_records_and_agrees():
    from usp.train import signals

    assert (
        signals.REQUEUE_EXIT_CODE == REQUEUE_EXIT_CODE == 75
    )  # the entry point's copy (it imports no torch)
    with StopRequest() as stop:
        assert not stop.agreed(torch.device("cpu"))
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.05)
        assert stop.received == signal.SIGUSR1 and stop.agreed(torch.device("cpu"))
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL  # restored


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_signal_to_one_rank_checkpoints_all_and_the_relaunch_matches(tmp_path, reference_losses):
    """SIGUSR1 to rank 1 only: both ranks stop at the same step with one checkpoint and exit 75; relaunched
    in the same run dir the run continues from there and reaches the uninterrupted losses."""
    run_dir = tmp_path / "run"
    args = [*TINY2, f"trainer.max_steps={STEPS}", f"hydra.run.dir={run_dir}"]
    job = Job(args, tmp_path)
    try:
        _wait_for_step(job, run_dir, 3)
        os.kill(job.workers()[1], signal.SIGUSR1)
        rc, out = job.wait(300)
    finally:
        job.close()
    assert rc != 0
    stopped_at = _steps(run_dir)[-1]["step"]
    assert stopped_at < STEPS
    assert (run_dir / "checkpoints" / f"step_{stopped_at}").is_dir()
    assert f"stopped by SIGUSR1 after step {stopped_at}" in (run_dir / "usp-train.log").read_text()
    # both ranks stopped at that step (the first to exit with 75; torchrun may end the other while it exits)
    summary = out.split("usp.train FAILED", 1)[1]
    assert (
        summary.count(f"stopped by a signal after saving {run_dir / 'checkpoints' / f'step_{stopped_at}'}")
        == 2
    )
    assert f"exitcode  : {REQUEUE_EXIT_CODE}" in summary.split("Root Cause", 1)[1], summary
    rc, out = Job(args, tmp_path).wait(600)
    assert rc == 0, out[-4000:]
    assert (
        f"resumed from {run_dir / 'checkpoints' / f'step_{stopped_at}'}"
        in (run_dir / "usp-train.log").read_text()
    )
    _assert_same_losses(run_dir, reference_losses)


def test_wandb_resumes_the_run_of_the_run_dir(tmp_path, monkeypatch):
    from usp.train import wandb_run

    calls: list[dict] = []
    fake = type(sys)("wandb")
    fake.init = lambda **kw: calls.append(kw)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    for run_dir in (tmp_path / "a", tmp_path / "a", tmp_path / "b"):
        wandb_run.init_wandb(WandbConfig(mode="offline"), run_dir, {}, {})
    assert calls[0]["resume"] == "allow" and calls[0]["id"] == calls[1]["id"] != calls[2]["id"]


def test_run_name_names_the_run_dir():
    assert run_id("ctx128k") == "ctx128k"
    with pytest.raises(ValueError, match="run_name='../x' is invalid"):
        run_id("../x")
    from hydra import compose, initialize_config_dir

    from usp.config.compose import CONF_DIR, register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("train", overrides=["run_name=ctx128k"], return_hydra_config=True)
        assert cfg.hydra.run.dir == "outputs/ctx128k"


def _stub(bin_dir: Path, name: str, body: str) -> None:
    path = bin_dir / name
    path.write_text("#!/bin/bash\n" + body)
    path.chmod(0o755)


SLURM_ENV = {
    "SLURM_JOB_ID": "4242",
    "SLURM_NNODES": "2",
    "SLURM_JOB_NODELIST": "gpu[007-008]",
    "SLURM_GPUS_ON_NODE": "8",
}


def test_sbatch_script_asks_for_the_signal_forwards_it_and_requeues(tmp_path):
    header = SLURM_SBATCH.read_text()
    assert "#SBATCH --signal=B:USR1@300" in header and "#SBATCH --requeue" in header
    bin_dir, log = tmp_path / "bin", tmp_path / "log"
    bin_dir.mkdir()
    log.mkdir()
    # srun: records its argv, then waits for a signal (the job's ranks, checkpointing) and exits 1 like torchrun
    _stub(
        bin_dir,
        "srun",
        f"printf '%s\\n' \"$@\" > '{log}/srun.args'\n"
        f"trap 'echo USR1 > \"{log}/srun.signal\"; exit 1' USR1\nfor _ in $(seq 300); do sleep 0.1; done\n",
    )
    _stub(
        bin_dir,
        "scontrol",
        f"[[ $1 == show ]] && printf 'gpu007\\ngpu008\\n' || printf '%s\\n' \"$@\" > '{log}/scontrol.args'\n",
    )
    _stub(bin_dir, "torchrun", "")
    env = {
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "HOME": str(tmp_path),
        **SLURM_ENV,
        "SLURM_JOB_NAME": "ctx128k",
    }
    proc = subprocess.Popen(
        ["bash", str(SLURM_SBATCH), "recipe=x"], env=env, cwd=tmp_path, stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 30
        while not (log / "srun.args").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.2)
        proc.send_signal(signal.SIGUSR1)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert (log / "srun.signal").read_text().strip() == "USR1"  # passed on to srun, hence to torchrun
    assert (log / "scontrol.args").read_text().split() == ["requeue", "4242"]
    args = (log / "srun.args").read_text().split()
    assert args[args.index("usp.train") + 1 :] == [
        "run_name=ctx128k",
        "recipe=x",
    ]  # the job's name: its run dir
    assert args[args.index("--signals-to-handle") + 1] == commands.SIGNALS_TO_HANDLE


def test_sbatch_script_without_signal_does_not_requeue_and_keeps_the_exit_status(tmp_path):
    bin_dir, log = tmp_path / "bin", tmp_path / "log"
    bin_dir.mkdir()
    log.mkdir()
    _stub(bin_dir, "srun", f"printf '%s\\n' \"$@\" > '{log}/srun.args'\nexit 3\n")
    _stub(
        bin_dir,
        "scontrol",
        f"[[ $1 == show ]] && printf 'gpu007\\n' || printf '%s\\n' \"$@\" > '{log}/scontrol.args'\n",
    )
    _stub(bin_dir, "torchrun", "")
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path), **SLURM_ENV, "SLURM_JOB_NAME": "usp"}
    proc = subprocess.run(
        ["bash", str(SLURM_SBATCH), "--max-restarts", "1", "recipe=x"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 3
    assert not (log / "scontrol.args").exists()
    args = (log / "srun.args").read_text().split()
    assert args[args.index("usp.train") + 1 :] == ["recipe=x"]  # the default job name names no run dir
    expected = commands.srun_command(
        ["recipe=x"], nodes=2, nproc_per_node=8, job_id="4242", head="gpu007", max_restarts=1
    )
    assert args == expected[1:]


def test_max_restarts_in_every_launcher(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    assert (
        cli.main(
            ["torchrun", "--cpu", "--nproc-per-node", "2", "--max-restarts", "1", *TINY2[:4], "--dry-run"]
        )
        == 0
    )
    printed = capsys.readouterr().out.split()
    assert printed[:6] == ["torchrun", "--standalone", "--nproc-per-node", "2", "--max-restarts", "1"]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _stub(bin_dir, "torchrun", f"printf '%s\\n' \"$@\" > '{tmp_path}/torchrun.args'\n")
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path)}
    proc = subprocess.run(
        ["bash", str(TORCHRUN_SH), "--cpu", "--nproc-per-node", "2", "--max-restarts", "1", *TINY2[:4]],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert ["torchrun", *(tmp_path / "torchrun.args").read_text().split()] == printed


# --- 6. errors said once ----------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_bad_setting_under_torchrun_is_said_once_every_time(tmp_path):
    """Five launches with a bad setting: the reason is in torchrun's summary (the root cause's error file)
    every time, and said once on stderr, not a traceback per rank. The last one fails inside the trainer."""
    cases = [("parallel.ulysses_degree=3", "parallel.ulysses_degree=3")] * 4 + [
        ("trainer.resume=/nonexistent/step_9", "trainer.resume='/nonexistent/step_9' does not exist")
    ]
    for i, (override, reason) in enumerate(cases):
        cmd = [
            str(TORCHRUN),
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "usp.train",
            *TINY2,
            override,
            f"hydra.run.dir={tmp_path / f'run{i}'}",
        ]
        proc = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=240)
        out = proc.stdout + proc.stderr
        assert proc.returncode != 0
        root_cause = out.split("Root Cause (first observed failure):", 1)[-1]
        assert reason in root_cause, f"launch {i}: the reason is not in torchrun's summary:\n{out[-3000:]}"
        assert out.count("usp-train: error:") == 1, out[-3000:]
        assert "Traceback" not in out.split("usp.train FAILED", 1)[0].replace(_torchrun_traceback(out), "")


def _torchrun_traceback(out: str) -> str:
    """torchrun's own traceback (the agent's ChildFailedError), printed before its summary."""
    start = out.find('Traceback (most recent call last):\n  File "' + str(TORCHRUN))
    return out[start : out.find("ChildFailedError", start)] if start >= 0 else ""


# --- 11. a stuck rank -------------------------------------------------------------------------------------
def test_watchdog_rules():
    dog = StepWatchdog(factor=5, minutes=1, min_seconds=2)
    for step in range(WARMUP_STEPS):
        dog.begin_step(step)
        dog._step_start -= 0.5  # each step took 0.5 s
        dog.end_step()
    dog.begin_step(WARMUP_STEPS)
    start = dog._step_start
    assert dog.check(start + 2.4) is None  # 4.8 x the median
    assert "more than trainer.watchdog_factor=5 x the median step (0.500 s)" in dog.check(start + 2.6)
    dog.end_step()
    assert dog.check(start + 59) is None and "no progress for 1.0 min" in dog.check(start + 62)
    assert StepWatchdog(factor=0, minutes=0, min_seconds=0).enabled is False
    with pytest.raises(ValueError, match="trainer.watchdog_factor=-1"):
        StepWatchdog(factor=-1, minutes=1, min_seconds=1)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_stopped_rank_fails_the_job_fast_with_stacks(tmp_path):
    run_dir = tmp_path / "run"
    args = [
        *TINY2,
        "trainer.max_steps=5000",
        "trainer.checkpoint_every=0",
        f"hydra.run.dir={run_dir}",
        "trainer.watchdog_factor=5",
        "trainer.watchdog_min_seconds=3",
    ]
    job = Job(args, tmp_path, ("--shutdown-timeout", "5"))
    try:
        _wait_for_step(job, run_dir, 8)
        stopped = time.monotonic()
        os.kill(job.workers()[1], signal.SIGSTOP)
        rc, out = job.wait(240)
        took = time.monotonic() - stopped
    finally:
        job.close()
    assert rc != 0
    assert took < 60, f"the job took {took:.0f} s to fail"
    assert "usp-train: watchdog: rank 0: step" in out, out[-4000:]
    assert "Python stacks of rank 0 follow" in out and "most recent call first" in out  # faulthandler's dump
    assert "usp-train: watchdog: rank 0" in out.split("Root Cause (first observed failure):", 1)[-1]


# --- 14. checks before the queue --------------------------------------------------------------------------
USER = ("model.path=/ckpt/m", "data.prepared_path=/data/d")


@pytest.fixture
def no_launch(monkeypatch):
    for var in (
        "SLURM_JOB_ID",
        "SLURM_NNODES",
        "SLURM_JOB_NODELIST",
        "SLURM_GPUS_ON_NODE",
        "SLURM_GPUS_PER_NODE",
    ):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.chdir(REPO)
    monkeypatch.setattr(cli.subprocess, "run", lambda *a, **k: pytest.fail(f"usp-launch ran {a}"))


def test_usp_launch_refuses_a_seq_len_the_layout_cannot_split(capsys, no_launch):
    assert cli.main(["slurm", "recipe=llama31_8b_128k", *USER, "trainer.seq_len=130000", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert (
        err.startswith("usp-launch: error: sequence length 130000 is not divisible by 32")
        and err.count("\n") == 1
    )
    assert "Use trainer.seq_len = 129984 or 130016" in err


def test_usp_launch_checks_memory_with_the_planners_figure(tmp_path, capsys, no_launch):
    from usp.plan import PRESETS

    model = tmp_path / "llama-3.1-8b"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(PRESETS["llama-3.1-8b"]))
    base = ["slurm", "recipe=llama31_8b_128k", f"model.path={model}", "data.prepared_path=/d"]
    assert cli.main([*base, "--dry-run"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("sbatch ") and err.startswith("usp-launch: memory: the planner estimates ")
    assert "GiB per GPU of 80 GiB (h100-80g)" in err
    assert cli.main([*base, "trainer.seq_len=1048576", "--dry-run"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "usp-launch: error: the planner estimates" in err and "run out of memory" in err
    assert cli.main([*base, "trainer.seq_len=1048576", "--skip-memory-check", "--dry-run"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("sbatch ") and "usp-launch: warning: the planner estimates" in err


# --- 10. bad data -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tok") / "tok"
    build_tiny_tokenizer(path)
    return path


def _prepare(tmp_path: Path, tok_dir: Path, src: Path, *extra: str) -> int:
    """``usp-prepare-data`` on ``src``; its exit status."""
    try:
        return prepare_main(
            [
                "--input",
                str(src),
                "--tokenizer",
                str(tok_dir),
                "--seq-len",
                "16",
                "--output",
                str(tmp_path / f"out-{src.stem}"),
                "--cache-dir",
                str(tmp_path / "hf"),
                *extra,
            ]
        )
    except SystemExit as e:
        return int(e.code or 0)


def test_non_string_text_is_an_error_or_skipped_and_counted(tmp_path, tok_dir, capsys):
    docs = [
        "the first document, long enough to fill a row or two",
        "line one\nline two of the third",
        "the fourth document",
        "   ",
    ]
    src = tmp_path / "mixed.jsonl"
    rows = [
        {"text": docs[0]},
        {"text": 42},
        {"text": docs[1]},
        {"text": docs[2]},
        {"text": docs[3]},
        {"text": ["a"]},
    ]
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    rc = _prepare(tmp_path, tok_dir, src)
    err = capsys.readouterr().err
    assert rc == 2
    assert f"the 'text' value of {src}:2 is of type int ('42'), not a string; 2 of 6 rows are not text" in err
    rc = _prepare(tmp_path, tok_dir, src, "--skip-non-text")
    assert rc == 0, capsys.readouterr().err
    assert "2 rows whose text is not a string skipped" in capsys.readouterr().out
    stats = json.loads((tmp_path / "out-mixed" / "usp_prepare.json").read_text())
    assert stats["extra"]["rows_not_text_skipped"] == 2 and stats["extra"]["documents_empty"] == 1
    # the documents kept are the strings, as they were: no quotes, no escaped newlines
    kept = load_text_sources([str(src)], cache_dir=tmp_path / "hf", skip_non_text=True)["text"]
    assert kept == [docs[0], docs[1], docs[2], docs[3]]
    tokenizer = build_tiny_tokenizer(tmp_path / "tok2")
    ids = [i for row in datasets.load_from_disk(str(tmp_path / "out-mixed"))["input_ids"] for i in row]
    expected = [
        t
        for d in docs[:3]
        for t in [
            tokenizer.bos_token_id,
            *tokenizer(d, add_special_tokens=False)["input_ids"],
            tokenizer.eos_token_id,
        ]
    ]
    assert ids == expected[: len(ids)]
    # streamed: the same rule, applied as the rows are read
    assert _prepare(tmp_path, tok_dir, src, "--streaming", "--overwrite") == 2
    assert "the 'text' value of row 1 is of type int ('42'), not a string" in capsys.readouterr().err
    assert _prepare(tmp_path, tok_dir, src, "--streaming", "--skip-non-text", "--overwrite") == 0
    streamed = datasets.load_from_disk(str(tmp_path / "out-mixed"))["input_ids"]
    assert [i for row in streamed for i in row] == ids
    assert (
        json.loads((tmp_path / "out-mixed" / "usp_prepare.json").read_text())["extra"][
            "rows_not_text_skipped"
        ]
        == 2
    )


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b'{"text": "fine"}\n{"text": "fine"}\n{"text": "cut\n', ":3: not valid JSON (Unterminated string"),
        (b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 8, ":1: not UTF-8 text (a binary file?)"),
    ],
    ids=["malformed-line", "binary"],
)
def test_a_file_that_does_not_parse_is_one_line_with_file_and_line(
    tmp_path, tok_dir, capsys, content, message
):
    src = tmp_path / "bad.jsonl"
    src.write_bytes(content)
    rc = _prepare(tmp_path, tok_dir, src)
    err = capsys.readouterr().err
    assert rc == 2
    lines = [line for line in err.splitlines() if "error" in line.lower()]
    assert len(lines) == 1 and lines[0].startswith(f"usp-prepare-data: error: data.inputs: {src}{message}"), (
        err
    )
    assert "Traceback" not in err
