"""``usp-prepare-data``: sources -> tokenized documents -> packed ``seq_len`` rows, saved with ``save_to_disk``.

Example (a Llama 3 checkpoint, 128K rows, long documents upsampled 2x)::

    usp-prepare-data --input 'corpus/*.jsonl' --input owner/books --weights 0.7 0.3 \\
        --tokenizer /ckpt/Meta-Llama-3-8B --seq-len 131072 --num-proc 16 \\
        --long-doc-threshold 32768 --long-doc-factor 2 --output /data/prepared-128k

The output loads with ``datasets.load_from_disk(output)`` (memory-mapped); every row has ``input_ids``
(exactly ``seq_len`` int32), ``document_lengths`` (summing to ``seq_len``) and ``first_position``. A summary
(documents, tokens, dropped tail, tokens/s) is printed and saved next to the data as ``usp_prepare.json``.
The same :func:`prepare_dataset` runs on the fly inside ``build_dataloaders`` for small corpora.
``--format chat`` reads conversations instead (:mod:`usp.data.chat_prepare`; rows gain ``loss_mask``).
The command line is :mod:`usp.data.cli`; the output's key, summary file and publishing, shared with the chat
format, are :mod:`usp.data.prepared`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
from datasets import Dataset, IterableDataset

from usp.data.pack import PACKED_FEATURES, LengthShaping, PackStats, pack_documents
from usp.data.prepared import Preparation, PreparedData, preparation_key
from usp.data.sources import load_text_sources
from usp.data.tokenize import TOKENS_COLUMN, check_tokenizer, tokenize_documents


def document_windows(ds: Dataset | IterableDataset, window: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Tokenized documents in order, ``window`` at a time, as ``(flat int32 tokens, lengths)``."""
    if isinstance(ds, Dataset):
        for table in ds.with_format("arrow").iter(batch_size=window):
            col = table.column(TOKENS_COLUMN).combine_chunks()
            yield (
                col.flatten().to_numpy(zero_copy_only=False).astype(np.int32, copy=False),
                col.value_lengths().to_numpy(zero_copy_only=False),
            )
        return
    for batch in ds.iter(batch_size=window):
        docs = batch[TOKENS_COLUMN]
        if not docs:
            continue
        lengths = np.fromiter(map(len, docs), dtype=np.int64, count=len(docs))
        yield np.concatenate([np.asarray(d, dtype=np.int32) for d in docs]), lengths


def prepare_dataset(
    inputs: Sequence[str],
    *,
    tokenizer: Any,
    seq_len: int,
    output: str | os.PathLike,
    text_field: str | Sequence[str] = "text",
    weights: Sequence[float] | None = None,
    seed: int = 0,
    streaming: bool = False,
    num_proc: int = 1,
    cache_dir: str | os.PathLike | None = None,
    shaping: LengthShaping | None = None,
    add_bos: bool = True,
    max_documents: int | None = None,
    overwrite: bool = False,
    window: int = 256,
    log: Callable[[str], None] | None = None,
    skip_non_text: bool = False,
) -> PreparedData:
    """Tokenize, shape, pack and save ``inputs`` to ``output``; see the module docstring.

    Writes into a sibling work directory and renames it into place at the end, so an interrupted run never
    leaves a half-written ``output``. Peak extra disk (besides the ``datasets`` cache of the raw text): the
    tokenized documents and the packed rows while packing, then (the tokenized documents deleted) the packed
    rows twice while ``save_to_disk`` copies them: about ``8 x tokens`` bytes; ``4 x tokens`` remain.

    If ``output`` appears while this runs (another process preparing the same path), it is never deleted
    unless ``overwrite``: when it holds the same preparation (same inputs, tokenizer and settings) this
    run's work is discarded and the existing output used; otherwise this run's rows are kept next to it and
    ``ValueError`` says where. Raises ``ValueError`` for bad inputs before tokenizing, and for a corpus too
    small to fill a row; for a file that does not parse (file and line) and for a text value that is not a
    string (file, row and type), unless ``skip_non_text``: such rows are then dropped and counted
    (``rows_not_text_skipped`` in the summary). Empty and whitespace-only documents are skipped and counted
    (``documents_empty``).
    """
    log = log or (lambda msg: print(msg, flush=True))
    if not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"--seq-len / trainer.seq_len={seq_len!r} must be a positive number of tokens.")
    check_tokenizer(tokenizer)
    run = Preparation.start(inputs, tokenizer, output, weights, seed, streaming, overwrite, log)
    shaping = shaping or LengthShaping()
    key = preparation_key(
        inputs,
        tokenizer=tokenizer,
        seq_len=seq_len,
        text_field=text_field,
        weights=weights,
        seed=seed,
        streaming=streaming,
        shaping=shaping,
        add_bos=add_bos,
        max_documents=max_documents,
    )
    skipped: dict[str, int] = {}
    raw = run.read(
        load_text_sources,
        text_field=text_field,
        cache_dir=cache_dir,
        skip_non_text=skip_non_text,
        skipped=skipped,
        max_documents=max_documents,
    )

    def no_rows(stats: PackStats) -> str:
        what = "no non-empty documents" if stats.documents_in == 0 else f"only {stats.tokens_in} tokens"
        return (
            f"the corpus {list(inputs)} gives {what} after tokenization"
            f"{' and filtering' if shaping.min_doc_tokens else ''}, not enough for one row of --seq-len / "
            f"trainer.seq_len={seq_len}. Add data, lower the sequence length, or relax --min-doc-tokens."
        )

    def pack(work: Path) -> tuple[Path, PackStats, int]:
        return _pack_text(
            raw,
            work,
            tokenizer=tokenizer,
            seq_len=seq_len,
            shaping=shaping,
            seed=seed,
            add_bos=add_bos,
            num_proc=num_proc,
            window=window,
            skipped=skipped,
        )

    return run.publish(pack, key=key, settings={"text_field": text_field}, no_rows=no_rows, summary=summary)


def _pack_text(
    raw: Dataset | IterableDataset,
    work: Path,
    *,
    tokenizer: Any,
    seq_len: int,
    shaping: LengthShaping,
    seed: int,
    add_bos: bool,
    num_proc: int,
    window: int,
    skipped: dict[str, int],
) -> tuple[Path, PackStats, int]:
    """Tokenize (``num_proc`` processes), shape and pack ``raw`` into ``work/packed.arrow``, then free the disk
    of the tokenized documents; returns ``(file, stats, max token id)``."""
    tokenized = tokenize_documents(
        raw, tokenizer, num_proc=num_proc, add_bos=add_bos, cache_file_name=str(work / "tokenized.arrow")
    )
    stats = PackStats(seq_len=seq_len)
    if isinstance(raw, Dataset):
        stats.extra["documents_empty"] = len(raw) - len(tokenized)
    packed_file = work / "packed.arrow"
    max_id = [-1]
    with (
        pa.OSFile(str(packed_file), "wb") as sink,
        pa.ipc.new_stream(sink, PACKED_FEATURES.arrow_schema) as w,
    ):
        for batch in pack_documents(
            _track_max(document_windows(tokenized, window), max_id),
            seq_len,
            shaping=shaping,
            seed=seed,
            stats=stats,
        ):
            w.write_batch(batch)
    del tokenized
    for f in work.iterdir():  # the tokenized documents (one file per process): free the disk first
        if f.is_file() and f != packed_file:
            f.unlink()
    stats.extra["rows_not_text_skipped"] = sum(skipped.values())  # a stream counts them as it is read
    return packed_file, stats, max_id[0]


def _track_max(
    windows: Iterator[tuple[np.ndarray, np.ndarray]], max_id: list[int]
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Pass the windows through, recording the largest token id seen in ``max_id[0]``."""
    for values, lengths in windows:
        if len(values):
            max_id[0] = max(max_id[0], int(values.max()))
        yield values, lengths


def summary(stats: PackStats, output: Path | str) -> str:
    share = 100.0 * stats.tokens_dropped / max(stats.tokens_in, 1)
    return (
        f"usp-prepare-data: {stats.documents_in} documents ({stats.documents_filtered} filtered, "
        f"{stats.documents_upsampled} upsampled copies, {stats.extra.get('documents_empty', 0)} empty skipped"
        f"{_non_text(stats)}) -> "
        f"{stats.rows} rows x {stats.seq_len} tokens at {output}; {stats.documents_split} row boundaries cut a "
        f"document (it continues in the next row); {stats.tokens_dropped} tail tokens dropped ({share:.3f}%); {stats.document_tokens} tokens in "
        f"{stats.seconds:.1f}s = {stats.extra.get('tokens_per_s', 0.0):,.0f} tokens/s"
    )


def _non_text(stats: PackStats) -> str:
    n = stats.extra.get("rows_not_text_skipped", 0)
    return f", {n} rows whose text is not a string skipped (--skip-non-text)" if n else ""
