"""Which checkpoint a run starts from: ``trainer.resume`` resolved, verified and fingerprinted, collectively.

- ``auto``: the newest checkpoint under the checkpoint dir whose files verify against the checksums saved with
  it (newer damaged ones are skipped, each named with its damaged file, and renamed ``damaged-step_<N>``);
  refused when it was saved by a run
  with another ``model.path`` / ``trainer.seq_len`` (its fingerprint), or when checkpoints exist but none
  verifies.
- a path: that ``step_<N>`` (a root: its newest complete one), which must verify; ``ValueError`` naming the
  damaged file otherwise.
- ``null``: fresh.

Whatever the choice, a run never shares its checkpoint dir with checkpoints it does not continue
(:func:`check_checkpoints_of_other_runs`): keep-last pruning, ``resume=auto`` after a crash and the export
would otherwise mix two runs; it is refused with the command that moves the other run aside.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

from usp.checkpoint import find_intact_checkpoint, read_saved_extra, resolve_checkpoint, verify_checkpoint
from usp.config import TrainConfig
from usp.parallel.agree import on_every_rank, on_rank0

logger = logging.getLogger(__name__)


def run_fingerprint(cfg: TrainConfig) -> dict[str, Any]:
    """What identifies a run's checkpoints, stored in each checkpoint's ``extra["fingerprint"]``: the resolved
    ``model.path`` and ``trainer.seq_len``."""
    return {"model_path": str(Path(cfg.model.path).resolve()), "seq_len": int(cfg.trainer.seq_len)}


def check_fingerprint(cfg: TrainConfig, ckpt: Path) -> None:
    """``ValueError`` when the checkpoint ``ckpt`` was saved by a run with another ``model.path`` or
    ``trainer.seq_len`` (its ``extra["fingerprint"]``); checkpoints without a fingerprint pass."""

    saved = read_saved_extra(ckpt).get("fingerprint")
    if saved is None:
        return
    now = run_fingerprint(cfg)
    diffs = [
        f"{setting} {saved[key]!r} there, {now[key]!r} now"
        for key, setting in (("model_path", "model.path"), ("seq_len", "trainer.seq_len"))
        if key in saved and saved[key] != now[key]
    ]
    if diffs:
        raise ValueError(
            f"trainer.resume=auto found {ckpt}, saved by another run ({'; '.join(diffs)}). Give this run its "
            f"own directory (hydra.run.dir=... or trainer.checkpoint_dir=...), move that run's checkpoints aside "
            f"(mv {ckpt.parent} {ckpt.parent}.old), or set trainer.resume={ckpt} to continue from it on purpose "
            f"(e.g. a longer-context stage)."
        )


DAMAGED_PREFIX = "damaged-"


def set_aside_damaged(skipped: list[tuple[Path, list[str]]]) -> None:
    """Rename checkpoints that failed verification to ``damaged-step_<N>`` (kept for inspection, invisible to
    ``resume=auto`` and keep-last; delete them by hand). Rank 0 only."""
    for path, _ in skipped:
        target = path.with_name(DAMAGED_PREFIX + path.name)
        if target.exists():
            target = path.with_name(f"{DAMAGED_PREFIX}{path.name}-{time.strftime('%Y%m%d-%H%M%S')}")
        os.replace(path, target)
        logger.warning("moved the damaged checkpoint %s aside to %s", path, target)


def newest_intact_checkpoint(ckpt_root: Path, *, set_aside: bool = False) -> Path | None:
    """The newest checkpoint under ``ckpt_root`` that verifies, ``None`` if there is none; rank 0 logs the
    newer ones it skipped and why (and, with ``set_aside``, renames them: :func:`set_aside_damaged`).
    ``ValueError`` (every rank) if checkpoints exist but none verifies. Collective under a process group."""

    intact, skipped = find_intact_checkpoint(ckpt_root)
    if skipped and (not dist.is_initialized() or dist.get_rank() == 0):
        logger.warning(
            "trainer.resume=auto: skipped %d checkpoint(s) that fail verification: %s",
            len(skipped),
            describe_skipped(skipped),
        )
    if intact is None and skipped:
        raise ValueError(
            f"trainer.resume=auto: no checkpoint under {ckpt_root} verifies ({describe_skipped(skipped)}). "
            f"Move them aside (mv {ckpt_root} {ckpt_root}.damaged) to start fresh, or point trainer.resume at "
            f"a checkpoint saved elsewhere."
        )
    if skipped and set_aside:
        on_rank0(lambda: set_aside_damaged(skipped), "trainer.resume=auto: setting damaged checkpoints aside")
    return intact


def check_auto_resume(cfg: TrainConfig, ckpt_root: Path) -> Path | None:
    """``trainer.resume=auto``: the newest complete checkpoint under ``ckpt_root`` whose files verify against
    their checksums (or ``None`` if there is none), refused with ``ValueError`` when it was saved by a run with
    another ``model.path`` or ``trainer.seq_len``, or when checkpoints exist but none verifies.

    Collective under a process group (the verification is shared over the ranks). Newer checkpoints that fail
    verification are skipped with a warning naming each damaged file. An explicit ``trainer.resume=PATH`` is
    not fingerprinted (a new stage at a longer ``seq_len`` is legitimate).
    """
    intact = newest_intact_checkpoint(ckpt_root)
    if intact is not None:
        check_fingerprint(cfg, intact)
    return intact


def choose_resume(cfg: TrainConfig, ckpt_root: Path) -> Path | None:
    """The checkpoint this run starts from (``None``: fresh), the same on every rank; collective.

        ``auto``: :func:`check_auto_resume`. A path: its ``step_<N>`` (a root: its newest complete one), which must
        verify (``ValueError`` naming the damaged file otherwise). Then a run never shares the checkpoint dir with
        checkpoints it does not continue (:func:`check_checkpoints_of_other_runs`): keep-last pruning, ``resume=auto`` after a crash and the export
    would otherwise mix two runs; it is refused with the command that moves the other run aside.
    """

    resume = cfg.trainer.resume
    resume_from: Path | None = None
    if resume == "auto":
        intact = newest_intact_checkpoint(ckpt_root, set_aside=True)  # damaged ones are not another run's
        if intact is not None:
            on_every_rank(lambda: check_fingerprint(cfg, intact), "trainer.resume=auto")
        resume_from = intact
    elif resume:
        resume_from = on_every_rank(lambda: resolve_checkpoint(resume), "trainer.resume")
        problems = verify_checkpoint(resume_from)  # the same list on every rank
        if problems:
            raise ValueError(
                f"trainer.resume={resume!r}: {resume_from} fails verification: {'; '.join(problems)}. Point "
                f"trainer.resume at another step_<N> directory (trainer.resume=auto takes the newest intact one)."
            )
    on_every_rank(
        lambda: check_checkpoints_of_other_runs(ckpt_root, resume_from, run_dir=Path(cfg.run_dir)),
        "trainer.checkpoint_dir",
    )
    return resume_from


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
