"""One RULER prompt of a requested length in *this* tokenizer's tokens: seed, render, bisect the haystack.

Sample ``i`` of (task ``T``, length ``L``) draws everything from ``random.Random("usp-ruler/{seed}/{T}/{L}/{i}")``
(``eval.ruler.seed``), so every rank builds the same prompt and a rerun the same prompts. The prompt (plain, or
in the chat template, :mod:`usp.eval.chat`) is rendered and tokenized whole for a haystack size ``n``, and
``n`` is bisected to the largest value whose prompt has at most ``L`` tokens (the same count as the model
sees: BOS or the template's tokens included), so the prompt falls short of ``L`` by less than one haystack
unit (a word, a distractor needle, a list word). The bracket starts from the previous sample's ``n`` for the
same task and length (or a tokens-per-unit estimate), so a sample costs a handful of tokenizations.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from usp.config import EvalConfig
from usp.eval.chat import ChatFrame, chat_frame, render_prompt
from usp.eval.ruler.haystack import Haystack
from usp.eval.ruler.tasks import TASKS, Draft

_MIN_UNITS = 10
"""The smallest haystack a prompt has (words, list words, ...)."""
_PREFER_UNITS = 40
"""A task's preferred variant (cwe's 30 repetitions of the common words) is used when it leaves room for this
many haystack units; otherwise the next one (the last one down to :data:`_MIN_UNITS`)."""


@dataclass
class Sample:
    task: str
    length: int
    index: int
    prompt: str
    """The exact prompt text (chat template included); its tokens are :attr:`input_ids`."""
    input_ids: list[int]
    references: list[str]
    max_new_tokens: int
    haystack_size: int


def sample_rng(seed: int, task: str, length: int, index: int) -> random.Random:
    return random.Random(f"usp-ruler/{seed}/{task}/{length}/{index}")


class PromptBuilder:
    """Builds :class:`Sample` s for one tokenizer and one ``eval.*`` config (``eval.chat_template``,
    ``eval.ruler.seed``, ``eval.ruler.haystack``). ``ValueError`` naming the setting for bad ones."""

    def __init__(self, tokenizer: Any, cfg: EvalConfig) -> None:
        self.tokenizer = tokenizer
        self.seed = cfg.ruler.seed
        self.frame: ChatFrame | None = chat_frame(tokenizer) if cfg.chat_template else None
        self.haystacks = {
            "noise": Haystack("noise"),
            "essay": Haystack("essay", seed=cfg.ruler.seed, path=cfg.ruler.haystack),
            "none": None,
        }
        self._last_n: dict[
            tuple[str, int, int], int
        ] = {}  # (task, length, variant) -> n of the previous sample

    def tokens(self, draft: Draft) -> tuple[str, list[int]]:
        return render_prompt(self.tokenizer, draft.question, draft.answer_prefix, self.frame)

    def _drafts(self, task: str, length: int, index: int) -> list[Callable[[int], Draft]]:
        spec, factory = TASKS[task]
        return factory(sample_rng(self.seed, task, length, index), self.haystacks[spec.haystack])

    def minimum_tokens(self, task: str) -> int:
        """Tokens of the shortest prompt ``task`` can have (its last, smallest variant; ``_MIN_UNITS`` units)."""
        return len(self.tokens(self._drafts(task, 0, 0)[-1](_MIN_UNITS))[1])

    def build(self, task: str, length: int, index: int) -> Sample:
        """Sample ``index`` of ``(task, length)``: at most ``length`` tokens, as close to it as the haystack's
        granularity allows. ``ValueError`` naming ``eval.lengths`` when ``length`` is too short for the task."""
        drafts = self._drafts(task, length, index)
        for variant, draft in enumerate(drafts):
            count = self._counter(draft)
            if count(_MIN_UNITS if variant == len(drafts) - 1 else _PREFER_UNITS) <= length:
                n = self._fit(count, length, self._last_n.get((task, length, variant)))
                self._last_n[task, length, variant] = n
                d = draft(n)
                text, ids = self.tokens(d)
                assert len(ids) <= length, (task, length, len(ids))
                return Sample(
                    task, length, index, text, ids, list(d.references), TASKS[task][0].max_new_tokens, n
                )
        raise ValueError(
            f"eval.lengths: {length} tokens cannot hold a {task} prompt (at least {self.minimum_tokens(task)} tokens "
            f"with this tokenizer{' and chat template' if self.frame else ''}); use longer eval.lengths or leave "
            f"{task} out of eval.ruler.tasks."
        )

    def _counter(self, draft: Callable[[int], Draft]) -> Callable[[int], int]:
        cache: dict[int, int] = {}

        def count(n: int) -> int:
            if n not in cache:
                cache[n] = len(self.tokens(draft(n))[1])
            return cache[n]

        return count

    @staticmethod
    def _fit(count: Callable[[int], int], length: int, hint: int | None) -> int:
        """The largest ``n >= _MIN_UNITS`` with ``count(n) <= length`` (``count(_MIN_UNITS) <= length``; ``count``
        grows with ``n``)."""
        base = count(_MIN_UNITS)
        if hint is None:  # a tokens-per-unit estimate: within a few percent
            probe = 4 * _MIN_UNITS
            per_unit = max((count(probe) - base) / (probe - _MIN_UNITS), 1e-3)
            hint = _MIN_UNITS + max(0, int((length - base) / per_unit))
            step = max(1, hint // 64)
        else:  # the previous sample's size: off by a few units
            step = 8
        # gallop from the hint to a bracket lo (fits) < hi (does not), then bisect
        if count(hint) <= length:
            lo, hi = hint, hint + step
            while count(hi) <= length:
                lo, step = hi, step * 2
                hi = lo + step
        else:
            hi, lo = hint, max(_MIN_UNITS, hint - step)
            while lo > _MIN_UNITS and count(lo) > length:
                hi, step = lo, step * 2
                lo = max(_MIN_UNITS, hi - step)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if count(mid) <= length:
                lo = mid
            else:
                hi = mid
        return lo
