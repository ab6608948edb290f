"""Units, defined once: token counts on the command line (``131072``, ``128K``, ``1M``: binary multiples, one
parser for every tool), bytes per GiB, the divisors of a count."""

from __future__ import annotations

import argparse
import math
import re

GIB = 1024**3
"""Bytes per GiB: every memory figure usp prints is in GiB (binary)."""


def divisors(n: int) -> list[int]:
    """The divisors of ``n >= 1``, ascending."""
    if n < 1:
        raise ValueError(f"divisors of {n}: need n >= 1")
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


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


LENGTH_KEYS: tuple[str, ...] = (
    "trainer.seq_len",
    "trainer.loss_chunk_size",
    "model.max_position_embeddings",
    "data.long_doc_threshold",
    "eval.lengths",
    "eval.original_context_length",
)
"""Config keys that hold token counts: on the command line they take the same syntax as ``--seq-len``."""
_LENGTH = re.compile(r"\s*\d+(?:\.\d+)?\s*[kKmMgG]\s*")


def expand_length_overrides(overrides: list[str]) -> list[str]:
    """``trainer.seq_len=1K`` -> ``trainer.seq_len=1024`` (and ``eval.lengths=[1K,2K]``): Hydra overrides of
    :data:`LENGTH_KEYS` in the one length syntax, made integers before Hydra types them. Anything else, and
    a value that is not a length, is left for Hydra (and its error)."""
    out = []
    for item in overrides:
        key, sep, value = item.partition("=")
        if sep and key.lstrip("+") in LENGTH_KEYS:
            listed = value.startswith("[") and value.endswith("]")
            parts = value[1:-1].split(",") if listed else [value]
            if any(_LENGTH.fullmatch(x) for x in parts):
                try:
                    ints = [str(parse_seq_len(x)) if _LENGTH.fullmatch(x) else x.strip() for x in parts]
                except ValueError:
                    out.append(item)
                    continue
                value = f"[{','.join(ints)}]" if listed else ints[0]
                item = f"{key}={value}"
        out.append(item)
    return out
