"""The wandb run of a run dir: one run per run dir (:func:`wandb_run_id`), across requeues and resumes;
wandb imported only when ``logging.wandb.mode`` is not ``disabled``."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

from usp.config import WandbConfig


def wandb_run_id(run_dir: str | os.PathLike) -> str:
    """The wandb run id of a run dir: a hash of its absolute path, so a requeued, resubmitted or relaunched
    job that continues in the same run dir continues the same wandb run (``resume="allow"``)."""
    return "usp-" + hashlib.sha256(str(Path(run_dir).resolve()).encode()).hexdigest()[:16]


def init_wandb(cfg: WandbConfig, run_dir: Path, config: dict, layout: dict) -> Any:
    """``wandb.init`` for the run in ``run_dir`` (``resume="allow"``, the run id of the dir).
    ``ImportError`` naming the extra and the setting when wandb is not installed."""
    try:
        import wandb
    except ImportError as err:
        raise ImportError(
            f"logging.wandb.mode={cfg.mode} needs the wandb package: pip install 'usp[wandb]', "
            "or set logging.wandb.mode=disabled."
        ) from err
    return wandb.init(
        project=cfg.project,
        entity=cfg.entity,
        name=cfg.name,
        tags=list(cfg.tags) or None,
        mode=cfg.mode,
        dir=str(run_dir),  # offline runs land in <run_dir>/wandb/offline-run-*
        id=wandb_run_id(run_dir),  # one wandb run per run dir, across requeues and resumes
        resume="allow",
        config={**config, "layout": layout},
    )
