"""Every random number generator a training rank uses, seeded once and saved with each checkpoint.

``rng_state`` / ``set_rng_state`` carry torch's CPU generator, Python's ``random``, numpy's global generator and
(on CUDA) this rank's device generator, so a resumed run draws what the uninterrupted one would have drawn.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def rng_state(device: torch.device) -> dict[str, Any]:
    """This rank's RNG states as plain data (tensors, ints, tuples), so a checkpoint loads with
    ``weights_only=True``: numpy's ``(name, uint32 keys, pos, has_gauss, cached_gaussian)`` keeps its keys as
    an int64 tensor."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": (
            str(name),
            torch.from_numpy(keys.astype(np.int64)),
            int(pos),
            int(has_gauss),
            float(cached),
        ),
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    """Restore what :func:`rng_state` saved (the CUDA state only on a CUDA device)."""
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def seed_everything(seed: int) -> None:
    """Seed Python's ``random``, numpy and torch (every device) from ``trainer.seed``."""
    random.seed(seed)
    np.random.seed(seed % (1 << 32))
    torch.manual_seed(seed)
