"""Training checkpoints: atomic, resharding-friendly saves of model, optimizer, scheduler and trainer state.

Layout of one checkpoint (``<ckpt_root>/step_<N>/``)::

    dcp/            torch.distributed.checkpoint of {"model": ..., "optim": ...}; every rank writes its shards
    meta.pt         rank 0: {"step", "scheduler", "world_size", "format_version"}
    rank_<r>.pt     rank r: {"extra": the ``extra`` dict that rank passed, "rank", "world_size"}
    COMPLETE        rank 0, written last (json): the marker that makes the directory a checkpoint, with the
                    size and SHA-256 of every other file (``"files"``), verified before a load

``meta.pt`` and ``rank_<r>.pt`` hold plain data only (tensors, numbers, strings, lists, tuples, dicts): they
are written with ``torch.save`` and read with ``torch.load(weights_only=True)``, so a crafted checkpoint cannot
run code through them; ``save_checkpoint`` refuses an ``extra`` holding anything else. DCP's own
``.metadata`` is read by an unpickler that only admits DCP's metadata classes (:class:`SafeFileSystemReader`).

Model and optimizer state go through ``get_state_dict`` / ``set_state_dict``: keys are the model's own FQNs and
FSDP2 shards are DTensors, so DCP stores global tensors and a load reshards into whatever mesh (or no mesh) the
new job has: save at world 4 under FSDP2, resume at world 2, or load into a plain single-process model.

Atomicity: everything is written into ``<ckpt_root>/.tmp-step_<N>``; after every rank has finished (a
collective that also carries errors, so a failure on one rank raises on all ranks instead of hanging them),
rank 0 writes ``COMPLETE`` and renames the directory to ``step_<N>`` (one ``rename`` on the same filesystem,
:func:`usp.atomic.publish_dir`; ``meta.pt``, ``rank_<r>.pt`` and ``COMPLETE`` are each written atomically too).
Only then are checkpoints beyond the newest ``keep_last`` deleted. A crash at any point leaves the previous
checkpoints untouched; :func:`latest_checkpoint` only reports directories named ``step_<N>`` that hold the
marker, so a leftover ``.tmp-step_*`` is never picked up (the next save removes it).

``extra`` is stored per rank. On load, a job with the same world size gets back exactly what *its* rank saved
(per-rank RNG states are restored exactly); a job with a different world size gets rank 0's ``extra`` on every
rank (per-rank RNG states cannot map one-to-one then). So keep global state in ``extra`` in a form that any
layout can interpret — e.g. the data loader's position in *global* samples, which is equal on every rank — and
put per-rank state (RNG) next to it. The returned dict says which case applied (``"extra_rank"``).

The checkpoint root must be on a filesystem every rank sees (a shared filesystem across nodes).

This module holds the save (:func:`save_checkpoint`) and the load (:func:`load_checkpoint`,
:func:`read_saved_extra`); the parts they use live next to it and are importable from here too:

- :mod:`usp.train.checkpoint_layout` - the file names, ``FORMAT_VERSION`` and the queries
  (:func:`list_checkpoints`, :func:`latest_checkpoint`, :func:`resolve_checkpoint`);
- :mod:`usp.train.checkpoint_integrity` - :func:`check_plain_data`, the per-file checksums and their
  verification (:func:`verify_checkpoint`, :func:`find_intact_checkpoint`);
- :mod:`usp.train.checkpoint_reader` - the pickle-free reads (:func:`load_plain`, :class:`SafeFileSystemReader`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from usp.atomic import fsync_dir, publish_dir
from usp.atomic import write_file as _write_file
from usp.errors import as_setting_path_error
from usp.parallel.agree import dist_rank, dist_world_size, raise_if_any_failed
from usp.parallel.agree import distributed as _distributed

# The parts this module is built from, importable from here as before (``from usp.train.checkpoint import ...``).
from usp.train.checkpoint_integrity import (  # noqa: F401 - public here too
    _HASH_BLOCK,
    _OWNED_RE,
    _PLAIN_LEAVES,
    CHECKSUM,
    _all_files,
    _gather,
    _hash_own_files,
    _owner,
    _read_marker,
    _verify_own_files,
    check_plain_data,
    file_digest,
    find_intact_checkpoint,
    verify_checkpoint,
)
from usp.train.checkpoint_layout import (  # noqa: F401 - public here too
    _STEP_RE,
    COMPLETE_MARKER,
    DCP_DIR,
    FORMAT_VERSION,
    META_FILE,
    STEP_PREFIX,
    TMP_PREFIX,
    is_complete_checkpoint,
    latest_checkpoint,
    list_checkpoints,
    resolve_checkpoint,
)
from usp.train.checkpoint_reader import (  # noqa: F401 - public here too
    _METADATA_MODULE,
    _REFUSED,
    _SAFE_GLOBALS,
    SafeFileSystemReader,
    _MetadataUnpickler,
    load_plain,
)

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def _single_process_quiet() -> Iterator[None]:
    """Silence DCP's "assuming the intent is to save in a single process" warning: that is our intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to .* in a single process")
        yield


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


def _first_failure(error: CheckpointException) -> str:
    for rank, (exc, _) in sorted(error.failures.items()):
        return f"rank {rank}: {type(exc).__name__}: {exc}"
    return str(error)



# --- save ----------------------------------------------------------------------------------------------
def _model_optim_state(model: torch.nn.Module, optimizer: Optimizer | None) -> dict[str, Any]:
    if optimizer is None:
        return {"model": get_model_state_dict(model)}
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd}


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
    try:
        return _save_checkpoint(
            ckpt_root, step, model=model, optimizer=optimizer, scheduler=scheduler, extra=extra, keep_last=keep_last
        )
    except Exception as e:
        tmp = Path(ckpt_root) / f"{TMP_PREFIX}{step}"
        failure = as_setting_path_error(e, "trainer.checkpoint_dir", ckpt_root, f"writing checkpoint step {step} ({tmp})")
        if failure is e:
            raise
        raise failure from e


def _save_checkpoint(
    ckpt_root: str | os.PathLike,
    step: int,
    *,
    model: torch.nn.Module,
    optimizer: Optimizer | None,
    scheduler: LRScheduler | None,
    extra: dict[str, Any],
    keep_last: int,
) -> Path:
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
        with _single_process_quiet():
            dcp.save(_model_optim_state(model, optimizer), storage_writer=writer, no_dist=not _distributed())
    except CheckpointException as e:  # raised on every rank; a BaseException, so make it an ordinary error
        # this rank's own error keeps its chain (the OSError behind torch's "unexpected pos"); DCP's copy of it,
        # gathered from the ranks, was pickled without it
        raise RuntimeError(f"writing checkpoint step {step} failed: {_first_failure(e)}") from (writer.error or e)

    # 3. small per-rank and global files
    error = None
    try:
        per_rank = {"extra": extra, "rank": rank, "world_size": world}
        _write_file(tmp / f"rank_{rank}.pt", lambda f: torch.save(per_rank, f))
        if rank == 0:
            meta = {
                "step": step,
                "scheduler": None if scheduler is None else scheduler.state_dict(),
                "world_size": world,
                "format_version": FORMAT_VERSION,
            }
            check_plain_data(meta, "meta")
            _write_file(tmp / META_FILE, lambda f: torch.save(meta, f))
    except Exception as e:  # noqa: BLE001 - reported to every rank below
        error = e
    raise_if_any_failed(error, f"writing checkpoint step {step}")

    # 4. every rank hashes the files it wrote (rank 0 also DCP's .metadata and meta.pt); rank 0 gathers them
    error, digests = None, {}
    try:
        digests = _hash_own_files(tmp, rank, world)
    except Exception as e:  # noqa: BLE001
        error = e
    raise_if_any_failed(error, f"checksumming checkpoint step {step}")
    files = {rel: entry for share in _gather(digests) for rel, entry in share.items()}

    # 5. rank 0: marker (with the checksums) last, then the atomic rename
    error = None
    if rank == 0:
        try:
            unlisted = sorted(set(_all_files(tmp)) - set(files))
            assert not unlisted, f"checkpoint files without a checksum: {unlisted}"
            marker = {"step": step, "world_size": world, "format_version": FORMAT_VERSION, "time": time.time(),
                      "checksum": CHECKSUM, "files": files}  # fmt: skip
            _write_file(tmp / COMPLETE_MARKER, lambda f: f.write(json.dumps(marker).encode()))
            fsync_dir(tmp)
            publish_dir(tmp, final)
        except Exception as e:  # noqa: BLE001
            error = e
    raise_if_any_failed(error, f"publishing checkpoint {final}")

    # 6. only now that the new one is complete: drop the old ones
    if rank == 0:
        _prune(root, keep_last, final)
    return final


# --- load ----------------------------------------------------------------------------------------------
def read_saved_extra(path: str | os.PathLike, rank: int = 0) -> dict[str, Any]:
    """The ``extra`` dict rank ``rank`` saved in the checkpoint at ``path`` (a ``step_<N>`` dir or a root),
    without touching the model: cheap (one small file, ``weights_only``), for checks before loading (run
    fingerprints)."""
    ckpt = resolve_checkpoint(path)
    per_rank = load_plain(ckpt / f"rank_{rank}.pt")
    if not isinstance(per_rank, dict) or not isinstance(per_rank.get("extra"), dict):
        raise ValueError(f"trainer.resume={str(path)!r}: {ckpt / f'rank_{rank}.pt'} is not a usp rank file.")
    return per_rank["extra"]


def load_checkpoint(
    path: str | os.PathLike,
    *,
    model: torch.nn.Module,
    optimizer: Optimizer | None,
    scheduler: LRScheduler | None,
    verify: bool = True,
) -> dict[str, Any]:
    """Load a checkpoint written by :func:`save_checkpoint` into ``model`` / ``optimizer`` / ``scheduler``.

    Collective under a process group (call on every rank). ``path`` is a ``step_<N>`` directory or a checkpoint
    root (its latest complete checkpoint is loaded). With ``verify`` (default) every file is first checked
    against the checksums recorded at save (:func:`verify_checkpoint`; skip it only when the caller just did).
    The model may be sharded differently from the saved one (other FSDP2 mesh size, or a plain module): DCP
    reshards. Returns ``{"step": int, "extra": dict, "path": Path, "saved_world_size": int, "extra_rank": int}``,
    where ``extra`` is this rank's saved ``extra`` when the world size is unchanged, otherwise rank 0's
    (``extra_rank`` says which).
    Raises ``ValueError`` (naming ``trainer.resume`` and the damaged file) if the path is missing, incomplete,
    fails verification or holds anything but plain data.
    """
    ckpt = resolve_checkpoint(path)
    if verify:
        problems = verify_checkpoint(ckpt)
        if problems:
            raise ValueError(
                f"trainer.resume={str(path)!r}: {ckpt} fails verification: {'; '.join(problems)}. Point "
                f"trainer.resume at another step_<N> directory (trainer.resume=auto takes the newest intact one)."
            )
    meta = load_plain(ckpt / META_FILE)
    if not isinstance(meta, dict) or meta.get("format_version") != FORMAT_VERSION:
        version = meta.get("format_version") if isinstance(meta, dict) else None
        raise ValueError(
            f"trainer.resume={str(path)!r}: checkpoint format {version!r} is not supported "
            f"by this version of usp (expects {FORMAT_VERSION})."
        )
    state = _model_optim_state(model, optimizer)
    try:
        with _single_process_quiet():
            dcp.load(state, storage_reader=SafeFileSystemReader(ckpt / DCP_DIR), no_dist=not _distributed())
    except CheckpointException as e:  # raised on every rank
        if _REFUSED in _first_failure(e):  # DCP wraps our UnpicklingError (in an AssertionError on 2.13)
            raise ValueError(
                f"trainer.resume={str(path)!r}: {ckpt / DCP_DIR / '.metadata'} holds objects usp refuses to "
                f"unpickle ({_first_failure(e)}); it was not written by usp. Point trainer.resume at another "
                f"step_<N> directory."
            ) from e
        raise ValueError(
            f"trainer.resume={str(path)!r}: {ckpt} does not fit this model/optimizer ({_first_failure(e)}). "
            f"Resume with the model config and optimizer the checkpoint was saved with, or start fresh "
            f"with a new hydra.run.dir / trainer.checkpoint_dir."
        ) from e
    if optimizer is None:
        set_model_state_dict(model, state["model"])
    else:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    if scheduler is not None:
        if meta["scheduler"] is None:
            raise ValueError(f"checkpoint {ckpt} was saved without a scheduler; pass scheduler=None to load it.")
        scheduler.load_state_dict(meta["scheduler"])

    saved_world = int(meta["world_size"])
    extra_rank = dist_rank() if saved_world == dist_world_size() else 0
    per_rank = load_plain(ckpt / f"rank_{extra_rank}.pt")
    return {
        "step": int(meta["step"]),
        "extra": per_rank["extra"],
        "path": ckpt,
        "saved_world_size": saved_world,
        "extra_rank": extra_rank,
    }
