"""The command-line value types the benchmarks share: comma-separated integers, lengths and ring layouts.

Each benchmark keeps its own flags and defaults (they differ per tool); what repeats is how a list of
values is read, so it is read once here, and a bad value is an argparse error naming the flag's value.
"""

from __future__ import annotations

import argparse

from usp.modes import check_ring_layout
from usp.units import parse_seq_len


def comma_ints(text: str) -> list[int]:
    """``"1,2,4"`` -> ``[1, 2, 4]`` (an argparse ``type=``)."""
    try:
        return [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: use whole numbers, comma-separated (e.g. 1,2,4)."
        ) from None


def comma_lengths(text: str) -> list[int]:
    """``"1024,4K,1M"`` -> token counts (:func:`usp.units.parse_seq_len`, the one length syntax)."""
    return [parse_seq_len(x) for x in str(text).split(",") if x.strip()]


def comma_ring_layouts(text: str) -> list[str]:
    """``"zigzag,contiguous"`` -> ring layouts, each one of :data:`usp.modes.RING_LAYOUTS`."""
    layouts = [x.strip() for x in str(text).split(",") if x.strip()]
    for layout in layouts:
        try:
            check_ring_layout(layout, setting="--layouts")
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None
    return layouts
