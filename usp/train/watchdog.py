"""A step-level watchdog: a rank that stops making progress fails the job in seconds, with Python stacks,
instead of holding every rank in a collective for ``parallel.timeout_minutes``.

Each rank runs one :class:`StepWatchdog` thread beside its training loop. It fails the process when

- a training step has run longer than ``factor`` x the running median of the previous steps (the last
  :data:`HISTORY` steps, once :data:`WARMUP_STEPS` are known) and at least ``min_seconds``; or
- nothing has progressed (no step begun or ended, no checkpoint or evaluation finished) for ``minutes``.

Failing means: one line on stderr saying which rule fired, then :func:`faulthandler.dump_traceback` of every
thread of this process (where the main thread waits: usually a collective, for the rank that is not stuck),
the same line in the torchrun error file, and ``os._exit(WATCHDOG_EXIT_CODE)``. torchrun then stops the other
ranks (a stopped, SIGSTOP'ed rank after its ``--shutdown-timeout``, 30 s by default). A rank that is itself
frozen cannot report; the others' messages name the step they wait in. Checkpoint saves and evaluations
are not steps: only the ``minutes`` rule covers them.
"""

from __future__ import annotations

import faulthandler
import os
import statistics
import sys
import threading
import time
from collections import deque
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from usp.config import TrainerConfig

WATCHDOG_EXIT_CODE = 3
"""Exit status of a rank the watchdog failed."""
HISTORY = 50
WARMUP_STEPS = 3


class StepWatchdog:
    """Watches one rank's steps from a daemon thread; see the module docstring for the rules.

    Args:
        factor: a step slower than ``factor`` x the running median fails the job; 0 turns the rule off.
        minutes: no progress for this many minutes fails the job; 0 turns the rule off.
        min_seconds: the step rule never fires before a step has run this long (one slow step on a noisy
            machine is no hang).
        rank: named in the message.
        poll_s: how often the thread looks.
    """

    def __init__(
        self, *, factor: float, minutes: float, min_seconds: float, rank: int = 0, poll_s: float = 0.5
    ) -> None:
        if factor < 0 or minutes < 0 or min_seconds < 0:
            raise ValueError(
                f"trainer.watchdog_factor={factor}, trainer.watchdog_minutes={minutes} and "
                f"trainer.watchdog_min_seconds={min_seconds} must be >= 0 (0 turns a rule off)."
            )
        self.factor, self.minutes, self.min_seconds = factor, minutes, min_seconds
        self.rank, self.poll_s = rank, poll_s
        self.durations: deque[float] = deque(maxlen=HISTORY)
        self._step: int | None = None
        self._step_start = 0.0
        self._last_progress = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def enabled(self) -> bool:
        return self.factor > 0 or self.minutes > 0

    def __enter__(self) -> StepWatchdog:
        if self.enabled:
            self._last_progress = time.monotonic()
            self._thread = threading.Thread(target=self._watch, name="usp-step-watchdog", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def begin_step(self, step: int) -> None:
        self._step, self._step_start = step, time.monotonic()
        self._last_progress = self._step_start

    def end_step(self) -> None:
        now = time.monotonic()
        if self._step is not None:
            self.durations.append(now - self._step_start)
        self._step, self._last_progress = None, now

    def beat(self) -> None:
        """Progress outside a step (a checkpoint saved, an evaluation done)."""
        self._last_progress = time.monotonic()

    def check(self, now: float | None = None) -> str | None:
        """The reason to fail now, or None (the thread calls this every ``poll_s``)."""
        now = time.monotonic() if now is None else now
        step = self._step
        if step is not None and self.factor > 0 and len(self.durations) >= WARMUP_STEPS:
            median = statistics.median(self.durations)
            elapsed = now - self._step_start
            if elapsed > max(self.factor * median, self.min_seconds):
                return (
                    f"step {step + 1} has run {elapsed:.1f} s, more than trainer.watchdog_factor={self.factor:g} x "
                    f"the median step ({median:.3f} s) and trainer.watchdog_min_seconds={self.min_seconds:g}"
                )
        idle = now - self._last_progress
        if self.minutes > 0 and idle > self.minutes * 60:
            where = f"in step {step + 1}" if step is not None else "between steps"
            return f"no progress for {idle / 60:.1f} min ({where}), trainer.watchdog_minutes={self.minutes:g}"
        return None

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            reason = self.check()
            if reason is not None:
                self._fail(reason)

    def _fail(self, reason: str) -> None:
        from usp.startup.error_file import record_error

        message = (
            f"usp-train: watchdog: rank {self.rank}: {reason}; a rank is stuck or stopped. Python stacks of "
            f"rank {self.rank} follow; failing the job (exit {WATCHDOG_EXIT_CODE})."
        )
        print(message, file=sys.stderr, flush=True)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stderr.flush()
        try:
            record_error(RuntimeError(message), with_traceback=False)
        finally:
            os._exit(WATCHDOG_EXIT_CODE)


def build_watchdog(trainer: TrainerConfig, rank: int) -> StepWatchdog:
    """The step watchdog ``trainer.watchdog_factor`` / ``watchdog_min_seconds`` / ``watchdog_minutes`` ask for."""
    return StepWatchdog(
        factor=float(trainer.watchdog_factor),
        minutes=float(trainer.watchdog_minutes),
        min_seconds=float(trainer.watchdog_min_seconds),
        rank=rank,
    )
