"""How every entry point ends a failure: one ``usp-<tool>: error: ...`` line, the traceback kept elsewhere.

The one mechanism that ``usp-train``, ``usp-eval``, ``usp-launch``, ``usp-plan``, ``usp-prepare-data`` and
``usp-bench`` share (no per-tool copies):

- :func:`pop_verbose` takes ``--verbose`` off the command line (every tool accepts it, Hydra apps included);
- :func:`report` prints the one line on stderr (once: rank 0 of a launched job), writes the full traceback
  to the log files of the root logger (``<run dir>/usp-train.log`` / ``usp-eval.log`` under Hydra) and, with
  ``--verbose``, to stderr as well; it returns the exit status: 2 for a bad setting (``ValueError``), 130 for
  an interrupt (SIGINT before the training loop could checkpoint), 1 for anything else;
- :func:`one_line` is that line's text: a ``ValueError`` is its message (it names the setting and the fix); an
  ``OSError`` anywhere in the exception's chain is quoted with its errno, strerror and path, however deep it
  was wrapped (a torch writer that only says "unexpected pos" still shows ``[Errno 27] File too large``);
- :func:`path_error` / :func:`check_writable_dir` build the message for a path a setting names: the setting,
  the path, the OS error and the fix, before any work where possible (preflight) and at the failing write
  otherwise.

Pure standard library: the composing tools import it without torch.
"""

from __future__ import annotations

import errno
import logging
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

VERBOSE_FLAG = "--verbose"
"""Print the full traceback of a failure on stderr too (it always goes to the log file where there is one)."""
EXIT_BAD_SETTING = 2
EXIT_INTERRUPTED = 130
EXIT_FAILED = 1
REPORT_GRACE_S = 5.0
"""How long ranks > 0 of a launched job wait before reporting an error that rank 0 reports too: rank 0 is
the first to fail, the launcher stops the others, and the reason is said once."""


def pop_verbose(argv: list[str]) -> bool:
    """Remove every ``--verbose`` from ``argv`` (in place); whether there was one."""
    found = VERBOSE_FLAG in argv
    argv[:] = [a for a in argv if a != VERBOSE_FLAG]
    return found


def os_error_text(err: OSError) -> str:
    """``[Errno 28] No space left on device: '/ckpt/step_10/dcp/__0_0.distcp'`` (errno, strerror, path)."""
    if err.errno is None:
        return f"{type(err).__name__}: {err}"
    text = f"[Errno {err.errno}] {err.strerror or os.strerror(err.errno)}"
    if err.filename is not None:
        text += f": {str(err.filename)!r}"
    return text


def find_os_error(err: BaseException) -> OSError | None:
    """The first ``OSError`` with an errno in ``err``'s chain (itself, ``__cause__``, ``__context__``, and the
    per-rank failures of a ``torch.distributed.checkpoint`` ``CheckpointException``)."""
    seen: set[int] = set()
    todo: list[BaseException] = [err]
    while todo:
        e = todo.pop(0)
        if id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno is not None:
            return e
        todo.extend(x for x in (e.__cause__, e.__context__) if x is not None)
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            todo.extend(v[0] if isinstance(v, tuple) else v for v in failures.values() if v is not None)
    return None


def one_line(err: BaseException) -> str:
    """The text after ``usp-<tool>: error:``. A ``ValueError`` is said as it is (it names the setting and the
    fix); anything else with its type, and with the OS error of its chain when the message lacks it."""
    if isinstance(err, KeyboardInterrupt):
        return "interrupted (SIGINT) before a checkpoint could be taken; nothing was saved since the last one"
    message = str(err).strip() or type(err).__name__
    if not isinstance(err, ValueError) and not isinstance(err, OSError):
        message = f"{type(err).__name__}: {message}"
    os_err = find_os_error(err)
    if os_err is not None and f"Errno {os_err.errno}" not in message:
        message = f"{message} (cause: {os_error_text(os_err)})"
    return message


def exit_status(err: BaseException) -> int:
    if isinstance(err, KeyboardInterrupt):
        return EXIT_INTERRUPTED
    return EXIT_BAD_SETTING if isinstance(err, ValueError) else EXIT_FAILED


def _log_files() -> list[logging.Handler]:
    return [
        h
        for h in logging.getLogger().handlers
        if isinstance(h, logging.FileHandler) and h.baseFilename != os.devnull
    ]


def log_traceback(err: BaseException, prog: str) -> list[str]:
    """Write ``err``'s full traceback to the root logger's file handlers only (not the console); their paths."""
    handlers = _log_files()
    if not handlers:
        return []
    record = logging.LogRecord(
        prog,
        logging.ERROR,
        __file__,
        0,
        "%s: error: %s",
        (prog, one_line(err)),
        (type(err), err, err.__traceback__),
    )
    for h in handlers:
        h.handle(record)
        h.flush()
    return [h.baseFilename for h in handlers]


def report(
    prog: str,
    err: BaseException,
    *,
    verbose: bool = False,
    record: Callable[[BaseException], None] | None = None,
) -> int:
    """Say ``err`` once as ``<prog>: error: <one line>`` and return the exit status (:func:`exit_status`).

    The traceback goes to the log files (:func:`log_traceback`) and, with ``verbose``, to stderr. Under a
    launcher (``RANK`` set) only rank 0 prints it; the other ranks wait :data:`REPORT_GRACE_S` first (so rank
    0 is the first to fail and the launcher stops them) and then only ``record`` it: ``record`` (torchrun's
    error file, whose failure summary shows it) gets the error on every rank, so the reason is never lost.
    """
    rank = int(os.environ.get("RANK", "0") or 0)
    if rank != 0:
        time.sleep(REPORT_GRACE_S)
    if record is not None:
        record(err)
    files = log_traceback(err, prog) if not isinstance(err, ValueError) or verbose else []
    if rank != 0:  # rank 0 says it; this rank's reason is in the launcher's error file (``record``)
        return exit_status(err)
    line = f"{prog}: error: {one_line(err)}"
    if verbose:
        traceback.print_exception(type(err), err, err.__traceback__, file=sys.stderr)
    elif not isinstance(err, (ValueError, KeyboardInterrupt)):
        line += f" [traceback in {files[0]}]" if files else f" [rerun with {VERBOSE_FLAG} for the traceback]"
    print(line, file=sys.stderr, flush=True)
    return exit_status(err)


def guarded(prog: str, fn: Callable[[], int | None], *, verbose: bool = False) -> int:
    """Run an argparse tool's body: its failures end in :func:`report`'s one line and exit status; argparse's
    own exits (``--help``, a bad flag) pass through."""
    try:
        return int(fn() or 0)
    except (Exception, KeyboardInterrupt) as err:  # noqa: BLE001 - the entry point's one report of a failure
        return report(prog, err, verbose=verbose)


# --- paths that settings name -------------------------------------------------------------------------
def _hint(err: OSError) -> str:
    return {
        errno.ENOSPC: "free space there or point it at a filesystem with room",
        errno.EFBIG: "the file size limit (ulimit -f) or the filesystem's maximum file size was reached; raise it "
        "or point it elsewhere",
        errno.EDQUOT: "the disk quota is exhausted; free space or point it elsewhere",
        errno.EROFS: "the filesystem is read-only; point it at a writable directory",
    }.get(err.errno or 0, "point it at a directory this user can write")


def path_error(
    setting: str, path: str | os.PathLike, err: OSError, doing: str = "cannot be written"
) -> ValueError:
    """``ValueError`` (a setting to change, exit 2) naming ``setting``, ``path`` and the OS error, with the fix."""
    return ValueError(f"{setting}={str(path)!r} {doing}: {os_error_text(err)}; {_hint(err)} ({setting}=...).")


class SettingPathError(OSError):
    """An OS error while writing under a path a setting names (a disk that filled up during a checkpoint):
    ``str()`` is the whole message, naming the setting, the path and the errno; ``errno`` is the OS error's."""

    def __init__(self, setting: str, path: str | os.PathLike, err: OSError, doing: str) -> None:
        super().__init__(err.errno, err.strerror, str(path))
        self.message = f"{setting}={str(path)!r}: {doing} failed: {os_error_text(err)}; {_hint(err)}."

    def __str__(self) -> str:
        return self.message


def as_setting_path_error(
    err: BaseException, setting: str, path: str | os.PathLike, doing: str
) -> BaseException:
    """``err`` as a :class:`SettingPathError` when an OS error is in its chain (else ``err`` itself): the
    errno that a wrapper (torch's zip writer: "unexpected pos") hid, with the setting and the path."""
    os_err = find_os_error(err)
    if os_err is None or isinstance(err, SettingPathError):
        return err
    return SettingPathError(setting, path, os_err, doing)


def check_writable_dir(path: str | os.PathLike, setting: str) -> None:
    """``ValueError`` (:func:`path_error`) unless ``path`` is, or could be created as, a directory this process
    can write: its nearest existing ancestor is tried with a real temp file (permissions, read-only mounts and
    ACLs all count). Creates nothing that stays."""
    p = Path(path).absolute()
    probe = p
    while not probe.exists():
        if probe.parent == probe:
            break
        probe = probe.parent
    if not probe.is_dir():
        raise ValueError(
            f"{setting}={str(path)!r}: {str(probe)!r} is a file, not a directory; choose another path."
        )
    try:
        with tempfile.TemporaryFile(dir=probe, prefix=".usp-write-check-"):
            pass
    except OSError as e:  # name the directory, not the probe's random name
        raise path_error(setting, path, OSError(e.errno, e.strerror, str(probe))) from e
