"""The text the needles hide in, as a stream of words: noise, generated essay-like prose, or the user's files.

- **noise**: four short sentences repeated (RULER's "noise" haystack: nothing in it resembles a needle);
- **essay**: essay-like prose generated from a fixed grammar and word lists, deterministic for a seed, as long
  as asked (RULER uses downloaded essays; this needs no download);
- **files** (``eval.ruler.haystack=PATH``): the words of a text file, or of every ``.txt``/``.md`` file of a
  directory in name order, cycled when a length needs more.

Generators take the first ``n`` words (:meth:`Haystack.words`) and insert their needles between sentences.
"""

from __future__ import annotations

import random
from pathlib import Path

NOISE = "The water is calm. The hills are green. The road goes on. Here we are again."

_SUBJECTS = (
    "a small team",
    "the first version",
    "most good ideas",
    "a careful reader",
    "the market",
    "an old friend",
    "every founder",
    "the best teachers",
    "a new city",
    "the library",
    "this kind of work",
    "the real problem",
    "a patient editor",
    "the second draft",
    "people who build things",
    "a quiet morning",
    "the committee",
    "good software",
    "a long walk",
    "the history of science",
)
_VERBS = (
    "rarely looks like",
    "tends to become",
    "often starts as",
    "slowly turns into",
    "is mostly about",
    "depends on",
    "grows out of",
    "usually hides",
    "can teach you",
    "seldom survives",
    "makes room for",
    "keeps coming back to",
    "was never meant to be",
    "quietly rewards",
)
_OBJECTS = (
    "a side project",
    "an honest question",
    "the work itself",
    "a few loyal users",
    "a list of mistakes",
    "the habit of writing",
    "a map of the problem",
    "an unfinished essay",
    "a better question",
    "plain luck",
    "the things nobody else wants to do",
    "a clear explanation",
    "a slow and steady rhythm",
    "real curiosity",
    "a fair amount of boredom",
    "the courage to start over",
)
_TAILS = (
    "",
    "",
    "",
    " in the long run",
    " if you let it",
    " more than anyone admits",
    " for a while",
    " when nobody is watching",
    " at least at first",
    " in most cases",
)
_OPENERS = (
    "",
    "",
    "",
    "In practice, ",
    "Looking back, ",
    "Oddly enough, ",
    "For that reason, ",
    "Still, ",
    "As a rule, ",
    "Sooner or later, ",
)


def essay_sentence(rng: random.Random) -> str:
    subject, verb, obj = rng.choice(_SUBJECTS), rng.choice(_VERBS), rng.choice(_OBJECTS)
    opener = rng.choice(_OPENERS)
    text = f"{opener}{subject} {verb} {obj}{rng.choice(_TAILS)}."
    return text[0].upper() + text[1:]


class Haystack:
    """An endless, deterministic stream of words; :meth:`words` ``(n)`` is its first ``n``."""

    def __init__(self, kind: str, *, seed: int = 0, path: str | None = None) -> None:
        assert kind in ("noise", "essay"), kind
        self.kind = kind
        self._rng = random.Random(f"usp-ruler-essay/{seed}")
        self._words: list[str] = []
        self._base: list[str] = []  # the repeated unit: noise, or the user's files
        if kind == "noise":
            self._base = NOISE.split()
        elif path is not None:
            self._base = read_haystack_words(path)

    def words(self, n: int) -> list[str]:
        """The first ``n`` words (extended on demand; the same words for the same seed and source)."""
        while len(self._words) < n:
            if self._base:
                self._words.extend(self._base)
            else:
                for _ in range(256):
                    self._words.extend(essay_sentence(self._rng).split())
        return self._words[:n]


def haystack_files(path: str) -> list[Path]:
    """The files ``eval.ruler.haystack`` names. ``ValueError`` naming it when there are none."""
    p = Path(path).expanduser()
    if p.is_file():
        return [p]
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix.lower() in (".txt", ".md"))
        if files:
            return files
        raise ValueError(
            f"eval.ruler.haystack={path!r} is a directory without .txt or .md files; point it at text files."
        )
    raise ValueError(
        f"eval.ruler.haystack={path!r} does not exist; give a text file or a directory of .txt/.md files."
    )


def read_haystack_words(path: str) -> list[str]:
    """Every word of the haystack files, in order. ``ValueError`` naming ``eval.ruler.haystack`` when they
    hold too little text (under 100 words) or are not UTF-8 text."""
    words: list[str] = []
    for f in haystack_files(path):
        try:
            words.extend(f.read_text(encoding="utf-8").split())
        except UnicodeDecodeError as e:
            raise ValueError(f"eval.ruler.haystack={path!r}: {f} is not UTF-8 text ({e}).") from e
    if len(words) < 100:
        raise ValueError(
            f"eval.ruler.haystack={path!r} holds {len(words)} words; give at least 100 words of text (it is "
            f"repeated to fill long prompts)."
        )
    return words
