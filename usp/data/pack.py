"""Pack tokenized documents into rows of exactly ``seq_len`` tokens, keeping every document boundary.

Documents are laid end to end in order and the stream is cut every ``seq_len`` tokens. A document that
crosses a cut is split: its first piece ends one row, the rest starts the next row (and continues into
further rows if it is longer than ``seq_len``). Each row records

- ``input_ids``: ``seq_len`` int32 tokens;
- ``document_lengths``: the lengths of the document pieces in the row, in order, summing to ``seq_len``;
- ``first_position``: the position of the row's first token inside its document (0 unless the row starts
  with the continuation of a split document), so position ids can continue across the split.

Only the final partial row (fewer than ``seq_len`` tokens) is dropped; its size is reported. Optional length
shaping happens before packing: documents shorter than ``min_doc_tokens`` are filtered out, and documents of
at least ``long_doc_threshold`` tokens are repeated ``long_doc_factor`` times on average (long-context
recipes upsample long documents inside each source to keep the domain mix while raising the share of
long-range dependencies). Copies are spread by a seeded shuffle inside each window of documents.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field

import numpy as np
import pyarrow as pa
from datasets import Features, Sequence, Value

PACKED_FEATURES = Features(
    {
        "input_ids": Sequence(Value("int32")),
        "document_lengths": Sequence(Value("int32")),
        "first_position": Value("int64"),
    }
)


@dataclass
class LengthShaping:
    """Length filter and long-document upsampling applied before packing (all off by default)."""

    min_doc_tokens: int = 0
    """Drop documents with fewer tokens than this (BOS/EOS included); the count is reported."""
    long_doc_threshold: int | None = None
    """Documents with at least this many tokens are upsampled by ``long_doc_factor``."""
    long_doc_factor: float = 1.0
    """Expected copies of each long document (>= 1; the fractional part is drawn from the seed)."""

    def __post_init__(self) -> None:
        if self.min_doc_tokens < 0:
            raise ValueError(f"--min-doc-tokens={self.min_doc_tokens} must be >= 0.")
        if self.long_doc_factor < 1.0:
            raise ValueError(
                f"--long-doc-factor={self.long_doc_factor} must be >= 1 (1 disables upsampling)."
            )
        if self.long_doc_threshold is not None and self.long_doc_threshold < 1:
            raise ValueError(
                f"--long-doc-threshold={self.long_doc_threshold} must be a positive token count."
            )

    @property
    def active(self) -> bool:
        return self.min_doc_tokens > 0 or (self.long_doc_threshold is not None and self.long_doc_factor > 1.0)


@dataclass
class PackStats:
    """What packing did; ``tokens_in == tokens_packed + tokens_dropped``."""

    seq_len: int
    documents_in: int = 0
    documents_filtered: int = 0
    documents_upsampled: int = 0
    """Extra copies added by long-document upsampling."""
    documents_split: int = 0
    """Cuts that fell inside a document (the document continues in the next row)."""
    document_tokens: int = 0
    """Tokens of the tokenized documents, before filtering and upsampling (the throughput measure)."""
    tokens_in: int = 0
    """Tokens entering the packer (after filtering and upsampling)."""
    rows: int = 0
    tokens_packed: int = 0
    tokens_dropped: int = 0
    """The final partial row, which cannot fill ``seq_len``."""
    seconds: float = 0.0
    extra: dict[str, object] = field(default_factory=dict)

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def shape_lengths(
    values: np.ndarray,
    lengths: np.ndarray,
    shaping: LengthShaping,
    rng: np.random.Generator,
    stats: PackStats,
) -> tuple[np.ndarray, np.ndarray]:
    """Apply the length filter and long-document upsampling to one window of documents."""
    copies = np.ones(len(lengths), dtype=np.int64)
    if shaping.min_doc_tokens > 0:
        copies[lengths < shaping.min_doc_tokens] = 0
        stats.documents_filtered += int((copies == 0).sum())
    if shaping.long_doc_threshold is not None and shaping.long_doc_factor > 1.0:
        long = (lengths >= shaping.long_doc_threshold) & (copies > 0)
        f = shaping.long_doc_factor
        extra = np.floor(f).astype(np.int64) - 1 + (rng.random(len(lengths)) < f - np.floor(f))
        copies[long] += extra[long]
        stats.documents_upsampled += int(extra[long].sum())
    if (copies == 1).all():
        return values, lengths
    order = np.repeat(np.arange(len(lengths)), copies)
    if shaping.long_doc_threshold is not None and shaping.long_doc_factor > 1.0:
        order = rng.permutation(order)  # spread the copies over the window
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    pieces = [values[starts[i] : starts[i] + lengths[i]] for i in order]
    new_values = np.concatenate(pieces) if pieces else values[:0]
    return new_values, lengths[order]


def pack_documents(
    doc_batches: Iterable[tuple[np.ndarray, np.ndarray]],
    seq_len: int,
    *,
    shaping: LengthShaping | None = None,
    seed: int = 0,
    stats: PackStats | None = None,
) -> Iterator[pa.RecordBatch]:
    """Windows of documents ``(flat int32 tokens, lengths)`` -> record batches of packed rows.

    The generator updates ``stats`` as it goes (final values once exhausted). Memory: one window of
    documents plus one partial row.
    """
    if seq_len < 1:
        raise ValueError(f"--seq-len={seq_len} must be a positive number of tokens.")
    shaping = shaping or LengthShaping()
    stats = stats if stats is not None else PackStats(seq_len=seq_len)
    rng = np.random.default_rng(seed)
    t0 = time.perf_counter()
    carry_tokens = np.zeros(0, dtype=np.int32)
    carry_pieces: list[tuple[int, int]] = []  # (length, position of its first token in its document)
    for values, lengths in doc_batches:
        lengths = np.asarray(lengths, dtype=np.int64)
        stats.documents_in += len(lengths)
        stats.document_tokens += int(lengths.sum())
        if shaping.active:
            values, lengths = shape_lengths(values, lengths, shaping, rng, stats)
        stats.tokens_in += int(lengths.sum())
        tokens = np.concatenate([carry_tokens, np.asarray(values, dtype=np.int32)])
        pieces = carry_pieces + [(int(n), 0) for n in lengths]
        n_rows = len(tokens) // seq_len
        row_pieces: list[list[int]] = [[] for _ in range(n_rows)]
        first_pos = np.zeros(n_rows, dtype=np.int64)
        carry_pieces = []
        pos = 0  # offset in `tokens`
        for length, offset in pieces:
            while length > 0:
                row = pos // seq_len
                if row >= n_rows:
                    carry_pieces.append((length, offset))
                    pos += length
                    break
                take = min((row + 1) * seq_len - pos, length)
                if not row_pieces[row]:
                    first_pos[row] = offset
                    stats.documents_split += offset > 0
                row_pieces[row].append(take)
                pos, length, offset = pos + take, length - take, offset + take
        assert pos == len(tokens)
        carry_tokens = tokens[n_rows * seq_len :]
        if n_rows == 0:
            continue
        stats.rows += n_rows
        stats.tokens_packed += n_rows * seq_len
        yield _record_batch(tokens[: n_rows * seq_len], row_pieces, first_pos, seq_len)
    stats.tokens_dropped = len(carry_tokens)
    stats.seconds += time.perf_counter() - t0
    assert stats.tokens_in == stats.tokens_packed + stats.tokens_dropped


def _record_batch(
    flat: np.ndarray, row_pieces: list[list[int]], first_pos: np.ndarray, seq_len: int
) -> pa.RecordBatch:
    n_rows = len(row_pieces)
    assert flat.size == n_rows * seq_len
    assert all(sum(p) == seq_len for p in row_pieces)
    tok_offsets = np.arange(n_rows + 1, dtype=np.int64) * seq_len
    doc_offsets = np.concatenate([[0], np.cumsum([len(p) for p in row_pieces])])
    doc_values = np.fromiter((n for p in row_pieces for n in p), dtype=np.int32, count=int(doc_offsets[-1]))
    assert tok_offsets[-1] < 2**31, "a record batch must stay under 2^31 tokens (int32 list offsets)"
    return pa.RecordBatch.from_arrays(
        [
            pa.ListArray.from_arrays(pa.array(tok_offsets.astype(np.int32)), pa.array(flat, pa.int32())),
            pa.ListArray.from_arrays(pa.array(doc_offsets.astype(np.int32)), pa.array(doc_values)),
            pa.array(first_pos, pa.int64()),
        ],
        schema=PACKED_FEATURES.arrow_schema,
    )
