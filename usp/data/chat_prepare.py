"""``usp-prepare-data --format chat``: conversations -> rendered, masked, best-fit packed rows, saved.

Example (SmolLM2's ChatML template, 32K rows, loss on every assistant turn)::

    usp-prepare-data --format chat --input chats.jsonl --messages-field messages \\
        --tokenizer /ckpt/SmolLM2-135M-Instruct --seq-len 32768 --output /data/sft-32k

The output has the text format's columns (``input_ids``, ``document_lengths``, ``first_position``) plus
``loss_mask`` (:mod:`usp.data.pack_chat`); ``usp_prepare.json`` records the counts: conversations without an
assistant message (skipped), truncated or dropped long ones, padding, fill ratio, target tokens. Inputs are
read as for text (files, saved datasets, hub names, weighted mixes: :mod:`usp.data.sources`); every row must
hold a conversation (:func:`usp.data.chat.conversation_of`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import datasets
import numpy as np
from datasets import Dataset, IterableDataset

from usp.data.chat import ChatRenderer, check_loss_on, conversation_of, read_chat_template
from usp.data.encoded import encode_rows, load_normalized, pad_id_of, windows_of, write_packed
from usp.data.pack import PackStats
from usp.data.pack_chat import CHAT_PACKED_FEATURES, LOSS_MASK_COLUMN, pack_conversations
from usp.data.prepared import Preparation, options_preparation_key
from usp.data.tokenize import check_tokenizer
from usp.modes import LONG_CONVERSATIONS

TEMPLATES_DIR = Path(__file__).parent / "templates"
MESSAGES = "messages"
MESSAGE_FEATURES = datasets.Features(
    {MESSAGES: datasets.List({"role": datasets.Value("string"), "content": datasets.Value("string")})}
)
CHAT_ENCODED = datasets.Features(
    {
        "input_ids": datasets.List(datasets.Value("int32")),
        LOSS_MASK_COLUMN: datasets.List(datasets.Value("uint8")),
    }
)


@dataclass(frozen=True)
class ChatOptions:
    """How conversations become rows (the ``data.*`` / ``usp-prepare-data`` chat settings)."""

    messages_field: str = "messages"
    chat_template: str | None = None
    """A Jinja file, or the name of one shipped in ``usp/data/templates`` (``chatml``, ``tiny_chatml``);
    ``None``: the tokenizer's own template."""
    loss_on: str = "assistant"
    long_conversations: str = "truncate"
    split_long_conversations: bool = False

    def check(self) -> None:
        check_loss_on(self.loss_on, "--loss-on / data.loss_on")
        if self.long_conversations not in LONG_CONVERSATIONS:
            raise ValueError(
                f"--long-conversations / data.long_conversations={self.long_conversations!r} is invalid; choose "
                f"one of: {', '.join(LONG_CONVERSATIONS)}."
            )
        if not isinstance(self.messages_field, str) or not self.messages_field:
            raise ValueError(
                f"--messages-field / data.messages_field={self.messages_field!r} must be a column name."
            )

    def template_path(self) -> str | None:
        t = self.chat_template
        if t is None or os.sep in t or t.endswith(".jinja") or Path(os.path.expanduser(t)).exists():
            return t
        shipped = TEMPLATES_DIR / f"{t}.jinja"
        if not shipped.is_file():
            names = sorted(p.stem for p in TEMPLATES_DIR.glob("*.jinja"))
            raise ValueError(
                f"--chat-template / data.chat_template={t!r} is neither a file nor a shipped template ({names})."
            )
        return str(shipped)

    def template_text(self, tokenizer: Any) -> Any:
        """The text of the chat template (:meth:`template_path`, else the tokenizer's own)."""
        path = self.template_path()
        return read_chat_template(path) if path else getattr(tokenizer, "chat_template", None)

    def key_fields(self, tokenizer: Any) -> dict[str, Any]:
        """What these settings add to the preparation key (:func:`chat_preparation_key`)."""
        return {
            "text_field": self.messages_field,
            "chat": {**asdict(self), "template_text": self.template_text(tokenizer)},
        }

    def renderer(self, tokenizer: Any) -> ChatRenderer:
        path = self.template_path()
        return ChatRenderer(
            tokenizer, self.loss_on, read_chat_template(path), None if path is None else repr(path)
        )


def _normalize(batch: dict[str, list], indices: list[int], spec: str, field: str) -> dict[str, list]:
    rows = [dict(zip(batch, values)) for values in zip(*batch.values())]
    return {
        MESSAGES: [conversation_of(r, field, where=f"input {spec!r}, row {i}") for r, i in zip(rows, indices)]
    }


def load_conversations(
    inputs: Sequence[str],
    options: ChatOptions,
    *,
    weights: Sequence[float] | None = None,
    seed: int = 0,
    streaming: bool = False,
    cache_dir: str | None = None,
    log: Callable[[str], None] | None = None,
    usage: list[dict[str, object]] | None = None,
) -> Dataset | IterableDataset:
    """Every input as one column ``messages`` (``[{role, content}]``), concatenated or mixed by ``weights``.
    A row that holds no conversation or an unknown role raises ``ValueError`` naming the input and row."""
    return load_normalized(
        inputs,
        _normalize,
        {"field": options.messages_field},
        MESSAGE_FEATURES,
        "reading conversations",
        weights=weights,
        seed=seed,
        streaming=streaming,
        cache_dir=cache_dir,
        log=log,
        usage=usage,
    )


def encode_conversations(batch: dict[str, list], renderer: ChatRenderer) -> dict[str, list]:
    """A batch of ``{MESSAGES: [conversation, ...]}`` rendered with the chat template: ``input_ids`` (int32)
    and the loss mask (uint8, 1 on assistant tokens) per conversation; empty arrays for a conversation without
    an assistant message (:func:`conversation_windows` counts and skips them). The ``datasets.map`` function
    of ``usp-prepare-data --format chat``."""
    ids, masks = [], []
    for messages in batch[MESSAGES]:
        out = renderer.encode(messages)
        ids.append(np.zeros(0, np.int32) if out is None else out[0])  # empty: no assistant message (counted)
        masks.append(np.zeros(0, np.uint8) if out is None else out[1])
    return {"input_ids": ids, LOSS_MASK_COLUMN: masks}


def conversation_windows(
    ds: Dataset | IterableDataset, window: int, stats: PackStats
) -> Iterator[list[tuple[np.ndarray, np.ndarray]]]:
    """Encoded conversations, ``window`` at a time; empty ones (no assistant message) are counted, not yielded."""
    for batch in windows_of(ds, window):
        convs = []
        for ids, mask in zip(batch["input_ids"], batch[LOSS_MASK_COLUMN]):
            if len(ids) == 0:
                stats.extra["conversations_no_assistant"] = (
                    stats.extra.get("conversations_no_assistant", 0) + 1
                )
                continue
            convs.append((np.asarray(ids, dtype=np.int32), np.asarray(mask, dtype=np.uint8)))
        if convs:
            yield convs


def pack_chat_to(
    raw: Dataset | IterableDataset,
    work: Path,
    *,
    tokenizer: Any,
    seq_len: int,
    options: ChatOptions,
    num_proc: int = 1,
    window: int = 4096,
) -> tuple[Path, PackStats, int]:
    """Render + mask (``num_proc`` processes) and pack ``raw`` into ``work/packed.arrow``; returns
    ``(file, stats, max token id)``."""
    renderer = options.renderer(tokenizer)
    encoded = encode_rows(
        raw,
        work,
        encode_conversations,
        {"renderer": renderer},
        remove_columns=[MESSAGES],
        features=CHAT_ENCODED,
        desc="rendering conversations",
        num_proc=num_proc,
    )
    stats = PackStats(seq_len=seq_len)
    stats.extra["conversations_no_assistant"] = 0
    batches = pack_conversations(
        conversation_windows(encoded, window, stats),
        seq_len,
        pad_id=pad_id_of(tokenizer),
        long_conversations=options.long_conversations,
        split_long_conversations=options.split_long_conversations,
        stats=stats,
    )
    packed, max_id = write_packed(work, CHAT_PACKED_FEATURES.arrow_schema, batches)
    del encoded, batches
    return packed, stats, max_id


def chat_summary(stats: PackStats, output: Path | str) -> str:
    x = stats.extra
    return (
        f"usp-prepare-data --format chat: {stats.documents_in + x.get('conversations_no_assistant', 0)} conversations "
        f"({x.get('conversations_no_assistant', 0)} without an assistant message skipped, "
        f"{x.get('conversations_truncated', 0)} truncated, {x.get('conversations_dropped_long', 0)} too long dropped, "
        f"{stats.documents_split} split across rows) -> {stats.rows} rows x {stats.seq_len} tokens at {output}; "
        f"fill ratio {100 * float(x.get('fill_ratio', 0.0)):.2f}% ({x.get('padding_tokens', 0)} padding tokens); "
        f"{x.get('target_tokens', 0)} target tokens of {stats.tokens_packed}; {stats.tokens_dropped} tokens "
        f"truncated or dropped; {stats.seconds:.1f}s"
    )


def prepare_chat_dataset(
    inputs: Sequence[str],
    *,
    tokenizer: Any,
    seq_len: int,
    output: str | os.PathLike,
    options: ChatOptions,
    weights: Sequence[float] | None = None,
    seed: int = 0,
    streaming: bool = False,
    num_proc: int = 1,
    cache_dir: str | os.PathLike | None = None,
    max_documents: int | None = None,
    overwrite: bool = False,
    window: int = 4096,
    log: Callable[[str], None] | None = None,
) -> Any:
    """The chat counterpart of :func:`usp.data.prepare.prepare_dataset` (same publishing and summary file).

    Raises ``ValueError`` before reading any data for bad settings and a tokenizer without a chat template
    (naming ``--chat-template FILE``), and while reading for a row without a conversation or with an unknown
    role, or a template whose assistant spans cannot be found (:class:`usp.data.chat.ChatRenderer`).
    """
    log = log or (lambda msg: print(msg, flush=True))
    if not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"--seq-len / trainer.seq_len={seq_len!r} must be a positive number of tokens.")
    options.check()
    check_tokenizer(tokenizer)
    options.renderer(tokenizer)  # no chat template, a missing file: said before reading any data
    run = Preparation.start(inputs, tokenizer, output, weights, seed, streaming, overwrite, log)
    key = chat_preparation_key(inputs, tokenizer, seq_len, options, weights, seed, streaming, max_documents)
    raw = run.read(
        load_conversations,
        options,
        cache_dir=None if cache_dir is None else str(cache_dir),
        max_documents=max_documents,
    )

    def no_rows(stats: PackStats) -> str:
        return (
            f"the inputs {list(inputs)} give no conversation to train on ({stats.documents_in} rendered, "
            f"{stats.extra.get('conversations_no_assistant', 0)} without an assistant message, "
            f"{stats.extra.get('conversations_dropped_long', 0)} longer than --seq-len {seq_len} dropped)."
        )

    def pack(work: Path) -> tuple[Path, PackStats, int]:
        return pack_chat_to(
            raw, work, tokenizer=tokenizer, seq_len=seq_len, options=options, num_proc=num_proc, window=window
        )

    settings = {"data_format": "chat", "chat": asdict(options)}
    return run.publish(pack, key=key, settings=settings, no_rows=no_rows, summary=chat_summary)


def chat_preparation_key(
    inputs: Sequence[str],
    tokenizer: Any,
    seq_len: int,
    options: ChatOptions,
    weights: Sequence[float] | None,
    seed: int,
    streaming: bool,
    max_documents: int | None,
) -> str:
    """The text format's key (:func:`usp.data.prepared.preparation_key`), extended by the chat settings and
    the template's text (:meth:`ChatOptions.key_fields`)."""
    return options_preparation_key(
        inputs, tokenizer, seq_len, options, weights, seed, streaming, max_documents
    )
