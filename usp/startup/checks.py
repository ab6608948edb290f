"""The model against the resolved degrees, the same checks for training and evaluation."""

from __future__ import annotations

from typing import Any

from usp.model import check_heads
from usp.parallel import ParallelLayout


def check_model_for_degrees(model_config: Any, degrees: ParallelLayout) -> None:
    """The attention heads split over ``ulysses_degree`` (:func:`usp.model.check_heads`); ``ValueError`` naming
    the setting and the fix. (RoPE types that depend on the longest position a call sees, ``dynamic`` and
    ``longrope``, are made exact by ``apply_usp``: :mod:`usp.model.global_positions`.)"""
    check_heads(model_config, degrees.ulysses_degree)
