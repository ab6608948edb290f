"""A prepared dataset on disk, whichever format made it (text: :mod:`usp.data.prepare`; chat:
:mod:`usp.data.chat_prepare`): the checks on ``--output``, the key naming a preparation, the summary file
``usp_prepare.json`` next to the rows, and publishing the finished rows into place.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from datasets import IterableDataset

from usp.atomic import publish_dir
from usp.data.pack import LengthShaping, PackStats
from usp.data.sources import is_prepared_dataset

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
