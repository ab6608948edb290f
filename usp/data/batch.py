"""From packed rows to one rank's training batch: labels, position ids, boundaries, then the sp slice.

Everything is computed on the GLOBAL packed sequence first and only then sharded with
:func:`usp.parallel.shard_sequence` (given the row's ``cu_seqlens``, which place the ``balanced`` layout), so
a label whose target token lives on another sp rank is still right, and every rank of an sp group derives
identical ``cu_seqlens``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from usp.parallel import SPMesh, shard_sequences

IGNORE_INDEX = -100


def row_labels(
    input_ids: torch.Tensor,
    document_lengths: Sequence[int],
    document_masking: bool,
    loss_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Next-token targets of one packed row ``[S]``: ``input_ids`` shifted left by one.

    ``IGNORE_INDEX`` where there is no target: the last token of the row and, with document masking, the last
    token of every document piece (its successor belongs to another document, or to the next row). With a
    ``loss_mask`` ``[S]`` (chat rows, :mod:`usp.data.chat`), token ``t`` is a target only where
    ``loss_mask[t] == 1``: ``labels[t - 1] = input_ids[t]`` then, else ``IGNORE_INDEX`` (so ``loss_mask[0]``,
    the row's first token, never counts: nothing in the row predicts it).
    """
    labels = torch.full_like(input_ids, IGNORE_INDEX)
    labels[:-1] = input_ids[1:]
    if loss_mask is not None:
        labels[:-1][torch.as_tensor(loss_mask)[1:] == 0] = IGNORE_INDEX
    if document_masking:
        ends = torch.as_tensor(np.cumsum(document_lengths), dtype=torch.long) - 1
        labels[ends] = IGNORE_INDEX
    return labels


def row_positions(
    seq_len: int,
    document_lengths: Sequence[int],
    first_position: int,
    document_masking: bool,
    shared_prefix: Sequence[int] | None = None,
) -> torch.Tensor:
    """Position ids of one packed row ``[S]``.

    With document masking they restart at 0 at each document, except that the row's first piece continues
    from ``first_position`` (the part of a split document that was in the previous row), and a document with a
    ``shared_prefix`` of ``n`` tokens (DPO's shared prompt: it continues the first ``n`` tokens of the document
    before it) starts at ``n``. Without document masking: 0..S-1.
    """
    if not document_masking:
        return torch.arange(seq_len)
    lengths = torch.as_tensor(list(document_lengths), dtype=torch.long)
    assert int(lengths.sum()) == seq_len, "document_lengths must sum to the row length"
    starts = torch.cumsum(lengths, 0) - lengths
    positions = torch.arange(seq_len) - torch.repeat_interleave(starts, lengths)
    positions[: int(lengths[0])] += int(first_position)
    if shared_prefix is not None:
        positions += torch.repeat_interleave(torch.as_tensor(list(shared_prefix), dtype=torch.long), lengths)
    return positions


def cu_seqlens_of(document_lengths: Sequence[int]) -> torch.Tensor:
    """Boundaries ``[num_docs + 1]`` (int32, 0 .. S) of the pieces of one packed row."""
    return torch.as_tensor(np.concatenate([[0], np.cumsum(document_lengths)]), dtype=torch.int32)


def document_index_of(document_lengths: Sequence[int]) -> torch.Tensor:
    """For each token of one packed row ``[S]`` (int64), the index of the document (within the row) holding it."""
    lengths = torch.as_tensor(list(document_lengths), dtype=torch.long)
    return torch.repeat_interleave(torch.arange(len(lengths)), lengths)


def collate_rows(
    rows: Sequence[dict[str, Any]],
    *,
    mesh: SPMesh | None,
    document_masking: bool,
    row_indices: Sequence[int] | None = None,
) -> dict[str, Any]:
    """Packed rows (``input_ids``, ``document_lengths``, ``first_position``; ``loss_mask`` for chat and
    preference rows; ``document_roles`` for preference rows) -> this rank's batch dict.

    Returns ``input_ids``, ``labels``, ``position_ids`` (int64 ``[B, S_local]``), ``cu_seqlens`` (int32
    ``[num_docs + 1]`` of the global row when ``B == 1`` and document masking, else ``None``) and
    ``document_lengths`` (per sample, the global lengths of the attention segments: the document pieces
    with document masking, the whole row ``[S]`` without it). With ``row_indices`` (the dataset rows of the
    samples; :class:`usp.data.loader.PackedLoader` passes them), also ``row_index``: a list of ints. For rows
    with ``document_roles`` (``data.format=preference``; :mod:`usp.data.pack_preference`), also
    ``document_roles`` (per sample, the global list of python ints: 1 chosen, 2 rejected, 0 padding) and
    ``document_index`` (int64 ``[B, S_local]``: the index, within its row, of the document holding each
    token; sharded with ``labels`` in the same call, so the same token positions). Rows without
    ``document_roles`` return neither key. Rows with ``shared_prefix`` (preference rows prepared with
    ``--shared-prompt``: per document, the leading tokens of the document before it that it continues; one row,
    document masking) also return ``shared_prefix`` (int32 ``[num_docs]``, global, on the CPU), which the
    attention reads beside ``cu_seqlens``; their position ids continue from the prefix.
    """
    ids = torch.stack([torch.as_tensor(np.asarray(r["input_ids"]), dtype=torch.long) for r in rows])  # [B, S]
    seq_len = ids.size(1)
    doc_lengths = [[int(n) for n in r["document_lengths"]] for r in rows]
    for lengths in doc_lengths:
        assert sum(lengths) == seq_len, (
            f"a packed row's document_lengths sum to {sum(lengths)}, not {seq_len}"
        )
    masks = [r.get("loss_mask") for r in rows]
    labels = torch.stack(
        [
            row_labels(
                ids[i],
                doc_lengths[i],
                document_masking,
                None if masks[i] is None else torch.as_tensor(np.asarray(masks[i])),
            )
            for i in range(len(rows))
        ]
    )
    prefixes = [r.get("shared_prefix") for r in rows]
    prefixes = [None if x is None else [int(n) for n in np.asarray(x).tolist()] for x in prefixes]
    if any(x is not None and any(x) for x in prefixes):
        assert document_masking and len(rows) == 1, (
            "shared prefixes need document masking and one row per batch"
        )
    positions = torch.stack(
        [
            row_positions(
                seq_len, doc_lengths[i], int(rows[i].get("first_position", 0)), document_masking, prefixes[i]
            )
            for i in range(len(rows))
        ]
    )
    raw_roles = [r.get("document_roles") for r in rows]
    roles = None
    tensors = [ids, labels, positions]
    if any(x is not None for x in raw_roles):
        assert all(x is not None for x in raw_roles), "a batch mixes rows with and without document_roles"
        roles = [[int(k) for k in np.asarray(x).tolist()] for x in raw_roles]
        for rr, lengths in zip(roles, doc_lengths):
            assert len(rr) == len(lengths), f"{len(rr)} document_roles for {len(lengths)} documents"
        tensors.append(torch.stack([document_index_of(lengths) for lengths in doc_lengths]))
    cu_seqlens = cu_seqlens_of(doc_lengths[0]) if len(rows) == 1 and document_masking else None
    if mesh is not None and mesh.sp_degree > 1:  # balanced: placed from the row's boundaries
        # one index computation for every tensor; the length was checked at start-up (trainer.seq_len)
        tensors = shard_sequences(tensors, mesh, dim=1, cu_seqlens=cu_seqlens, checked=True)
    out: dict[str, Any] = {
        "input_ids": tensors[0],
        "labels": tensors[1],
        "position_ids": tensors[2],
        "cu_seqlens": cu_seqlens,
        "document_lengths": doc_lengths if document_masking else [[seq_len] for _ in rows],
    }
    if prefixes[0] is not None and any(prefixes[0]):
        assert len(prefixes[0]) == len(doc_lengths[0]), "one shared_prefix per document"
        out["shared_prefix"] = torch.tensor(prefixes[0], dtype=torch.int32)
    if roles is not None:
        out["document_roles"] = roles
        out["document_index"] = tensors[3]
    if row_indices is not None:
        assert len(row_indices) == len(rows), "one row index per row"
        out["row_index"] = [int(i) for i in row_indices]
    return out
