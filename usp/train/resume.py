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
(:func:`usp.train.rundir.check_checkpoints_of_other_runs`).
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

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
    from usp.checkpoint import read_saved_extra

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
    from usp.checkpoint import find_intact_checkpoint
    from usp.train.rundir import describe_skipped

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
    checkpoints it does not continue (:func:`usp.train.rundir.check_checkpoints_of_other_runs`).
    """
    from usp.checkpoint import resolve_checkpoint, verify_checkpoint
    from usp.train.rundir import check_checkpoints_of_other_runs

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
