"""``usp-prepare-data --format preference``: preference pairs -> encoded, best-fit packed rows, saved.

Example (text or chat pairs, 32K rows, for ``trainer.objective=dpo``)::

    usp-prepare-data --format preference --input pairs.jsonl \\
        --tokenizer /ckpt/SmolLM2-135M-Instruct --seq-len 32768 --output /data/dpo-32k

Rows in: ``{prompt, chosen, rejected}`` (other names: ``--prompt-field`` / ``--chosen-field`` /
``--rejected-field``), each a string (text form) or, for chat, lists of messages (:mod:`usp.data.preference`).
The output has the chat format's columns (``input_ids``, ``document_lengths``, ``first_position``,
``loss_mask``) plus ``document_roles`` (:mod:`usp.data.pack_preference`); ``usp_prepare.json`` records the
counts: pairs read, packed, dropped (too long, prompt too long, empty completion), rows, fill ratio, target
(completion) tokens. Inputs are read as for text and chat (files, saved datasets, hub names, weighted mixes:
:mod:`usp.data.sources`). Every row is checked while it is read, before any packed row is written: a missing
field is a ``ValueError`` naming the field, the input and the row.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import datasets
import numpy as np
from datasets import Dataset, IterableDataset

from usp.data.chat_prepare import ChatOptions
from usp.data.encoded import encode_rows, load_normalized, pad_id_of, windows_of, write_packed
from usp.data.pack import PackStats
from usp.data.pack_preference import (
    PREFERENCE_PACKED_FEATURES,
    PREFERENCE_SHARED_FEATURES,
    Pair,
    pack_preference_pairs,
)
from usp.data.preference import PAIR_PARTS, PreferenceEncoder, preference_pair_of
from usp.data.prepared import Preparation, PreparedData, options_preparation_key
from usp.data.tokenize import check_tokenizer

_MESSAGES = datasets.List({"role": datasets.Value("string"), "content": datasets.Value("string")})
PAIR_FEATURES = datasets.Features(
    {
        "chat": datasets.Value("bool"),
        **{f"{p}_text": datasets.Value("string") for p in PAIR_PARTS},
        **{f"{p}_messages": _MESSAGES for p in PAIR_PARTS},
    }
)
"""One normalized pair (:func:`usp.data.preference.preference_pair_of`): the common schema of every input."""
PAIR_ENCODED = datasets.Features(
    {
        "chat": datasets.Value("bool"),
        **{
            f"{p}_{k}": datasets.List(datasets.Value(dtype))
            for p in PAIR_PARTS[1:]
            for k, dtype in (("ids", "int32"), ("mask", "uint8"))
        },
    }
)


@dataclass(frozen=True)
class PreferenceOptions:
    """How preference rows become packed pairs (the ``data.*`` / ``usp-prepare-data`` preference settings)."""

    prompt_field: str = "prompt"
    chosen_field: str = "chosen"
    rejected_field: str = "rejected"
    chat_template: str | None = None
    """For chat-form rows: a Jinja file, or a shipped one (``chatml``, ``tiny_chatml``); ``None``: the
    tokenizer's own. Text-form rows need none."""
    add_bos: bool = True
    """Text-form rows start with BOS when the tokenizer defines one (``--no-bos``: never)."""
    shared_prompt: bool = False
    """Lay each pair out with its prompt once (``--shared-prompt``, for ``trainer.dpo.shared_prompt``;
    :mod:`usp.data.pack_preference`): rows gain a ``shared_prefix`` column."""

    def settings(self) -> dict[str, Any]:
        """These options as a dict, ``shared_prompt`` only when set (so the two-sequence layout's keys and
        summaries are those of earlier preparations)."""
        out = asdict(self)
        if not self.shared_prompt:
            del out["shared_prompt"]
        return out

    @property
    def fields(self) -> tuple[str, str, str]:
        return (self.prompt_field, self.chosen_field, self.rejected_field)

    def check(self) -> None:
        names = dict(zip(PAIR_PARTS, self.fields))
        if not all(isinstance(v, str) and v for v in names.values()) or len(set(names.values())) != 3:
            shown = ", ".join(f"--{p}-field={v!r}" for p, v in names.items())
            raise ValueError(f"{shown}: give three different column names.")

    def _chat(self) -> ChatOptions:
        return ChatOptions(chat_template=self.chat_template, loss_on="last_assistant")

    def template_path(self) -> str | None:
        return self._chat().template_path()

    def template_text(self, tokenizer: Any) -> Any:
        return self._chat().template_text(tokenizer)

    def key_fields(self, tokenizer: Any) -> dict[str, Any]:
        """What these settings add to the preparation key (:func:`preference_preparation_key`)."""
        return {
            "text_field": list(self.fields),
            "add_bos": self.add_bos,
            "chat": {
                "data_format": "preference",
                **self.settings(),
                "template_text": self.template_text(tokenizer),
            },
        }

    def encoder(self, tokenizer: Any) -> PreferenceEncoder:
        """The encoder of these options; with ``chat_template`` set its renderer is built (and checked) now,
        else on the first chat row (text pairs need no template)."""
        make = partial(_renderer, self._chat(), tokenizer)
        if self.chat_template is not None:
            make()  # a missing file or a template that does not load: said before reading any data
        return PreferenceEncoder(tokenizer, add_bos=self.add_bos, renderer=make)


def _renderer(chat: ChatOptions, tokenizer: Any) -> Any:
    return chat.renderer(tokenizer)


def _normalize(
    batch: dict[str, list], indices: list[int], spec: str, fields: tuple[str, ...]
) -> dict[str, list]:
    names = list(batch)
    rows = [dict(zip(names, values)) for values in zip(*batch.values())] if names else [{} for _ in indices]
    pairs = [preference_pair_of(r, fields, where=f"input {spec!r}, row {i}") for r, i in zip(rows, indices)]
    return {k: [p[k] for p in pairs] for k in PAIR_FEATURES}


def load_preference_pairs(
    inputs: Sequence[str],
    options: PreferenceOptions,
    *,
    weights: Sequence[float] | None = None,
    seed: int = 0,
    streaming: bool = False,
    cache_dir: str | None = None,
    log: Callable[[str], None] | None = None,
    usage: list[dict[str, object]] | None = None,
) -> Dataset | IterableDataset:
    """Every input as normalized pairs (:data:`PAIR_FEATURES`), concatenated or mixed by ``weights``. A row
    without one of the three fields raises ``ValueError`` naming the field, the input and the row (for a
    ``Dataset``: here, while reading, before any packing)."""
    return load_normalized(
        inputs,
        _normalize,
        {"fields": options.fields},
        PAIR_FEATURES,
        "reading preference pairs",
        weights=weights,
        seed=seed,
        streaming=streaming,
        cache_dir=cache_dir,
        log=log,
        usage=usage,
    )


def encode_pairs(batch: dict[str, list], encoder: PreferenceEncoder) -> dict[str, list]:
    """A batch of normalized pairs -> ``chosen_ids``/``chosen_mask``/``rejected_ids``/``rejected_mask`` of
    the two whole sequences; empty arrays for a pair with an empty completion (:func:`pair_windows` counts
    and skips them). The ``datasets.map`` function of ``usp-prepare-data --format preference``."""
    out: dict[str, list] = {k: [] for k in PAIR_ENCODED}
    names = list(batch)
    for values in zip(*batch.values()):
        pair = dict(zip(names, values))
        enc = encoder.encode(pair)
        empty = (np.zeros(0, np.int32), np.zeros(0, np.uint8)) * 2
        for k, v in zip(("chosen_ids", "chosen_mask", "rejected_ids", "rejected_mask"), enc or empty):
            out[k].append(v)
        out["chat"].append(bool(pair["chat"]))
    return out


def pair_windows(ds: Dataset | IterableDataset, window: int, stats: PackStats) -> Iterator[list[Pair]]:
    """Encoded pairs, ``window`` at a time; counts ``pairs_read``, ``pairs_chat_form`` and
    ``pairs_dropped_empty_completion`` (those are not yielded)."""
    x = stats.extra
    for batch in windows_of(ds, window):
        pairs = []
        columns = [batch[k] for k in ("chosen_ids", "chosen_mask", "rejected_ids", "rejected_mask")]
        for chat, c_ids, c_mask, r_ids, r_mask in zip(batch["chat"], *columns):
            x["pairs_read"] += 1
            x["pairs_chat_form"] += bool(chat)
            if len(c_ids) == 0:
                x["pairs_dropped_empty_completion"] += 1
                continue
            pairs.append(
                (
                    np.asarray(c_ids, dtype=np.int32),
                    np.asarray(c_mask, dtype=np.uint8),
                    np.asarray(r_ids, dtype=np.int32),
                    np.asarray(r_mask, dtype=np.uint8),
                )
            )
        if pairs:
            yield pairs


def pack_preference_to(
    raw: Dataset | IterableDataset,
    work: Path,
    *,
    tokenizer: Any,
    seq_len: int,
    options: PreferenceOptions,
    num_proc: int = 1,
    window: int = 4096,
) -> tuple[Path, PackStats, int]:
    """Encode (``num_proc`` processes) and pack ``raw`` into ``work/packed.arrow``; returns
    ``(file, stats, max token id)``."""
    encoder = options.encoder(tokenizer)
    encoded = encode_rows(
        raw,
        work,
        encode_pairs,
        {"encoder": encoder},
        remove_columns=list(PAIR_FEATURES),
        features=PAIR_ENCODED,
        desc="encoding preference pairs",
        num_proc=num_proc,
    )
    stats = PackStats(seq_len=seq_len)
    stats.extra.update(pairs_read=0, pairs_chat_form=0, pairs_dropped_empty_completion=0)
    batches = pack_preference_pairs(
        pair_windows(encoded, window, stats),
        seq_len,
        pad_id=pad_id_of(tokenizer),
        stats=stats,
        shared_prompt=options.shared_prompt,
    )
    features = PREFERENCE_SHARED_FEATURES if options.shared_prompt else PREFERENCE_PACKED_FEATURES
    packed, max_id = write_packed(work, features.arrow_schema, batches)
    del encoded, batches
    return packed, stats, max_id


def preference_summary(stats: PackStats, output: Path | str) -> str:
    x = stats.extra
    return (
        f"usp-prepare-data --format preference: {x.get('pairs_read', 0)} pairs read "
        f"({x.get('pairs_chat_form', 0)} chat form) -> {x.get('pairs_packed', 0)} packed; dropped: "
        f"{x.get('pairs_dropped_empty_completion', 0)} with an empty completion, "
        f"{x.get('pairs_dropped_prompt_too_long', 0)} whose prompt alone fills --seq-len, "
        f"{x.get('pairs_dropped_too_long', 0)} longer than --seq-len (pairs are never truncated or split) -> "
        f"{stats.rows} rows x {stats.seq_len} tokens at {output}; fill ratio "
        f"{100 * float(x.get('fill_ratio', 0.0)):.2f}% ({x.get('padding_tokens', 0)} padding tokens); "
        f"{x.get('target_tokens', 0)} completion (target) tokens of {stats.tokens_packed}"
        + (
            f" ({x['prompt_tokens_shared']} prompt tokens laid out once instead of twice, --shared-prompt)"
            if x.get("prompt_tokens_shared")
            else ""
        )
        + f"; {stats.seconds:.1f}s"
    )


def prepare_preference_dataset(
    inputs: Sequence[str],
    *,
    tokenizer: Any,
    seq_len: int,
    output: str | os.PathLike,
    options: PreferenceOptions | None = None,
    weights: Sequence[float] | None = None,
    seed: int = 0,
    streaming: bool = False,
    num_proc: int = 1,
    cache_dir: str | os.PathLike | None = None,
    max_documents: int | None = None,
    overwrite: bool = False,
    window: int = 4096,
    log: Callable[[str], None] | None = None,
) -> PreparedData:
    """The preference counterpart of :func:`usp.data.chat_prepare.prepare_chat_dataset` (same publishing and
    summary file; ``max_documents``: the first N pairs).

    Raises ``ValueError`` before reading any data for bad settings (and a ``chat_template`` that cannot be
    loaded); while reading, before any packed row is written, for a row missing a field (naming it and the
    row), or a chat row when there is no chat template; and when no pair fits a row.
    """
    log = log or (lambda msg: print(msg, flush=True))
    options = options or PreferenceOptions()
    if not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"--seq-len / trainer.seq_len={seq_len!r} must be a positive number of tokens.")
    options.check()
    check_tokenizer(tokenizer)
    options.encoder(tokenizer)  # a --chat-template that does not load: said before reading any data
    run = Preparation.start(inputs, tokenizer, output, weights, seed, streaming, overwrite, log)
    key = preference_preparation_key(
        inputs, tokenizer, seq_len, options, weights, seed, streaming, max_documents
    )
    raw = run.read(
        load_preference_pairs,
        options,
        cache_dir=None if cache_dir is None else str(cache_dir),
        max_documents=max_documents,
    )

    def no_rows(stats: PackStats) -> str:
        x = stats.extra
        return (
            f"the inputs {list(inputs)} give no preference pair to train on ({x['pairs_read']} read, "
            f"{x['pairs_dropped_empty_completion']} with an empty completion, "
            f"{x['pairs_dropped_prompt_too_long'] + x['pairs_dropped_too_long']} longer than --seq-len "
            f"{seq_len} dropped)."
        )

    def pack(work: Path) -> tuple[Path, PackStats, int]:
        return pack_preference_to(
            raw, work, tokenizer=tokenizer, seq_len=seq_len, options=options, num_proc=num_proc, window=window
        )

    settings = {"data_format": "preference", "preference": options.settings()}
    return run.publish(pack, key=key, settings=settings, no_rows=no_rows, summary=preference_summary)


def preference_preparation_key(
    inputs: Sequence[str],
    tokenizer: Any,
    seq_len: int,
    options: PreferenceOptions,
    weights: Sequence[float] | None,
    seed: int,
    streaming: bool,
    max_documents: int | None,
) -> str:
    """The text format's key (:func:`usp.data.prepared.preparation_key`), extended by the format name, the
    field names and the template's text (:meth:`PreferenceOptions.key_fields`): never equal to a chat or text
    preparation's key."""
    return options_preparation_key(
        inputs, tokenizer, seq_len, options, weights, seed, streaming, max_documents
    )
