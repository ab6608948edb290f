"""What the checkpoint save and load share around ``torch.distributed.checkpoint`` (DCP).

- :func:`model_optim_state` - the ``{"model": ..., "optim": ...}`` state DCP writes and reads, through
  ``get_state_dict`` (the model's own FQNs; FSDP2 shards as DTensors, so a load reshards);
- :func:`single_process_quiet` - DCP without a process group, minus its "single process" warning;
- :func:`first_failure` - the first rank's error out of DCP's gathered ``CheckpointException``.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_state_dict
from torch.optim import Optimizer

STATE_OPTIONS = StateDictOptions(ignore_frozen_params=True)
"""Frozen parameters are not checkpointed: a LoRA run's base weights are ``model.path`` itself, loaded again at
resume (:mod:`usp.model.lora`); only what trains (and its optimizer states) is written."""
LOAD_OPTIONS = StateDictOptions(ignore_frozen_params=True, strict=False)
"""Loading what :data:`STATE_OPTIONS` saved: not strict about the frozen parameters, which are not in it. The
state DCP fills is :func:`model_optim_state`'s (every trainable key; DCP fails on one the checkpoint lacks), so
nothing trainable is left unloaded."""


def model_optim_state(model: torch.nn.Module, optimizer: Optimizer | None) -> dict[str, Any]:
    """``{"model": state}`` or, with an optimizer, ``{"model": ..., "optim": ...}`` for DCP: the trainable
    parameters (:data:`STATE_OPTIONS`), buffers, and the optimizer's states."""
    if optimizer is None:
        return {"model": get_model_state_dict(model, options=STATE_OPTIONS)}
    model_sd, optim_sd = get_state_dict(model, optimizer, options=STATE_OPTIONS)
    return {"model": model_sd, "optim": optim_sd}


@contextlib.contextmanager
def single_process_quiet() -> Iterator[None]:
    """Silence DCP's "assuming the intent is to save in a single process" warning: that is our intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to .* in a single process")
        yield


def first_failure(error: CheckpointException) -> str:
    """``"rank <r>: <type>: <message>"`` of the lowest rank that failed."""
    for rank, (exc, _) in sorted(error.failures.items()):
        return f"rank {rank}: {type(exc).__name__}: {exc}"
    return str(error)
