"""Model FLOPs of a training step and the attention work balance over the ring ranks.

FLOPs of one forward + backward over a batch of packed sequences (what :func:`training_flops` returns)::

    6 * dense_params * tokens  +  12 * L * Hq * D * sum_i s_i^2   (attention term halved when causal)

``dense_params`` is every parameter except the input embedding table (a lookup, not a matmul; a tied output
head *is* a matmul and is counted); ``tokens`` is the number of tokens; ``s_i`` runs over the packed
documents (attention never crosses a document boundary, so a 128K sequence of 32 4K documents costs far less
attention than one 128K document). Per layer the attention matmuls are ``QK^T`` and ``PV``, each
``2 * s^2 * Hq * D`` FLOPs forward, and backward costs twice forward: ``3 * 2 * 2 = 12``.

Recomputation under activation checkpointing is not counted (model FLOPs, not hardware FLOPs). MFU from these:
:func:`usp.train.peak_flops.mfu`.
"""

from __future__ import annotations

from typing import Any


def training_flops(
    *,
    dense_params: int,
    num_layers: int,
    num_heads: int,
    head_dim: int,
    document_lengths: list[list[int]],
    causal: bool = True,
) -> float:
    """Model FLOPs of one forward + backward over ``document_lengths`` (per sequence, its packed documents).

    ``6 * dense_params * tokens + 12 * num_layers * num_heads * head_dim * sum(s_i^2)``, the attention term
    halved when ``causal``. ``num_heads`` counts query heads (GQA shares K/V, not the score matmuls).
    """
    if min(dense_params, num_layers, num_heads, head_dim) < 0:
        raise ValueError("training_flops: dense_params, num_layers, num_heads and head_dim must be >= 0")
    lengths = [s for seq in document_lengths for s in seq]
    if any(s < 0 for s in lengths):
        raise ValueError(f"training_flops: document lengths must be >= 0, got {document_lengths}")
    tokens = sum(lengths)
    attention = 12.0 * num_layers * num_heads * head_dim * sum(float(s) * s for s in lengths)
    if causal:
        attention /= 2
    return 6.0 * dense_params * tokens + attention


def attention_work_imbalance(document_lengths: list[list[int]], ring_degree: int, ring_layout: str) -> float:
    """``attn_work_imbalance`` of a step: max / mean over ring ranks of the causal in-document (query, key) pairs
    each computes, summed over the step's samples (per sample, its packed document lengths).

    Exact pair counts from the layout (:func:`usp.parallel.ring_rank_pairs`); 1.0 = every ring rank does the
    same attention work. The slowest rank sets the step time, so ``1 / imbalance`` is the attention time a
    perfectly balanced layout would need.
    """
    import numpy as np

    from usp.parallel import ring_rank_pairs

    if ring_degree == 1:
        return 1.0
    work = np.zeros(ring_degree)
    for lengths in document_lengths:
        cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        work += np.asarray(ring_rank_pairs(int(cu[-1]), ring_degree, ring_layout, cu), dtype=np.float64)
    mean = work.mean()
    return float(work.max() / mean) if mean > 0 else 1.0


def count_dense_params(model: Any) -> int:
    """Parameters that do matmuls: all (global numel, also under FSDP2) minus the input embedding table,
    which is kept when it is tied to the output head."""
    total = sum(p.numel() for p in model.parameters())
    embedding = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    if head is not None and head.weight is embedding:
        return int(total)
    return int(total - embedding.numel())
