"""A pool worker for the bad-settings tests of ``usp.train.trainer.run`` (shared by several test modules)."""

from __future__ import annotations

from usp.config import TrainConfig
from usp.train.trainer import run


def run_expecting_error(cfg: TrainConfig) -> str:
    """Worker: ``run(cfg)`` must raise ``ValueError`` on this rank; returns its message."""
    try:
        run(cfg)
    except ValueError as e:
        return str(e)
    raise AssertionError("run() accepted a bad config")
