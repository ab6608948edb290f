"""Raw text sources: local files and hub datasets, normalised to one ``text`` column, optionally mixed.

Accepted inputs (``--input`` / ``data.inputs``), each one of:

- a local file or glob: ``.jsonl``/``.json`` (one object per line), ``.parquet``, ``.csv``, ``.arrow``, or
  ``.txt``/``.text``/``.md`` (one *file* is one document: long-context data wants whole documents, not lines);
  compressed ``.gz``/``.zst`` variants of these work as ``datasets`` handles them;
- a directory written by ``Dataset.save_to_disk`` or ``DatasetDict.save_to_disk`` (loaded memory-mapped with
  ``datasets.load_from_disk``; of a ``DatasetDict`` only the ``train`` split), or a directory of data files;
- a hub dataset name ``owner/name`` or ``owner/name:config`` (split ``train``). Downloads go to ``cache_dir``;
  with ``HF_DATASETS_OFFLINE=1`` (or ``HF_HUB_OFFLINE=1``) only the local cache is used.

Inside a directory input, README files, hidden files and folders (``.git``, ``.cache``, ``.huggingface``)
are skipped, ``.md`` files are skipped when the directory also holds data files (a hub download: README.md +
``data/*.parquet``), and when the files are named by split (``train-*``/``test-*``/``validation-*``, or under
``train/``/``test/`` folders) only the ``train`` split is read; each choice is logged.

Every source becomes a dataset with exactly one column, ``text`` (taken from ``text_field``: one name for all
inputs, or a list with one name per input), so sources with different schemas can be mixed. Mixing with ``weights`` samples documents from the sources with those
probabilities, deterministically from ``seed``, **without repeating any document**: the mix is the largest
one the sources can fill at those proportions (:func:`weighted_counts`), so the most constrained source is
used whole and the others partly (their unused documents are logged). To repeat a source on purpose, list
it twice in the inputs (long-document upsampling is separate: ``LengthShaping``).
"""

from __future__ import annotations

import glob
import json
import logging
import math
import os
import re
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import datasets
import numpy as np
from datasets import Dataset, IterableDataset

from usp.config import text_fields_per_input

TEXT_COLUMN = "text"
logger = logging.getLogger(__name__)
_SPLITS = ("train", "test", "validation", "valid", "dev", "eval")
_SPLIT_NAME = re.compile(r"^(" + "|".join(_SPLITS) + r")(?:[-_.]|$)", re.IGNORECASE)

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


NON_TEXT_FIX = (
    "Fix the data, or point the text field at the text column (usp-train / usp-eval: data.text_field=...; "
    "usp-prepare-data: --text-field), or drop such rows: usp-prepare-data --skip-non-text (counted in its "
    "summary), then train on its output with data=prepared data.prepared_path=..."
)
"""The advice for a text value that is not a string, for both entry points that read text (the trainer's
``data=jsonl`` has no skip setting: the rows are dropped by preparing the data once)."""


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


def _is_saved_dataset_dict(path: Path) -> bool:
    return path.is_dir() and (path / "dataset_dict.json").exists()


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


def _split_of(rel: Path) -> str | None:
    """The split a file belongs to by its folder (``train/...``) or name (``train-00000-of-00002.parquet``)."""
    for part in rel.parts[:-1]:
        if part.lower() in _SPLITS:
            return part.lower()
    m = _SPLIT_NAME.match(rel.name)
    return m.group(1).lower() if m else None


def directory_files(path: Path, log: Callable[[str], None] | None = None) -> list[str]:
    """The data files of a directory input, sorted (see the module docstring for what is skipped)."""
    log = log or logger.info
    files, skipped = [], []
    for f in sorted(path.rglob("*")):
        rel = f.relative_to(path)
        if not f.is_file():
            continue
        if any(part.startswith(".") for part in rel.parts) or f.name.upper().startswith("README"):
            skipped.append(str(rel))
        elif _builder_for(str(f)) is not None:
            files.append(f)
    if any(_builder_for(str(f)) != "text" for f in files):  # data files: .md/.txt next to them are docs
        docs = [f for f in files if _builder_for(str(f)) == "text"]
        skipped += [str(f.relative_to(path)) for f in docs]
        files = [f for f in files if _builder_for(str(f)) != "text"]
    if skipped:
        log(
            f"input {str(path)!r}: skipping {len(skipped)} non-data files ({', '.join(skipped[:5])}"
            f"{', ...' if len(skipped) > 5 else ''})"
        )
    splits = {f: _split_of(f.relative_to(path)) for f in files}
    if any(s == "train" for s in splits.values()) and any(s not in (None, "train") for s in splits.values()):
        others = sorted({s for s in splits.values() if s not in (None, "train")})
        kept = [f for f in files if splits[f] == "train"]
        log(
            f"input {str(path)!r}: using only the train split ({len(kept)} of {len(files)} files; "
            f"skipping {others}). Pass the files you want (a glob) to use other splits."
        )
        files = kept
    return [str(f) for f in files]


def load_one(
    spec: str, *, cache_dir: str | None, streaming: bool, log: Callable[[str], None] | None = None
) -> Dataset | IterableDataset:
    """One input as read, all its columns (a saved dataset, a DatasetDict's train split, files of one format,
    a directory's files, or a hub name); ``ValueError`` for one that cannot be read."""
    if _looks_local(spec):
        path = Path(os.path.expanduser(spec))
        if _is_saved_dataset(path) or _is_saved_dataset_dict(path):
            ds = datasets.load_from_disk(str(path))
            if isinstance(ds, datasets.DatasetDict):
                if "train" not in ds:
                    raise ValueError(
                        f"data.inputs: {spec!r} is a saved DatasetDict without a 'train' split (splits: "
                        f"{sorted(ds)}); pass the split's directory ({spec}/<split>) instead."
                    )
                (log or logger.info)(
                    f"input {spec!r}: saved DatasetDict, using its train split of {sorted(ds)}"
                )
                ds = ds["train"]
            return ds.to_iterable_dataset() if streaming else ds
        if path.is_dir():
            files = directory_files(path, log=log)
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
        quiet = logging.getLogger("datasets.packaged_modules")  # logs a parse error before raising it
        level = quiet.level
        quiet.setLevel(logging.CRITICAL)
        try:
            return datasets.load_dataset(
                builder, data_files=files, split="train", cache_dir=cache_dir, streaming=streaming, **extra
            )
        except Exception as e:  # noqa: BLE001 - a parse error deep in datasets/pyarrow: said as one line
            if not _is_parse_error(e):
                raise
            raise ValueError(f"data.inputs: {describe_parse_error(files, builder, e)}") from e
        finally:
            quiet.setLevel(level)
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


def _is_parse_error(e: BaseException) -> bool:
    """A file ``datasets`` could not read (its generation error wrapping pyarrow's, or pyarrow's own)."""
    chain = [e, e.__cause__, e.__context__]
    names = {type(x).__name__ for x in chain if x is not None}
    return bool(names & {"DatasetGenerationError", "ArrowInvalid", "ArrowTypeError", "UnicodeDecodeError"})


def _json_lines(path: str) -> Iterator[tuple[int, bytes]]:
    """``(line number, raw line)`` of the non-blank lines of a JSON Lines file (compressed ones too)."""
    opener = {".gz": "gzip", ".bz2": "bz2", ".xz": "lzma"}.get(os.path.splitext(path)[1])
    if opener is not None:
        import importlib

        f = importlib.import_module(opener).open(path, "rb")
    else:
        f = open(path, "rb")  # noqa: SIM115 - closed below
    with f:
        for number, raw in enumerate(f, start=1):
            if raw.strip():
                yield number, raw


def describe_parse_error(files: Sequence[str], builder: str, error: BaseException) -> str:
    """One line for a file ``datasets`` could not parse: ``<file>:<line>: <what is wrong>`` for JSON Lines
    (found by reading the files again, line by line), else the file(s) and the parser's first line."""
    if builder == "json":
        for path in files:
            if path.endswith(".zst"):
                continue
            try:
                for number, raw in _json_lines(path):
                    try:
                        text = raw.decode("utf-8").rstrip("\r\n")
                    except UnicodeDecodeError:
                        return f"{path}:{number}: not UTF-8 text (a binary file?); fix or remove it."
                    try:
                        json.loads(text)
                    except json.JSONDecodeError as e:
                        return f"{path}:{number}: not valid JSON ({e.msg}, column {e.colno}); fix or remove the line."
            except OSError as e:
                return f"{path}: cannot be read ({e})."
    causes = [x for x in (error.__cause__, error.__context__, error) if x is not None and str(x).strip()]
    first = str(causes[0]).strip().splitlines()[0] if causes else type(error).__name__
    where = files[0] if len(files) == 1 else f"one of {len(files)} files ({files[0]}, ...)"
    return f"{where}: cannot be parsed as {builder} ({first[:300]})."


def _locate_row(files: Sequence[str], builder: str, index: int) -> str:
    """Where row ``index`` of an input came from: ``<file>:<line>`` for JSON Lines, else the row number."""
    if builder == "json":
        seen = 0
        for path in files:
            if path.endswith(".zst"):
                break
            for number, _ in _json_lines(path):
                if seen == index:
                    return f"{path}:{number}"
                seen += 1
    return f"row {index}"


def check_text_column(
    ds: Dataset,
    spec: str,
    text_field: str,
    *,
    files: Sequence[str] = (),
    builder: str = "",
    skip: bool = False,
) -> tuple[Dataset, int]:
    """Refuse (or, with ``skip``, drop and count) rows whose ``text_field`` is not a string.

    A column of strings passes untouched (nulls are empty documents: tokenization skips and counts them).
    Anything else (a number, a list, an object: ``datasets`` then types the column as ``Json`` or a
    non-string value) raises ``ValueError`` naming the input, the first such row (``file:line`` for JSON
    Lines) and its type; text is never re-encoded. Returns the text column alone as a string ``Dataset``
    (the strings as decoded, in memory: only columns that are not strings come here) and the number of rows
    dropped.
    """
    feature = ds.features[text_field]
    if isinstance(feature, datasets.Value) and feature.dtype in ("string", "large_string"):
        return ds, 0
    values = ds[text_field]
    bad = [i for i, v in enumerate(values) if not (v is None or isinstance(v, str))]
    if bad and not skip:
        first = values[bad[0]]
        where = _locate_row(files, builder, bad[0])
        raise ValueError(
            f"data.inputs: {spec!r}: the {text_field!r} value of {where} is of type {type(first).__name__} "
            f"({str(first)[:60]!r}), not a string; {len(bad)} of {len(values)} rows are not text. {NON_TEXT_FIX}"
        )
    # the decoded strings themselves: casting a Json column to string would JSON-encode them
    texts = [v for v in values if v is None or isinstance(v, str)]
    return Dataset.from_dict(
        {text_field: texts}, features=datasets.Features({text_field: datasets.Value("string")})
    ), len(bad)


def _is_string(features: datasets.Features | None, field: str) -> bool:
    feature = None if features is None else features.get(field)
    return isinstance(feature, datasets.Value) and feature.dtype in ("string", "large_string")


def _checked_stream(
    ds: IterableDataset, spec: str, field: str, skip: bool, skipped: dict[str, int] | None
) -> IterableDataset:
    """:func:`check_text_column` for a stream, applied as rows are read: the decoded strings pass, anything
    else raises ``ValueError`` (the row number within ``spec``) or, with ``skip``, is dropped and counted."""

    def check(batch: dict[str, list], indices: list[int]) -> dict[str, list]:
        texts = []
        for index, value in zip(indices, batch[field]):
            if value is None or isinstance(value, str):
                texts.append(value)
            elif skip:
                if skipped is not None:
                    skipped[spec] = skipped.get(spec, 0) + 1
            else:
                raise ValueError(
                    f"data.inputs: {spec!r}: the {field!r} value of row {index} is of type {type(value).__name__} "
                    f"({str(value)[:60]!r}), not a string. {NON_TEXT_FIX}"
                )
        return {field: texts}

    return ds.map(
        check, batched=True, with_indices=True, features=datasets.Features({field: datasets.Value("string")})
    )


def _local_files(spec: str) -> tuple[list[str], str]:
    """The files of a local input and their builder (for locating a row); ``([], "")`` otherwise."""
    if not _looks_local(spec):
        return [], ""
    path = Path(os.path.expanduser(spec))
    if _is_saved_dataset(path):
        return [], ""
    if path.is_dir():
        files = directory_files(path, log=lambda msg: None)
    else:
        files = sorted(glob.glob(str(path))) if any(c in spec for c in "*?[") else [str(path)]
    kinds = {_builder_for(f) for f in files}
    return files, (kinds.pop() or "") if len(kinds) == 1 else ""


def _text_only(
    ds: Dataset | IterableDataset,
    spec: str,
    text_field: str,
    plain_text: bool,
    *,
    skip_non_text: bool = False,
    skipped: dict[str, int] | None = None,
) -> Dataset | IterableDataset:
    if isinstance(ds, Dataset) and not plain_text and text_field in ds.column_names:
        feature = ds.features[text_field]
        if not (isinstance(feature, datasets.Value) and feature.dtype in ("string", "large_string")):
            files, builder = _local_files(spec)
            ds, dropped = check_text_column(
                ds, spec, text_field, files=files, builder=builder, skip=skip_non_text
            )
            if skipped is not None:
                skipped[spec] = skipped.get(spec, 0) + dropped
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
    if isinstance(ds, IterableDataset) and not _is_string(ds.features, text_field):
        ds = _checked_stream(ds, spec, text_field, skip_non_text, skipped)
    if text_field != TEXT_COLUMN:
        ds = ds.rename_column(text_field, TEXT_COLUMN)
    return ds


def weighted_counts(sizes: Sequence[int], weights: Sequence[float]) -> list[int]:
    """Documents to take from each source: the largest mix in proportion ``weights`` that repeats nothing.

    The total ``T = min(size_i / w_i)`` over sources with ``w_i > 0`` (weights normalised) is the most the
    sources can give at those proportions; source ``i`` contributes ``floor(T * w_i)`` (at most its size),
    so the most constrained source is used whole and a source of weight 0 not at all.
    """
    assert len(sizes) == len(weights) and sum(weights) > 0
    total = float(sum(weights))
    share = [w / total for w in weights]
    t = min(n / w for n, w in zip(sizes, share) if w > 0)
    return [min(n, math.floor(t * w + 1e-6)) for n, w in zip(sizes, share)]


def _mix(parts: list[Dataset], counts: list[int], seed: int) -> Dataset:
    """``counts[i]`` documents of part ``i`` (a seeded subset, kept in file order), in a seeded random
    interleaving; no document appears twice."""
    rng = np.random.default_rng(seed)
    offset, chosen = 0, []
    for p, c in zip(parts, counts):
        pick = np.arange(len(p)) if c == len(p) else np.sort(rng.choice(len(p), size=c, replace=False))
        chosen.append(offset + pick)
        offset += len(p)
    source = rng.permutation(np.repeat(np.arange(len(parts)), counts))
    order = np.empty(len(source), dtype=np.int64)
    for i, rows in enumerate(chosen):
        order[source == i] = rows  # the k-th draw of source i takes its k-th chosen document
    return datasets.concatenate_datasets(parts).select(order)


def load_text_sources(
    inputs: Sequence[str],
    *,
    text_field: str | Sequence[str] = "text",
    weights: Sequence[float] | None = None,
    seed: int = 0,
    streaming: bool = False,
    cache_dir: str | os.PathLike | None = None,
    log: Callable[[str], None] | None = None,
    usage: list[dict[str, object]] | None = None,
    skip_non_text: bool = False,
    skipped: dict[str, int] | None = None,
) -> Dataset | IterableDataset:
    """Load every input, keep only its text (column ``text``), and concatenate or mix them.

    Bad data is never rewritten: a file that does not parse raises ``ValueError`` with the file and line
    (:func:`describe_parse_error`); a text value that is not a string raises ``ValueError`` naming the
    input, row and type, or, with ``skip_non_text``, the row is dropped and counted in ``skipped`` (input ->
    rows) (:func:`check_text_column`; for a stream, as its rows are read).

    Returns a memory-mapped ``Dataset`` (or an ``IterableDataset`` when ``streaming``). Raises ``ValueError``
    for missing inputs, a missing text field, mismatched weights or an empty result. With ``weights`` no
    document is repeated (see :func:`weighted_counts`); the documents used and left unused per source are
    logged through ``log`` and, when ``usage`` is a list, appended to it (one dict per input; not known
    up front when ``streaming``: the stream then stops when the first source runs out).
    """
    check_inputs(inputs, weights)
    fields = text_fields_per_input(text_field, inputs)
    log = log or logger.info
    cache = None if cache_dir is None else str(cache_dir)
    parts = [
        _text_only(
            load_one(s, cache_dir=cache, streaming=streaming, log=log),
            s,
            field,
            _is_plain_text(s),
            skip_non_text=skip_non_text,
            skipped=skipped,
        )
        for s, field in zip(inputs, fields)
    ]
    features = datasets.Features({TEXT_COLUMN: datasets.Value("string")})
    parts = [p.cast(features) if p.features is not None and p.features != features else p for p in parts]
    return combine_sources(
        parts, inputs, weights=weights, seed=seed, streaming=streaming, log=log, usage=usage
    )


def combine_sources(
    parts: list[Dataset | IterableDataset],
    inputs: Sequence[str],
    *,
    weights: Sequence[float] | None,
    seed: int,
    streaming: bool,
    log: Callable[[str], None],
    usage: list[dict[str, object]] | None = None,
) -> Dataset | IterableDataset:
    """One dataset from the loaded ``parts`` (one per input, same features): concatenated, or mixed by
    ``weights`` without repeating a row (see :func:`load_text_sources`)."""
    if not streaming:
        for spec, p in zip(inputs, parts):
            if len(p) == 0:
                raise ValueError(f"input {spec!r} holds no documents; remove it from --input / data.inputs.")
    if len(parts) == 1:
        return parts[0]
    if weights is None:
        return datasets.concatenate_datasets(parts)
    total = float(sum(weights))
    if streaming:
        nonzero = [(p, w / total) for p, w in zip(parts, weights) if w > 0]
        log("weighted mix of streams: sampling stops when the first source runs out (no document repeated)")
        return datasets.interleave_datasets(
            [p for p, _ in nonzero],
            probabilities=[w for _, w in nonzero],
            seed=seed,
            stopping_strategy="first_exhausted",
        )
    counts = weighted_counts([len(p) for p in parts], weights)
    for spec, p, w, c in zip(inputs, parts, weights, counts):
        row = {"input": spec, "weight": w / total, "documents": len(p), "used": c, "unused": len(p) - c}
        if usage is not None:
            usage.append(row)
        log(f"mix: {spec!r} weight {w / total:.3g}: {c} of {len(p)} documents used, {len(p) - c} unused")
    return _mix(parts, counts, seed)
