"""Issue 22, the failure paths a newcomer hits (rows 1-6, 14-16, 19): every one ends in one
``usp-<tool>: error:`` line naming the setting, the path and the OS error; Ctrl-C keeps the work.

Unwritable directories: a ``chmod 555`` directory, or (as root, whom permissions do not stop) ``/sys``, where
nobody may create a file. A full disk: ``ulimit -f`` (Python ignores SIGXFSZ, so a write past the limit fails
with ``EFBIG``, as on a full filesystem with ``ENOSPC``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from usp.errors import check_writable_dir, one_line, report
from usp.tiny import build_tiny_llama

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable
TORCHRUN = Path(sys.executable).parent / "torchrun"
ONE_RANK = [
    "recipe=tiny",
    "parallel.ulysses_degree=1",
    "parallel.ring_degree=1",
    "parallel.node_size=1",
    "logging.progress_bar=false",
]


def _env() -> dict[str, str]:
    return {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
    }


def _run(
    args: list[str], cwd: Path, *, shell_prefix: str = "", timeout: float = 300
) -> subprocess.CompletedProcess:
    cmd = " ".join(f"'{a}'" for a in args)
    return subprocess.run(
        ["bash", "-c", f"{shell_prefix}exec {cmd}"],
        cwd=cwd,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _error_lines(text: str, prog: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(f"{prog}: error:")]


@pytest.fixture
def unwritable(tmp_path) -> Path:
    """A directory path this process cannot create anything under."""
    if os.geteuid() == 0:
        yield Path("/sys/usp-newcomer-test/run")
        return
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    yield locked / "run"
    locked.chmod(0o755)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("model") / "tiny")


# --- the shared mechanism --------------------------------------------------------------------------------
def test_one_line_names_the_os_error_a_wrapper_hid(capsys, tmp_path, monkeypatch):
    import usp.errors

    # no log file here (an earlier test in this process may have left a run's file handler on the root logger,
    # and then the line names that file instead of --verbose)
    monkeypatch.setattr(usp.errors, "_log_files", lambda: [])
    try:
        try:
            raise OSError(27, "File too large")
        except OSError as e:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598") from e
    except RuntimeError as err:
        assert "[Errno 27] File too large" in one_line(err)
        assert report("usp-x", err) == 1
    err_text = capsys.readouterr().err
    assert len(_error_lines(err_text, "usp-x")) == 1 and "Traceback" not in err_text
    assert "--verbose" in err_text  # where the traceback is
    try:
        raise ValueError("trainer.seq_len=3 is invalid")
    except ValueError as err:
        assert report("usp-x", err) == 2
        assert capsys.readouterr().err == "usp-x: error: trainer.seq_len=3 is invalid\n"
        assert report("usp-x", err, verbose=True) == 2
    err_text = capsys.readouterr().err
    assert "Traceback" in err_text and err_text.endswith("usp-x: error: trainer.seq_len=3 is invalid\n")
    assert report("usp-x", KeyboardInterrupt()) == 130


def test_writable_check_names_the_setting_the_path_and_the_errno(unwritable, tmp_path):
    check_writable_dir(tmp_path / "new" / "deeper", "hydra.run.dir")  # creatable: fine, and nothing is left
    assert not (tmp_path / "new").exists()
    with pytest.raises(
        ValueError,
        match=r"trainer.checkpoint_dir='.*usp-newcomer-test/run|trainer.checkpoint_dir='.*locked/run",
    ):
        check_writable_dir(unwritable, "trainer.checkpoint_dir")
    try:
        check_writable_dir(unwritable, "trainer.checkpoint_dir")
    except ValueError as e:
        assert "[Errno 13] Permission denied" in str(e) or "[Errno 30]" in str(e), e


# --- row 1: a typed model.path never becomes a random tiny model -------------------------------------------
def test_a_mistyped_model_path_is_an_error_not_a_random_model(tmp_path):
    from usp.config.compose import compose_config
    from usp.train.checks import build_tiny_if_asked

    typo = tmp_path / "smollm2-135m-instruc"
    cfg = compose_config([*ONE_RANK, f"model.path={typo}"], run_dir=str(tmp_path / "run"))
    with pytest.raises(
        ValueError, match=r"model.path='.*smollm2-135m-instruc' does not exist.*only at its own path"
    ):
        build_tiny_if_asked(cfg, 0)
    assert not typo.exists()
    cfg = compose_config(ONE_RANK, run_dir=str(tmp_path / "run"))  # the default path: built as before
    build_tiny_if_asked(cfg, 0)
    assert (tmp_path / "run" / "tiny-llama" / "config.json").is_file()


# --- row 2: Ctrl-C = SIGINT to the process groups of a torchrun job -----------------------------------------
def test_stop_request_takes_sigint_like_sigterm():
    from usp.train.signals import StopRequest

    before = signal.getsignal(signal.SIGINT)  # Python's handler; SIG_IGN when pytest runs in the background
    with StopRequest() as stop:
        os.kill(os.getpid(), signal.SIGINT)  # no KeyboardInterrupt: recorded, acted on at the step boundary
        time.sleep(0.05)
        assert stop.received == signal.SIGINT and stop.agreed(torch.device("cpu"))
    assert signal.getsignal(signal.SIGINT) is before  # restored


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_ctrl_c_under_torchrun_checkpoints_says_one_line_and_exits_like_sigterm(tmp_path):
    from tests.test_faults_launch import TINY2, Job, _steps, _wait_for_step

    run_dir = tmp_path / "run"
    job = Job([*TINY2, "trainer.max_steps=400", f"hydra.run.dir={run_dir}"], tmp_path)
    try:
        _wait_for_step(job, run_dir, 13)
        groups = {job.proc.pid, *job.workers().values()}  # the terminal's group and the workers' own
        for pgid in groups:
            os.killpg(pgid, signal.SIGINT)
        rc, out = job.wait(300)
    finally:
        job.close()
    assert rc != 0
    stopped_at = _steps(run_dir)[-1]["step"]
    assert 13 <= stopped_at < 400
    assert (run_dir / "checkpoints" / f"step_{stopped_at}" / "COMPLETE").is_file(), out[-3000:]
    assert f"stopped by SIGINT after step {stopped_at}" in (run_dir / "usp-train.log").read_text()
    assert "KeyboardInterrupt" not in out, out[-3000:]  # no rank interrupted inside a collective
    # one line from the job (rank 0), as for SIGTERM; torchrun's own report of the signal it got is its own
    assert out.count(f"stopped by SIGINT after step {stopped_at}: checkpoint ") == 1, out[-3000:]
    assert "exiting with status 75" in out


# --- row 3: usp-eval on a damaged model.safetensors -----------------------------------------------------------
def test_eval_on_a_truncated_safetensors_names_model_path(tmp_path):
    import shutil

    from usp.config.compose import compose_eval_config
    from usp.eval.runner import prepare
    from usp.model import load_causal_lm

    model = tmp_path / "hf"
    shutil.copytree(build_tiny_llama(tmp_path / "tiny"), model)
    weights = model / "model.safetensors"
    data = weights.read_bytes()
    cfg = compose_eval_config(
        [*ONE_RANK, f"model.path={model}", "eval=passkey"], run_dir=str(tmp_path / "run")
    )
    weights.write_bytes(data[:5])  # the header itself cut: "incomplete metadata"
    with pytest.raises(
        ValueError, match=r"model.path='.*hf': model.safetensors: .*could not read the weights"
    ):
        prepare(cfg, 1, torch.device("cpu"))
    weights.write_bytes(data[: len(data) // 2])  # the tensors cut
    with pytest.raises(ValueError, match=r"model.path='.*hf'.*could not read the weights"):
        prepare(cfg, 1, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"model.path='.*hf'.*could not read the weights"):
        load_causal_lm(model)  # the load itself (a checkpoint damaged after the checks) says it the same way


# --- rows 4 and 6: directories that cannot be written -------------------------------------------------------
def test_unwritable_checkpoint_dir_is_one_line_naming_it(tmp_path, unwritable):
    proc = _run(
        [
            PY,
            "-m",
            "usp.train",
            *ONE_RANK,
            f"hydra.run.dir={tmp_path / 'run'}",
            f"trainer.checkpoint_dir={unwritable}",
        ],
        tmp_path,
    )
    lines = _error_lines(proc.stderr, "usp-train")
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
    assert f"trainer.checkpoint_dir='{unwritable}' cannot be written: [Errno" in lines[0], lines
    assert "hydra.run.dir" not in lines[0] and "Traceback" not in proc.stderr


def test_unwritable_run_dir_is_refused_by_usp_train_and_by_the_dry_run(tmp_path, unwritable, capsys):
    from usp.launch import cli

    proc = _run([PY, "-m", "usp.train", *ONE_RANK, f"hydra.run.dir={unwritable}"], tmp_path)
    lines = _error_lines(proc.stderr, "usp-train")
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
    assert (
        f"hydra.run.dir='{unwritable}' cannot be written: [Errno" in lines[0]
        and "Traceback" not in proc.stderr
    )
    assert (
        cli.main(
            [
                "torchrun",
                "--cpu",
                "--nproc-per-node",
                "4",
                "recipe=tiny",
                f"hydra.run.dir={unwritable}",
                "--dry-run",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert f"usp-launch: error: hydra.run.dir='{unwritable}' cannot be written: [Errno" in err, err


# --- row 5: the disk fills up during a checkpoint -----------------------------------------------------------
def test_a_full_disk_during_a_save_is_one_line_with_errno_and_path_also_in_the_log(tmp_path, tiny_dir):
    run_dir = tmp_path / "run"
    # 1024-byte blocks: the data cache and the logs fit; the checkpoint (weights + AdamW states) does not
    proc = _run(
        [
            PY,
            "-m",
            "usp.train",
            *ONE_RANK,
            "model=hf",
            f"model.path={tiny_dir}",
            "model.dtype=float32",
            f"hydra.run.dir={run_dir}",
            "trainer.max_steps=2",
            "trainer.checkpoint_every=1",
        ],
        tmp_path,
        shell_prefix="ulimit -f 300; ",
    )
    lines = _error_lines(proc.stderr, "usp-train")
    assert proc.returncode == 1 and len(lines) == 1, proc.stderr[-3000:]
    assert "trainer.checkpoint_dir=" in lines[0] and "[Errno 27] File too large" in lines[0], lines
    assert str(run_dir / "checkpoints" / ".tmp-step_1") in lines[0] and "Traceback" not in proc.stderr
    log = (run_dir / "usp-train.log").read_text()
    assert "[Errno 27] File too large" in log and "Traceback" in log  # the whole story is in the log
    assert not (run_dir / "checkpoints" / "step_1").exists()  # nothing half-written published


# --- row 14: eval=ppl on a real model needs documents -------------------------------------------------------
def test_ppl_on_a_real_model_needs_eval_inputs(tmp_path, tiny_dir):
    from transformers import LlamaConfig

    from usp.config.compose import compose_eval_config
    from usp.eval.ppl import check_ppl_inputs
    from usp.model import check_model_dir

    cfg = compose_eval_config([*ONE_RANK, "model.path=/ckpt/smollm2", "eval=ppl"], run_dir=str(tmp_path))
    with pytest.raises(ValueError, match=r"eval=ppl needs held-out documents for model.path='/ckpt/smollm2'"):
        check_ppl_inputs(cfg, LlamaConfig())
    check_ppl_inputs(cfg, check_model_dir(tiny_dir))  # the demo model: its own corpus
    with_inputs = compose_eval_config(
        [*ONE_RANK, "model.path=/ckpt/smollm2", "eval=ppl", "eval.inputs=[/d.jsonl]"]
    )
    check_ppl_inputs(with_inputs, LlamaConfig())


# --- row 15: a damaged eval.json -----------------------------------------------------------------------------
def test_a_damaged_eval_json_is_kept_aside_and_said(tmp_path, capsys):
    from usp.eval.report import write_json

    (tmp_path / "eval.json").write_text('{"passkey": {"result": {"cells": [')
    write_json(tmp_path, "ppl", {"result": 1})
    kept = list(tmp_path.glob("eval.json.damaged-*"))
    assert len(kept) == 1 and kept[0].read_text() == '{"passkey": {"result": {"cells": ['
    assert json.loads((tmp_path / "eval.json").read_text()) == {"ppl": {"result": 1}}
    err = capsys.readouterr().err
    assert "did not parse" in err and str(kept[0]) in err


# --- rows 16 and 19: usp-prepare-data's errors --------------------------------------------------------------
def test_prepare_data_errors_come_without_the_usage(tmp_path, capsys):
    from usp.data.cli import main
    from usp.data.sources import NON_TEXT_FIX

    rc = main(
        [
            "--input",
            str(tmp_path / "missing.jsonl"),
            "--tokenizer",
            str(tmp_path),
            "--seq-len",
            "1K",
            "--output",
            str(tmp_path / "out"),
        ]
    )
    err = capsys.readouterr().err
    assert rc == 2 and "usage:" not in err and len(_error_lines(err, "usp-prepare-data")) == 1, err
    assert (
        "data.text_field" in NON_TEXT_FIX
        and "--text-field" in NON_TEXT_FIX
        and "data.prepared_path" in NON_TEXT_FIX
    )
