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
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
from datasets import Dataset, IterableDataset

from usp.atomic import publish_dir, temp_path
from usp.data.pack import PACKED_FEATURES, LengthShaping, PackStats, pack_documents
from usp.data.sources import check_inputs, is_prepared_dataset, load_text_sources
from usp.data.tokenize import TOKENS_COLUMN, check_tokenizer, load_tokenizer, tokenize_documents
from usp.errors import guarded, pop_verbose
from usp.modes import DATA_FORMATS, LONG_CONVERSATIONS, LOSS_ON, RING_LAYOUTS
from usp.parallel import check_sequence_length
from usp.units import parse_seq_len

STATS_FILE = "usp_prepare.json"
FORMAT_VERSION = "usp-packed-v1"


@dataclass
class PreparedData:
    path: Path
    stats: PackStats


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


def _check_output(output: Path, overwrite: bool) -> None:
    if not output.exists() or (output.is_dir() and not any(output.iterdir())):
        return
    if not overwrite:
        raise ValueError(f"--output {str(output)!r} already exists; choose a new path or pass --overwrite.")
    if not is_prepared_dataset(output):
        raise ValueError(
            f"--output {str(output)!r} exists and is not a usp-prepare-data output; refusing to overwrite it. "
            "Choose a new path."
        )


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
    check_inputs(inputs, weights, setting="--input / data.inputs")
    output = Path(output)
    _check_output(output, overwrite)
    shaping = shaping or LengthShaping()
    t0 = time.perf_counter()
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
    usage: list[dict[str, object]] = []
    skipped: dict[str, int] = {}
    raw = load_text_sources(
        inputs,
        text_field=text_field,
        weights=weights,
        seed=seed,
        streaming=streaming,
        cache_dir=cache_dir,
        log=log,
        usage=usage,
        skip_non_text=skip_non_text,
        skipped=skipped,
    )
    raw = first_documents(raw, max_documents)
    work = temp_path(output, "work")  # tokenized and packed files, then the rows to publish: same filesystem
    work.mkdir(parents=True)
    try:
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
        if stats.rows == 0:
            what = "no non-empty documents" if stats.documents_in == 0 else f"only {stats.tokens_in} tokens"
            raise ValueError(
                f"the corpus {list(inputs)} gives {what} after tokenization"
                f"{' and filtering' if shaping.min_doc_tokens else ''}, not enough for one row of --seq-len / "
                f"trainer.seq_len={seq_len}. Add data, lower the sequence length, or relax --min-doc-tokens."
            )
        del tokenized
        for f in work.iterdir():  # the tokenized documents (one file per process): free the disk first
            if f.is_file() and f != packed_file:
                f.unlink()
        out_tmp = work / "out"
        Dataset.from_file(str(packed_file)).save_to_disk(str(out_tmp))
        packed_file.unlink()
        stats.seconds = time.perf_counter() - t0
        stats.extra.update(
            rows_not_text_skipped=sum(skipped.values()),  # a stream counts them as it is read: after packing
            tokens_per_s=stats.document_tokens / max(stats.seconds, 1e-9),
            inputs=list(inputs),
            text_field=text_field,
            weights=None if weights is None else list(weights),
            seed=seed,
            tokenizer=getattr(tokenizer, "name_or_path", ""),
            format=FORMAT_VERSION,
            preparation_key=key,
            tokenizer_identity=tokenizer_identity(tokenizer),
            max_token_id=max_id[0],
            sources=usage,
        )
        existing = publish_rows(out_tmp, output, stats, key=key, overwrite=overwrite, log=log)
        if existing is not None:
            return existing
    finally:
        shutil.rmtree(work, ignore_errors=True)
    log(summary(stats, output))
    return PreparedData(path=output, stats=stats)


def _track_max(
    windows: Iterator[tuple[np.ndarray, np.ndarray]], max_id: list[int]
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Pass the windows through, recording the largest token id seen in ``max_id[0]``."""
    for values, lengths in windows:
        if len(values):
            max_id[0] = max(max_id[0], int(values.max()))
        yield values, lengths


def first_documents(raw: Any, max_documents: int | None) -> Any:
    """The first ``max_documents`` documents of a loaded corpus (a ``Dataset`` or a streamed
    ``IterableDataset``), or all of them when ``None``."""
    if max_documents is None:
        return raw
    if isinstance(raw, IterableDataset):
        return raw.take(max_documents)
    return raw.select(range(min(max_documents, len(raw))))


def publish_rows(
    out_tmp: Path, output: Path, stats: PackStats, *, key: str, overwrite: bool, log: Callable[[str], None]
) -> PreparedData | None:
    """Write ``stats`` next to the finished rows in ``out_tmp`` and move them into place as ``output``
    (:func:`_publish`). ``None`` once published; the existing dataset when another process prepared the same
    one meanwhile (it is used)."""
    (out_tmp / STATS_FILE).write_text(json.dumps(stats.as_dict(), indent=2))
    if _publish(out_tmp, output, key=key, overwrite=overwrite, log=log):
        return None
    return PreparedData(path=output, stats=PackStats(**read_stats(output)))


def _occupied(path: Path) -> bool:
    return path.exists() and not (path.is_dir() and not any(path.iterdir()))


def _publish(out_tmp: Path, output: Path, *, key: str, overwrite: bool, log: Callable[[str], None]) -> bool:
    """Move the finished rows into place. False when an identical output appeared meanwhile (it is used).

    Never deletes an ``output`` that appeared while this run prepared (another process may be reading it)
    unless ``overwrite`` and it is a prepared dataset; a different one is left alone and this run's rows
    are kept at a sibling path named in the ``ValueError``.
    """
    for _ in range(2):  # a second look if another process renamed into place between our check and ours
        replace = False
        if _occupied(output):
            same = (
                is_prepared_dataset(output)
                and read_stats(output).get("extra", {}).get("preparation_key") == key
            )
            if same and not overwrite:
                log(f"{output} was prepared by another process with the same inputs and settings; using it")
                return False
            if not (overwrite and is_prepared_dataset(output)):
                keep = output.parent / f"{output.name}.usp-{os.getpid()}"
                publish_dir(out_tmp, keep, replace=False)
                raise ValueError(
                    f"--output {str(output)!r} appeared while preparing (another process?) and holds other data; "
                    f"it was left untouched and this run's rows were saved at {str(keep)!r}. Use that path, or "
                    "move it into place yourself."
                )
            replace = True
        try:  # --overwrite of a prepared dataset: the previous one stays whole until the new one is in place
            publish_dir(out_tmp, output, replace=replace)
            return True
        except FileExistsError:
            pass
    raise ValueError(
        f"--output {str(output)!r} keeps being replaced by another process; choose another path."
    )


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


def read_stats(path: str | os.PathLike) -> dict[str, Any]:
    """The summary saved next to a prepared dataset (``{}`` if there is none)."""
    f = Path(path) / STATS_FILE
    return json.loads(f.read_text()) if f.exists() else {}


def tokenizer_identity(tokenizer: Any) -> dict[str, Any]:
    """What prepared token ids depend on: vocabulary size, the BOS/EOS ids written around each document, and a
    hash of the vocabulary (not the backend JSON, which changes between library versions)."""
    vocab = json.dumps(sorted(tokenizer.get_vocab().items()), ensure_ascii=False).encode()
    return {
        "vocab_size": len(tokenizer),
        **{f"{k}_token_id": getattr(tokenizer, f"{k}_token_id", None) for k in ("bos", "eos")},
        "vocab_sha256": hashlib.sha256(vocab).hexdigest()[:16],
    }


def tokenizer_fingerprint(tokenizer: Any) -> str:
    h = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        h.update(backend.to_str().encode())
    else:
        h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    h.update(repr((len(tokenizer), tokenizer.bos_token_id, tokenizer.eos_token_id)).encode())
    return h.hexdigest()[:16]


def _input_fingerprint(spec: str) -> list[Any]:
    path = os.path.expanduser(spec)
    files = glob.glob(path) if any(c in spec for c in "*?[") else [path]
    out: list[Any] = []
    for f in sorted(files):
        p = Path(f)
        if not p.exists():
            out.append(spec)  # a hub name: identified by its name (pin a revision via a local copy)
            continue
        members = sorted(x for x in p.rglob("*") if x.is_file()) if p.is_dir() else [p]
        out.extend((str(m.resolve()), m.stat().st_size, m.stat().st_mtime_ns) for m in members)
    return out


def preparation_key(
    inputs: Sequence[str],
    *,
    tokenizer: Any,
    seq_len: int,
    text_field: str | Sequence[str],
    weights: Sequence[float] | None,
    seed: int,
    streaming: bool,
    shaping: LengthShaping,
    add_bos: bool = True,
    max_documents: int | None = None,
    chat: dict[str, Any] | None = None,
) -> str:
    """A short hash of everything that decides the packed rows (used to name on-the-fly cache entries)."""
    desc = {
        "format": FORMAT_VERSION,
        "inputs": [_input_fingerprint(s) for s in inputs],
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "seq_len": seq_len,
        "text_field": text_field,
        "weights": None if weights is None else list(weights),
        "seed": seed,
        "streaming": streaming,
        "shaping": None if shaping is None else asdict(shaping),
        "add_bos": add_bos,
    }
    if max_documents is not None:  # only then, so existing cache entries keep their names
        desc["max_documents"] = max_documents
    if chat is not None:  # --format chat: its settings and template
        desc["chat"] = chat
    return hashlib.sha256(json.dumps(desc, sort_keys=True, default=str).encode()).hexdigest()[:20]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="usp-prepare-data",
        description="Tokenize and pack a corpus into fixed-length rows for long-context training.",
    )
    p.add_argument(
        "--input",
        action="extend",
        nargs="+",
        required=True,
        help="file, glob, saved dataset dir or hub name (owner/name[:config]); several after one --input (a glob "
        "the shell expanded) or --input repeated: one source each",
    )
    p.add_argument(
        "--text-field",
        nargs="+",
        default=["text"],
        help="column holding the document text (default: text); several names: one per --input, in order",
    )
    p.add_argument("--tokenizer", required=True, help="checkpoint or tokenizer directory")
    p.add_argument(
        "--seq-len", type=parse_seq_len, required=True, help="tokens per packed row (131072, 128K, 1M)"
    )
    p.add_argument("--output", required=True, help="directory to write (datasets.save_to_disk layout)")
    p.add_argument("--num-proc", type=int, default=1, help="tokenizer processes (default 1)")
    p.add_argument("--weights", type=float, nargs="+", help="mixing weights, one per --input")
    p.add_argument("--seed", type=int, default=0, help="seed for mixing and upsampling (default 0)")
    p.add_argument(
        "--streaming",
        action="store_true",
        help="read inputs as streams (corpora bigger than memory "
        "or disk for a full download); tokenizes in this process",
    )
    p.add_argument("--cache-dir", help="datasets cache for raw inputs and hub downloads")
    p.add_argument("--min-doc-tokens", type=int, default=0, help="drop documents shorter than this")
    p.add_argument(
        "--long-doc-threshold", type=int, help="documents with at least this many tokens are upsampled"
    )
    p.add_argument("--long-doc-factor", type=float, default=1.0, help="expected copies of each long document")
    p.add_argument("--max-documents", type=int, help="use only the first N documents (a quick sample)")
    p.add_argument(
        "--no-bos", action="store_true", help="do not prepend BOS to each document (EOS is always added)"
    )
    p.add_argument("--overwrite", action="store_true", help="replace an existing usp-prepare-data output")
    p.add_argument(
        "--skip-non-text",
        action="store_true",
        help="drop (and count) rows whose text field is not a string, instead of stopping with the first one",
    )
    chat = p.add_argument_group("conversations (--format chat; docs/data.md, 'Chat data')")
    chat.add_argument(
        "--format", default="text", choices=list(DATA_FORMATS), help="text documents or conversations"
    )
    chat.add_argument(
        "--messages-field", default="messages", help="column holding the [{role, content}] list"
    )
    chat.add_argument(
        "--chat-template", help="Jinja chat template file (or a shipped one: chatml, tiny_chatml)"
    )
    chat.add_argument("--loss-on", default="assistant", help=f"target tokens: {', '.join(LOSS_ON)}")
    chat.add_argument(
        "--long-conversations",
        default="truncate",
        choices=list(LONG_CONVERSATIONS),
        help="a conversation longer than --seq-len: keep its first tokens, or drop it",
    )
    chat.add_argument(
        "--split-long-conversations",
        action="store_true",
        help="cut conversations longer than --seq-len across rows instead",
    )
    p.add_argument("--ring-degree", type=int, default=1, help="check --seq-len suits this training layout")
    p.add_argument("--ulysses-degree", type=int, default=1, help="check --seq-len suits this training layout")
    p.add_argument("--ring-layout", default="balanced", choices=list(RING_LAYOUTS), help="(for the check)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """``usp-prepare-data``: a bad flag gets argparse's usage; a data error is one ``usp-prepare-data: error:``
    line alone (:func:`usp.errors.report`; its traceback with ``--verbose``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    verbose = pop_verbose(argv)
    args = build_parser().parse_args(argv)
    return guarded("usp-prepare-data", lambda: _prepare(args), verbose=verbose)


def _prepare(args: argparse.Namespace) -> int:
    try:
        check_sequence_length(args.seq_len, args.ring_degree, args.ulysses_degree, args.ring_layout)
    except ValueError as e:
        raise ValueError(str(e).replace("trainer.seq_len =", "--seq-len")) from e
    shaping = LengthShaping(args.min_doc_tokens, args.long_doc_threshold, args.long_doc_factor)
    tokenizer = load_tokenizer(args.tokenizer)
    if args.format == "chat":
        return _main_chat(args, tokenizer)
    prepare_dataset(
        args.input,
        tokenizer=tokenizer,
        seq_len=args.seq_len,
        output=args.output,
        text_field=args.text_field[0] if len(args.text_field) == 1 else args.text_field,
        weights=args.weights,
        seed=args.seed,
        streaming=args.streaming,
        num_proc=args.num_proc,
        cache_dir=args.cache_dir,
        shaping=shaping,
        add_bos=not args.no_bos,
        max_documents=args.max_documents,
        overwrite=args.overwrite,
        skip_non_text=args.skip_non_text,
    )
    return 0


def _main_chat(args: argparse.Namespace, tokenizer: Any) -> int:
    from usp.data.chat_prepare import ChatOptions, prepare_chat_dataset

    options = ChatOptions(
        messages_field=args.messages_field,
        chat_template=args.chat_template,
        loss_on=args.loss_on,
        long_conversations=args.long_conversations,
        split_long_conversations=args.split_long_conversations,
    )
    prepare_chat_dataset(
        args.input,
        tokenizer=tokenizer,
        seq_len=args.seq_len,
        output=args.output,
        options=options,
        weights=args.weights,
        seed=args.seed,
        streaming=args.streaming,
        num_proc=args.num_proc,
        cache_dir=args.cache_dir,
        max_documents=args.max_documents,
        overwrite=args.overwrite,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
