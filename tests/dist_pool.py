"""A pool of gloo worker processes, one per rank, started once per world size and reused by many tests.

``pool.run(fn, *args)`` runs the module-level function ``fn(*args)`` on every rank (inside an initialized gloo
world) and returns the list of per-rank results, in rank order. If any rank raises, ``run`` raises
``WorkerError`` with every failing rank's traceback; if the ranks don't all answer within ``timeout`` seconds,
``run`` raises ``WorkerTimeout``. When ranks don't answer, either error's message holds the Python stacks (all
threads) of every worker still running, so a hang names the line each rank was stuck on: each worker registers
:mod:`faulthandler` on ``SIGUSR2`` (``usp.train.signals`` owns SIGUSR1) into a per-rank file, and the parent
signals them and reads the files before it kills them. After any failure the pool is torn down and restarted, so
one bad case never hangs or poisons the next. Every collective inside the workers has the process-group timeout
``collective_timeout_s``, so a rank left waiting on a peer that died raises instead of hanging.

Results travel through a pipe: return CPU tensors, numbers, dicts or lists of them.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import queue
import shutil
import signal
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any


class WorkerError(RuntimeError):
    def __init__(self, message: str, tracebacks: dict[int, str]):
        super().__init__(message)
        self.tracebacks = tracebacks


class WorkerTimeout(RuntimeError):
    pass


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(
    rank: int,
    world_size: int,
    port: int,
    tasks: Any,
    results: Any,
    collective_timeout_s: float,
    stack_file: str,
) -> None:
    # first of all: SIGUSR2 dumps every thread's stack into stack_file (the parent's hang report); the file stays
    # open for the process's life (faulthandler writes to its fd from the signal handler, GIL or not)
    # (the file appears under its name only once the handler is in place: the parent signals no worker before)
    stacks = open(stack_file + ".part", "w")  # noqa: SIM115
    faulthandler.register(signal.SIGUSR2, file=stacks, all_threads=True)
    os.rename(stack_file + ".part", stack_file)
    os.environ.update(
        {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank),
            "OMP_NUM_THREADS": "1",
        }
    )
    os.environ.pop("LOCAL_WORLD_SIZE", None)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=collective_timeout_s)
        )
        results.put(("ready", rank, True, None))
    except BaseException:  # noqa: BLE001 - report any start-up failure to the parent
        results.put(("ready", rank, False, traceback.format_exc()))
        return
    parent = os.getppid()
    while True:
        try:
            task = tasks.get(timeout=5)
        except queue.Empty:
            if os.getppid() != parent:  # the test process died (killed run): don't linger holding memory
                os._exit(1)
            continue
        if task is None:
            break
        task_id, fn, args, kwargs = task
        try:
            out = fn(*args, **kwargs)
            results.put((task_id, rank, True, out))
        except BaseException:  # noqa: BLE001 - send the traceback to the test
            results.put((task_id, rank, False, traceback.format_exc()))
    dist.destroy_process_group()


class DistPool:
    """``world_size`` gloo ranks in spawned processes; see the module docstring."""

    def __init__(
        self,
        world_size: int,
        *,
        timeout: float = 300.0,
        collective_timeout_s: float = 60.0,
        failure_grace_s: float | None = None,
    ):
        self.world_size = world_size
        self.timeout = timeout
        self.collective_timeout_s = collective_timeout_s
        # after a rank fails, how long the others get to report (default: one collective timeout and 10 s)
        self.failure_grace_s = collective_timeout_s + 10 if failure_grace_s is None else failure_grace_s
        import torch.multiprocessing as mp  # here, not at the top: a worker sets up its stack dump before torch

        self._ctx = mp.get_context("spawn")
        self._procs: list[Any] = []
        self._next_id = 0
        self._stack_dir = tempfile.mkdtemp(prefix="dist_pool_stacks_")
        self._start()

    def _start(self) -> None:
        for r in range(self.world_size):  # no stale stacks of a previous world
            for path in (self._stack_file(r), self._stack_file(r) + ".part"):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(path)
        port = _free_port()
        self._results = self._ctx.Queue()
        self._tasks = [self._ctx.Queue() for _ in range(self.world_size)]
        self._procs = [
            self._ctx.Process(
                target=_worker,
                args=(
                    r,
                    self.world_size,
                    port,
                    self._tasks[r],
                    self._results,
                    self.collective_timeout_s,
                    self._stack_file(r),
                ),
                daemon=True,
            )
            for r in range(self.world_size)
        ]
        for p in self._procs:
            p.start()
        self._collect("ready", self.timeout)

    def _stack_file(self, rank: int) -> str:
        return os.path.join(self._stack_dir, f"rank_{rank}.txt")

    def _dump_stacks(self, wait_s: float = 5.0) -> str:
        """Every live worker's Python stacks (all threads), through its SIGUSR2 faulthandler; '' if none live."""
        signalled, starting = [], []
        for rank, p in enumerate(self._procs):
            if not p.is_alive() or p.pid is None:
                continue
            if not os.path.exists(self._stack_file(rank)):  # SIGUSR2's default action would kill it
                starting.append(rank)
                continue
            try:
                os.kill(p.pid, signal.SIGUSR2)
                signalled.append(rank)
            except ProcessLookupError:
                pass
        dumps = {r: "" for r in signalled}
        deadline = time.monotonic() + wait_s
        pending = set(signalled)
        while pending and time.monotonic() < deadline:  # a dump is done when its file stops growing
            time.sleep(0.2)
            for rank in sorted(pending):
                text = _read(self._stack_file(rank))
                if text and text == dumps[rank]:
                    pending.discard(rank)
                dumps[rank] = text
        return "".join(
            f"\n--- rank {r} ({_proc_state(self._procs[r].pid)}) ---\n" + (dumps[r] or "(no stack written)\n")
            for r in signalled
        ) + "".join(
            f"\n--- rank {r}: still starting (before its stack dump was set up) ---\n" for r in starting
        )

    def _kill(self) -> None:
        for p in self._procs:
            if p.is_alive():
                p.kill()
        for p in self._procs:
            p.join(timeout=10)
        self._procs = []

    def _collect(self, task_id: Any, timeout: float) -> list[Any]:
        deadline = time.monotonic() + timeout
        grace = self.failure_grace_s
        out: dict[int, Any] = {}
        errors: dict[int, str] = {}
        while len(out) + len(errors) < self.world_size:
            if errors and deadline - time.monotonic() > grace:
                # one rank failed: give the others one collective timeout to report, then restart the world
                deadline = time.monotonic() + grace
            remaining = deadline - time.monotonic()
            if remaining <= 0 or any(not p.is_alive() for p in self._procs):
                if remaining > 0:
                    time.sleep(0.5)  # a dead process may still have a message in flight
                    while not self._results.empty() and len(out) + len(errors) < self.world_size:
                        self._accept(self._results.get(), task_id, out, errors)
                    if len(out) + len(errors) == self.world_size:
                        break
                missing = sorted(set(range(self.world_size)) - set(out) - set(errors))
                dead = {r: p.exitcode for r, p in enumerate(self._procs) if r in missing and not p.is_alive()}
                if dead:  # a signal's exit code is minus its number (-9: SIGKILL, the OOM killer's)
                    msg = f"ranks {sorted(dead)} exited without answering (exit codes {dead})"
                elif errors:
                    msg = f"ranks {missing} did not answer within {grace:.0f}s of ranks {sorted(errors)} failing"
                else:
                    msg = f"ranks {missing} did not answer within {timeout:.0f}s"
                stacks = self._dump_stacks()
                if stacks:
                    msg += "\nPython stacks of the workers still running (all threads):" + stacks
                self._kill()
                if errors:
                    raise WorkerError(msg + "\n" + _format(errors), errors)
                raise WorkerTimeout(msg)
            try:
                item = self._results.get(timeout=min(remaining, 1.0))
            except Exception:  # queue.Empty
                continue
            self._accept(item, task_id, out, errors)
        if errors:
            self._kill()
            raise WorkerError(_format(errors), errors)
        return [out[r] for r in range(self.world_size)]

    @staticmethod
    def _accept(item: tuple, task_id: Any, out: dict, errors: dict) -> None:
        tid, rank, ok, payload = item
        if tid != task_id:
            return  # stale answer from a task that already failed
        (out if ok else errors)[rank] = payload

    def run(
        self, fn: Callable[..., Any], *args: Any, timeout: float | None = None, **kwargs: Any
    ) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; return the per-rank results in rank order."""
        if not self._procs:
            self._start()
        self._next_id += 1
        task_id = self._next_id
        for q in self._tasks:
            q.put((task_id, fn, args, kwargs))
        try:
            return self._collect(task_id, self.timeout if timeout is None else timeout)
        except (WorkerError, WorkerTimeout):
            self._procs = [] if not any(p.is_alive() for p in self._procs) else self._procs
            self._kill()
            raise

    def close(self) -> None:
        for q in self._tasks:
            q.put(None)
        for p in self._procs:
            p.join(timeout=10)
        self._kill()
        shutil.rmtree(self._stack_dir, ignore_errors=True)


def _proc_state(pid: int) -> str:
    """``pid``'s kernel state, wait channel and resident memory (Linux /proc; a C-level wait or a process stalled
    on memory shows here when its Python stack looks idle)."""
    stat = _read(f"/proc/{pid}/stat").rsplit(")", 1)[-1].split()
    if len(stat) < 22:
        return f"pid {pid}"
    rss_mib = int(stat[21]) * os.sysconf("SC_PAGE_SIZE") >> 20
    wchan = _read(f"/proc/{pid}/wchan") or "?"
    return f"pid {pid}, state {stat[0]}, wchan {wchan}, rss {rss_mib} MiB, {_threads(pid)} threads"


def _threads(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/task"))
    except OSError:
        return 0


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def _format(errors: dict[int, str]) -> str:
    return "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
