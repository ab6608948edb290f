"""An exclusive lock on a directory, held by one process for the life of a job.

:class:`DirLock` is a non-blocking ``fcntl.flock`` on ``<dir>/.usp.lock``. The kernel drops the lock when the
holder dies, however it dies, so a killed job never leaves the directory locked; the file names the holder's
host and pid, which a refusal quotes. ``flock`` works across nodes on NFS (Linux maps it to POSIX locks) and
on Lustre mounted with ``-o flock``; where the filesystem has no locks the lock is skipped with a warning.
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

from usp.errors import path_error

logger = logging.getLogger(__name__)

LOCK_FILE = ".usp.lock"


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
