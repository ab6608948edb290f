"""Training checkpoints: atomic, resharding-friendly saves of model, optimizer, scheduler and trainer state.

Layout of one checkpoint (``<ckpt_root>/step_<N>/``)::

    dcp/            torch.distributed.checkpoint of {"model": ..., "optim": ...}; every rank writes its shards
    meta.pt         rank 0: {"step", "scheduler", "world_size", "format_version"}
    rank_<r>.pt     rank r: {"extra": the ``extra`` dict that rank passed, "rank", "world_size"}
    COMPLETE        rank 0, written last (json): the marker that makes the directory a checkpoint

Model and optimizer state go through ``get_state_dict`` / ``set_state_dict``: keys are the model's own FQNs and
FSDP2 shards are DTensors, so DCP stores global tensors and a load reshards into whatever mesh (or no mesh) the
new job has: save at world 4 under FSDP2, resume at world 2, or load into a plain single-process model.

Atomicity: everything is written into ``<ckpt_root>/.tmp-step_<N>``; after every rank has finished (a
collective that also carries errors, so a failure on one rank raises on all ranks instead of hanging them),
rank 0 writes ``COMPLETE`` and renames the directory to ``step_<N>`` (one ``rename`` on the same filesystem).
Only then are checkpoints beyond the newest ``keep_last`` deleted. A crash at any point leaves the previous
checkpoints untouched; :func:`latest_checkpoint` only reports directories named ``step_<N>`` that hold the
marker, so a leftover ``.tmp-step_*`` is never picked up (the next save removes it).

``extra`` is stored per rank. On load, a job with the same world size gets back exactly what *its* rank saved
(per-rank RNG states are restored exactly); a job with a different world size gets rank 0's ``extra`` on every
rank (per-rank RNG states cannot map one-to-one then). So keep global state in ``extra`` in a form that any
layout can interpret — e.g. the data loader's position in *global* samples, which is equal on every rank — and
put per-rank state (RNG) next to it. The returned dict says which case applied (``"extra_rank"``).

The checkpoint root must be on a filesystem every rank sees (a shared filesystem across nodes).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from usp.parallel.agree import dist_rank, dist_world_size, raise_if_any_failed
from usp.parallel.agree import distributed as _distributed

FORMAT_VERSION = 1
COMPLETE_MARKER = "COMPLETE"
DCP_DIR = "dcp"
META_FILE = "meta.pt"
STEP_PREFIX = "step_"
TMP_PREFIX = ".tmp-step_"
_STEP_RE = re.compile(r"^step_(\d+)$")


@contextlib.contextmanager
def _single_process_quiet() -> Iterator[None]:
    """Silence DCP's "assuming the intent is to save in a single process" warning: that is our intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to .* in a single process")
        yield


def _first_failure(error: CheckpointException) -> str:
    for rank, (exc, _) in sorted(error.failures.items()):
        return f"rank {rank}: {type(exc).__name__}: {exc}"
    return str(error)


# --- filesystem helpers --------------------------------------------------------------------------------
def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # some filesystems don't allow opening directories; the rename is still atomic
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_file(path: Path, write: Any) -> None:
    """Write via ``write(f)`` to ``path`` aside-then-rename, fsynced."""
    part = path.with_name(path.name + ".part")
    with open(part, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(part, path)


def publish_dir(tmp: Path, final: Path) -> None:
    """Rename the finished directory ``tmp`` to ``final`` (replacing an older ``final``), then fsync the parent.

    ``rename`` cannot replace a non-empty directory, so an existing ``final`` is first moved aside and deleted
    only after ``tmp`` took its place.
    """
    old = None
    if final.exists():
        old = final.with_name(f".old-{final.name}-{os.getpid()}-{time.time_ns()}")
        os.replace(final, old)
    os.replace(tmp, final)
    _fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


# --- queries -------------------------------------------------------------------------------------------
def is_complete_checkpoint(path: str | os.PathLike) -> bool:
    """True if ``path`` is a finished checkpoint directory (marker, DCP metadata and meta file present)."""
    path = Path(path)
    return (
        (path / COMPLETE_MARKER).is_file()
        and (path / DCP_DIR / ".metadata").is_file()
        and (path / META_FILE).is_file()
    )


def list_checkpoints(ckpt_root: str | os.PathLike) -> list[tuple[int, Path]]:
    """Complete checkpoints under ``ckpt_root`` as ``(step, path)``, oldest first; temp dirs are ignored."""
    root = Path(ckpt_root)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        m = _STEP_RE.match(child.name)
        if m and child.is_dir() and is_complete_checkpoint(child):
            found.append((int(m.group(1)), child))
    return sorted(found)


def latest_checkpoint(ckpt_root: str | os.PathLike) -> Path | None:
    """The complete checkpoint with the highest step under ``ckpt_root``, or ``None`` if there is none."""
    found = list_checkpoints(ckpt_root)
    return found[-1][1] if found else None


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """Validate a checkpoint path given by the user: a ``step_<N>`` directory, or a checkpoint root (-> latest).

    Raises ``ValueError`` naming ``trainer.resume`` and the fix if nothing loadable is there.
    """
    p = Path(path)
    if not p.exists():
        raise ValueError(
            f"trainer.resume={str(path)!r}: the path does not exist. Point it at a checkpoint directory "
            f"(<checkpoint_dir>/step_<N>) or a checkpoint root, use trainer.resume=auto, or null to start fresh."
        )
    if not p.is_dir():
        raise ValueError(
            f"trainer.resume={str(path)!r} is a file, not a checkpoint directory. Point it at "
            f"<checkpoint_dir>/step_<N> (a directory holding {COMPLETE_MARKER}, {META_FILE} and {DCP_DIR}/)."
        )
    if is_complete_checkpoint(p):
        return p
    latest = latest_checkpoint(p)
    if latest is not None:
        return latest
    missing = [n for n in (COMPLETE_MARKER, META_FILE, f"{DCP_DIR}/.metadata") if not (p / n).exists()]
    raise ValueError(
        f"trainer.resume={str(path)!r} is not a complete checkpoint (missing: {', '.join(missing)}) and holds no "
        f"complete step_<N> checkpoint. It may be a save that was interrupted; point trainer.resume at an "
        f"earlier step_<N> directory, or use trainer.resume=auto to take the latest complete one."
    )


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
    ``RuntimeError`` on every rank if any rank failed; the previous checkpoints are then untouched.
    """
    if not isinstance(keep_last, int) or keep_last < 1:
        raise ValueError(f"trainer.keep_last={keep_last!r} is invalid: keep at least 1 checkpoint (e.g. 2).")
    if not isinstance(step, int) or step < 0:
        raise ValueError(f"checkpoint step must be an integer >= 0, got {step!r}.")
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
    try:
        with _single_process_quiet():
            dcp.save(_model_optim_state(model, optimizer), checkpoint_id=tmp / DCP_DIR, no_dist=not _distributed())
    except CheckpointException as e:  # raised on every rank; a BaseException, so make it an ordinary error
        raise RuntimeError(f"writing checkpoint step {step} failed: {_first_failure(e)}") from e

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
            _write_file(tmp / META_FILE, lambda f: torch.save(meta, f))
    except Exception as e:  # noqa: BLE001 - reported to every rank below
        error = e
    raise_if_any_failed(error, f"writing checkpoint step {step}")

    # 4. rank 0: marker last, then the atomic rename
    error = None
    if rank == 0:
        try:
            marker = {"step": step, "world_size": world, "format_version": FORMAT_VERSION, "time": time.time()}
            _write_file(tmp / COMPLETE_MARKER, lambda f: f.write(json.dumps(marker).encode()))
            _fsync_dir(tmp)
            publish_dir(tmp, final)
        except Exception as e:  # noqa: BLE001
            error = e
    raise_if_any_failed(error, f"publishing checkpoint {final}")

    # 5. only now that the new one is complete: drop the old ones
    if rank == 0:
        _prune(root, keep_last, final)
    return final


# --- load ----------------------------------------------------------------------------------------------
def _load_pickle(path: Path) -> Any:
    # Our own files hold arbitrary trainer state (numpy / python RNG states, loader state): full unpickling,
    # the same trust as DCP's own pickled .metadata in the same directory.
    return torch.load(path, map_location="cpu", weights_only=False)


def read_saved_extra(path: str | os.PathLike, rank: int = 0) -> dict[str, Any]:
    """The ``extra`` dict rank ``rank`` saved in the checkpoint at ``path`` (a ``step_<N>`` dir or a root),
    without touching the model: cheap (one small file), for checks before loading (run fingerprints)."""
    ckpt = resolve_checkpoint(path)
    rank_file = ckpt / f"rank_{rank}.pt"
    if not rank_file.is_file():
        raise ValueError(f"trainer.resume={str(path)!r}: {rank_file.name} is missing from {ckpt}; the checkpoint "
                         f"is damaged. Point trainer.resume at another step_<N> directory.")
    return _load_pickle(rank_file)["extra"]


def load_checkpoint(
    path: str | os.PathLike,
    *,
    model: torch.nn.Module,
    optimizer: Optimizer | None,
    scheduler: LRScheduler | None,
) -> dict[str, Any]:
    """Load a checkpoint written by :func:`save_checkpoint` into ``model`` / ``optimizer`` / ``scheduler``.

    Collective under a process group (call on every rank). ``path`` is a ``step_<N>`` directory or a checkpoint
    root (its latest complete checkpoint is loaded). The model may be sharded differently from the saved one
    (other FSDP2 mesh size, or a plain module): DCP reshards. Returns ``{"step": int, "extra": dict,
    "path": Path, "saved_world_size": int, "extra_rank": int}``, where ``extra`` is this rank's saved ``extra``
    when the world size is unchanged, otherwise rank 0's (``extra_rank`` says which).
    Raises ``ValueError`` (naming ``trainer.resume``) if the path is missing or incomplete.
    """
    ckpt = resolve_checkpoint(path)
    meta = _load_pickle(ckpt / META_FILE)
    if meta.get("format_version") != FORMAT_VERSION:
        raise ValueError(
            f"trainer.resume={str(path)!r}: checkpoint format {meta.get('format_version')!r} is not supported "
            f"by this version of usp (expects {FORMAT_VERSION})."
        )
    state = _model_optim_state(model, optimizer)
    try:
        with _single_process_quiet():
            dcp.load(state, checkpoint_id=ckpt / DCP_DIR, no_dist=not _distributed())
    except CheckpointException as e:  # raised on every rank
        raise ValueError(
            f"trainer.resume={str(path)!r}: {ckpt} does not fit this model/optimizer ({_first_failure(e)}). "
            f"Resume with the model config and optimizer the checkpoint was saved with, or start fresh "
            f"(trainer.resume=null) with a new trainer.checkpoint_dir."
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
    rank_file = ckpt / f"rank_{extra_rank}.pt"
    if not rank_file.is_file():
        raise ValueError(f"trainer.resume={str(path)!r}: {rank_file.name} is missing from {ckpt}; the checkpoint "
                         f"is damaged. Point trainer.resume at another step_<N> directory.")
    per_rank = _load_pickle(rank_file)
    return {
        "step": int(meta["step"]),
        "extra": per_rank["extra"],
        "path": ckpt,
        "saved_world_size": saved_world,
        "extra_rank": extra_rank,
    }
