"""A prepared dataset on disk, whichever format made it (text: :mod:`usp.data.prepare`; chat:
:mod:`usp.data.chat_prepare`; preference: :mod:`usp.data.preference_prepare`): the checks on ``--output``, the
key naming a preparation, the summary file ``usp_prepare.json`` next to the rows, and publishing the finished
rows into place (:class:`Preparation`: the steps every format shares).
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from datasets import Dataset, IterableDataset

from usp.atomic import publish_dir, temp_path
from usp.data.pack import LengthShaping, PackStats
from usp.data.sources import check_inputs, is_prepared_dataset

STATS_FILE = "usp_prepare.json"
FORMAT_VERSION = "usp-packed-v1"


@dataclass
class PreparedData:
    path: Path
    stats: PackStats


def check_output(output: Path, overwrite: bool) -> None:
    """Refuse an ``--output`` that holds data, unless ``overwrite`` and it is a usp-prepare-data output."""
    if not output.exists() or (output.is_dir() and not any(output.iterdir())):
        return
    if not overwrite:
        raise ValueError(f"--output {str(output)!r} already exists; choose a new path or pass --overwrite.")
    if not is_prepared_dataset(output):
        raise ValueError(
            f"--output {str(output)!r} exists and is not a usp-prepare-data output; refusing to overwrite it. "
            "Choose a new path."
        )


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


@dataclass
class Preparation:
    """One preparation under way, whichever its format: the request every format records in
    ``usp_prepare.json``, and the steps they share: :meth:`start` (the checks on the inputs and ``--output``),
    :meth:`read` the inputs, then :meth:`publish` (pack into a work directory, save, record, publish)."""

    inputs: Sequence[str]
    tokenizer: Any
    output: Path
    weights: Sequence[float] | None
    seed: int
    streaming: bool
    overwrite: bool
    log: Callable[[str], None]
    started: float = field(default_factory=time.perf_counter)
    sources: list[dict[str, object]] = field(default_factory=list)
    """What each input gave (filled while reading, as ``usage`` by :mod:`usp.data.sources`)."""

    @classmethod
    def start(
        cls,
        inputs: Sequence[str],
        tokenizer: Any,
        output: str | os.PathLike,
        weights: Sequence[float] | None,
        seed: int,
        streaming: bool,
        overwrite: bool,
        log: Callable[[str], None],
    ) -> Preparation:
        """Check ``inputs`` and ``output`` (before reading any data) and start the clock."""
        check_inputs(inputs, weights, setting="--input / data.inputs")
        output = Path(output)
        check_output(output, overwrite)
        return cls(inputs, tokenizer, output, weights, seed, streaming, overwrite, log)

    def read(self, load: Callable[..., Any], *args: Any, max_documents: int | None, **kwargs: Any) -> Any:
        """``load(inputs, *args, weights=, seed=, streaming=, log=, usage=, **kwargs)``, the first
        ``max_documents`` of it (:func:`first_documents`)."""
        raw = load(
            self.inputs,
            *args,
            weights=self.weights,
            seed=self.seed,
            streaming=self.streaming,
            log=self.log,
            usage=self.sources,
            **kwargs,
        )
        return first_documents(raw, max_documents)

    def publish(
        self,
        pack: Callable[[Path], tuple[Path, PackStats, int]],
        *,
        key: str,
        settings: dict[str, Any],
        no_rows: Callable[[PackStats], str],
        summary: Callable[[PackStats, Path], str],
    ) -> PreparedData:
        """The shared steps once the inputs are read: ``pack(work)`` writes the packed rows into a work
        directory next to ``output`` and returns ``(packed file, stats, max token id)``; no row is a
        ``ValueError`` saying ``no_rows(stats)``. The rows are saved, the summary recorded in ``stats.extra``
        (the request, ``settings``: the format's own entries, ``key``, the tokenizer, tokens/s) and published
        as ``output`` by :func:`publish_rows` (the existing dataset is returned instead when another process
        prepared the same one meanwhile). The work directory is always removed; ``summary(stats, output)``
        is logged."""
        work = temp_path(self.output, "work")  # intermediate files, then the rows to publish: same filesystem
        work.mkdir(parents=True)
        try:
            packed, stats, max_id = pack(work)
            if stats.rows == 0:
                raise ValueError(no_rows(stats))
            out_tmp = work / "out"
            Dataset.from_file(str(packed)).save_to_disk(str(out_tmp))
            packed.unlink()
            stats.seconds = time.perf_counter() - self.started
            stats.extra.update(
                inputs=list(self.inputs),
                weights=None if self.weights is None else list(self.weights),
                seed=self.seed,
                tokenizer=getattr(self.tokenizer, "name_or_path", ""),
                format=FORMAT_VERSION,
                **settings,
                preparation_key=key,
                tokenizer_identity=tokenizer_identity(self.tokenizer),
                max_token_id=max_id,
                sources=self.sources,
                tokens_per_s=stats.document_tokens / max(stats.seconds, 1e-9),
            )
            existing = publish_rows(
                out_tmp, self.output, stats, key=key, overwrite=self.overwrite, log=self.log
            )
            if existing is not None:
                return existing
        finally:
            shutil.rmtree(work, ignore_errors=True)
        self.log(summary(stats, self.output))
        return PreparedData(path=self.output, stats=stats)


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
    shaping: LengthShaping | None,
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


def options_preparation_key(
    inputs: Sequence[str],
    tokenizer: Any,
    seq_len: int,
    options: Any,
    weights: Sequence[float] | None,
    seed: int,
    streaming: bool,
    max_documents: int | None,
) -> str:
    """:func:`preparation_key` of a format with its own settings (chat, preference): no length shaping, and
    what ``options.key_fields(tokenizer)`` says of them (its ``text_field``, ``add_bos``, and its settings and
    template's text as ``chat``)."""
    return preparation_key(
        inputs,
        tokenizer=tokenizer,
        seq_len=seq_len,
        weights=weights,
        seed=seed,
        streaming=streaming,
        shaping=None,
        max_documents=max_documents,
        **options.key_fields(tokenizer),
    )
