"""The longest length that passes a monotone test, found once for every tool: grow, then bisect.

``usp.bench.throughput --find-max`` (a training step that fits the device) and ``usp.bench.maxlen`` (a whole
trainer run per length) both search the longest sequence this way. Passing must be monotone: when a length
passes, every shorter one does.

The walk: test ``start`` (rounded down to a multiple of ``unit``, at most ``limit``); while it passes, grow by
``factor`` (rounded up to the next multiple, capped at the limit); when it fails, shrink by ``factor`` until one
passes; then bisect between the longest pass and the shortest failure until they are one ``unit`` apart. Every
length tried is a multiple of ``unit`` and none is tried twice.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

Stopped = Literal["converged", "limit", "nothing_fits", "interrupted"]


@dataclass(frozen=True)
class Longest:
    """What :func:`search_longest` found: ``length`` (the longest that passed, ``None`` when none did) and why it
    stopped: ``converged`` (the shortest failure is one unit longer), ``limit`` (the longest multiple of the
    unit under the limit passed), ``nothing_fits`` (one unit failed, or the limit is below one unit),
    ``interrupted`` (the test returned ``None``: neither pass nor fail, e.g. out of time or another error)."""

    length: int | None
    stopped: Stopped


def floor_multiple(x: float, unit: int) -> int:
    """``x`` rounded down to a multiple of ``unit``, at least ``unit``."""
    return max(unit, int(x) // unit * unit)


def ceil_multiple(x: float, unit: int) -> int:
    """``x`` rounded up to a multiple of ``unit``."""
    return -(-math.ceil(x) // unit) * unit


def search_longest(
    passes: Callable[[int], bool | None], *, start: int, unit: int, limit: int, factor: float = 2.0
) -> Longest:
    """The longest multiple of ``unit`` at most ``limit`` for which ``passes`` is true (see the module).

    ``passes(length)`` returns ``True`` (passes), ``False`` (fails: every longer length fails too) or ``None``
    (no verdict: the search stops and reports the longest pass so far as ``interrupted``).
    """
    if unit < 1 or factor <= 1:
        raise ValueError(f"search_longest: need unit >= 1 and factor > 1 (got unit={unit}, factor={factor}).")
    if limit < unit:
        return Longest(None, "nothing_fits")
    top = limit // unit * unit
    lo: int | None = None  # the longest pass
    hi: int | None = None  # the shortest failure
    s = min(floor_multiple(start, unit), top)
    verdict = passes(s)
    if verdict is None:
        return Longest(None, "interrupted")
    if verdict:
        lo = s
        while hi is None:  # grow
            if lo >= top:
                return Longest(lo, "limit")
            nxt = min(ceil_multiple(lo * factor, unit), top)
            verdict = passes(nxt)
            if verdict is None:
                return Longest(lo, "interrupted")
            lo, hi = (nxt, None) if verdict else (lo, nxt)
    else:
        hi = s
        while lo is None:  # shrink
            if hi <= unit:
                return Longest(None, "nothing_fits")
            nxt = min(floor_multiple(hi / factor, unit), hi - unit)
            verdict = passes(nxt)
            if verdict is None:
                return Longest(None, "interrupted")
            lo, hi = (nxt, hi) if verdict else (None, nxt)
    while hi - lo > unit:  # bisect
        mid = floor_multiple((lo + hi) // 2, unit)
        verdict = passes(mid)
        if verdict is None:
            return Longest(lo, "interrupted")
        lo, hi = (mid, hi) if verdict else (lo, mid)
    return Longest(lo, "converged")


def longest_passing(
    passes: Callable[[int], bool], start: int, unit: int, limit: int, factor: float = 2.0
) -> int:
    """The longest multiple of ``unit`` at most ``limit`` that ``passes`` (0 when none does): doubling from
    ``start`` (halving when it fails), then bisection (:func:`search_longest`)."""
    return search_longest(passes, start=start, unit=unit, limit=limit, factor=factor).length or 0
