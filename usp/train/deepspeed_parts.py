"""The DeepSpeed parts usp uses, imported on demand with a ``ValueError`` naming the setting that needs them.

DeepSpeed is optional (``pip install 'usp[deepspeed]'``; in ``dev``): ``parallel.mlp_tiles > 1`` uses its
``TiledMLP`` and ``optim.name=deepspeed_cpu_adam`` its ``DeepSpeedCPUAdam``. Versions before
:data:`MIN_VERSION` are refused (the interfaces used here were checked against it; see docs/memory.md).
"""

from __future__ import annotations

import importlib
from typing import Any

MIN_VERSION = (0, 19, 8)


def _version_tuple(version: str) -> tuple[int, ...]:
    parts = []
    for piece in version.split("+")[0].split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def import_deepspeed_part(module: str, name: str, *, setting: str, alternative: str) -> Any:
    """``getattr(import_module(module), name)``; ``ValueError`` naming ``setting`` and ``alternative`` when
    DeepSpeed is missing, older than :data:`MIN_VERSION`, or lacks the part."""
    wanted = ".".join(map(str, MIN_VERSION))
    try:
        import deepspeed

        part = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(
            f"{setting} uses DeepSpeed's {name}, which is not importable ({e}); install deepspeed>={wanted} "
            f"(pip install 'usp[deepspeed]') or set {alternative}."
        ) from e
    if _version_tuple(getattr(deepspeed, "__version__", "0")) < MIN_VERSION:
        raise ValueError(
            f"{setting} uses DeepSpeed's {name}, checked against deepspeed>={wanted}, but {deepspeed.__version__} "
            f"is installed; upgrade it (pip install 'usp[deepspeed]') or set {alternative}."
        )
    return part
