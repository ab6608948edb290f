"""Where a checkpoint's files are and which directories are finished checkpoints.

The names of the files in one checkpoint (``step_<N>/``: ``dcp/``, ``meta.pt``, ``rank_<r>.pt``, ``COMPLETE``;
what each holds and the save protocol are described in :mod:`usp.checkpoint`), the format version, and the
queries that find checkpoints under a root: :func:`is_complete_checkpoint`, :func:`list_checkpoints`,
:func:`latest_checkpoint`, :func:`resolve_checkpoint` (a user's ``trainer.resume`` path) and
:func:`checkpoint_files`. These only look at names and the presence of files; whether the files are intact is
:mod:`usp.checkpoint.integrity`.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

FORMAT_VERSION = 2
"""2: plain-data ``meta.pt`` / ``rank_<r>.pt`` (``weights_only`` loads) and per-file checksums in ``COMPLETE``.
1 (older usp): pickled trainer state, no checksums; refused (it could only be read by unpickling code)."""
COMPLETE_MARKER = "COMPLETE"
DCP_DIR = "dcp"
META_FILE = "meta.pt"
STEP_PREFIX = "step_"
TMP_PREFIX = ".tmp-step_"
_STEP_RE = re.compile(r"^step_(\d+)$")


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


def checkpoint_files(ckpt: Path) -> list[str]:
    """Every file under the checkpoint directory ``ckpt`` (relative paths, sorted), except the marker: the files
    the marker's checksums cover."""
    return sorted(
        str(p.relative_to(ckpt)) for p in ckpt.rglob("*") if p.is_file() and p.name != COMPLETE_MARKER
    )


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
