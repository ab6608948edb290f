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
import shutil
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import pyarrow as pa
from datasets import Dataset, IterableDataset

from usp.atomic import temp_path
from usp.data.chat import ChatRenderer, check_loss_on, conversation_of, read_chat_template
from usp.data.pack import PackStats
from usp.data.pack_chat import CHAT_PACKED_FEATURES, LOSS_MASK_COLUMN, pack_conversations
from usp.data.prepared import (
    FORMAT_VERSION,
    PreparedData,
    check_output,
    first_documents,
    preparation_key,
    publish_rows,
    tokenizer_identity,
)
from usp.data.sources import check_inputs, combine_sources, load_one
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
    check_inputs(inputs, weights, setting="--input / data.inputs")
    log = log or (lambda msg: None)
    parts = []
    for spec in inputs:
        ds = load_one(spec, cache_dir=cache_dir, streaming=streaming, log=log)
        columns = ds.column_names
        if columns is None:  # a stream of unknown schema: peek at one row
            columns = list(next(iter(ds.take(1)), {}).keys())
        kwargs: dict[str, Any] = dict(
            batched=True,
            with_indices=True,
            fn_kwargs={"spec": spec, "field": options.messages_field},
            remove_columns=columns,
            features=MESSAGE_FEATURES,
        )
        if isinstance(ds, Dataset):
            kwargs["desc"] = "reading conversations"
        parts.append(ds.map(_normalize, **kwargs))
    return combine_sources(
        parts, inputs, weights=weights, seed=seed, streaming=streaming, log=log, usage=usage
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
    source = (
        ds.with_format("numpy").iter(batch_size=window)
        if isinstance(ds, Dataset)
        else ds.iter(batch_size=window)
    )
    for batch in source:
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
    kwargs: dict[str, Any] = dict(
        batched=True,
        batch_size=64,
        fn_kwargs={"renderer": renderer},
        remove_columns=[MESSAGES],
        features=CHAT_ENCODED,
    )
    if isinstance(raw, Dataset):
        kwargs.update(
            num_proc=num_proc if num_proc > 1 and len(raw) > 1 else None,
            desc="rendering conversations",
            cache_file_name=str(work / "encoded.arrow"),
            load_from_cache_file=False,
        )
    encoded = raw.map(encode_conversations, **kwargs)
    stats = PackStats(seq_len=seq_len)
    stats.extra["conversations_no_assistant"] = 0
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    packed = work / "packed.arrow"
    max_id = -1
    with (
        pa.OSFile(str(packed), "wb") as sink,
        pa.ipc.new_stream(sink, CHAT_PACKED_FEATURES.arrow_schema) as w,
    ):
        for batch in pack_conversations(
            conversation_windows(encoded, window, stats),
            seq_len,
            pad_id=pad_id,
            long_conversations=options.long_conversations,
            split_long_conversations=options.split_long_conversations,
            stats=stats,
        ):
            col = batch.column(0).flatten().to_numpy(zero_copy_only=False)
            max_id = max(max_id, int(col.max()) if col.size else -1)
            w.write_batch(batch)
    del encoded
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
    check_inputs(inputs, weights, setting="--input / data.inputs")
    output = Path(output)
    check_output(output, overwrite)
    t0 = time.perf_counter()
    key = chat_preparation_key(inputs, tokenizer, seq_len, options, weights, seed, streaming, max_documents)
    usage: list[dict[str, object]] = []
    raw = load_conversations(
        inputs,
        options,
        weights=weights,
        seed=seed,
        streaming=streaming,
        cache_dir=None if cache_dir is None else str(cache_dir),
        log=log,
        usage=usage,
    )
    raw = first_documents(raw, max_documents)
    work = temp_path(output, "work")
    work.mkdir(parents=True)
    try:
        packed, stats, max_id = pack_chat_to(
            raw, work, tokenizer=tokenizer, seq_len=seq_len, options=options, num_proc=num_proc, window=window
        )
        if stats.rows == 0:
            raise ValueError(
                f"the inputs {list(inputs)} give no conversation to train on ({stats.documents_in} rendered, "
                f"{stats.extra.get('conversations_no_assistant', 0)} without an assistant message, "
                f"{stats.extra.get('conversations_dropped_long', 0)} longer than --seq-len {seq_len} dropped)."
            )
        out_tmp = work / "out"
        Dataset.from_file(str(packed)).save_to_disk(str(out_tmp))
        stats.seconds = time.perf_counter() - t0
        stats.extra.update(
            inputs=list(inputs),
            weights=None if weights is None else list(weights),
            seed=seed,
            tokenizer=getattr(tokenizer, "name_or_path", ""),
            format=FORMAT_VERSION,
            data_format="chat",
            chat=asdict(options),
            preparation_key=key,
            tokenizer_identity=tokenizer_identity(tokenizer),
            max_token_id=max_id,
            sources=usage,
            tokens_per_s=stats.document_tokens / max(stats.seconds, 1e-9),
        )
        existing = publish_rows(out_tmp, output, stats, key=key, overwrite=overwrite, log=log)
        if existing is not None:
            return existing
    finally:
        shutil.rmtree(work, ignore_errors=True)
    log(chat_summary(stats, output))
    return PreparedData(path=output, stats=stats)


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
    the template's text."""
    path = options.template_path()
    chat = {
        **asdict(options),
        "template_text": read_chat_template(path) if path else getattr(tokenizer, "chat_template", None),
    }
    return preparation_key(
        inputs,
        tokenizer=tokenizer,
        seq_len=seq_len,
        text_field=options.messages_field,
        weights=weights,
        seed=seed,
        streaming=streaming,
        shaping=None,
        max_documents=max_documents,
        chat=chat,
    )
