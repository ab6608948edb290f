"""One run per directory: the start-up check of the run dir, its lock, and which checkpoints a run may touch.

A run dir (``hydra.run.dir``) belongs to one run at a time and to usp only:

- :func:`check_run_dir` refuses, before any work, a non-empty directory that is not a usp run (it names what
  it found). A usp run dir carries :data:`RUN_MARKER`; a directory without it is accepted only if it holds
  nothing but what a launch writes before the trainer starts (Hydra's ``.hydra/`` and log, the lock), or is
  the run dir of an older usp (only usp's own names, and usp checkpoints or usp's ``layout.json``).
- :class:`DirLock` is an exclusive ``fcntl.flock`` on ``<dir>/.usp.lock`` taken by rank 0 for the life of the
  job (the run dir, and the checkpoint dir when it lies elsewhere). The kernel drops the lock when the holder
  dies, however it dies, so a killed job never leaves the directory locked; the file names the holder's host
  and pid, which the refusal quotes.
- :func:`check_checkpoints_of_other_runs`: a fresh start (or a resume from elsewhere) never runs in a
  checkpoint dir that holds another run's checkpoints, since keep-last pruning, ``resume=auto`` after a crash
  and the export would then mix the two runs. It is refused with the command that moves them aside.

The checkpoint dir must be on a filesystem every rank sees; ``flock`` works across nodes on NFS (Linux maps it
to POSIX locks) and on Lustre mounted with ``-o flock``. Where the filesystem has no locks the run goes on
with a warning.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import time
from pathlib import Path

from usp.atomic import write_text
from usp.config import TrainConfig
from usp.errors import check_writable_dir, path_error

logger = logging.getLogger(__name__)

RUN_MARKER = "usp-run.json"
"""Written into the run dir at the first start: ``{"format": "usp-run", "created", "host", "pid"}``."""
LOCK_FILE = ".usp.lock"
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


# --- the lock --------------------------------------------------------------------------------------------
class DirLock:
    """An exclusive, non-blocking ``flock`` on ``<directory>/.usp.lock``, held until :meth:`release` (or the
    holder's death). :meth:`acquire` raises ``ValueError`` quoting the holder's host and pid if another process
    holds it. A context manager."""

    def __init__(self, directory: str | os.PathLike, setting: str = "hydra.run.dir") -> None:
        self.directory = Path(directory)
        self.path = self.directory / LOCK_FILE
        self.setting = setting
        self._fd: int | None = None

    def acquire(self) -> DirLock:
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:  # a directory this user cannot create or write: the setting, the path, the errno
            raise path_error(self.setting, self.directory, e) from e
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise ValueError(
                f"{self.setting}={str(self.directory)!r} is in use by another run ({self._holder()}): two jobs in "
                f"one directory would delete and resume each other's checkpoints. Wait for that job to end (its "
                f"lock goes when it exits or dies), or give this run its own directory ({self.setting}=...)."
            ) from None
        except OSError as e:
            if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                os.close(fd)
                raise
            logger.warning(
                "%s: the filesystem has no file locks (%s); one run per directory is not enforced",
                self.path,
                e,
            )
        info = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "since": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
        self._fd = fd
        return self

    def _holder(self) -> str:
        try:
            info = json.loads(self.path.read_text())
            return f"held by pid {info['pid']} on host {info['host']} since {info['since']}"
        except (OSError, ValueError, KeyError, TypeError):
            return f"{self.path} is locked; its holder did not record itself yet"

    def release(self) -> None:
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            os.ftruncate(fd, 0)
        finally:
            os.close(fd)  # closing the descriptor drops the flock

    def __enter__(self) -> DirLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


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


# --- whose checkpoints ---------------------------------------------------------------------------------
def _step_dirs(ckpt_root: Path) -> list[tuple[int, Path]]:
    found = []
    if ckpt_root.is_dir():
        for child in ckpt_root.iterdir():
            if child.is_dir() and child.name.startswith("step_") and child.name[5:].isdigit():
                found.append((int(child.name[5:]), child))
    return sorted(found)


def check_checkpoints_of_other_runs(
    ckpt_root: Path, resume_from: Path | None, *, run_dir: Path | None = None
) -> None:
    """``ValueError`` if this run would share ``ckpt_root`` with checkpoints it did not resume from.

    ``resume_from=None`` (a fresh start): any ``step_<N>`` there belongs to an earlier run. A resume from a
    checkpoint outside ``ckpt_root`` (a new stage): the same. A resume from ``ckpt_root/step_<N>``: the ones
    with a higher step belong to an abandoned branch (``resume=auto`` would take them after a crash, and
    keep-last would keep them instead of this run's). When ``ckpt_root`` is ``<run_dir>/checkpoints`` the
    advice is to move the whole run dir aside (its metrics.jsonl and hf/ belong to the old run too).
    """
    existing = _step_dirs(ckpt_root)
    if resume_from is not None:
        resume_from = Path(resume_from).resolve()
        if resume_from.parent == ckpt_root.resolve():
            step = int(resume_from.name[5:]) if resume_from.name[5:].isdigit() else -1
            existing = [(s, p) for s, p in existing if s > step]
    if not existing:
        return
    names = ", ".join(p.name for _, p in existing[-4:]) + (" ..." if len(existing) > 4 else "")
    inside = run_dir is not None and ckpt_root.resolve().parent == Path(run_dir).resolve()
    moved = Path(run_dir) if inside else ckpt_root
    aside = f"mv {moved} {moved}.old-{time.strftime('%Y%m%d-%H%M%S')}"
    start = "a fresh start" if resume_from is None else f"resuming from {resume_from}"
    raise ValueError(
        f"{start} would share trainer.checkpoint_dir={str(ckpt_root)!r} with checkpoints this run did not "
        f"come from ({names}): keep-last would prune them or this run's, and trainer.resume=auto after a crash "
        f"would continue the wrong run. Move the earlier run aside ({aside}), or give this run its own "
        f"directory (hydra.run.dir=... or trainer.checkpoint_dir=...), or continue them with trainer.resume=auto."
    )


def describe_skipped(skipped: list[tuple[Path, list[str]]]) -> str:
    """One line per checkpoint that failed verification, for logs and errors."""
    return "; ".join(f"{path.name}: {', '.join(problems)}" for path, problems in skipped)
