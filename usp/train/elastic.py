"""What the trainer takes from torchrun (``torch.distributed.elastic``): a rendezvous store per restart, and
error files.

**Store per restart.** torchrun hosts one TCPStore in its agent for the whole job and points every worker at
it (``MASTER_ADDR:MASTER_PORT``, ``TORCHELASTIC_USE_AGENT_STORE=True``); after ``--max-restarts`` restarts
the workers, the new workers meet in the *same* store, where the previous attempt's keys still are (gloo's
peer addresses, NCCL's unique id). ``init_process_group(init_method="env://")`` uses that store without a
per-attempt prefix, so a restarted rank can read a dead peer's address: gloo fails with "connectFullMesh
failed ... Connection refused" or hangs, depending on which rank writes first (2 failures in 6 restarts of a
plain gloo script on torch 2.13, docs/launch.md). :func:`launcher_store` opens the same store and prefixes
every key with the restart count (``TORCHELASTIC_RESTART_COUNT``), so each attempt sees only its own keys.

**Error files.** torchrun gives each worker ``TORCHELASTIC_ERROR_FILE`` and prints the content of the first
failing rank's file in its failure summary. :func:`record_error` writes it (the same JSON as
``torch.distributed.elastic.multiprocessing.errors.record``), for errors the entry point reports itself
instead of raising.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from datetime import timedelta

import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

STORE_PREFIX = "usp/restart_"
"""Every key of a launched job's store is under ``usp/restart_<TORCHELASTIC_RESTART_COUNT>/``."""


def restart_count(env: Mapping[str, str] | None = None) -> int:
    """How many times torchrun has restarted the workers (0 on the first attempt, and without torchrun)."""
    env = os.environ if env is None else env
    value = env.get("TORCHELASTIC_RESTART_COUNT", "0")
    return int(value) if value.isdigit() else 0


def launcher_store(timeout: timedelta, env: Mapping[str, str] | None = None) -> dist.Store:
    """The launcher's store (``MASTER_ADDR:MASTER_PORT``), with keys private to this restart attempt.

    Under torchrun the agent hosts the store (every rank is a client); under another ``env://`` launcher
    rank 0 hosts it, as ``init_method="env://"`` would. Pass the result to
    ``init_process_group(store=..., rank=RANK, world_size=WORLD_SIZE)``.
    """
    env = os.environ if env is None else env
    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    agent_hosts = env.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
    store = dist.TCPStore(
        env.get("MASTER_ADDR", "localhost"),
        int(env.get("MASTER_PORT", "29500")),
        world,
        is_master=not agent_hosts and rank == 0,
        timeout=timeout,
        multi_tenant=True,  # as env:// does: another group of this process may share the port
    )
    return dist.PrefixStore(f"{STORE_PREFIX}{restart_count(env)}", store)


def record_error(error: BaseException, *, with_traceback: bool = True) -> None:
    """Write ``error`` to this worker's torchrun error file (``TORCHELASTIC_ERROR_FILE``; nothing without it),
    where torchrun's failure summary shows it. Call inside the ``except`` block.

    ``with_traceback=False`` (a user error: a bad setting, whose message names the fix) records the message
    in place of the Python stack, so the summary shows the reason, not N copies of a traceback.
    """
    if with_traceback:
        ErrorHandler().record_exception(error)
        return
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    message = f"{type(error).__name__}: {error}"
    data = {
        "message": {
            "message": message,
            "extraInfo": {"py_callstack": message, "timestamp": str(int(time.time()))},
        }
    }
    with open(path, "w") as f:
        json.dump(data, f)
