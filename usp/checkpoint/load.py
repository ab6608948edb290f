"""The checkpoint load: :func:`load_checkpoint` (model, optimizer, scheduler and this rank's ``extra``; DCP
reshards into whatever mesh the new job has) and :func:`read_saved_extra` (one rank file, for checks before a
load). Every file is read without unpickling code (:mod:`usp.checkpoint.reader`).
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from usp.checkpoint.dcp_state import LOAD_OPTIONS, first_failure, model_optim_state, single_process_quiet
from usp.checkpoint.files import DCP_DIR, FORMAT_VERSION, META_FILE, resolve_checkpoint
from usp.checkpoint.integrity import verify_checkpoint
from usp.checkpoint.reader import REFUSED, SafeFileSystemReader, load_plain
from usp.parallel.agree import dist_rank, dist_world_size
from usp.parallel.agree import distributed as _distributed


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
    state = model_optim_state(model, optimizer)
    try:
        with single_process_quiet():
            dcp.load(state, storage_reader=SafeFileSystemReader(ckpt / DCP_DIR), no_dist=not _distributed())
    except CheckpointException as e:  # raised on every rank
        if REFUSED in first_failure(e):  # DCP wraps our UnpicklingError (in an AssertionError on 2.13)
            raise ValueError(
                f"trainer.resume={str(path)!r}: {ckpt / DCP_DIR / '.metadata'} holds objects usp refuses to "
                f"unpickle ({first_failure(e)}); it was not written by usp. Point trainer.resume at another "
                f"step_<N> directory."
            ) from e
        raise ValueError(
            f"trainer.resume={str(path)!r}: {ckpt} does not fit this model/optimizer ({first_failure(e)}). "
            f"Resume with the model config and optimizer the checkpoint was saved with, or start fresh "
            f"with a new hydra.run.dir / trainer.checkpoint_dir."
        ) from e
    if optimizer is None:
        set_model_state_dict(model, state["model"], options=LOAD_OPTIONS)
    else:
        set_state_dict(
            model,
            optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
            options=LOAD_OPTIONS,
        )
    if scheduler is not None:
        if meta["scheduler"] is None:
            raise ValueError(
                f"checkpoint {ckpt} was saved without a scheduler; pass scheduler=None to load it."
            )
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
