"""Perplexity by position on long held-out documents.

Documents come from the data pipeline's sources (:func:`usp.data.load_text_sources`: local files, saved
datasets, hub names), tokenized like training data (``[BOS] + tokens + [EOS]``). For each evaluated length
``L`` the first ``eval.num_documents`` documents of at least ``L`` tokens are cut to their first ``L`` tokens
(a document shorter than ``L`` is never padded or packed: it would not measure long context). Rank 0 reads
and tokenizes; the token ids (or the error) are broadcast, so every rank fails or succeeds together before
any forward (:func:`usp.parallel.agree.on_rank0`).
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from usp.config import TrainConfig
from usp.eval.losses import bucket_losses, token_losses
from usp.eval.replicas import gather_shares, gather_timing, my_share
from usp.parallel import SPMesh


def inputs_setting(cfg: TrainConfig) -> str:
    """The setting the ppl documents come from, for messages: ``eval.inputs``, ``data.inputs`` or the tiny
    corpus (``data.build_tiny_corpus``)."""
    return (
        "eval.inputs" if cfg.eval.inputs else "data.inputs" if cfg.data.inputs else "data.build_tiny_corpus"
    )


def check_ppl_inputs(cfg: TrainConfig, model_config: Any) -> None:
    """``ValueError`` unless eval=ppl has documents for this model: ``eval.inputs`` or ``data.inputs``; the
    synthetic tiny corpus only for the tiny demo model (:func:`usp.tiny.is_tiny_model`), whose tokenizer it
    was made for. Pure (reads nothing)."""
    from usp.tiny import is_tiny_model

    if cfg.eval.inputs or cfg.data.inputs or (cfg.data.build_tiny_corpus and is_tiny_model(model_config)):
        return
    raise ValueError(
        f"eval=ppl needs held-out documents for model.path={cfg.model.path!r}: set eval.inputs=[/data/held-out.jsonl] "
        "(files, dirs or hub names, as data.inputs; or data.inputs). The synthetic tiny corpus is only for the "
        "tiny demo model; packed data (data.prepared_path) cannot be used, documents must be whole."
    )


def ppl_inputs(cfg: TrainConfig, cache_dir: Path) -> list[str]:
    """``eval.inputs``, else ``data.inputs``, else the tiny corpus (``data.build_tiny_corpus``) in ``cache_dir``."""
    if cfg.eval.inputs:
        return list(cfg.eval.inputs)
    if cfg.data.inputs:
        return list(cfg.data.inputs)
    if cfg.data.build_tiny_corpus:
        from usp.tiny import build_tiny_corpus

        path = cache_dir / "tiny_corpus.jsonl"
        if not path.exists():
            build_tiny_corpus(path, seed=cfg.data.seed, text_field=cfg.data.text_field)
        return [str(path)]
    raise ValueError(
        "eval=ppl needs held-out documents: set eval.inputs=[/data/held-out.jsonl] (files, dirs or hub names, as "
        "data.inputs); packed data (data.prepared_path) cannot be used, documents must be whole."
    )


def read_documents(
    cfg: TrainConfig, tokenizer: Any, lengths: list[int], cache_dir: Path
) -> dict[int, torch.Tensor]:
    """``{L: int64 [n_L, L]}``, the first ``eval.num_documents`` documents of at least ``L`` tokens, cut to
    ``L``. Raises ``ValueError`` naming ``eval.inputs`` / ``eval.lengths`` when a length finds no document."""
    from usp.data import load_text_sources
    from usp.data.sources import TEXT_COLUMN, check_inputs

    inputs = ppl_inputs(cfg, cache_dir)
    try:
        check_inputs(inputs, None)
    except ValueError as e:
        raise ValueError(f"{inputs_setting(cfg)}={inputs}: {e}") from e
    ds = load_text_sources(inputs, text_field=cfg.data.text_field, cache_dir=cache_dir / "hf_datasets")
    want = cfg.eval.num_documents
    found: dict[int, list[list[int]]] = {length: [] for length in lengths}
    longest = 0
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    for text in ds[TEXT_COLUMN] if hasattr(ds, "__len__") else (row[TEXT_COLUMN] for row in ds):
        if all(len(v) >= want for v in found.values()):
            break
        if not text or not text.strip():
            continue
        ids = bos + list(tokenizer(text, add_special_tokens=False)["input_ids"]) + eos
        longest = max(longest, len(ids))
        for length, docs in found.items():
            if len(docs) < want and len(ids) >= length:
                docs.append(ids[:length])
    short = [length for length, docs in found.items() if not docs]
    if short:
        raise ValueError(
            f"eval.lengths={lengths}: no document in {inputs_setting(cfg)}={inputs} has {min(short)} tokens or more "
            f"(the longest has {longest}); a document must be at least the evaluated length. Use shorter "
            f"eval.lengths or longer documents (eval.inputs=[...])."
        )
    return {length: torch.tensor(docs, dtype=torch.long) for length, docs in found.items()}


def run_ppl(
    model: nn.Module, mesh: SPMesh, documents: dict[int, torch.Tensor], *, batch_size: int, bucket_size: int
) -> dict[str, Any]:
    """Token losses of every document at every length, bucketed by position.

    Returns ``{"lengths": {L: {"documents", "tokens", "loss", "ppl", "buckets": [...]}}, "timing": {...}}``
    (same on every rank; ``buckets`` as :func:`usp.eval.losses.bucket_losses`). dp replicas split the
    documents (:mod:`usp.eval.replicas`).
    """
    out: dict[str, Any] = {}
    tokens = 0
    seconds = 0.0
    for length, docs in documents.items():
        rows = my_share(list(docs), mesh)  # this dp replica's documents, [L] each
        losses = []
        for start in range(0, len(rows), batch_size):
            batch = torch.stack(rows[start : start + batch_size])  # [b, L]
            t0 = time.perf_counter()
            losses.extend(token_losses(model, batch, mesh).cpu())
            seconds += time.perf_counter() - t0
            tokens += batch.numel()
        all_losses = torch.stack(gather_shares(losses, mesh))  # [n, L], document order
        mean = float(all_losses[:, :-1].double().mean())
        out[str(length)] = {
            "documents": int(docs.size(0)),
            "tokens": int(all_losses[:, :-1].numel()),
            "loss": mean,
            "ppl": math.exp(mean),
            "buckets": bucket_losses(all_losses, bucket_size),
        }
    seconds, tokens = gather_timing(seconds, tokens, mesh)
    return {
        "lengths": out,
        "timing": {
            "forward_tokens": tokens,
            "forward_s": seconds,
            "forward_tokens_per_s": tokens / seconds if seconds > 0 else None,
        },
    }
