"""Raw text sources: local files and hub datasets, normalised to one ``text`` column, optionally mixed.

Accepted inputs (``--input`` / ``data.inputs``), each one of:

- a local file or glob: ``.jsonl``/``.json`` (one object per line), ``.parquet``, ``.csv``, ``.arrow``, or
  ``.txt``/``.text``/``.md`` (one *file* is one document: long-context data wants whole documents, not lines);
  compressed ``.gz``/``.zst`` variants of these work as ``datasets`` handles them;
- a directory written by ``Dataset.save_to_disk`` (loaded memory-mapped), or a directory of such files;
- a hub dataset name ``owner/name`` or ``owner/name:config`` (split ``train``). Downloads go to ``cache_dir``;
  with ``HF_DATASETS_OFFLINE=1`` (or ``HF_HUB_OFFLINE=1``) only the local cache is used.

Every source becomes a dataset with exactly one column, ``text`` (taken from ``text_field``), so sources
with different schemas can be mixed. Mixing with ``weights`` samples documents from the sources with those
probabilities, deterministically from ``seed``, until every source has been used up at least once
(``datasets``' ``all_exhausted`` strategy): no document is lost, and a source whose weight exceeds its
share of the data is repeated.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Sequence
from pathlib import Path

import datasets
from datasets import Dataset, IterableDataset

TEXT_COLUMN = "text"

_BUILDERS: dict[str, str] = {
    ".jsonl": "json",
    ".json": "json",
    ".parquet": "parquet",
    ".csv": "csv",
    ".arrow": "arrow",
    ".txt": "text",
    ".text": "text",
    ".md": "text",
}
_COMPRESSION = (".gz", ".zst", ".bz2", ".xz")


def _builder_for(path: str) -> str | None:
    name = path.lower()
    for ext in _COMPRESSION:
        if name.endswith(ext):
            name = name[: -len(ext)]
    return _BUILDERS.get(os.path.splitext(name)[1])


def _looks_local(spec: str) -> bool:
    """A path-like spec (absolute, relative with a dot/slash prefix, a glob, or a known file extension)."""
    return (
        spec.startswith(("/", "./", "../", "~"))
        or any(c in spec for c in "*?[")
        or _builder_for(spec) is not None
        or os.path.exists(spec)
    )


def _is_saved_dataset(path: Path) -> bool:
    return path.is_dir() and (path / "state.json").exists() and (path / "dataset_info.json").exists()


def is_prepared_dataset(path: str | os.PathLike) -> bool:
    """True if ``path`` is a ``usp-prepare-data`` output (a saved dataset with packed rows)."""
    p = Path(path)
    if not _is_saved_dataset(p):
        return False
    try:
        info = datasets.load_from_disk(str(p)).features
    except Exception:  # noqa: BLE001 - anything unreadable is simply not a prepared dataset
        return False
    return "input_ids" in info and "document_lengths" in info


def check_inputs(
    inputs: Sequence[str], weights: Sequence[float] | None, setting: str = "data.inputs"
) -> None:
    """Cheap checks before any loading: local inputs exist, weights match. Raises ``ValueError``."""
    if not inputs:
        raise ValueError(
            f"{setting} is empty: give at least one file, directory or hub dataset name "
            "(or set data.build_tiny_corpus=true for the synthetic demo corpus)."
        )
    for spec in inputs:
        if not isinstance(spec, str) or not spec:
            raise ValueError(f"{setting} entry {spec!r} is not a path or hub dataset name.")
        if _looks_local(spec):
            expanded = os.path.expanduser(spec)
            matches = glob.glob(expanded) if any(c in spec for c in "*?[") else [expanded]
            missing = [m for m in matches if not os.path.exists(m)]
            if not matches or missing:
                raise ValueError(
                    f"{setting}: input {spec!r} does not exist (no such file, directory or glob match). "
                    "Fix the path, or pass a hub dataset name such as 'owner/name'."
                )
            empty = [m for m in matches if os.path.isfile(m) and os.path.getsize(m) == 0]
            if empty:
                raise ValueError(
                    f"{setting}: input file {empty[0]!r} is empty (0 bytes); remove it from the inputs or fill it."
                )
            if os.path.isfile(matches[0]) and _builder_for(matches[0]) is None:
                raise ValueError(
                    f"{setting}: cannot tell the format of {spec!r}; use one of the extensions "
                    f"{sorted(_BUILDERS)} (optionally compressed: {list(_COMPRESSION)})."
                )
    if weights is not None:
        if len(weights) != len(inputs):
            raise ValueError(
                f"data.weights has {len(weights)} entries but {setting} has {len(inputs)}: give one weight per "
                "input, or leave weights unset to concatenate the inputs."
            )
        if any(w < 0 for w in weights) or sum(weights) <= 0:
            raise ValueError(f"data.weights={list(weights)} must be >= 0 with a positive sum.")


def _is_plain_text(spec: str) -> bool:
    return _looks_local(spec) and not os.path.isdir(os.path.expanduser(spec)) and _builder_for(spec) == "text"


def _load_one(spec: str, *, cache_dir: str | None, streaming: bool) -> Dataset | IterableDataset:
    if _looks_local(spec):
        path = Path(os.path.expanduser(spec))
        if _is_saved_dataset(path):
            ds = datasets.load_from_disk(str(path))
            return ds.to_iterable_dataset() if streaming else ds
        if path.is_dir():
            files = sorted(
                str(f) for f in path.rglob("*") if f.is_file() and _builder_for(str(f)) is not None
            )
            if not files:
                raise ValueError(
                    f"data.inputs: directory {spec!r} holds no file with a known extension {sorted(_BUILDERS)}."
                )
        else:
            files = sorted(glob.glob(str(path))) if any(c in spec for c in "*?[") else [str(path)]
        empty = [f for f in files if os.path.getsize(f) == 0]
        if empty:  # `datasets` fails obscurely on empty files
            raise ValueError(f"data.inputs: file {empty[0]!r} in {spec!r} is empty (0 bytes); remove it.")
        kinds = {_builder_for(f) for f in files}
        if len(kinds) != 1:
            raise ValueError(
                f"data.inputs: {spec!r} mixes file formats {sorted(map(str, kinds))}; give one input per format."
            )
        builder = kinds.pop()
        assert builder is not None
        extra = {"sample_by": "document"} if builder == "text" else {}
        return datasets.load_dataset(
            builder, data_files=files, split="train", cache_dir=cache_dir, streaming=streaming, **extra
        )
    name, _, config = spec.partition(":")
    try:
        return datasets.load_dataset(
            name, config or None, split="train", cache_dir=cache_dir, streaming=streaming
        )
    except (ConnectionError, FileNotFoundError) as e:
        offline = datasets.config.HF_HUB_OFFLINE
        hint = (
            "HF_DATASETS_OFFLINE/HF_HUB_OFFLINE is set and it is not in the cache: download it once with network "
            "access into the same cache_dir, or pass local files."
            if offline
            else "check the name (owner/name[:config]) and your network, or pass local files."
        )
        raise ValueError(
            f"data.inputs: cannot load hub dataset {spec!r} ({type(e).__name__}: {e}); {hint}"
        ) from e


def _text_only(
    ds: Dataset | IterableDataset, spec: str, text_field: str, plain_text: bool
) -> Dataset | IterableDataset:
    columns = ds.column_names
    if columns is None and isinstance(ds, IterableDataset):  # unknown schema until read: peek one row
        columns = list(next(iter(ds.take(1)), {}).keys())
    if plain_text:
        return ds  # text files: one column 'text' whatever text_field says
    if text_field not in columns:
        raise ValueError(
            f"input {spec!r} has no column {text_field!r} (columns: {columns}). "
            f"Set --text-field / data.text_field to the column that holds the document text."
        )
    ds = ds.select_columns([text_field])
    if text_field != TEXT_COLUMN:
        ds = ds.rename_column(text_field, TEXT_COLUMN)
    return ds


def load_text_sources(
    inputs: Sequence[str],
    *,
    text_field: str = "text",
    weights: Sequence[float] | None = None,
    seed: int = 0,
    streaming: bool = False,
    cache_dir: str | os.PathLike | None = None,
) -> Dataset | IterableDataset:
    """Load every input, keep only its text (column ``text``), and concatenate or mix them.

    Returns a memory-mapped ``Dataset`` (or an ``IterableDataset`` when ``streaming``). Raises ``ValueError``
    for missing inputs, a missing text field, mismatched weights or an empty result.
    """
    check_inputs(inputs, weights)
    cache = None if cache_dir is None else str(cache_dir)
    parts = [
        _text_only(_load_one(s, cache_dir=cache, streaming=streaming), s, text_field, _is_plain_text(s))
        for s in inputs
    ]
    features = datasets.Features({TEXT_COLUMN: datasets.Value("string")})
    parts = [p.cast(features) if p.features is not None and p.features != features else p for p in parts]
    if not streaming:
        for spec, p in zip(inputs, parts):
            if len(p) == 0:
                raise ValueError(f"input {spec!r} holds no documents; remove it from --input / data.inputs.")
    if len(parts) == 1:
        return parts[0]
    if weights is None:
        return datasets.concatenate_datasets(parts)
    total = float(sum(weights))
    nonzero = [(p, w / total) for p, w in zip(parts, weights) if w > 0]
    return datasets.interleave_datasets(
        [p for p, _ in nonzero],
        probabilities=[w for _, w in nonzero],
        seed=seed,
        stopping_strategy="all_exhausted",
    )
