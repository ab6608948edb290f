"""Token counts on the command line: ``131072``, ``128K``, ``1M`` (binary multiples), one parser for every tool."""

from __future__ import annotations

import argparse
import re

_SUFFIX = {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3}


def parse_seq_len(text: str) -> int:
    """``"131072"``, ``"128K"``, ``"1M"``, ``"1.5M"`` -> tokens (K = 1024). An argparse ``type=``.

    Raises ``argparse.ArgumentTypeError`` (a ``ValueError``) for anything that is not a whole positive count.
    """
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgG]?)\s*", str(text))
    if not m:
        raise argparse.ArgumentTypeError(f"--seq-len={text!r}: use a token count like 131072, 128K or 1M.")
    value = float(m.group(1)) * _SUFFIX[m.group(2).lower()]
    if value != int(value) or value < 1:
        raise argparse.ArgumentTypeError(f"--seq-len={text!r} is not a whole positive number of tokens.")
    return int(value)
