"""RULER's string-match scores, the per-length means and the effective length.

A prediction is the decoded answer, cut at EOS and at a stop string, with non-printable characters dropped.
``string_match_all`` (every synthetic task, as in RULER): the fraction of the references that occur in the
prediction, case-insensitive; 1 when all do. ``string_match_part``: 1 when any does (RULER's QA metric, kept
for tasks that accept one of several answers).

The effective length (RULER's question "up to which length does the model still work?"): the longest evaluated
length such that it and every shorter one have a mean score of at least ``threshold`` x the shortest length's
mean (``eval.ruler.threshold``, default 0.85); None when the shortest length scores 0.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

STOP_STRINGS: tuple[str, ...] = ("\n\n",)
"""An answer ends at a blank line after its first letter or digit (base models go on with a new question;
the blank line after an opening ":" does not count)."""


def _answer_start(text: str) -> int:
    """Index of the first letter or digit (``len(text)`` when there is none)."""
    return next((i for i, c in enumerate(text) if c.isalnum()), len(text))


def clean_prediction(text: str, stop_strings: Sequence[str] = STOP_STRINGS) -> str:
    """``text`` cut at the first stop string after its first letter or digit, non-printables dropped, stripped."""
    start = _answer_start(text)
    for stop in stop_strings:
        at = text.find(stop, start)
        if at >= 0:
            text = text[:at]
    return "".join(c for c in text if c.isprintable() or c in "\n\t").strip()


def stopped(text: str, stop_strings: Sequence[str] = STOP_STRINGS) -> bool:
    """Whether a partial answer already holds a stop string after its first letter or digit."""
    start = _answer_start(text)
    return any(text.find(stop, start) >= 0 for stop in stop_strings)


def string_match_all(prediction: str, references: Sequence[str]) -> float:
    """The fraction of ``references`` found in ``prediction`` (case-insensitive)."""
    assert references, "a sample without references"
    low = prediction.lower()
    return sum(r.lower() in low for r in references) / len(references)


def string_match_part(prediction: str, references: Sequence[str]) -> float:
    """1.0 when any of ``references`` is found in ``prediction`` (case-insensitive), else 0.0."""
    assert references, "a sample without references"
    low = prediction.lower()
    return float(any(r.lower() in low for r in references))


METRICS = {"string_match_all": string_match_all, "string_match_part": string_match_part}


def score(task: str, prediction: str, references: Sequence[str]) -> float:
    """The sample's score in [0, 1]: RULER's ``string_match_all`` for every synthetic task."""
    del task  # every synthetic task uses the same metric; kept so the table can grow per task
    return string_match_all(prediction, references)


def summarize(trials: Iterable[dict], tasks: Sequence[str], lengths: Sequence[int]) -> tuple[dict, dict]:
    """``(tasks[task][str(length)] = mean score, mean[str(length)] = mean over tasks)``."""
    rows = list(trials)
    table: dict[str, dict[str, float]] = {}
    for task in tasks:
        table[task] = {}
        for length in lengths:
            scores = [r["score"] for r in rows if r["task"] == task and r["length"] == length]
            table[task][str(length)] = sum(scores) / len(scores) if scores else float("nan")
    mean = {str(n): sum(table[t][str(n)] for t in tasks) / len(tasks) for n in lengths}
    return table, mean


def effective_length(mean: dict[str, float], threshold: float) -> tuple[int | None, float]:
    """``(effective length, the score it must reach)`` from the per-length means (module docstring)."""
    lengths = sorted(int(n) for n in mean)
    bar = threshold * mean[str(lengths[0])]
    if mean[str(lengths[0])] <= 0:
        return None, bar
    best = None
    for n in lengths:
        if mean[str(n)] < bar:
            break
        best = n
    return best, bar
