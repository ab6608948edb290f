"""Atomic publication of files and directories: a reader sees the old content or the new one, never a mix.

Everything is written beside its target (same directory, so same filesystem) and renamed into place:

- :func:`write_file` / :func:`write_text`: write to a temp file, ``fsync`` it, ``os.replace`` it over the
  target, ``fsync`` the directory. A failure inside the write callback removes the temp file and leaves the
  target as it was.
- :func:`publish_dir`: rename a finished directory to its final name. An existing target is first moved aside
  and deleted only after the new one took its place; if the second rename fails the old one is moved back.
  A process killed between the two renames leaves the old copy whole under its aside name
  (``.<name>.old-<pid>-<ns>``) and the new one under its temp name; the next :func:`publish_dir` to that
  target moves the old copy back first (:func:`restore_aside`), so a user is never left with neither.
- :func:`write_dir`: build a directory through a callback in a temp sibling, then :func:`publish_dir` it; a
  failure inside the callback removes the temp directory and leaves the target untouched.

Temp names (:func:`temp_path`) are hidden siblings, ``.<name>.<tag>`` or ``.<name>.<tag>-<pid>-<ns>``, so a
crash leaves something clearly named that globs of the target's siblings (``step_*``, ``*.jsonl``) skip; a
fixed name is cleared by the next run, a unique one is ignored.

Local operations only: no collectives. Multi-rank callers publish from one rank after their own barrier.
One replacing publisher per target at a time (a checkpoint step, an export, ``--overwrite``); writers that may
race for the same target use ``replace=False``, where the rename itself decides who wins.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO

ASIDE_TAG = "old"
"""Tag of an older copy moved aside by :func:`publish_dir` (``.<name>.old-<pid>-<ns>``)."""


def temp_path(final: str | os.PathLike, tag: str = "tmp", *, unique: bool = True) -> Path:
    """The hidden sibling of ``final`` used while writing it: ``.<name>.<tag>`` when not ``unique`` (one
    writer at a time; the next run clears it), else ``.<name>.<tag>-<pid>-<ns>`` (concurrent writers)."""
    final = Path(final)
    suffix = f"-{os.getpid()}-{time.time_ns()}" if unique else ""
    return final.parent / f".{final.name}.{tag}{suffix}"


def fsync_dir(path: str | os.PathLike) -> None:
    """``fsync`` a directory so a rename inside it is durable; a no-op where the filesystem does not allow it
    (the rename is atomic all the same)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def write_file(path: str | os.PathLike, write: Callable[[IO[bytes]], object]) -> None:
    """Write ``path`` atomically: ``write(f)`` fills a binary temp file beside it, which is flushed, fsynced
    and renamed over ``path``; then the directory is fsynced. If ``write`` raises, the temp file is removed,
    ``path`` is unchanged and the error propagates."""
    path = Path(path)
    part = temp_path(path)
    try:
        with open(part, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(part, path)
    except BaseException:
        _remove(part)
        raise
    fsync_dir(path.parent)


def write_text(path: str | os.PathLike, text: str) -> None:
    """:func:`write_file` of ``text`` in UTF-8."""
    data = text.encode()
    write_file(path, lambda f: f.write(data))


def _occupied(path: Path) -> bool:
    return path.exists() and not (path.is_dir() and not path.is_symlink() and not any(path.iterdir()))


def _asides(final: Path) -> list[Path]:
    """Older copies of ``final`` moved aside by :func:`publish_dir`, newest first."""
    prefix = f".{final.name}.{ASIDE_TAG}-"

    def stamp(p: Path) -> int:
        tail = p.name[len(prefix) :].rpartition("-")[2]
        return int(tail) if tail.isdigit() else -1

    if not final.parent.is_dir():
        return []
    return sorted((p for p in final.parent.iterdir() if p.name.startswith(prefix)), key=stamp, reverse=True)


def restore_aside(final: str | os.PathLike) -> bool:
    """After a crash between :func:`publish_dir`'s two renames: if ``final`` is missing, move the newest copy
    set aside back into place (True); leftovers next to an existing ``final`` are deleted."""
    final = Path(final)
    asides = _asides(final)
    restored = False
    if asides and not os.path.lexists(final):
        os.replace(asides.pop(0), final)
        fsync_dir(final.parent)
        restored = True
    for stale in asides:
        _remove(stale)
    return restored


def publish_dir(tmp: str | os.PathLike, final: str | os.PathLike, *, replace: bool = True) -> None:
    """Rename the finished directory ``tmp`` to ``final`` (same filesystem) and fsync the parent.

    ``replace=True``: an existing ``final`` (directory or file) is moved aside first and deleted only once
    ``tmp`` took its place; if that rename fails, the old one is moved back and the error propagates.
    ``replace=False``: ``FileExistsError`` if ``final`` exists and is not an empty directory (checked by the
    rename itself, so two racing publishers cannot both win); ``tmp`` is then left where it is.
    """
    tmp, final = Path(tmp), Path(final)
    restore_aside(final)
    aside = None
    if replace and os.path.lexists(final):
        aside = temp_path(final, ASIDE_TAG)
        os.replace(final, aside)
    try:
        os.replace(tmp, final)
    except OSError as e:
        if aside is not None:
            os.replace(aside, final)
        elif not replace and (e.errno in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR) or _occupied(final)):
            raise FileExistsError(errno.EEXIST, f"{final} already exists", str(final)) from e
        raise
    fsync_dir(final.parent)
    if aside is not None:
        _remove(aside)


def write_dir(
    final: str | os.PathLike,
    write: Callable[[Path], object],
    *,
    replace: bool = True,
    tag: str = "tmp",
    unique: bool = True,
) -> bool:
    """Build directory ``final`` atomically: ``write(tmp)`` fills a fresh temp sibling (:func:`temp_path` with
    ``tag`` / ``unique``; a leftover of that name is cleared first), which :func:`publish_dir` then renames
    into place. If ``write`` raises, the temp directory is removed, ``final`` is untouched and the error
    propagates. With ``replace=False`` an occupied ``final`` is kept and this build dropped: returns False
    (another writer won); True when this build was published."""
    final = Path(final)
    tmp = temp_path(final, tag, unique=unique)
    _remove(tmp)
    tmp.mkdir(parents=True)
    try:
        write(tmp)
        try:
            publish_dir(tmp, final, replace=replace)
        except FileExistsError:
            if replace:
                raise
            _remove(tmp)
            return False
    except BaseException:
        _remove(tmp)
        raise
    return True
