"""usp.bench.flags: the list values the benchmarks share, and their argparse errors."""

from __future__ import annotations

import argparse

import pytest

from usp.bench.flags import comma_ints, comma_lengths, comma_ring_layouts


def test_lists() -> None:
    assert comma_ints("1,2,4") == [1, 2, 4] and comma_ints("8") == [8] and comma_ints("4,") == [4]
    assert comma_lengths("1024,4K,1M") == [1024, 4096, 1 << 20]
    assert comma_ring_layouts("zigzag, contiguous,balanced") == ["zigzag", "contiguous", "balanced"]


def test_bad_values_are_argparse_errors() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ring", type=comma_ints, default="4,8")
    p.add_argument("--layouts", type=comma_ring_layouts, default="zigzag")
    assert p.parse_args([]).ring == [4, 8]  # string defaults go through the type too
    for argv in (["--ring", "2,x"], ["--layouts", "zigzag,ring"]):
        with pytest.raises(SystemExit):
            p.parse_args(argv)
    with pytest.raises(argparse.ArgumentTypeError, match="--layouts='ring' is invalid"):
        comma_ring_layouts("ring")
