"""The model against the resolved degrees, the same checks for training and evaluation."""

from __future__ import annotations

from typing import Any

from usp.model import check_heads, check_rope_for_sequence_parallel
from usp.startup.degrees import ResolvedDegrees


def check_model_for_degrees(model_config: Any, degrees: ResolvedDegrees) -> None:
    """The attention heads split over ``ulysses_degree`` (:func:`usp.model.check_heads`) and the RoPE suits a
    sequence sharded over ``ulysses_degree x ring_degree`` ranks (:func:`usp.model.check_rope_for_sequence_parallel`).
    ``ValueError`` naming the setting and the fix."""
    check_heads(model_config, degrees.ulysses_degree)
    check_rope_for_sequence_parallel(model_config, degrees.ulysses_degree * degrees.ring_degree)
