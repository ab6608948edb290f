"""The checkpoint save, :func:`save_checkpoint`: every rank writes into ``<root>/.tmp-step_<N>``, then rank 0
writes the ``COMPLETE`` marker (with every file's checksum) and publishes the directory with one rename; only
then are checkpoints beyond ``keep_last`` deleted. The protocol and the files are described in
:mod:`usp.checkpoint`.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from usp.atomic import fsync_dir, publish_dir, write_file
from usp.checkpoint.dcp_state import first_failure, model_optim_state, single_process_quiet
from usp.checkpoint.files import (
    COMPLETE_MARKER,
    DCP_DIR,
    FORMAT_VERSION,
    META_FILE,
    STEP_PREFIX,
    TMP_PREFIX,
    checkpoint_files,
    list_checkpoints,
)
from usp.checkpoint.integrity import CHECKSUM, check_plain_data, record_checksums
from usp.errors import as_setting_path_error
from usp.parallel.agree import dist_rank, dist_world_size, raise_if_any_failed
from usp.parallel.agree import distributed as _distributed


class _RecordingWriter(FileSystemWriter):
    """DCP's file writer, keeping this rank's own write error (with its ``__context__`` chain) before DCP
    gathers a pickled copy of it from every rank."""

    error: BaseException | None = None

    def write_data(self, plan: Any, planner: Any) -> Any:
        try:
            return super().write_data(plan, planner)
        except BaseException as e:
            self.error = e
            raise


def _prune(root: Path, keep_last: int, newest: Path) -> None:
    for _, path in list_checkpoints(root)[:-keep_last]:
        if path == newest:
            continue
        doomed = path.with_name(f".del-{path.name}")
        try:
            os.replace(path, doomed)  # first make it invisible to latest_checkpoint, then delete
            shutil.rmtree(doomed)
        except OSError as e:
            warnings.warn(f"could not delete old checkpoint {path}: {e!r}", stacklevel=3)


def _as_checkpoint_dir_error(save: Callable[..., Path]) -> Callable[..., Path]:
    """``save`` with a failure that has an OS error behind it raised as :class:`usp.errors.SettingPathError`
    (``trainer.checkpoint_dir``, the path, the errno), however deep torch wrapped it."""

    @functools.wraps(save)
    def wrapper(ckpt_root: str | os.PathLike, step: int, **kwargs: Any) -> Path:
        try:
            return save(ckpt_root, step, **kwargs)
        except Exception as e:
            tmp = Path(ckpt_root) / f"{TMP_PREFIX}{step}"
            failure = as_setting_path_error(
                e, "trainer.checkpoint_dir", ckpt_root, f"writing checkpoint step {step} ({tmp})"
            )
            if failure is e:
                raise
            raise failure from e

    return wrapper


@_as_checkpoint_dir_error
def save_checkpoint(
    ckpt_root: str | os.PathLike,
    step: int,
    *,
    model: torch.nn.Module,
    optimizer: Optimizer | None,
    scheduler: LRScheduler | None,
    extra: dict[str, Any],
    keep_last: int,
) -> Path:
    """Save model, optimizer, scheduler, ``step`` and this rank's ``extra`` to ``<ckpt_root>/step_<step>``.

    Collective: call on every rank (or in a single process without a process group). Returns the final path
    once the checkpoint is complete on disk. Keeps the newest ``keep_last`` complete checkpoints. Raises
    ``RuntimeError`` on every rank if any rank failed; the previous checkpoints are then untouched. A failure
    with an OS error behind it (a full disk, ``ulimit -f``, a quota) is raised as
    :class:`usp.errors.SettingPathError` on the rank that saw it: ``trainer.checkpoint_dir``, the path and the
    errno, however deep torch wrapped it.
    """
    if not isinstance(keep_last, int) or keep_last < 1:
        raise ValueError(f"trainer.keep_last={keep_last!r} is invalid: keep at least 1 checkpoint (e.g. 2).")
    if not isinstance(step, int) or step < 0:
        raise ValueError(f"checkpoint step must be an integer >= 0, got {step!r}.")
    check_plain_data(extra)
    root = Path(ckpt_root)
    final = root / f"{STEP_PREFIX}{step}"
    tmp = root / f"{TMP_PREFIX}{step}"
    rank, world = dist_rank(), dist_world_size()

    # 1. rank 0 clears leftovers of interrupted saves (only one save runs at a time) and makes the temp dir
    error: BaseException | None = None
    if rank == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            for stale in root.glob(f"{TMP_PREFIX}*"):
                shutil.rmtree(stale)
            for stale in root.glob(".del-step_*"):
                shutil.rmtree(stale, ignore_errors=True)
            tmp.mkdir()
        except OSError as e:
            error = e
    raise_if_any_failed(error, f"preparing checkpoint directory {tmp}")

    # 2. model + optimizer shards (DCP gathers errors across ranks itself and raises on every rank)
    writer = _RecordingWriter(tmp / DCP_DIR)
    try:
        with single_process_quiet():
            dcp.save(model_optim_state(model, optimizer), storage_writer=writer, no_dist=not _distributed())
    except CheckpointException as e:  # raised on every rank; a BaseException, so make it an ordinary error
        # this rank's own error keeps its chain (the OSError behind torch's "unexpected pos"); DCP's copy of it,
        # gathered from the ranks, was pickled without it
        raise RuntimeError(f"writing checkpoint step {step} failed: {first_failure(e)}") from (
            writer.error or e
        )

    # 3. small per-rank and global files
    error = None
    try:
        per_rank = {"extra": extra, "rank": rank, "world_size": world}
        write_file(tmp / f"rank_{rank}.pt", lambda f: torch.save(per_rank, f))
        if rank == 0:
            meta = {
                "step": step,
                "scheduler": None if scheduler is None else scheduler.state_dict(),
                "world_size": world,
                "format_version": FORMAT_VERSION,
            }
            check_plain_data(meta, "meta")
            write_file(tmp / META_FILE, lambda f: torch.save(meta, f))
    except Exception as e:  # noqa: BLE001 - reported to every rank below
        error = e
    raise_if_any_failed(error, f"writing checkpoint step {step}")

    # 4. every rank hashes the files it wrote (rank 0 also DCP's .metadata and meta.pt); rank 0 gathers them
    files = record_checksums(tmp, f"checksumming checkpoint step {step}")

    # 5. rank 0: marker (with the checksums) last, then the atomic rename
    error = None
    if rank == 0:
        try:
            unlisted = sorted(set(checkpoint_files(tmp)) - set(files))
            assert not unlisted, f"checkpoint files without a checksum: {unlisted}"
            marker = {
                "step": step,
                "world_size": world,
                "format_version": FORMAT_VERSION,
                "time": time.time(),
                "checksum": CHECKSUM,
                "files": files,
            }
            write_file(tmp / COMPLETE_MARKER, lambda f: f.write(json.dumps(marker).encode()))
            fsync_dir(tmp)
            publish_dir(tmp, final)
        except Exception as e:  # noqa: BLE001
            error = e
    raise_if_any_failed(error, f"publishing checkpoint {final}")

    # 6. only now that the new one is complete: drop the old ones
    if rank == 0:
        _prune(root, keep_last, final)
    return final
