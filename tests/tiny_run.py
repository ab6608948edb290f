"""One run of the tiny recipe under torchrun (4 CPU processes: 2 emulated nodes of 2), shared by the tests that
need it: the demo test checks its metrics, checkpoints and export; the Ray test's run must equal its losses."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TORCHRUN = Path(sys.executable).parent / "torchrun"
STEPS = 8
OVERRIDES = (
    "recipe=tiny",
    "logging.progress_bar=false",
    f"trainer.max_steps={STEPS}",
    "trainer.checkpoint_every=3",
)
"""The run's overrides; a run that adds only ``trainer.export_hf=false`` and its own run dir has the same losses."""


@dataclass(frozen=True)
class TinyRun:
    run_dir: Path
    returncode: int
    output: str  # stdout, then stderr


def launch_env() -> dict[str, str]:
    """The environment of a launched job: one thread per process (2 cores), this checkout importable."""
    return {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
    }


def run_tiny_under_torchrun(root: Path) -> TinyRun:
    run_dir = root / "run"
    cmd = [str(TORCHRUN), "--standalone", "--nproc-per-node", "4", "-m", "usp.train", *OVERRIDES]
    proc = subprocess.run(
        [*cmd, f"hydra.run.dir={run_dir}"],
        cwd=root,
        env=launch_env(),
        capture_output=True,
        text=True,
        timeout=840,
    )
    return TinyRun(run_dir, proc.returncode, proc.stdout + proc.stderr)
