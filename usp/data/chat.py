"""Conversations -> token ids and a ``loss_mask``: which tokens are trained as targets.

Rows hold a conversation in one of three shapes (:func:`conversation_of`): ``messages`` (a list of
``{role, content}``; the column name is ``--messages-field`` / ``data.messages_field``), ShareGPT
``conversations`` (a list of ``{from, value}``; ``human``/``gpt`` are ``user``/``assistant``), or a ``prompt`` /
``completion`` pair (strings: one user and one assistant message; or lists of messages). Roles are
``system``, ``user``, ``assistant`` and ``tool``; anything else is an error naming the row.

Each conversation is rendered with the tokenizer's own chat template (or ``--chat-template FILE``), then
tokenized once (no special tokens added: the template writes BOS where it wants one). The mask follows
``loss_on`` (:data:`usp.modes.LOSS_ON`):

- ``assistant``: for every assistant message, the tokens of its content **and** of the end-of-turn marker
  the template writes after it (``<|im_end|>``, ``<|eot_id|>``, ...), and nothing else: not the role header
  (``<|im_start|>assistant\\n``), not system, user or tool text, not the whitespace a template puts after the
  marker (ChatML's newline; generation stops at the marker);
- ``last_assistant``: the same, for the last assistant message only;
- ``all``: every token.

**Semantics with respect to the label shift.** ``loss_mask[t] == 1`` means token ``t`` is a *target*: the loss
includes ``-log p(token_t | tokens_<t)``, computed from the logits at position ``t - 1``
(:func:`usp.data.batch.row_labels`: ``labels[t-1] = input_ids[t]`` where ``loss_mask[t]``). So the first
content token of an assistant turn is predicted from its role header, and the end-of-turn marker from the
last content token; the first token of a document (or of a row) is never a target.

**How the spans are found** (:class:`ChatRenderer`). When the template marks its trained text with
``{% generation %}`` blocks, transformers' ``return_assistant_tokens_mask`` gives the mask. Otherwise the
conversation is rendered prefix by prefix: for assistant message ``i``, the text of messages ``< i`` with
the generation prompt (``P``) and of messages ``<= i`` (``Q``) must both be prefixes of the whole rendering
``S``; the span is ``S[len(P) : len(Q.rstrip())]``. Its boundaries must fall between tokens of ``S``'s
tokenization, and the span's text tokenized alone must give the same ids as inside ``S``; a template for
which any of this fails (one that renders history differently from a generation, or does not render
assistant messages at all) is an error naming it, never a silently wrong mask.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from usp.modes import LOSS_ON

ROLES: dict[str, str] = {
    "system": "system",
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "tool": "tool",
}
"""Accepted role names (``role`` or ShareGPT ``from``) and what they mean."""
CHAT_FIX = "pass --chat-template FILE (usp-prepare-data) / data.chat_template=FILE (a Jinja chat template)"


def _content(value: Any, where: str) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(p, Mapping) and p.get("type") == "text" for p in value):
        return "".join(str(p.get("text") or "") for p in value)  # [{"type": "text", "text": ...}] parts
    raise ValueError(f"{where}: a message's content is of type {type(value).__name__}, not a string.")


def _messages(items: Any, role_key: str, content_key: str, where: str) -> list[dict[str, str]]:
    if not isinstance(items, (list, tuple)):
        raise ValueError(
            f"{where}: the conversation is of type {type(items).__name__}, not a list of messages."
        )
    out = []
    for j, m in enumerate(items):
        if not isinstance(m, Mapping) or role_key not in m:
            raise ValueError(
                f"{where}: message {j} is not an object with a {role_key!r} field ({str(m)[:80]!r})."
            )
        role = m[role_key]
        if role not in ROLES:
            raise ValueError(
                f"{where}: message {j} has an unknown role {role!r}; accepted roles: {sorted(ROLES)} "
                "(human/gpt are ShareGPT's user/assistant). Fix or map the data."
            )
        out.append({"role": ROLES[role], "content": _content(m.get(content_key), f"{where}, message {j}")})
    return out


def conversation_of(
    row: Mapping[str, Any], messages_field: str = "messages", where: str = "row"
) -> list[dict[str, str]]:
    """The messages ``[{role, content}]`` of one row (see the module docstring for the accepted shapes)."""
    if row.get(messages_field) is not None:
        value = row[messages_field]
        key = "from" if value and isinstance(value[0], Mapping) and "from" in value[0] else "role"
        return _messages(value, key, "value" if key == "from" else "content", where)
    if row.get("conversations") is not None:
        return _messages(row["conversations"], "from", "value", where)
    if row.get("prompt") is not None and "completion" in row:
        prompt, completion = row["prompt"], row["completion"]
        head = (
            _messages(prompt, "role", "content", where)
            if isinstance(prompt, list)
            else [{"role": "user", "content": _content(prompt, where)}]
        )
        tail = (
            _messages(completion, "role", "content", where)
            if isinstance(completion, list)
            else [{"role": "assistant", "content": _content(completion, where)}]
        )
        return head + tail
    raise ValueError(
        f"{where}: no conversation: expected a {messages_field!r} list of {{role, content}} "
        f"(--messages-field / data.messages_field), a ShareGPT 'conversations' list of {{from, value}}, or "
        f"'prompt' and 'completion' (columns: {sorted(row)})."
    )


def read_chat_template(path: str | os.PathLike | None) -> str | None:
    """The Jinja text of ``--chat-template FILE`` (``None`` passes through)."""
    if path is None:
        return None
    p = Path(os.path.expanduser(str(path)))
    if not p.is_file():
        raise ValueError(
            f"--chat-template / data.chat_template {str(path)!r} is not a file (a Jinja chat template)."
        )
    return p.read_text()


def check_loss_on(loss_on: str, setting: str = "data.loss_on") -> None:
    if loss_on not in LOSS_ON:
        raise ValueError(f"{setting}={loss_on!r} is invalid; choose one of: {', '.join(LOSS_ON)}.")


class ChatRenderer:
    """Renders conversations with one tokenizer and template; :meth:`encode` gives ``(ids, loss_mask)``.

    Args:
        tokenizer: a Hugging Face fast tokenizer (offsets are needed to place the spans).
        loss_on: see :data:`usp.modes.LOSS_ON`.
        chat_template: Jinja text overriding the tokenizer's own template (``None``: the tokenizer's).
        template_name: how errors name the template (the file, or the tokenizer's path).
    """

    def __init__(
        self,
        tokenizer: Any,
        loss_on: str = "assistant",
        chat_template: str | None = None,
        template_name: str | None = None,
    ) -> None:
        check_loss_on(loss_on)
        self.tokenizer = tokenizer
        self.loss_on = loss_on
        self.template = (
            chat_template if chat_template is not None else getattr(tokenizer, "chat_template", None)
        )
        tok_name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        self.name = template_name or f"the chat template of tokenizer {tok_name!r}"
        if isinstance(self.template, dict):  # several named templates: the default one
            self.template = self.template.get("default")
        if not self.template:
            raise ValueError(
                f"the tokenizer {tok_name!r} has no chat template to render conversations with; {CHAT_FIX}."
            )
        if not getattr(tokenizer, "is_fast", False):
            raise ValueError(
                f"tokenizer {tok_name!r} is not a fast tokenizer: chat data needs token offsets to place the "
                "trained spans. Use a checkpoint with tokenizer.json."
            )
        self.generation_blocks = "generation %}" in self.template

    def render(self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = False) -> str:
        try:
            return self.tokenizer.apply_chat_template(
                list(messages),
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                chat_template=self.template,
            )
        except Exception as e:  # noqa: BLE001 - a template's own raise_exception(...) or a Jinja error
            raise ValueError(f"{self.name} failed to render a conversation ({type(e).__name__}: {e}).") from e

    def _ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])

    def encode(self, messages: Sequence[Mapping[str, str]]) -> tuple[np.ndarray, np.ndarray] | None:
        """``(input_ids int32 [n], loss_mask uint8 [n])``, or ``None`` for a conversation without an
        assistant message (unless ``loss_on == 'all'``): the caller skips and counts it."""
        assistant = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        if not messages or (not assistant and self.loss_on != "all"):
            return None
        if self.loss_on == "all":
            ids = self._ids(self.render(messages))
            return np.asarray(ids, dtype=np.int32), np.ones(len(ids), dtype=np.uint8)
        if self.loss_on == "last_assistant":
            assistant = assistant[-1:]
        if self.generation_blocks:
            ids, mask = self._generation_mask(messages, keep_last_only=self.loss_on == "last_assistant")
        else:
            ids, mask = self._prefix_mask(messages, assistant)
        return np.asarray(ids, dtype=np.int32), np.asarray(mask, dtype=np.uint8)

    def _generation_mask(
        self, messages: Sequence[Mapping[str, str]], keep_last_only: bool
    ) -> tuple[list[int], list[int]]:
        out = self.tokenizer.apply_chat_template(
            list(messages),
            tokenize=True,
            return_dict=True,
            return_assistant_tokens_mask=True,
            chat_template=self.template,
        )
        ids, mask = list(out["input_ids"]), [int(x) for x in out["assistant_masks"]]
        if not any(mask):
            raise ValueError(
                f"{self.name} has {{% generation %}} blocks but marked no token of an assistant message."
            )
        if keep_last_only:  # the last run of ones
            end = max(i for i, x in enumerate(mask) if x) + 1
            start = end
            while start > 0 and mask[start - 1]:
                start -= 1
            mask = [1 if start <= i < end else 0 for i in range(len(mask))]
        return ids, mask

    def char_spans(
        self, messages: Sequence[Mapping[str, str]], assistant: Sequence[int]
    ) -> tuple[str, list[tuple[int, int]]]:
        """The whole rendering and, per assistant message in ``assistant``, its trained ``[start, end)``
        characters (content + end-of-turn marker), found by rendering prefixes."""
        full = self.render(messages)
        spans = []
        for i in assistant:
            head = self.render(messages[:i], add_generation_prompt=True)
            turn = self.render(messages[: i + 1])
            content = messages[i]["content"].strip()
            if not full.startswith(head) or not turn.startswith(head) or not full.startswith(turn):
                if content and content not in full:
                    raise ValueError(
                        f"{self.name} does not render assistant messages (message {i}'s text is not in the "
                        f"rendered conversation), so there is nothing to train on; {CHAT_FIX} that renders them."
                    )
                raise ValueError(
                    f"{self.name} cannot be split into turns at assistant message {i}: the messages before it "
                    "rendered with the generation prompt, and the messages up to it, must both be prefixes of the "
                    "whole conversation (this template renders history differently from a generation). Use a "
                    f"template with {{% generation %}} blocks, or {CHAT_FIX}."
                )
            start, end = len(head), len(turn.rstrip())
            if end <= start or (content and content not in full[start:end]):
                raise ValueError(
                    f"{self.name} does not render assistant message {i} after its generation prompt, so its span "
                    f"cannot be found; {CHAT_FIX} that renders assistant turns."
                )
            spans.append((start, end))
        return full, spans

    def _prefix_mask(
        self, messages: Sequence[Mapping[str, str]], assistant: Sequence[int]
    ) -> tuple[list[int], list[int]]:
        full, spans = self.char_spans(messages, assistant)
        enc = self.tokenizer(full, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
        ids = list(enc["input_ids"])
        offsets = np.asarray(enc["offset_mapping"], dtype=np.int64).reshape(-1, 2)
        starts, ends = offsets[:, 0], offsets[:, 1]  # [n] character offsets of each token
        mask = np.zeros(len(ids), dtype=np.uint8)
        for start, end in spans:
            cut = np.nonzero(((starts < start) & (start < ends)) | ((starts < end) & (end < ends)))[0]
            if cut.size:
                j = int(cut[0])
                raise ValueError(
                    f"{self.name}: an assistant span's boundary falls inside token {j} "
                    f"({full[starts[j] : ends[j]]!r}), so the span cannot be trained exactly; {CHAT_FIX} whose "
                    "turns end on token boundaries."
                )
            inside = np.nonzero((starts >= start) & (ends <= end) & (ends > starts))[0]
            first, last = (int(inside[0]), int(inside[-1])) if inside.size else (0, -1)
            if not inside.size or self._ids(full[start:end]) != ids[first : last + 1]:
                raise ValueError(
                    f"{self.name}: the assistant span {full[start:end][:60]!r} does not re-tokenize to the ids it has "
                    f"inside the conversation; {CHAT_FIX} whose turns tokenize independently."
                )
            mask[first : last + 1] = 1
        return ids, mask
