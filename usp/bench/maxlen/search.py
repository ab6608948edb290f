"""The search of ``python -m usp.bench.maxlen``: what one attempt measured (:class:`Attempt`), the longest
length that trained (:func:`search`, the one grow-then-bisect walk of :mod:`usp.longest`) and the report's
table."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from usp.longest import search_longest

BOUND_STATUSES: tuple[str, ...] = ("oom", "host_mem", "timeout", "killed")
"""Outcomes that bound the answer from above (a longer sequence would fail too); ``error`` and ``budget`` stop
the search instead."""


@dataclass
class Attempt:
    """One tried length and what it measured (``None`` where it did not get that far)."""

    seq_len: int
    status: str
    mlp_tiles: int | None = None
    wall_s: float = 0.0
    step_time_s: float | None = None
    tokens_per_s: float | None = None
    mfu: float | None = None
    peak_mem_gib: float | None = None
    peak_mem_reserved_gib: float | None = None
    error: str | None = None
    planner: dict[str, Any] = field(default_factory=dict)
    """:func:`usp.plan.evaluate_layout` at this length: ``mem_gib_per_gpu``, ``host_mem_gib_per_node``,
    ``step_time_s``, ``mfu``, ``fits`` (with the planner's default headroom)."""

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def search(
    try_len: Callable[[int], Attempt],
    *,
    start: int,
    granularity: int,
    max_len: int,
    factor: float = 1.25,
    time_left: Callable[[], bool] = lambda: True,
) -> tuple[int | None, str, list[Attempt]]:
    """The longest length (a multiple of ``granularity``, at most ``max_len``) for which ``try_len`` succeeds,
    assuming success is monotone (shorter fits when longer does).

    Returns ``(longest ok or None, why it stopped, attempts in order)``; why: ``converged`` (the longest ok and
    the shortest failure are one granule apart), ``limit`` (``max_len`` trained), ``nothing_fits`` (the
    smallest length failed), ``budget`` (``time_left()`` said stop, or an attempt was cut by the budget),
    ``error`` (an attempt failed for another reason than memory or time).
    """
    attempts: list[Attempt] = []
    stop = {"why": "budget"}

    def passes(s: int) -> bool | None:
        if not time_left():
            stop["why"] = "budget"
            return None
        a = try_len(s)
        attempts.append(a)
        if a.ok or a.status in BOUND_STATUSES:
            return a.ok
        stop["why"] = a.status
        return None

    found = search_longest(passes, start=start, unit=granularity, limit=max_len, factor=factor)
    return found.length, stop["why"] if found.stopped == "interrupted" else found.stopped, attempts


def attempt_from(result: dict[str, Any], planner: dict[str, Any]) -> Attempt:
    """An :class:`Attempt` from :func:`usp.bench.maxlen.attempt.launch`'s result: the last step's time,
    tokens/s and MFU (the first may include warm-up), the peaks over all steps."""
    recs = result.get("records") or []
    last = recs[-1] if recs else {}

    def peak(key: str) -> float | None:
        values = [r[key] for r in recs if r.get(key) is not None]
        return max(values) if values else None

    return Attempt(
        seq_len=int(result["seq_len"]),
        status=result["status"],
        mlp_tiles=(result.get("layout") or {}).get("mlp_tiles"),
        wall_s=round(float(result.get("wall_s", 0.0)), 1),
        step_time_s=last.get("step_time_s"),
        tokens_per_s=last.get("tokens_per_s"),
        mfu=last.get("mfu"),
        peak_mem_gib=peak("peak_mem_gib"),
        peak_mem_reserved_gib=peak("peak_mem_reserved_gib"),
        error=result.get("error"),
        planner=planner,
    )


def fmt_cell(x: Any, spec: str) -> str:
    """``x`` formatted with ``spec``, ``-`` for None (a table cell)."""
    return "-" if x is None else format(x, spec)


def table(attempts: Sequence[Attempt]) -> str:
    """The attempts, longest first, as a Markdown table (measured, then the planner's figures)."""
    head = (
        "| seq_len | status | tiles | step s | tokens/s | MFU | peak alloc GiB | peak reserved GiB | planner GiB "
        "| planner step s | planner MFU | wall s |"
    )
    rows = [head, "|" + " --- |" * (head.count("|") - 1)]
    for a in sorted(attempts, key=lambda a: -a.seq_len):
        p = a.planner
        rows.append(
            f"| {a.seq_len} | {a.status} | {fmt_cell(a.mlp_tiles, 'd')} | {fmt_cell(a.step_time_s, '.2f')} | "
            f"{fmt_cell(a.tokens_per_s, '.0f')} | {fmt_cell(None if a.mfu is None else 100 * a.mfu, '.1f')}"
            f"{'%' if a.mfu is not None else ''} | {fmt_cell(a.peak_mem_gib, '.2f')} | {fmt_cell(a.peak_mem_reserved_gib, '.2f')} | "
            f"{fmt_cell(p.get('mem_gib_per_gpu'), '.2f')} | {fmt_cell(p.get('step_time_s'), '.2f')} | "
            f"{fmt_cell(None if p.get('mfu') is None else 100 * p['mfu'], '.1f')} | {a.wall_s:.0f} |"
        )
    return "\n".join(rows)
