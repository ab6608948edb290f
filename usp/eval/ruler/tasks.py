"""RULER's synthetic tasks: what each prompt says and which answers it expects, for a haystack of size ``n``.

A task's factory draws everything random about one sample from its ``random.Random`` (keys, values, depths,
words) and returns *drafts*: functions ``n -> Draft`` giving the prompt's question text, its answer prefix and
the reference answers for a haystack of size ``n`` (words of text; words of distractor needles for ``niah_multikey_2/3``; extra list words for ``cwe``, ``fwe``). :mod:`usp.eval.ruler.fit` bisects ``n`` to the requested length.

=================  =========  ==========================================================================
task               haystack   needles and question
=================  =========  ==========================================================================
niah_single_1      noise      one key (a word pair), one 7-digit number; asked for it
niah_single_2      essay      one key, one 7-digit number
niah_single_3      essay      one key, one UUID
niah_multikey_1    essay      four keys with a number each; asked for one
niah_multikey_2    needles    the key among distractor needles (other keys, their numbers)
niah_multikey_3    needles    UUID keys and UUID values, among distractor needles
niah_multivalue    essay      one key with four numbers; all four asked for
niah_multiquery    essay      four keys with a number each; all four asked for
vt                 noise      a chain of 5 variables (``VAR X = 12345``, ``VAR Y = VAR X``, ...); all
                              variables holding the value asked for
cwe                word list  10 words 30 times each (fewer at short lengths) among ``n`` words 3 times
                              each; the 10 most common asked for
fwe                coded      ``n`` words drawn with Zipf frequencies (alpha 2); the 3 most frequent
=================  =========  ==========================================================================

Scores (:mod:`usp.eval.ruler.scoring`): the fraction of the references found in the answer, every task.
"""

from __future__ import annotations

import random
import string
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from usp.eval.ruler.haystack import Haystack


@dataclass(frozen=True)
class Draft:
    question: str
    """Instructions, context and question (the user turn with a chat template)."""
    answer_prefix: str
    references: list[str]


@dataclass(frozen=True)
class TaskSpec:
    name: str
    category: str
    """``retrieval`` | ``tracing`` | ``aggregation``."""
    haystack: str
    """``noise`` | ``essay`` (``eval.ruler.haystack`` replaces it) | ``none`` (the task makes its own)."""
    max_new_tokens: int
    """Greedy tokens decoded, as RULER: 128 (niah), 30 (vt), 120 (cwe), 50 (fwe)."""


Factory = Callable[[random.Random, Haystack | None], list[Callable[[int], Draft]]]

_ADJECTIVES = (
    "abundant amber ancient brave bright brisk calm careful cheerful clever cloudy crimson curious daring "
    "dizzy eager elegant fancy fierce fluffy gentle gloomy golden graceful grumpy happy hidden hollow humble "
    "icy jolly keen lazy lively lonely lucky mellow merry misty modest nimble noisy odd polite proud quick "
    "quiet rapid rare restless rustic shiny silent silly sleepy smooth sober spicy steady stormy sturdy "
    "swift tender tidy tiny vivid wandering weary wild witty"
).split()
_NOUNS = (
    "anchor apple arrow badge basket beacon bicycle blanket bridge bucket cabin candle canyon castle cloud "
    "comet compass cottage crayon desert dragon drum eagle engine falcon feather forest fountain garden "
    "glacier guitar hammer harbor helmet island jacket kettle ladder lantern lemon magnet meadow mirror "
    "mountain needle ocean orchard parrot pebble pencil piano planet pocket rabbit river rocket saddle "
    "shadow ship spoon statue thunder tiger tower tulip valley violin wagon whistle window yard"
).split()
_CONSONANTS, _VOWELS = "bcdfghklmnprstvz", "aeiou"


def word_key(rng: random.Random, taken: set[str]) -> str:
    """A fresh key like ``quiet-harbor`` (three parts once two-part ones grow scarce)."""
    for attempt in range(64):
        parts = [rng.choice(_ADJECTIVES), rng.choice(_NOUNS)]
        if attempt >= 8 or len(taken) > len(_ADJECTIVES) * len(_NOUNS) // 2:
            parts.insert(0, rng.choice(_ADJECTIVES))
        key = "-".join(parts)
        if key not in taken:
            taken.add(key)
            return key
    raise AssertionError("no fresh key after 64 draws")


def number_value(rng: random.Random) -> str:
    return str(rng.randint(1_000_000, 9_999_999))


def uuid_value(rng: random.Random) -> str:
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def pseudo_words(rng: random.Random, count: int, taken: set[str]) -> list[str]:
    """``count`` fresh pronounceable words (2-3 syllables), none in ``taken`` (which grows)."""
    out = []
    while len(out) < count:
        w = "".join(rng.choice(_CONSONANTS) + rng.choice(_VOWELS) for _ in range(rng.choice((2, 3, 3))))
        if w not in taken:
            taken.add(w)
            out.append(w)
    return out


def insert_at_depths(units: list[str], needles: list[tuple[float, str]], snap: bool = True) -> str:
    """``units`` (words or sentences) joined by spaces with each needle at ``round(depth x len(units))``,
    moved back to just after a sentence end when one is within 64 words (``snap``); needles keep their order."""
    cuts = []
    for depth, _ in needles:
        at = round(depth * len(units))
        if snap:
            for back in range(min(at, 64) + 1):
                if at - back == 0 or units[at - back - 1].endswith("."):
                    at -= back
                    break
        cuts.append(at)
    out, prev = [], 0
    for at, (_, text) in sorted(zip(cuts, needles), key=lambda c: c[0]):  # stable: needles keep their order
        out.extend(units[prev:at])
        out.append(text)
        prev = at
    out.extend(units[prev:])
    return " ".join(out)


def _niah(
    kind: str,
    *,
    keys: int = 1,
    values: int = 1,
    queries: int = 1,
    uuid_keys: bool = False,
    needle_haystack: bool = False,
) -> Factory:
    noun = {"number": "numbers", "uuid": "uuids"}[kind]
    value_of = number_value if kind == "number" else uuid_value

    def factory(rng: random.Random, hay: Haystack | None) -> list[Callable[[int], Draft]]:
        taken: set[str] = set()

        def new_key() -> str:
            return uuid_value(rng) if uuid_keys else word_key(rng, taken)

        names = [new_key() for _ in range(keys)]
        vals = {k: [value_of(rng) for _ in range(values)] for k in names}
        needles = [(k, v) for k in names for v in vals[k]]
        rng.shuffle(needles)
        depths = sorted(rng.random() for _ in needles)
        placed = [
            (d, f"One of the special magic {noun} for {k} is: {v}.") for d, (k, v) in zip(depths, needles)
        ]
        asked = names[:queries]
        query = asked[0] if queries == 1 else ", ".join(asked[:-1]) + f", and {asked[-1]}"
        refs = [v for k in asked for v in vals[k]]
        distractors: list[str] = []  # the words of distractor needles (other keys), a fixed stream
        dist_rng = random.Random(rng.getrandbits(64))

        def draft(n: int) -> Draft:
            if needle_haystack:
                while len(distractors) < n:
                    k = uuid_value(dist_rng) if uuid_keys else word_key(dist_rng, taken)
                    distractors.extend(
                        f"One of the special magic {noun} for {k} is: {value_of(dist_rng)}.".split()
                    )
                context = insert_at_depths(distractors[:n], placed)  # the last distractor may be cut short
            else:
                assert hay is not None
                context = insert_at_depths(hay.words(n), placed)
            question = (
                f"Some special magic {noun} are hidden in the text below. Memorize them: a question about them "
                f"follows the text.\n{context}\nWhat are all the special magic {noun} for {query} mentioned in "
                f"the text above?"
            )
            return Draft(
                question, f"The special magic {noun} for {query} mentioned in the text above are", refs
            )

        return [draft]

    return factory


def _vt(hops: int = 4) -> Factory:
    def factory(rng: random.Random, hay: Haystack | None) -> list[Callable[[int], Draft]]:
        assert hay is not None
        names: list[str] = []
        while len(names) < hops + 1:
            v = "".join(rng.choice(string.ascii_uppercase) for _ in range(5))
            if v not in names:
                names.append(v)
        value = str(rng.randint(10_000, 99_999))
        chain = [f"VAR {names[0]} = {value}."] + [f"VAR {b} = VAR {a}." for a, b in zip(names, names[1:])]
        placed = list(zip(sorted(rng.random() for _ in chain), chain))

        def draft(n: int) -> Draft:
            context = insert_at_depths(hay.words(n), placed)
            question = (
                f"Memorize and track the chain of variable assignments hidden in the text below.\n{context}\n"
                f"Question: Find all variables that are assigned the value {value} in the text above."
            )
            prefix = (
                f"Answer: According to the chain of variable assignments in the text above, {len(names)} variables "
                f"are assigned the value {value}, they are:"
            )
            return Draft(question, prefix, list(names))

        return [draft]

    return factory


def _cwe(
    common: int = 10, uncommon_freq: int = 3, common_freqs: tuple[int, ...] = (30, 20, 12, 8, 5)
) -> Factory:
    def factory(rng: random.Random, hay: Haystack | None) -> list[Callable[[int], Draft]]:
        taken: set[str] = set()
        top = pseudo_words(rng, common, taken)
        rest: list[str] = []
        order_seed = rng.getrandbits(64)

        def make(freq: int) -> Callable[[int], Draft]:
            def draft(n: int) -> Draft:
                if len(rest) < n:
                    rest.extend(pseudo_words(rng, n - len(rest), taken))
                items = top * freq + rest[:n] * uncommon_freq
                random.Random(f"{order_seed}/{freq}/{n}").shuffle(items)
                listing = " ".join(f"{i + 1}. {w}" for i, w in enumerate(items))
                question = (
                    f"Below is a numbered list of words. Some of them appear more often than the others: memorize "
                    f"which.\n{listing}\nQuestion: What are the {common} most common words in the list above?"
                )
                prefix = f"Answer: The top {common} words that appear most often in the list are:"
                return Draft(question, prefix, list(top))

            return draft

        return [make(f) for f in common_freqs]  # the most frequent that fits the length

    return factory


def _fwe(alpha: float = 2.0, top: int = 3, base: int = 60) -> Factory:
    def factory(rng: random.Random, hay: Haystack | None) -> list[Callable[[int], Draft]]:
        taken: set[str] = set()
        vocab: list[str] = []
        order_seed = rng.getrandbits(64)

        def draft(n: int) -> Draft:
            total = base + n  # the shortest text still separates the top 3 from the 4th
            size = max(10, total // 20)
            if len(vocab) < size:
                vocab.extend(pseudo_words(rng, size - len(vocab), taken))
            weights = [r**-alpha for r in range(1, size + 1)]
            scale = total / sum(weights)
            counts = [int(w * scale) for w in weights]
            assert counts[top - 1] > counts[top], counts[: top + 1]
            items = [w for w, c in zip(vocab, counts) for _ in range(c)]
            random.Random(f"{order_seed}/{n}").shuffle(items)
            question = (
                "Read the coded text below and keep track of how often each coded word appears.\n"
                + " ".join(items)
                + f"\nQuestion: What are the {top} most frequent coded words in the text above? Answer without "
                "explanation."
            )
            prefix = f"Answer: According to the coded text above, the {top} most frequent words are:"
            return Draft(question, prefix, vocab[:top])

        return [draft]

    return factory


TASKS: dict[str, tuple[TaskSpec, Factory]] = {
    "niah_single_1": (TaskSpec("niah_single_1", "retrieval", "noise", 128), _niah("number")),
    "niah_single_2": (TaskSpec("niah_single_2", "retrieval", "essay", 128), _niah("number")),
    "niah_single_3": (TaskSpec("niah_single_3", "retrieval", "essay", 128), _niah("uuid")),
    "niah_multikey_1": (TaskSpec("niah_multikey_1", "retrieval", "essay", 128), _niah("number", keys=4)),
    "niah_multikey_2": (
        TaskSpec("niah_multikey_2", "retrieval", "none", 128),
        _niah("number", needle_haystack=True),
    ),
    "niah_multikey_3": (
        TaskSpec("niah_multikey_3", "retrieval", "none", 128),
        _niah("uuid", uuid_keys=True, needle_haystack=True),
    ),
    "niah_multivalue": (TaskSpec("niah_multivalue", "retrieval", "essay", 128), _niah("number", values=4)),
    "niah_multiquery": (
        TaskSpec("niah_multiquery", "retrieval", "essay", 128),
        _niah("number", keys=4, queries=4),
    ),
    "vt": (TaskSpec("vt", "tracing", "noise", 30), _vt()),
    "cwe": (TaskSpec("cwe", "aggregation", "none", 120), _cwe()),
    "fwe": (TaskSpec("fwe", "aggregation", "none", 50), _fwe()),
}
