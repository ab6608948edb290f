"""Ranks agree on failures: an error on one rank is raised on every rank, so no rank waits in a collective.

One home for the patterns the trainer, checkpoints, the data loader, model loading and the export share:

- :func:`raise_if_any_failed` -- every rank passes its local error (or ``None``); all raise if any failed;
- :func:`on_every_rank` -- run a function on every rank and share its failure the same way;
- :func:`on_rank0` -- run a function on rank 0 only and hand its result (or its failure) to every rank.

A user error (``ValueError``) stays a ``ValueError`` on the other ranks, with the failing rank's message, so
the entry point prints the same one line everywhere. Every function works without an initialized process
group (one process: it simply runs or raises). Each costs one object collective of short strings.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

T = TypeVar("T")


def distributed() -> bool:
    """True when a process group is initialized (the functions below are then collective)."""
    return dist.is_available() and dist.is_initialized()


def dist_rank() -> int:
    return dist.get_rank() if distributed() else 0


def dist_world_size() -> int:
    return dist.get_world_size() if distributed() else 1


def _report(error: BaseException | None) -> tuple[bool, str] | None:
    return None if error is None else (isinstance(error, ValueError), f"{type(error).__name__}: {error}")


def _raise_first(reports: list[tuple[bool, str] | None], what: str, cause: BaseException | None) -> None:
    failed = [(rank, r) for rank, r in enumerate(reports) if r is not None]
    if not failed:
        return
    ranks = [rank for rank, _ in failed]
    rank, (is_value_error, message) = failed[0]
    where = f"rank {rank}" if len(failed) == 1 else f"rank(s) {ranks} (first: rank {rank})"
    cls = ValueError if is_value_error else RuntimeError
    raise cls(f"{what} failed on {where}: {message}") from cause


def raise_if_any_failed(error: BaseException | None, what: str) -> None:
    """Collective: raise on every rank if ``error`` is set on any rank; otherwise return.

    ``ValueError`` when the first failing rank's error was one (a user mistake), else ``RuntimeError``; the
    message names ``what``, the failing ranks and the first one's error.
    """
    if not distributed():
        if error is not None:
            cls = ValueError if isinstance(error, ValueError) else RuntimeError
            raise cls(f"{what} failed: {type(error).__name__}: {error}") from error
        return
    reports: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(reports, _report(error))
    _raise_first(reports, what, error)


def on_every_rank(fn: Callable[[], T], what: str) -> T:
    """Run ``fn`` on every rank; if it raises on any rank, raise on every rank (no rank left hanging).

    The failing rank re-raises its own exception (its traceback intact); the others raise ``ValueError`` (for
    a user error) or ``RuntimeError`` quoting the first failing rank's message.
    """
    result: Any = None
    error: BaseException | None = None
    try:
        result = fn()
    except Exception as e:  # noqa: BLE001 - shared with the other ranks, then re-raised
        error = e
    if not distributed():
        if error is not None:
            raise error
        return result
    reports: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(reports, _report(error))
    if error is not None:
        raise error
    _raise_first(reports, what, None)
    return result


def on_rank0(fn: Callable[[], T], what: str) -> T:
    """Run ``fn`` on global rank 0 only and return its result on every rank (it must pickle).

    If ``fn`` raises, rank 0 re-raises it and every other rank raises ``ValueError``/``RuntimeError`` with its
    message. Collective: one ``broadcast_object_list`` that every rank reaches.
    """
    if not distributed() or dist.get_world_size() == 1:
        return fn()
    box: list[Any] = [None]
    failure: BaseException | None = None
    if dist.get_rank() == 0:
        try:
            box[0] = ("ok", fn())
        except BaseException as e:  # noqa: BLE001 - every rank must learn of the failure, not hang
            failure = e
            box[0] = ("error", _report(e))
    dist.broadcast_object_list(box, src=0)
    if failure is not None:
        raise failure
    kind, payload = box[0]
    if kind != "ok":
        _raise_first([payload], what, None)
    return payload
