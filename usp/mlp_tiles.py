"""The ``parallel.mlp_tiles`` rule, defined once (pure: no torch), for the trainer, the planner, ``usp-launch``
and the benchmarks.

``parallel.mlp_tiles``: ``1`` = off; an integer that divides the local tokens per rank
(``trainer.seq_len / (ulysses_degree x ring_degree)``); or ``auto``: tiles of about ``hidden_size`` tokens (a
tile's ``[tile, intermediate]`` tensors then take about as much memory as one MLP weight), i.e. the smallest
divisor of the local tokens that is at least ``ceil(local_tokens / hidden_size)``; 1 when the local sequence
is no longer than ``hidden_size``. What tiling does to a layer: :mod:`usp.train.tiling`.
"""

from __future__ import annotations

import math
from typing import Any

from usp.units import divisors


def check_mlp_tiles_setting(setting: Any) -> None:
    """``ValueError`` unless ``setting`` is ``"auto"`` or an integer >= 1 (a digit string counts)."""
    if setting == "auto":
        return
    if isinstance(setting, str) and setting.isdigit():
        setting = int(setting)
    if isinstance(setting, bool) or not isinstance(setting, int) or setting < 1:
        raise ValueError(f"parallel.mlp_tiles={setting!r} is invalid: use an integer >= 1 (1 = off) or auto.")


def resolve_mlp_tiles(setting: Any, *, local_tokens: int, hidden_size: int) -> int:
    """``parallel.mlp_tiles`` -> a tile count that divides ``local_tokens`` (``ValueError`` naming what works).

    ``local_tokens``: tokens per rank per sequence (``trainer.seq_len / (ulysses x ring)``). ``auto``: the
    module docstring's rule, the one used with explicit degrees; when the planner chooses the degrees, its own
    tile count is used instead.
    """
    if local_tokens < 1:
        raise ValueError(f"local tokens per rank must be >= 1 (got {local_tokens})")
    check_mlp_tiles_setting(setting)
    options = divisors(local_tokens)
    if setting == "auto":
        want = math.ceil(local_tokens / hidden_size)
        return next(d for d in options if d >= want)
    tiles = int(setting)
    if local_tokens % tiles != 0:
        shown = ", ".join(str(d) for d in options[:12]) + (", ..." if len(options) > 12 else "")
        raise ValueError(
            f"parallel.mlp_tiles={tiles} does not divide the {local_tokens} local tokens per rank "
            f"(trainer.seq_len / (ulysses_degree x ring_degree)); use one of its divisors ({shown}) or auto."
        )
    return tiles
