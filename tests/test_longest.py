"""usp.longest (the one grow-then-bisect search): against a brute force over known limits, and its edge cases."""

from __future__ import annotations

import pytest

from usp.longest import longest_passing, search_longest


def _under(limit: int, tried: list[int]):
    def passes(s: int) -> bool:
        tried.append(s)
        return s <= limit

    return passes


@pytest.mark.parametrize("factor", [2.0, 1.25])
def test_matches_brute_force(factor: float) -> None:
    unit, cap = 64, 64 * 40
    for start in (1, 64, 200, 1000, 5000):
        for limit in range(0, cap + 200, 37):
            tried: list[int] = []
            got = search_longest(_under(limit, tried), start=start, unit=unit, limit=cap, factor=factor)
            want = max((s for s in range(unit, cap + 1, unit) if s <= limit), default=None)
            assert got.length == want, (start, limit)
            assert all(s % unit == 0 and unit <= s <= cap for s in tried)
            assert len(set(tried)) == len(tried)  # nothing tried twice
            if want is None:
                assert got.stopped == "nothing_fits" and unit in tried
            elif want == cap:
                assert got.stopped == "limit"
            else:
                assert got.stopped == "converged" and want + unit in tried  # bracketed within one unit


def test_edges() -> None:
    tried: list[int] = []
    assert search_longest(_under(10**9, tried), start=100, unit=64, limit=63).stopped == "nothing_fits"
    assert tried == []  # no multiple of the unit under the limit: nothing is tried
    assert longest_passing(lambda s: True, 64, 64, 1000) == 960  # the limit, rounded down to the unit
    assert longest_passing(lambda s: False, 10**6, 64, 10**7) == 0
    assert longest_passing(lambda s: s <= 1 << 20, 1, 1, 1 << 30) == 1 << 20  # unit 1
    tried = []
    assert longest_passing(_under(4096, tried), 4096, 1024, 1 << 20) == 4096
    assert tried == [4096, 8192, 6144, 5120]  # double from a passing start, then bisect to one unit
    with pytest.raises(ValueError, match="factor"):
        search_longest(lambda s: True, start=1, unit=1, limit=8, factor=1.0)


def test_no_verdict_stops_with_the_longest_pass() -> None:
    verdicts = iter([True, True, None])
    got = search_longest(lambda s: next(verdicts), start=256, unit=256, limit=1 << 20)
    assert (got.length, got.stopped) == (512, "interrupted")
    assert search_longest(lambda s: None, start=256, unit=256, limit=1 << 20).length is None
