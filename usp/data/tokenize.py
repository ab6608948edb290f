"""Tokenize documents with the checkpoint's tokenizer: ``[BOS] + tokens + [EOS]`` per document, int32.

Special tokens are added here, explicitly, rather than by the tokenizer's template (``add_special_tokens``):
templates differ between checkpoints (Llama 2 adds BOS only, Llama 3 adds BOS only, some add nothing) and
packing needs every document to end with EOS so the model learns where documents stop.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
from datasets import Dataset, Features, IterableDataset, Sequence, Value

from usp.data.sources import TEXT_COLUMN

TOKENS_COLUMN = "input_ids"
TOKENIZED_FEATURES = Features({TOKENS_COLUMN: Sequence(Value("int32"))})


def check_tokenizer(tokenizer: Any, setting: str = "--tokenizer / model.path") -> None:
    """Raise ``ValueError`` unless the tokenizer defines an EOS token (and ids fit int32)."""
    if tokenizer is None:
        raise ValueError(f"no tokenizer given: set {setting} to a checkpoint or tokenizer directory.")
    if getattr(tokenizer, "eos_token_id", None) is None:
        name = getattr(tokenizer, "name_or_path", type(tokenizer).__name__)
        raise ValueError(
            f"the tokenizer {name!r} ({setting}) has no EOS token, so packed documents could not be "
            "separated. Use the checkpoint's own tokenizer, or set one and save it: "
            "tokenizer.eos_token = '</s>' (a token in its vocabulary); tokenizer.save_pretrained(dir)."
        )
    if len(tokenizer) >= 2**31:
        raise ValueError(f"tokenizer vocabulary of {len(tokenizer)} ids does not fit int32 token storage.")


def load_tokenizer(path: str | os.PathLike) -> Any:
    """``AutoTokenizer`` from a checkpoint or tokenizer directory (``--tokenizer``), with a clear error."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError) as e:
        raise ValueError(
            f"--tokenizer {str(path)!r}: cannot load a tokenizer there ({e}). Pass a Hugging Face checkpoint "
            "or tokenizer directory (tokenizer.json / tokenizer_config.json)."
        ) from e
    check_tokenizer(tokenizer)
    return tokenizer


def _encode_batch(batch: dict[str, list[str]], tokenizer: Any, add_bos: bool) -> dict[str, list[np.ndarray]]:
    texts = [t for t in batch[TEXT_COLUMN] if t is not None and t.strip()]  # empty documents carry nothing
    if not texts:
        return {TOKENS_COLUMN: []}
    encoded = tokenizer(texts, add_special_tokens=False, return_attention_mask=False, verbose=False)[
        "input_ids"
    ]
    head = [tokenizer.bos_token_id] if add_bos and tokenizer.bos_token_id is not None else []
    tail = [tokenizer.eos_token_id]
    return {TOKENS_COLUMN: [np.asarray(head + ids + tail, dtype=np.int32) for ids in encoded]}


def tokenize_documents(
    ds: Dataset | IterableDataset,
    tokenizer: Any,
    *,
    num_proc: int = 1,
    add_bos: bool = True,
    batch_size: int = 256,
    cache_file_name: str | None = None,
) -> Dataset | IterableDataset:
    """Documents (column ``text``) -> token lists (column ``input_ids``, int32), one row per non-empty document.

    Runs in ``num_proc`` processes for a ``Dataset`` (the result is memory-mapped arrow, written to
    ``cache_file_name`` when given); lazily, in this process, for an ``IterableDataset`` (streaming).
    Documents that are empty or whitespace-only are skipped (the caller reports the count).
    """
    check_tokenizer(tokenizer)
    if num_proc < 1:
        raise ValueError(f"--num-proc / data.num_proc={num_proc} must be >= 1.")
    kwargs: dict[str, Any] = dict(
        batched=True,
        batch_size=batch_size,
        fn_kwargs={"tokenizer": tokenizer, "add_bos": add_bos},
        remove_columns=[TEXT_COLUMN],
        features=TOKENIZED_FEATURES,
    )
    if isinstance(ds, IterableDataset):
        return ds.map(_encode_batch, **kwargs)
    return ds.map(
        _encode_batch,
        num_proc=num_proc if num_proc > 1 and len(ds) > 1 else None,
        cache_file_name=cache_file_name,
        writer_batch_size=batch_size,  # bounds memory when documents are books of ~1M tokens
        load_from_cache_file=cache_file_name is None,
        desc="tokenizing",
        **kwargs,
    )
