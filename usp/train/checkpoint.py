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
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import pickle
import re
import shutil
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
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
from usp.parallel.agree import dist_rank, dist_world_size, raise_if_any_failed
from usp.parallel.agree import distributed as _distributed

logger = logging.getLogger(__name__)

FORMAT_VERSION = 2
"""2: plain-data ``meta.pt`` / ``rank_<r>.pt`` (``weights_only`` loads) and per-file checksums in ``COMPLETE``.
1 (older usp): pickled trainer state, no checksums; refused (it could only be read by unpickling code)."""
CHECKSUM = "sha256"
_HASH_BLOCK = 8 << 20  # bytes read per hash update: streaming, constant memory
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


# --- plain data and checksums ----------------------------------------------------------------------------
_PLAIN_LEAVES = (type(None), bool, int, float, str, bytes, torch.Tensor)


def check_plain_data(obj: Any, where: str = "extra") -> None:
    """``TypeError`` unless ``obj`` is plain data that ``torch.load(weights_only=True)`` reads back: tensors,
    numbers, strings, ``None`` and lists, tuples and dicts of them (e.g. a numpy array is refused: store it as a
    tensor or a list)."""
    if isinstance(obj, _PLAIN_LEAVES):
        return
    if isinstance(obj, dict):
        for key, value in obj.items():
            if not isinstance(key, (str, int)):
                raise TypeError(f"checkpoint {where}: key {key!r} is a {type(key).__name__}; use str or int keys.")
            check_plain_data(value, f"{where}[{key!r}]")
        return
    if isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            check_plain_data(value, f"{where}[{i}]")
        return
    raise TypeError(
        f"checkpoint {where} is a {type(obj).__module__}.{type(obj).__qualname__}: store plain data (tensors, "
        f"numbers, strings, lists, tuples, dicts) so the checkpoint loads without unpickling code."
    )


def file_digest(path: Path) -> str:
    """SHA-256 of ``path`` read in 8 MiB blocks (constant memory)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_HASH_BLOCK):
            h.update(block)
    return h.hexdigest()


_OWNED_RE = re.compile(r"^(?:rank_(\d+)\.pt|__(\d+)_\d+\.distcp)$")


def _owner(rel: str, world: int) -> int:
    """The rank that hashes (at save) or verifies (at load) the checkpoint file ``rel``: the writer of a
    per-rank file (modulo ``world``, for a load at another world size), rank 0 for the rest."""
    m = _OWNED_RE.match(Path(rel).name)
    if m is None:
        return 0
    return int(m.group(1) or m.group(2)) % world


def _all_files(ckpt: Path) -> list[str]:
    return sorted(
        str(p.relative_to(ckpt)) for p in ckpt.rglob("*") if p.is_file() and p.name != COMPLETE_MARKER
    )


def _gather(obj: Any) -> list[Any]:
    if not _distributed():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _hash_own_files(tmp: Path, rank: int, world: int) -> dict[str, dict[str, Any]]:
    return {
        rel: {"bytes": (tmp / rel).stat().st_size, CHECKSUM: file_digest(tmp / rel)}
        for rel in _all_files(tmp)
        if _owner(rel, world) == rank
    }


def _read_marker(ckpt: Path) -> dict[str, Any]:
    try:
        marker = json.loads((ckpt / COMPLETE_MARKER).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{COMPLETE_MARKER} is unreadable ({type(e).__name__}: {e})") from e
    if not isinstance(marker, dict):
        raise ValueError(f"{COMPLETE_MARKER} is not a JSON object")
    return marker


def _verify_own_files(ckpt: Path, rank: int, world: int) -> list[str]:
    """This rank's share of :func:`verify_checkpoint` (no collectives); problems as ``"<file>: <why>"``."""
    try:
        marker = _read_marker(ckpt)
    except ValueError as e:
        return [str(e)] if rank == 0 else []
    version = marker.get("format_version")
    if version != FORMAT_VERSION:
        return [] if rank else [
            f"format {version!r} (this usp reads format {FORMAT_VERSION}; format 1 checkpoints of older usp "
            f"versions hold pickled state and carry no checksums)"
        ]
    files = marker.get("files")
    if not isinstance(files, dict) or not files:
        return [] if rank else [f"{COMPLETE_MARKER} lists no file checksums"]
    problems = []
    for rel, want in sorted(files.items()):
        if _owner(rel, world) != rank:
            continue
        path = ckpt / rel
        try:
            size = path.stat().st_size
            if size != want["bytes"]:
                problems.append(f"{rel}: {size} bytes, {want['bytes']} when saved (truncated or rewritten)")
            elif file_digest(path) != want[CHECKSUM]:
                problems.append(f"{rel}: {CHECKSUM} differs from the one recorded at save (the file changed)")
        except FileNotFoundError:
            problems.append(f"{rel}: missing")
        except (OSError, KeyError, TypeError) as e:
            problems.append(f"{rel}: cannot be checked ({type(e).__name__}: {e})")
    return problems


def verify_checkpoint(path: str | os.PathLike) -> list[str]:
    """Check every file of the checkpoint at ``path`` (a ``step_<N>`` dir) against the sizes and SHA-256
    recorded in its ``COMPLETE`` marker; returns the problems (``[]``: intact), the same list on every rank.

    Collective under a process group (one ``all_gather_object``): each rank hashes a share of the files (the
    per-rank files of its own rank, modulo the world size), so the cost is one read of the checkpoint spread
    over the ranks. Cost: about 0.6 s per GB per rank on one core (sha256 with SHA-NI, measured in
    docs/checkpoints.md).
    """
    ckpt = Path(path)
    try:
        mine = _verify_own_files(ckpt, dist_rank(), dist_world_size())
    except Exception as e:  # noqa: BLE001 - shared with every rank, never raised alone
        mine = [f"verification failed: {type(e).__name__}: {e}"]
    return [problem for share in _gather(mine) for problem in share]


def find_intact_checkpoint(ckpt_root: str | os.PathLike) -> tuple[Path | None, list[tuple[Path, list[str]]]]:
    """The newest complete checkpoint under ``ckpt_root`` that verifies, and the newer ones skipped with their
    problems (``(path, problems)``, newest first). Collective under a process group; the same on every rank."""
    skipped: list[tuple[Path, list[str]]] = []
    for _, path in reversed(list_checkpoints(ckpt_root)):
        problems = verify_checkpoint(path)
        if not problems:
            return path, skipped
        skipped.append((path, problems))
    return None, skipped


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader, but ``.metadata`` is unpickled with :class:`_MetadataUnpickler`: only DCP's metadata
    dataclasses, torch dtypes/sizes/layouts, paths and plain containers are admitted, so a crafted checkpoint
    cannot run code through it."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if not isinstance(metadata, Metadata):
            raise pickle.UnpicklingError(f"{path} holds a {type(metadata).__name__}, not DCP Metadata")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


_REFUSED = "is not allowed in a checkpoint's DCP .metadata"
_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
_SAFE_GLOBALS = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch._utils", "_get_layout"),
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("pathlib._local", "PosixPath"),
    ("pathlib._local", "WindowsPath"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module == _METADATA_MODULE and (not name.startswith("_") or name == "_MEM_FORMAT_ENCODING"):
            obj = super().find_class(module, name)
            if isinstance(obj, type) and obj.__module__ == module:  # DCP's own dataclasses and enums only
                return obj
        if (module, name) in _SAFE_GLOBALS or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} {_REFUSED}")


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
def load_plain(path: Path, what: str = "trainer.resume") -> Any:
    """``torch.load(weights_only=True)`` of a checkpoint's ``meta.pt`` / ``rank_<r>.pt``: plain data only.

    Anything else (a pickled object that would run code, a torn file) raises ``ValueError`` naming the file.
    """
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError as e:
        raise ValueError(f"{what}: {path} is missing; the checkpoint is damaged. Point {what} at another "
                         f"step_<N> directory.") from e
    except Exception as e:  # noqa: BLE001 - UnpicklingError, RuntimeError (torn zip), EOFError, ...
        raise ValueError(
            f"{what}: {path} cannot be read as plain checkpoint data ({type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''}); it is damaged, or it holds pickled objects, which "
            f"usp refuses to unpickle. Point {what} at another step_<N> directory."
        ) from e


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
