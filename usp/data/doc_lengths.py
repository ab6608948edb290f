"""Document-length distributions for packed rows: one spec parser for ``usp-bench`` and ``usp-plan``.

``--doc-lengths SPEC`` takes:

- ``lognormal:mean=8192[,sigma=1.0][,seed=0]`` - lengths drawn from a log-normal with that mean (``sigma`` of
  the underlying normal), packed until the row is full (the last document cut to fit);
- ``fixed:2048`` - documents of one length (the last one cut to fit);
- ``lengths:2048,65536,2048x31`` - these lengths in this order (``NxK``: ``K`` documents of ``N``), repeated
  until the row is full: one long document among short ones, a real row, ...;
- ``file:PATH`` (or just ``PATH`` of an existing file) - a corpus's document lengths (integers separated by
  whitespace or commas, or a JSON list); rows draw documents from it at random (``seed``), like packing.

Rows are deterministic: row ``i`` of a spec is the same everywhere (seeded by ``seed`` and ``i``).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

KINDS = ("lognormal", "fixed", "lengths", "file")


@dataclass(frozen=True)
class DocLengths:
    """A parsed ``--doc-lengths`` spec (see the module docstring); ``text`` is the spec as given."""

    kind: str
    text: str
    mean: float = 0.0
    sigma: float = 1.0
    seed: int = 0
    values: tuple[int, ...] = field(default=(), repr=False)

    def row(self, seq_len: int, index: int = 0) -> np.ndarray:
        """Document lengths (int64, all >= 1) of packed row ``index``, summing to ``seq_len``."""
        rng = np.random.default_rng([self.seed, index])
        out: list[np.ndarray] = []
        total = 0
        while total < seq_len:
            if self.kind == "lognormal":
                mu = math.log(self.mean) - self.sigma**2 / 2
                batch = np.maximum(1, np.rint(rng.lognormal(mu, self.sigma, 64))).astype(np.int64)
            elif self.kind == "file":
                batch = np.asarray(self.values, dtype=np.int64)[rng.integers(0, len(self.values), 64)]
            else:  # fixed, lengths: the list in order, again and again
                batch = np.asarray(self.values, dtype=np.int64)
            out.append(batch)
            total += int(batch.sum())
        lengths = np.concatenate(out)
        ends = np.cumsum(lengths)
        n = int(np.searchsorted(ends, seq_len)) + 1  # documents needed to reach seq_len
        lengths = lengths[:n].copy()
        lengths[-1] -= int(ends[n - 1]) - seq_len  # the last one cut to fit
        return lengths

    def rows(self, seq_len: int, count: int) -> list[np.ndarray]:
        return [self.row(seq_len, i) for i in range(count)]


def _number(key: str, text: str, spec: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"--doc-lengths {spec!r}: {key}={text!r} is not a number.") from None


def _int_list(text: str, spec: str) -> tuple[int, ...]:
    values: list[int] = []
    for item in re.split(r"[\s,]+", text.strip()):
        if not item:
            continue
        m = re.fullmatch(r"(\d+)(?:x(\d+))?", item)
        if not m:
            raise ValueError(f"--doc-lengths {spec!r}: {item!r} is not a length (N) or a repeat (NxCOUNT).")
        values += [int(m.group(1))] * int(m.group(2) or 1)
    if not values or min(values) < 1:
        raise ValueError(f"--doc-lengths {spec!r}: give at least one length, every length >= 1.")
    return tuple(values)


def parse_doc_lengths(spec: str) -> DocLengths:
    """Parse a ``--doc-lengths`` spec; ``ValueError`` naming the accepted forms otherwise."""
    forms = "lognormal:mean=8192[,sigma=1.0][,seed=0], fixed:2048, lengths:2048,65536,2048x31, file:PATH"
    kind, _, rest = spec.partition(":")
    if kind not in KINDS and Path(spec).is_file():
        kind, rest = "file", spec
    if kind == "lognormal":
        params = dict(item.split("=", 1) for item in rest.split(",") if "=" in item)
        unknown = set(params) - {"mean", "sigma", "seed"}
        if "mean" not in params or unknown:
            raise ValueError(f"--doc-lengths {spec!r}: lognormal takes mean=, sigma=, seed= (e.g. {forms}).")
        mean = _number("mean", params["mean"], spec)
        sigma = _number("sigma", params.get("sigma", "1.0"), spec)
        if mean < 1 or sigma < 0:
            raise ValueError(f"--doc-lengths {spec!r}: mean must be >= 1 and sigma >= 0.")
        seed = int(_number("seed", params.get("seed", "0"), spec))
        return DocLengths("lognormal", spec, mean=mean, sigma=sigma, seed=seed)
    if kind == "fixed":
        return DocLengths("fixed", spec, values=_int_list(rest, spec)[:1])
    if kind == "lengths":
        return DocLengths("lengths", spec, values=_int_list(rest, spec))
    if kind == "file":
        path = Path(rest)
        if not path.is_file():
            raise ValueError(f"--doc-lengths {spec!r}: no file {str(path)!r}.")
        text = path.read_text()
        values = (
            tuple(int(x) for x in json.loads(text))
            if text.lstrip().startswith("[")
            else _int_list(text, spec)
        )
        if not values or min(values) < 1:
            raise ValueError(f"--doc-lengths {spec!r}: the file must hold document lengths >= 1.")
        return DocLengths("file", spec, values=values)
    raise ValueError(f"--doc-lengths {spec!r} is not a document-length spec; use one of: {forms}.")


def boundaries(lengths: np.ndarray) -> np.ndarray:
    """``cu_seqlens`` (int64 ``[n + 1]``, ``0 .. sum``) of a row's document lengths."""
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
