"""Pack preference pairs into rows of exactly ``seq_len`` tokens, best-fit, a pair never split.

A pair is two sequences, ``prompt + chosen`` and ``prompt + rejected`` (:mod:`usp.data.preference`); its size is
the sum of their lengths. Within each window of pairs the largest is placed first into the open row with the
least room that still holds it (best-fit decreasing, as :mod:`usp.data.pack_chat` does for conversations), and
the rest of every row is padding. Each row is (:data:`PREFERENCE_PACKED_FEATURES`):

- ``input_ids``: ``seq_len`` int32; ``loss_mask``: ``seq_len`` uint8 (1: the token is a target; the prompt, the
  padding: 0);
- ``document_lengths``: per pair, two consecutive documents, ``prompt + chosen`` then ``prompt + rejected``;
  after all pairs the padding as a document of its own (absent when the pairs fill the row), summing to
  ``seq_len``;
- ``first_position``: 0;
- ``document_roles``: int8, one per document: 1 chosen, 2 rejected, 0 padding; always ``1, 2`` pairs.

With ``shared_prompt`` (``usp-prepare-data --shared-prompt``, for ``trainer.dpo.shared_prompt``) the prompt is
laid out once: a pair is ``prompt + chosen`` then ``last prompt token + rejected``, and each row gains
(:data:`PREFERENCE_SHARED_FEATURES`)

- ``shared_prefix``: int32, one per document: the rejected document's link, ``n`` = the prompt's length less
  one (its tokens shared with ``prompt + chosen``); 0 for the others. The rejected document attends to the
  first ``n`` tokens of the chosen document besides itself and its position ids start at ``n``
  (:func:`usp.data.batch.row_positions`), so every token sees what it sees in ``prompt + rejected``.

The prompt's last token is repeated at the head of the rejected document because its next-token target
differs (the first token of ``chosen`` in one, of ``rejected`` in the other): keeping it there keeps every
label where it is in the two-sequence layout. A pair then takes ``|prompt + chosen| + |rejected| + 1`` tokens
instead of ``|prompt + chosen| + |prompt + rejected|``; ``n`` is the two sequences' common leading tokens
before the first target, less one (a pair whose prompt is a single token shares nothing).

A pair larger than ``seq_len`` is dropped (never truncated: a cut completion would bias its log-probability),
and counted: ``pairs_dropped_prompt_too_long`` when the prompt alone takes ``seq_len`` tokens or more,
``pairs_dropped_too_long`` otherwise.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Iterable, Iterator

import numpy as np
import pyarrow as pa
from datasets import Features, Sequence, Value

from usp.data.pack import PackStats
from usp.data.pack_chat import CHAT_PACKED_FEATURES

DOCUMENT_ROLES_COLUMN = "document_roles"
ROLE_PADDING, ROLE_CHOSEN, ROLE_REJECTED = 0, 1, 2
"""``document_roles`` values."""
PREFERENCE_PACKED_FEATURES = Features(
    {**CHAT_PACKED_FEATURES, DOCUMENT_ROLES_COLUMN: Sequence(Value("int8"))}
)
SHARED_PREFIX_COLUMN = "shared_prefix"
PREFERENCE_SHARED_FEATURES = Features(
    {**PREFERENCE_PACKED_FEATURES, SHARED_PREFIX_COLUMN: Sequence(Value("int32"))}
)
"""The rows of ``shared_prompt`` packing: :data:`PREFERENCE_PACKED_FEATURES` and ``shared_prefix``."""

Pair = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]
"""(chosen ids int32 [n_c], chosen loss_mask uint8 [n_c], rejected ids [n_r], rejected loss_mask [n_r])."""

COUNTS = (
    "pairs_read",
    "pairs_packed",
    "pairs_dropped_too_long",
    "pairs_dropped_prompt_too_long",
    "pairs_dropped_empty_completion",
    "padding_tokens",
    "target_tokens",
    "prompt_tokens_shared",
)
"""The ``stats.extra`` counts of a preference preparation (``pairs_read`` and
``pairs_dropped_empty_completion`` are counted by the reader, before packing)."""


def prompt_length(pair: Pair) -> int:
    """Tokens before the first target of either sequence (the prompt, with BOS or the template's headers)."""
    return min(int(np.argmax(pair[1])), int(np.argmax(pair[3])))


def shared_prefix_length(pair: Pair) -> int:
    """Tokens of ``prompt + rejected`` that its document links to instead of holding (``shared_prompt``): the
    leading tokens both sequences share before the first target of either, less one (the last prompt token
    stays, since its target differs); 0 when nothing is shared."""
    limit = prompt_length(pair)
    c, r = np.asarray(pair[0][:limit]), np.asarray(pair[2][:limit])
    differ = np.flatnonzero(c != r)
    common = int(differ[0]) if differ.size else limit
    return max(common - 1, 0)


def pair_size(pair: Pair, shared_prompt: bool) -> int:
    """Tokens the pair takes in a row."""
    return len(pair[0]) + len(pair[2]) - (shared_prefix_length(pair) if shared_prompt else 0)


def pack_preference_pairs(
    windows: Iterable[list[Pair]],
    seq_len: int,
    *,
    pad_id: int,
    stats: PackStats | None = None,
    shared_prompt: bool = False,
) -> Iterator[pa.RecordBatch]:
    """Windows of pairs -> record batches of packed rows (:data:`PREFERENCE_PACKED_FEATURES`;
    :data:`PREFERENCE_SHARED_FEATURES` with ``shared_prompt``: the prompt once, module docstring).

    ``stats`` is updated as the generator runs: ``documents_in`` (2 per pair), ``tokens_in``, ``rows``,
    ``tokens_packed`` (real tokens), ``tokens_dropped`` (of dropped pairs); in ``extra``: ``pairs_packed``,
    ``pairs_dropped_too_long``, ``pairs_dropped_prompt_too_long``, ``padding_tokens``, ``fill_ratio`` (real
    tokens / row tokens), ``target_tokens``, ``prompt_tokens_shared`` (tokens the shared prompt saves: the
    rejected documents' links; 0 without ``shared_prompt``). ``tokens_in`` and ``tokens_packed`` count the
    tokens as laid out (with ``shared_prompt``, the prompt once).
    """
    if seq_len < 1:
        raise ValueError(f"--seq-len={seq_len} must be a positive number of tokens.")
    stats = stats if stats is not None else PackStats(seq_len=seq_len)
    x = stats.extra
    for k in COUNTS:
        x.setdefault(k, 0)
    t0 = time.perf_counter()
    for window in windows:
        items: list[Pair] = []
        for pair in window:
            size = pair_size(pair, shared_prompt)
            stats.documents_in += 2
            stats.document_tokens += size
            stats.tokens_in += size
            if size <= seq_len:
                items.append(pair)
                continue
            stats.tokens_dropped += size
            long_prompt = prompt_length(pair) >= seq_len
            x["pairs_dropped_prompt_too_long" if long_prompt else "pairs_dropped_too_long"] += 1
        items.sort(key=lambda p: -pair_size(p, shared_prompt))  # stable: ties keep the input order
        rows: list[list[Pair]] = []
        free: list[tuple[int, int]] = []  # (room left, row index), sorted: the open rows
        for pair in items:
            n = pair_size(pair, shared_prompt)
            i = bisect.bisect_left(free, (n, -1))
            if i < len(free):
                room, r = free.pop(i)
            else:
                room, r = seq_len, len(rows)
                rows.append([])
            rows[r].append(pair)
            if room - n > 0:
                bisect.insort(free, (room - n, r))
        if rows:
            yield _record_batch(rows, seq_len, pad_id, stats, shared_prompt)
    packed = stats.rows * seq_len
    x["fill_ratio"] = stats.tokens_packed / packed if packed else 0.0
    stats.seconds += time.perf_counter() - t0
    assert stats.tokens_in == stats.tokens_packed + stats.tokens_dropped


def _record_batch(
    rows: list[list[Pair]], seq_len: int, pad_id: int, stats: PackStats, shared_prompt: bool = False
) -> pa.RecordBatch:
    ids_parts, mask_parts, doc_lengths, roles, prefixes, doc_offsets = [], [], [], [], [], [0]
    for pairs in rows:
        used = 0
        for pair in pairs:
            c_ids, c_mask, r_ids, r_mask = pair
            shared = shared_prefix_length(pair) if shared_prompt else 0
            stats.extra["prompt_tokens_shared"] += shared
            for ids, mask, role, link in (
                (c_ids, c_mask, ROLE_CHOSEN, 0),
                (r_ids[shared:], r_mask[shared:], ROLE_REJECTED, shared),
            ):
                ids_parts.append(np.asarray(ids, dtype=np.int32))
                mask_parts.append(np.asarray(mask, dtype=np.uint8))
                doc_lengths.append(len(ids))
                roles.append(role)
                prefixes.append(link)
                used += len(ids)
                stats.extra["target_tokens"] += int(np.asarray(mask).sum())
        pad = seq_len - used
        assert pad >= 0
        if pad:
            ids_parts.append(np.full(pad, pad_id, dtype=np.int32))
            mask_parts.append(np.zeros(pad, dtype=np.uint8))
            doc_lengths.append(pad)
            roles.append(ROLE_PADDING)
            prefixes.append(0)
        doc_offsets.append(len(doc_lengths))
        stats.tokens_packed += used
        stats.extra["padding_tokens"] += pad
        stats.extra["pairs_packed"] += len(pairs)
    stats.rows += len(rows)
    flat_ids, flat_mask = np.concatenate(ids_parts), np.concatenate(mask_parts)
    assert flat_ids.size == len(rows) * seq_len < 2**31
    offsets = pa.array((np.arange(len(rows) + 1) * seq_len).astype(np.int32))
    doc_off = pa.array(np.asarray(doc_offsets, dtype=np.int32))
    columns = [
        pa.ListArray.from_arrays(offsets, pa.array(flat_ids, pa.int32())),
        pa.ListArray.from_arrays(doc_off, pa.array(np.asarray(doc_lengths, dtype=np.int32))),
        pa.array(np.zeros(len(rows), dtype=np.int64), pa.int64()),
        pa.ListArray.from_arrays(offsets, pa.array(flat_mask, pa.uint8())),
        pa.ListArray.from_arrays(doc_off, pa.array(np.asarray(roles, dtype=np.int8), pa.int8())),
    ]
    features = PREFERENCE_PACKED_FEATURES
    if shared_prompt:
        columns.append(pa.ListArray.from_arrays(doc_off, pa.array(np.asarray(prefixes, dtype=np.int32))))
        features = PREFERENCE_SHARED_FEATURES
    return pa.RecordBatch.from_arrays(columns, schema=features.arrow_schema)
