"""Preference pairs (DPO data) -> token ids and a ``loss_mask`` for ``prompt + chosen`` and ``prompt + rejected``.

Each row holds a ``prompt``, a ``chosen`` and a ``rejected`` completion (other column names:
``usp-prepare-data --prompt-field / --chosen-field / --rejected-field``). Two forms, told apart per row
(:func:`preference_pair_of`):

- **text**: all three are strings. A sequence is ``[BOS] + tokens(prompt) + tokens(completion) + [EOS]``
  (BOS when the tokenizer defines one, as for text documents; prompt and completion are tokenized separately
  and concatenated, nothing inserted between them); the completion's tokens and the EOS are the targets.
- **chat**: any of the three is a list of ``{role, content}`` messages (ShareGPT ``{from, value}`` too). The
  prompt is a list of messages, or a string (one user message); a completion is a string (one assistant
  message) or a list of messages, where a leading copy of the prompt (TRL's conversational format) is
  stripped. ``prompt + completion`` is rendered with the chat template exactly as ``--format chat`` does
  (:class:`usp.data.chat.ChatRenderer`) with ``loss_on='last_assistant'``: the targets are the last assistant
  message's content and the end-of-turn marker after it, nothing of the prompt.

``loss_mask`` has the chat format's meaning: ``loss_mask[t] == 1`` means token ``t`` is a target. A missing
value (no column, or ``null``) is a ``ValueError`` naming the field and the row; an empty completion (only
whitespace, or no assistant message in a chat completion) gives ``None`` from :meth:`PreferenceEncoder.encode`,
and the pair is dropped and counted by the caller.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from usp.data.chat import ChatRenderer, conversation_of

PAIR_PARTS: tuple[str, str, str] = ("prompt", "chosen", "rejected")
"""The three values of a preference row, in order (their columns: :attr:`fields`)."""

Encoded = tuple[np.ndarray, np.ndarray]  # (int32 ids [n], uint8 loss_mask [n])


def _flag(part: str) -> str:
    return f"usp-prepare-data --{part}-field"


def _messages_of(value: Any, default_role: str, where: str) -> list[dict[str, str]]:
    """A list of messages (``{role, content}`` or ShareGPT ``{from, value}``), or a string: one message of
    ``default_role``."""
    if isinstance(value, str):
        return [{"role": default_role, "content": value}]
    if isinstance(value, tuple):
        value = list(value)
    return conversation_of({"messages": value}, "messages", where=where)


def preference_pair_of(
    row: Mapping[str, Any], fields: Sequence[str] = PAIR_PARTS, where: str = "row"
) -> dict[str, Any]:
    """One row as ``{"chat": bool, "prompt_text", "chosen_text", "rejected_text", "prompt_messages",
    "chosen_messages", "rejected_messages"}`` (the text values are ``None`` for a chat row, the message lists
    empty for a text row).

    ``fields``: the column names of prompt, chosen and rejected. ``ValueError`` naming the field and ``where``
    for a missing or ``null`` value, or one that is neither a string nor a list of messages.
    """
    values = {}
    for part, name in zip(PAIR_PARTS, fields):
        value = row.get(name)
        if value is None:
            raise ValueError(
                f"{where}: the {name!r} field ({part}) is missing or null; a preference row needs "
                f"{list(fields)} ({_flag(part)} names another column; the row's columns: {sorted(row)})."
            )
        if not isinstance(value, (str, list, tuple)):
            raise ValueError(
                f"{where}: the {name!r} field ({part}) is of type {type(value).__name__}, not a string or a "
                "list of {role, content} messages."
            )
        values[part] = value
    out: dict[str, Any] = {f"{p}_text": None for p in PAIR_PARTS} | {f"{p}_messages": [] for p in PAIR_PARTS}
    chat = any(not isinstance(v, str) for v in values.values())
    out["chat"] = chat
    if not chat:
        out.update({f"{p}_text": values[p] for p in PAIR_PARTS})
        return out
    prompt = _messages_of(values["prompt"], "user", f"{where}, {fields[0]!r}")
    out["prompt_messages"] = prompt
    for part, name in zip(PAIR_PARTS[1:], fields[1:]):
        completion = _messages_of(values[part], "assistant", f"{where}, {name!r}")
        if prompt and completion[: len(prompt)] == prompt:
            completion = completion[len(prompt) :]  # TRL's conversational rows repeat the prompt
        out[f"{part}_messages"] = completion
    return out


class PreferenceEncoder:
    """Encodes normalized pairs (:func:`preference_pair_of`) with one tokenizer: :meth:`encode` gives
    ``(chosen ids, chosen mask, rejected ids, rejected mask)`` of the two whole sequences.

    Args:
        tokenizer: a Hugging Face fast tokenizer with EOS.
        add_bos: text rows start with BOS when the tokenizer defines one (``--no-bos``: never).
        renderer: a zero-argument callable returning the :class:`ChatRenderer` (``loss_on='last_assistant'``)
            for chat rows; called on the first chat row only, so text pairs need no chat template.
    """

    def __init__(self, tokenizer: Any, *, add_bos: bool = True, renderer: Any = None) -> None:
        self.tokenizer = tokenizer
        self.add_bos = add_bos
        self._make_renderer = renderer
        self._renderer: ChatRenderer | None = None

    def __getstate__(self) -> dict[str, Any]:  # worker processes build their own renderer
        return {**self.__dict__, "_renderer": None}

    def _ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])

    def encode_text(self, prompt: str, completion: str) -> Encoded | None:
        """``[BOS] + prompt + completion + [EOS]``, targets: completion + EOS; ``None`` for an empty completion."""
        if not completion.strip():
            return None
        bos = self.tokenizer.bos_token_id
        head = ([bos] if self.add_bos and bos is not None else []) + self._ids(prompt)
        tail = self._ids(completion) + [self.tokenizer.eos_token_id]
        ids = np.asarray(head + tail, dtype=np.int32)
        mask = np.concatenate([np.zeros(len(head), np.uint8), np.ones(len(tail), np.uint8)])
        return ids, mask

    def renderer(self) -> ChatRenderer:
        if self._renderer is None:
            if self._make_renderer is None:
                raise ValueError("chat-form preference rows need a chat template; pass --chat-template FILE.")
            self._renderer = self._make_renderer()
        return self._renderer

    def encode_chat(self, prompt: list[dict[str, str]], completion: list[dict[str, str]]) -> Encoded | None:
        """The rendering of ``prompt + completion``, targets: the completion's last assistant message (+ its
        end-of-turn marker); ``None`` when the completion has no assistant message or only an empty one."""
        last = [m for m in completion if m["role"] == "assistant"]
        if not last or not last[-1]["content"].strip():
            return None
        out = self.renderer().encode(list(prompt) + list(completion))
        if out is None or not out[1].any():
            return None
        return out

    def encode(self, pair: Mapping[str, Any]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
        """Both sequences of one normalized pair, or ``None`` if either completion is empty (no target)."""
        parts = []
        for part in PAIR_PARTS[1:]:
            if pair["chat"]:
                out = self.encode_chat(pair["prompt_messages"], pair[f"{part}_messages"])
            else:
                out = self.encode_text(pair["prompt_text"], pair[f"{part}_text"])
            if out is None:
                return None
            parts.extend(out)
        return parts[0], parts[1], parts[2], parts[3]


def build_tiny_preferences(path: str | os.PathLike, num_pairs: int = 400, seed: int = 0) -> Path:
    """Write ``num_pairs`` synthetic text-form preference rows as jsonl (``{"prompt", "chosen", "rejected"}``):
    a run of numbers to continue, the right continuation chosen and a wrong one rejected (demo and tests;
    ``data.build_tiny_corpus=true`` with ``data.format=preference``)."""
    rng = random.Random(seed)
    lines = []
    for _ in range(num_pairs):
        start, n, k = rng.randrange(500), rng.randint(3, 10), rng.randint(2, 12)
        prompt = "continue: " + " ".join(str(start + i) for i in range(n))
        chosen = " " + " ".join(str(start + n + i) for i in range(k))
        step = rng.choice((2, 3, -1))
        rejected = " " + " ".join(
            str(max(start + n - 1 + step * (i + 1), 0)) for i in range(rng.randint(2, 12))
        )
        lines.append(json.dumps({"prompt": prompt, "chosen": chosen, "rejected": rejected}) + "\n")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    tmp.write_text("".join(lines))
    os.replace(tmp, path)
    return path
