"""Pack conversations into rows of exactly ``seq_len`` tokens, best-fit, one conversation per document.

Unlike text packing (:mod:`usp.data.pack`, a stream cut every ``seq_len`` tokens), a conversation is never
split across rows: within each window of conversations, the longest is placed first into the open row with
the least room that still holds it (best-fit decreasing), and the rest of every row is padding. Each row is

- ``input_ids``: ``seq_len`` int32 tokens; ``loss_mask``: ``seq_len`` uint8 (1: the token is a target,
  :mod:`usp.data.chat`);
- ``document_lengths``: the conversations in the row, then the padding as a document of its own, so with
  document masking a real token never attends to padding (and padding, whose mask is 0, is never a target);
- ``first_position``: 0, or the offset of the row's first piece in its conversation when it continues one.

A conversation longer than ``seq_len``: with ``split_long_conversations`` it is cut into ``seq_len`` pieces
that fill whole rows, its remainder starting a row of its own (``first_position`` continues the positions; the
first token of each later piece cannot be a target, its predecessor being in another row); otherwise
``long_conversations='truncate'`` keeps its first ``seq_len`` tokens (a truncation left without any target is
dropped) and ``'drop'`` leaves it out. Every case is counted in the stats.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Iterable, Iterator

import numpy as np
import pyarrow as pa
from datasets import Features, Sequence, Value

from usp.data.pack import PACKED_FEATURES, PackStats
from usp.modes import LONG_CONVERSATIONS

LOSS_MASK_COLUMN = "loss_mask"
CHAT_PACKED_FEATURES = Features({**PACKED_FEATURES, LOSS_MASK_COLUMN: Sequence(Value("uint8"))})

Conversation = tuple[np.ndarray, np.ndarray]  # (int32 ids [n], uint8 loss_mask [n])


def _pieces(
    ids: np.ndarray, mask: np.ndarray, seq_len: int, long_conversations: str, split: bool, stats: PackStats
) -> list[tuple[np.ndarray, np.ndarray, int]]:
    """``(ids, mask, first_position)`` pieces of one conversation (none if it is dropped)."""
    n = len(ids)
    x = stats.extra
    if n <= seq_len:
        return [(ids, mask, 0)]
    if split:
        stats.documents_split += 1
        return [(ids[o : o + seq_len], mask[o : o + seq_len], o) for o in range(0, n, seq_len)]
    if long_conversations == "drop":
        x["conversations_dropped_long"] += 1
        stats.tokens_dropped += n
        return []
    if not mask[:seq_len].any():
        x["conversations_dropped_long"] += 1  # its targets all lie beyond seq_len
        stats.tokens_dropped += n
        return []
    x["conversations_truncated"] += 1
    stats.tokens_dropped += n - seq_len
    return [(ids[:seq_len], mask[:seq_len], 0)]


def pack_conversations(
    windows: Iterable[list[Conversation]],
    seq_len: int,
    *,
    pad_id: int,
    long_conversations: str = "truncate",
    split_long_conversations: bool = False,
    stats: PackStats | None = None,
) -> Iterator[pa.RecordBatch]:
    """Windows of conversations -> record batches of packed rows (:data:`CHAT_PACKED_FEATURES`).

    ``stats`` is updated as the generator runs: ``documents_in`` (conversations), ``tokens_in``, ``rows``,
    ``tokens_packed`` (real tokens), ``tokens_dropped`` (truncated or dropped), ``documents_split``; in
    ``extra``: ``padding_tokens``, ``fill_ratio`` (real tokens / row tokens), ``target_tokens``,
    ``conversations_truncated``, ``conversations_dropped_long``.
    """
    if seq_len < 1:
        raise ValueError(f"--seq-len={seq_len} must be a positive number of tokens.")
    if long_conversations not in LONG_CONVERSATIONS:
        raise ValueError(
            f"--long-conversations / data.long_conversations={long_conversations!r} is invalid; choose one of: "
            f"{', '.join(LONG_CONVERSATIONS)}."
        )
    stats = stats if stats is not None else PackStats(seq_len=seq_len)
    for k in ("padding_tokens", "target_tokens", "conversations_truncated", "conversations_dropped_long"):
        stats.extra.setdefault(k, 0)
    t0 = time.perf_counter()
    for window in windows:
        rows: list[list[tuple[np.ndarray, np.ndarray, int]]] = []
        free: list[tuple[int, int]] = []  # (room left, row index), sorted: the open rows
        items = []
        for ids, mask in window:
            stats.documents_in += 1
            stats.document_tokens += len(ids)
            stats.tokens_in += len(ids)
            items.extend(_pieces(ids, mask, seq_len, long_conversations, split_long_conversations, stats))
        continuing = [it for it in items if it[2] > 0 or len(it[0]) == seq_len]
        rest = sorted(
            (it for it in items if not (it[2] > 0 or len(it[0]) == seq_len)), key=lambda it: -len(it[0])
        )
        for it in continuing + rest:  # a continuation starts its own row (its positions continue there)
            n = len(it[0])
            i = len(free) if it[2] > 0 else bisect.bisect_left(free, (n, -1))
            if i < len(free):
                room, r = free.pop(i)
            else:
                room, r = seq_len, len(rows)
                rows.append([])
            rows[r].append(it)
            if room - n > 0:
                bisect.insort(free, (room - n, r))
        if rows:
            yield _record_batch(rows, seq_len, pad_id, stats)
    packed = stats.rows * seq_len
    stats.extra["fill_ratio"] = stats.tokens_packed / packed if packed else 0.0
    stats.seconds += time.perf_counter() - t0
    assert stats.tokens_in == stats.tokens_packed + stats.tokens_dropped


def _record_batch(
    rows: list[list[tuple[np.ndarray, np.ndarray, int]]], seq_len: int, pad_id: int, stats: PackStats
) -> pa.RecordBatch:
    ids_parts, mask_parts, doc_lengths, doc_offsets, first_pos = [], [], [], [0], []
    for pieces in rows:
        used = sum(len(p[0]) for p in pieces)
        pad = seq_len - used
        first_pos.append(pieces[0][2])
        for ids, mask, _ in pieces:
            ids_parts.append(np.asarray(ids, dtype=np.int32))
            mask_parts.append(np.asarray(mask, dtype=np.uint8))
            doc_lengths.append(len(ids))
            stats.extra["target_tokens"] += int(mask.sum())
        if pad:
            ids_parts.append(np.full(pad, pad_id, dtype=np.int32))
            mask_parts.append(np.zeros(pad, dtype=np.uint8))
            doc_lengths.append(pad)
        doc_offsets.append(len(doc_lengths))
        stats.tokens_packed += used
        stats.extra["padding_tokens"] += pad
    stats.rows += len(rows)
    flat_ids, flat_mask = np.concatenate(ids_parts), np.concatenate(mask_parts)
    assert flat_ids.size == len(rows) * seq_len < 2**31
    offsets = pa.array((np.arange(len(rows) + 1) * seq_len).astype(np.int32))
    return pa.RecordBatch.from_arrays(
        [
            pa.ListArray.from_arrays(offsets, pa.array(flat_ids, pa.int32())),
            pa.ListArray.from_arrays(
                pa.array(np.asarray(doc_offsets, dtype=np.int32)),
                pa.array(np.asarray(doc_lengths, dtype=np.int32)),
            ),
            pa.array(np.asarray(first_pos, dtype=np.int64), pa.int64()),
            pa.ListArray.from_arrays(offsets, pa.array(flat_mask, pa.uint8())),
        ],
        schema=CHAT_PACKED_FEATURES.arrow_schema,
    )
