"""Passkey retrieval: a random number hidden at a chosen depth of filler text, then asked for.

A prompt of exactly ``length`` tokens is built from token ids (so every length suits the sequence layout)::

    [BOS] intro | filler[:before] | needle("The secret number is 48213. Remember 48213.") | filler[before:] | question

``before = round(depth x filler tokens)``. With ``eval.chat_template=true`` (instruct models) the prompt is
the tokenizer's chat template around it (:mod:`usp.eval.chat`): the intro to the question's "What is the
secret number?" as the user turn, "The secret number is" opening the assistant's. The model's answer is :func:`usp.eval.decode.decode`'s greedy
continuation; a trial is correct when the first run of digits in the decoded answer equals the passkey.
Every rank builds the same prompts (the passkey of trial ``t`` in cell ``(length, depth)`` comes from a
``random.Random`` seeded with ``(eval.passkey.seed, length, depth, t)``), so nothing is broadcast.
"""

from __future__ import annotations

import random
import re
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from usp.config import EvalConfig
from usp.eval.chat import ChatFrame, bos_ids, chat_frame
from usp.eval.decode import decode
from usp.eval.replicas import decode_timing, gather_shares, gather_timing, my_share
from usp.parallel import SPMesh

INTRO = "A secret number is hidden in this text. Remember it."
FILLER = (
    " Rain fell on the old town and the streets grew quiet. A cat slept by the warm stove. The clock on the "
    "wall kept its slow time, and nobody hurried anywhere."
)
NEEDLE = " The secret number is {key}. Remember {key}."
QUESTION = " What is the secret number? The secret number is"
ASK, ANSWER_PREFIX = " What is the secret number?", "The secret number is"  # QUESTION's two turns (chat)


@dataclass
class PasskeyTrial:
    length: int
    depth: float
    trial: int
    key: str
    input_ids: list[int]


def passkey_value(seed: int, length: int, depth: float, trial: int, digits: int) -> str:
    rng = random.Random(f"{seed}/{length}/{depth!r}/{trial}")
    return str(rng.randint(10 ** (digits - 1), 10**digits - 1))


def _ids(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _frame_ids(tokenizer: Any, frame: ChatFrame | None) -> tuple[list[int], list[int]]:
    """``(ids before the filler, ids after it)`` around ``needle`` and filler: plain or in the chat frame."""
    if frame is None:
        return bos_ids(tokenizer) + _ids(tokenizer, INTRO), _ids(tokenizer, QUESTION)
    return _ids(tokenizer, frame.head + INTRO), _ids(tokenizer, ASK) + _ids(
        tokenizer, frame.tail + ANSWER_PREFIX
    )


def build_prompt(
    tokenizer: Any, length: int, depth: float, key: str, frame: ChatFrame | None = None
) -> list[int]:
    """Token ids of one passkey prompt, exactly ``length`` long (``frame``: the chat template's, or None for
    the plain prompt). ``ValueError`` naming ``eval.lengths`` when ``length`` cannot hold the intro, needle
    and question."""
    head, question = _frame_ids(tokenizer, frame)
    needle = _ids(tokenizer, NEEDLE.format(key=key))
    budget = length - len(head) - len(needle) - len(question)
    if budget < 0:
        raise ValueError(
            f"eval.lengths: {length} tokens cannot hold a passkey prompt (at least "
            f"{len(head) + len(needle) + len(question)} tokens with this tokenizer); use longer eval.lengths."
        )
    unit = _ids(tokenizer, FILLER)
    filler = (unit * (budget // max(1, len(unit)) + 1))[:budget]
    before = int(round(depth * budget))
    ids = head + filler[:before] + needle + filler[before:] + question
    assert len(ids) == length, (len(ids), length)
    return ids


def build_trials(tokenizer: Any, lengths: list[int], cfg: EvalConfig) -> list[PasskeyTrial]:
    """Every (length, depth, trial) prompt, lengths outermost. Raises ``ValueError`` for bad settings."""
    p = cfg.passkey
    frame = chat_frame(tokenizer) if cfg.chat_template else None
    trials = []
    for length in lengths:
        for depth in p.depths:
            for t in range(p.trials):
                key = passkey_value(p.seed, length, depth, t, p.digits)
                ids = build_prompt(tokenizer, length, depth, key, frame)
                trials.append(PasskeyTrial(length, depth, t, key, ids))
    return trials


def answer_of(tokenizer: Any, tokens: list[int]) -> str:
    """The first run of digits in the decoded answer ('' when there is none)."""
    eos = tokenizer.eos_token_id
    if eos is not None and eos in tokens:
        tokens = tokens[: tokens.index(eos)]
    match = re.search(r"\d+", tokenizer.decode(tokens, skip_special_tokens=True))
    return match.group(0) if match else ""


def run_passkey(
    model: nn.Module, tokenizer: Any, mesh: SPMesh, trials: list[PasskeyTrial], cfg: EvalConfig
) -> dict[str, Any]:
    """Decode every trial (``eval.micro_batch_size`` prompts of one length per call; dp replicas split the
    trials, :mod:`usp.eval.replicas`); accuracy per cell.

    Returns ``{"cells": [{"length", "depth", "trials", "correct", "accuracy"}], "accuracy", "trials":
    [{"length", "depth", "trial", "passkey", "answer", "correct"}], "timing": {...}}`` (same on every rank).
    """
    device = next(model.parameters()).device
    results: list[dict[str, Any]] = []
    prefill_tokens = decode_tokens = 0
    prefill_s = decode_s = 0.0
    t0 = time.perf_counter()
    everything, trials = trials, my_share(trials, mesh)  # dp replicas split the trials
    i = 0
    while i < len(trials):
        group = [trials[i]]
        while (
            i + len(group) < len(trials)
            and len(group) < cfg.micro_batch_size
            and trials[i + len(group)].length == group[0].length
        ):
            group.append(trials[i + len(group)])
        ids = torch.tensor([t.input_ids for t in group], dtype=torch.long, device=device)  # [B, length]
        res = decode(model, ids, mesh, cfg.passkey.max_new_tokens)
        prefill_tokens += res.prefill_tokens
        prefill_s += res.prefill_s
        decode_tokens += res.decode_steps * len(group)
        decode_s += res.decode_s
        for t, row in zip(group, res.tokens.tolist()):
            answer = answer_of(tokenizer, row)
            results.append(
                {
                    "length": t.length,
                    "depth": t.depth,
                    "trial": t.trial,
                    "passkey": t.key,
                    "answer": answer,
                    "correct": answer == t.key,
                }
            )
        i += len(group)
    results = gather_shares(results, mesh)
    prefill_s, prefill_tokens = gather_timing(prefill_s, prefill_tokens, mesh)
    decode_s, decode_tokens = gather_timing(decode_s, decode_tokens, mesh)
    cells = []
    for length in dict.fromkeys(t.length for t in everything):
        for depth in cfg.passkey.depths:
            rows = [r for r in results if r["length"] == length and r["depth"] == depth]
            correct = sum(r["correct"] for r in rows)
            cells.append(
                {
                    "length": length,
                    "depth": depth,
                    "trials": len(rows),
                    "correct": correct,
                    "accuracy": correct / max(1, len(rows)),
                }
            )
    return {
        "cells": cells,
        "accuracy": sum(r["correct"] for r in results) / max(1, len(results)),
        "trials": results,
        "timing": decode_timing(prefill_tokens, prefill_s, decode_tokens, decode_s, t0),
    }
