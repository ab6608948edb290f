"""Prompts for base and instruct models (``eval.chat_template``), shared by passkey and ruler.

A task's prompt has two parts: the *question* (instructions, context, the question itself) and the *answer
prefix* (the words the answer starts with, e.g. "The secret number is"). ``eval.chat_template=false`` (base
models): ``[BOS] question answer_prefix`` as plain text. ``eval.chat_template=true`` (instruct models): the
tokenizer's chat template with the question as the only user turn and the generation prompt, then the answer
prefix opening the assistant's turn::

    <template head> question <end of user turn, assistant header> answer_prefix

:func:`chat_frame` renders the template once around a placeholder and splits it, so callers that assemble
prompts from token ids (passkey) add the head and tail ids around their own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

_PLACEHOLDER = "\u2063USP-QUESTION\u2063"


@dataclass(frozen=True)
class ChatFrame:
    """The chat template around one user turn: ``head + question + tail`` is the rendered conversation up to
    the assistant's first token (generation prompt included)."""

    head: str
    tail: str


def chat_frame(tokenizer: Any) -> ChatFrame:
    """The tokenizer's chat template split around the user turn's content. ``ValueError`` naming
    ``eval.chat_template`` when the tokenizer has none (a base model)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "eval.chat_template=true, but the tokenizer has no chat template (a base model?); set "
            "eval.chat_template=false for the plain prompt, or evaluate an instruct model's checkpoint."
        )
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": _PLACEHOLDER}], tokenize=False, add_generation_prompt=True
    )
    if not isinstance(text, str) or text.count(_PLACEHOLDER) != 1:
        raise ValueError(
            "eval.chat_template=true: the tokenizer's chat template does not render the user's message once; "
            "set eval.chat_template=false."
        )
    head, tail = text.split(_PLACEHOLDER)
    return ChatFrame(head, tail)


def text_ids(tokenizer: Any, text: str) -> list[int]:
    """``text`` as token ids, no special tokens added."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def bos_ids(tokenizer: Any) -> list[int]:
    return [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []


def render_prompt(
    tokenizer: Any, question: str, answer_prefix: str, frame: ChatFrame | None
) -> tuple[str, list[int]]:
    """``(prompt text, token ids)`` of one prompt: plain (``frame`` None: BOS, question, a space, the answer
    prefix) or in the chat frame (the template's own special tokens, none added)."""
    if frame is None:
        text = f"{question} {answer_prefix}" if answer_prefix else question
        return text, bos_ids(tokenizer) + text_ids(tokenizer, text)
    text = frame.head + question + frame.tail + answer_prefix
    return text, text_ids(tokenizer, text)


def stop_token_ids(tokenizer: Any, generation_config: Any = None) -> set[int]:
    """Token ids that end an answer: the tokenizer's EOS and the model's generation config's EOS ids (an
    instruct model's end-of-turn token is among them)."""
    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    eos = getattr(generation_config, "eos_token_id", None)
    if eos is not None:
        ids.update(int(x) for x in (eos if isinstance(eos, (list, tuple)) else [eos]))
    return ids
