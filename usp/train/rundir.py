"""One run per directory: the start-up check of the run dir and its claim (check, lock, marker).

A run dir (``hydra.run.dir``) belongs to one run at a time and to usp only:

- :func:`check_run_dir` refuses, before any work, a non-empty directory that is not a usp run (it names what
  it found). A usp run dir carries :data:`RUN_MARKER`; a directory without it is accepted only if it holds
  nothing but what a launch writes before the trainer starts (Hydra's ``.hydra/`` and log, the lock), or is
  the run dir of an older usp (only usp's own names, and usp checkpoints or usp's ``layout.json``).
- :func:`claim_run_dir` takes a :class:`usp.train.dir_lock.DirLock` (rank 0, for the life of the job) on the
  run dir, and on the checkpoint dir when it lies elsewhere, and marks the run dir as usp's.

Which checkpoints a run may touch (never another run's) is :mod:`usp.train.resume`'s rule
(:func:`usp.train.resume.check_checkpoints_of_other_runs`).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from pathlib import Path

from usp.atomic import write_text
from usp.config import TrainConfig
from usp.errors import check_writable_dir
from usp.train.dir_lock import LOCK_FILE, DirLock

logger = logging.getLogger(__name__)

RUN_MARKER = "usp-run.json"
"""Written into the run dir at the first start: ``{"format": "usp-run", "created", "host", "pid"}``."""
LAUNCH_NAMES: frozenset[str] = frozenset({".hydra", "usp-train.log", LOCK_FILE})
"""What may be in a run dir before the trainer starts: Hydra's output dir and job log (rank 0 writes them
before ``run``), and the lock file."""
USP_NAMES: frozenset[str] = frozenset(
    {
        RUN_MARKER,
        "checkpoints",
        "metrics.jsonl",
        "metrics.jsonl.tmp",
        "layout.json",
        "hf",
        ".hf.tmp-export",
        "data_cache",
        "tiny-llama",
        "wandb",
    }
)
"""What usp itself writes into a run dir (default paths)."""


def checkpoint_root(cfg: TrainConfig) -> Path:
    """``trainer.checkpoint_dir``, default ``<run dir>/checkpoints``."""
    return Path(cfg.trainer.checkpoint_dir or Path(cfg.run_dir) / "checkpoints")


# --- the run-dir check -----------------------------------------------------------------------------------
def _own_leftover(name: str) -> bool:
    """A temp of one of usp's own names left by an interrupted atomic write (``.<name>.<tag>[-<pid>-<ns>]``,
    :func:`usp.atomic.temp_path`): counted as usp's, so a crash never makes a run dir look foreign."""
    return any(name.startswith(f".{own}.") for own in USP_NAMES)


def _is_older_usp_run(run_dir: Path, names: set[str]) -> bool:
    """A run dir of a usp version without the marker: only usp's names, and usp's layout.json or checkpoints."""
    if not names <= USP_NAMES | LAUNCH_NAMES:
        return False
    try:
        layout = json.loads((run_dir / "layout.json").read_text())
        if isinstance(layout, dict) and "ulysses_degree" in layout:
            return True
    except (OSError, ValueError):
        pass
    return any((run_dir / "checkpoints").glob("step_*/COMPLETE"))


def check_run_dir(run_dir: str | os.PathLike) -> None:
    """``ValueError`` (naming ``hydra.run.dir`` and what was found) if ``run_dir`` exists, is not empty and is
    not a usp run dir. Reads only."""
    run_dir = Path(run_dir)
    if not run_dir.exists():
        return
    if not run_dir.is_dir():
        raise ValueError(f"hydra.run.dir={str(run_dir)!r} is a file; point hydra.run.dir at a directory.")
    names = {p.name for p in run_dir.iterdir() if not _own_leftover(p.name)}
    if RUN_MARKER in names or names <= LAUNCH_NAMES or _is_older_usp_run(run_dir, names):
        return
    foreign = sorted(names - LAUNCH_NAMES)
    shown = ", ".join(foreign[:8]) + (f" and {len(foreign) - 8} more" if len(foreign) > 8 else "")
    raise ValueError(
        f"hydra.run.dir={str(run_dir)!r} is not empty and is not a usp run dir (no {RUN_MARKER}; found: "
        f"{shown}). usp would write metrics.jsonl, layout.json, checkpoints/ and hf/ there, over what is there. "
        f"Choose a new or empty directory (hydra.run.dir=...)."
    )


def write_run_marker(run_dir: Path) -> None:
    """Mark ``run_dir`` as a usp run dir (once; an existing marker is kept)."""
    marker = run_dir / RUN_MARKER
    if marker.exists():
        return
    info = {
        "format": "usp-run",
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "host": socket.gethostname(),
        "pid": os.getpid(),
    }
    write_text(marker, json.dumps(info) + "\n")


class RunDirClaim:
    """What :func:`claim_run_dir` returns: the locks a rank holds (none on ranks > 0); a context manager."""

    def __init__(self, locks: list[DirLock]) -> None:
        self.locks = locks

    def release(self) -> None:
        for lock in reversed(self.locks):
            lock.release()
        self.locks = []

    def __enter__(self) -> RunDirClaim:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def claim_run_dir(cfg: TrainConfig, rank: int) -> RunDirClaim:
    """Start-up, before any other work: on rank 0 check the run dir (:func:`check_run_dir`) and the export
    target (``<run dir>/hf``), lock the run dir (and the checkpoint dir when it lies outside it), and mark the
    run dir as usp's. Other ranks do nothing (wrap the call in ``on_every_rank`` so they all raise rank 0's
    error). Raises ``ValueError`` naming the setting and the fix: ``hydra.run.dir`` and ``trainer.checkpoint_dir``
    must be writable (:func:`usp.errors.check_writable_dir`: the path and the OS error are named)."""
    if rank != 0:
        return RunDirClaim([])  # the directories' checks and errors are rank 0's
    from usp.train.export import check_export_dir

    run_dir = Path(cfg.run_dir)
    check_writable_dir(run_dir, "hydra.run.dir")
    check_writable_dir(checkpoint_root(cfg), "trainer.checkpoint_dir")
    check_run_dir(run_dir)
    if cfg.trainer.export_hf:
        check_export_dir(run_dir / "hf")
        check_export_dir(run_dir / "adapter")
    locks = [DirLock(run_dir).acquire()]
    try:
        ckpt_root = checkpoint_root(cfg).resolve()
        if not ckpt_root.is_relative_to(run_dir.resolve()):
            locks.append(DirLock(ckpt_root, "trainer.checkpoint_dir").acquire())
        write_run_marker(run_dir)
    except BaseException:
        RunDirClaim(locks).release()
        raise
    return RunDirClaim(locks)
