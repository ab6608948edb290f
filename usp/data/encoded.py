"""The steps the chat and preference formats share between reading their inputs and publishing the packed
rows (:mod:`usp.data.chat_prepare`, :mod:`usp.data.preference_prepare`): the inputs read and normalized into
the format's schema (:func:`load_normalized`), the rows encoded with ``datasets.map`` (:func:`encode_rows`),
read back a window at a time (:func:`windows_of`), and the packer's batches written to ``work/packed.arrow``
(:func:`write_packed`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import datasets
import pyarrow as pa
from datasets import Dataset, IterableDataset

from usp.data.sources import check_inputs, combine_sources, load_one


def load_normalized(
    inputs: Sequence[str],
    normalize: Callable[..., dict[str, list]],
    fn_kwargs: dict[str, Any],
    features: datasets.Features,
    desc: str,
    *,
    weights: Sequence[float] | None,
    seed: int,
    streaming: bool,
    cache_dir: str | None,
    log: Callable[[str], None] | None,
    usage: list[dict[str, object]] | None,
) -> Dataset | IterableDataset:
    """Every input with the ``features`` columns only, ``normalize(batch, indices, spec=input, **fn_kwargs)``
    on batches of its rows (``desc``: the progress bar's), concatenated or mixed by ``weights``
    (:func:`usp.data.sources.combine_sources`)."""
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
            fn_kwargs={"spec": spec, **fn_kwargs},
            remove_columns=columns,
            features=features,
        )
        if isinstance(ds, Dataset):
            kwargs["desc"] = desc
        parts.append(ds.map(normalize, **kwargs))
    return combine_sources(
        parts, inputs, weights=weights, seed=seed, streaming=streaming, log=log, usage=usage
    )


def encode_rows(
    raw: Dataset | IterableDataset,
    work: Path,
    encode: Callable[..., dict[str, list]],
    fn_kwargs: dict[str, Any],
    *,
    remove_columns: list[str],
    features: datasets.Features,
    desc: str,
    num_proc: int,
) -> Dataset | IterableDataset:
    """``raw`` encoded by ``encode(batch, **fn_kwargs)`` into the ``features`` columns, 64 rows a batch; a
    ``Dataset`` in ``num_proc`` processes, cached in ``work/encoded.arrow``."""
    kwargs: dict[str, Any] = dict(
        batched=True,
        batch_size=64,
        fn_kwargs=fn_kwargs,
        remove_columns=remove_columns,
        features=features,
    )
    if isinstance(raw, Dataset):
        kwargs.update(
            num_proc=num_proc if num_proc > 1 and len(raw) > 1 else None,
            desc=desc,
            cache_file_name=str(work / "encoded.arrow"),
            load_from_cache_file=False,
        )
    return raw.map(encode, **kwargs)


def windows_of(ds: Dataset | IterableDataset, window: int) -> Iterator[dict[str, Any]]:
    """The encoded rows, ``window`` at a time (numpy columns for a ``Dataset``)."""
    if isinstance(ds, Dataset):
        return ds.with_format("numpy").iter(batch_size=window)
    return ds.iter(batch_size=window)


def pad_id_of(tokenizer: Any) -> int:
    """The id that pads a row: the tokenizer's pad token, else its EOS."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def write_packed(work: Path, schema: pa.Schema, batches: Iterable[pa.RecordBatch]) -> tuple[Path, int]:
    """Write ``batches`` (packed rows, ``input_ids`` first) to ``work/packed.arrow``; returns ``(file, max
    token id)`` (-1 for no token)."""
    packed = work / "packed.arrow"
    max_id = -1
    with pa.OSFile(str(packed), "wb") as sink, pa.ipc.new_stream(sink, schema) as w:
        for batch in batches:
            col = batch.column(0).flatten().to_numpy(zero_copy_only=False)
            max_id = max(max_id, int(col.max()) if col.size else -1)
            w.write_batch(batch)
    return packed, max_id
