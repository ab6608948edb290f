"""Preemption and Ctrl-C: SIGTERM, SIGUSR1 or SIGINT stops the run at the next step boundary, every rank
together, after a checkpoint.

A cluster preempts or ends a job with a signal (SLURM: SIGTERM at preemption or the time limit, and
``sbatch --signal=USR1@<seconds>`` some time before the limit; torchrun forwards SIGTERM, and SIGUSR1 with
``--signals-to-handle``, to its workers); Ctrl-C sends SIGINT to the foreground process group, and torchrun
forwards the SIGINT it gets to its workers too. A SIGINT is treated as SIGTERM is, rather than as Python's
``KeyboardInterrupt`` raised inside whatever collective a rank is in (which lost the steps since the last
checkpoint). The handler only records the signal; the training loop asks
:meth:`StopRequest.agreed` once per optimizer step, a one-element all-reduce (MAX) on the default group,
so every rank sees a signal that reached any of them at the same step, saves the same checkpoint and
stops. The entry point then exits with :data:`REQUEUE_EXIT_CODE` (75).
"""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

STOP_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
REQUEUE_EXIT_CODE = 75
"""Exit status of a run stopped by SIGTERM/SIGUSR1/SIGINT once its checkpoint is saved: ``EX_TEMPFAIL``, "try
again"; ``launch/slurm.sbatch`` requeues the job, which resumes from that checkpoint."""


class StopRequest:
    """Records SIGTERM / SIGUSR1 / SIGINT while installed (a context manager; handlers restored on exit).

    Installs nothing outside the main thread (Python delivers signals there only), where :meth:`agreed`
    still sees the other ranks' signals.
    """

    def __init__(self, signals: tuple[signal.Signals, ...] = STOP_SIGNALS) -> None:
        self.signals = signals
        self.received: signal.Signals | None = None
        self._previous: dict[signal.Signals, Any] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.received = signal.Signals(signum)

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    def agreed(self, device: torch.device, group: dist.ProcessGroup | None = None) -> bool:
        """Whether any rank of ``group`` (default: all) received a stop signal. Collective: call on every rank
        at the same point of every step; one int32 all-reduce on ``device``."""
        flag = torch.tensor(
            [0 if self.received is None else int(self.received)], dtype=torch.int32, device=device
        )
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        value = int(flag.item())
        if value and self.received is None:
            self.received = signal.Signals(value)  # another rank's signal: name it in this rank's log too
        return bool(value)
