"""Per-token losses of the sharded forward, and perplexity by position.

:func:`token_losses` runs an :func:`~usp.model.apply_usp`'d causal LM on a global batch, sharded over the mesh
exactly as in training, and returns every token's loss in global order on every rank. :func:`bucket_losses`
turns token losses into mean loss and perplexity per position bucket. :func:`loader_position_losses` is the
cheap in-training variant: it buckets the validation loader's token losses by their position in the document
(``position_ids``) without gathering anything but ``2 x buckets`` numbers.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import FSDPModule

from usp.model import LMHeadTransform, decoder_of, lm_head_transform, packed_sequence_kwargs
from usp.parallel import SPMesh, check_sequence_length, gather_sequence, shard_sequence

IGNORE_INDEX = -100


def _local_losses(
    model: nn.Module,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    position_ids: torch.Tensor,
    *,
    transform: LMHeadTransform,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = 4096,
) -> torch.Tensor:
    """This rank's token losses ``[B, S_local]`` fp32 (0 where ``labels == -100``); never builds ``[S, V]``.

    ``transform``: the model's :func:`~usp.model.lm_head_transform`, applied to each chunk's fp32 logits."""
    extra = packed_sequence_kwargs(cu_seqlens)
    hidden = decoder_of(model)(
        input_ids=input_ids, position_ids=position_ids, use_cache=False, **extra
    ).last_hidden_state  # [B, S_local, H], after the final norm
    head = model.get_output_embeddings()
    b, s, h = hidden.shape
    flat_h, flat_y = hidden.reshape(b * s, h), labels.reshape(b * s)  # [B*S_local, H], [B*S_local]
    acc = torch.promote_types(hidden.dtype, torch.float32)  # fp32; a float64 model (the tests) stays float64
    out = torch.empty(b * s, dtype=acc, device=hidden.device)
    apply = None if transform.is_identity else transform.apply  # Llama: no extra op
    for start in range(0, b * s, chunk_size):
        end = min(start + chunk_size, b * s)
        logits = head(flat_h[start:end]).to(acc)  # [chunk, V], log-softmax in fp32
        if apply is not None:
            logits = apply(logits)  # the model's softcap / scale, as its forward does
        out[start:end] = F.cross_entropy(
            logits, flat_y[start:end], ignore_index=IGNORE_INDEX, reduction="none"
        )
    return out.reshape(b, s)


@torch.no_grad()
def token_losses(
    model: nn.Module, input_ids: torch.Tensor, mesh: SPMesh, *, chunk_size: int = 4096
) -> torch.Tensor:
    """Every token's next-token loss under the sharded forward, in global order, on every rank.

    Args:
        model: a causal LM prepared by :func:`usp.model.apply_usp` over ``mesh`` (weights whole on each rank).
        input_ids: ``[B, S]`` global token ids (the same on every rank); ``S`` must suit the mesh's sequence
            layout (a multiple of ``mesh.sequence_multiple()``). Each row is one document from position 0.
        mesh: the :class:`~usp.parallel.SPMesh` the model was prepared with.
        chunk_size: tokens per ``lm_head`` chunk (at most ``[chunk, vocab]`` fp32 logits exist at once).

    Returns:
        float32 ``[B, S]`` (float64 for a float64 model): ``out[b, t] = -log p(input_ids[b, t + 1] | input_ids[b, :t + 1])`` for ``t < S - 1``;
        the last column is 0 (no next token; what ``cross_entropy(ignore_index=...)`` gives there). The same
        tensor on every rank (one all-gather of ``B x S`` floats over the sp group).

    Collective: every rank of the mesh calls it with the same arguments. Raises ``ValueError`` before any
    forward when ``S`` does not suit the layout.
    """
    if input_ids.dim() != 2 or input_ids.is_floating_point():
        raise ValueError(
            f"input_ids must be an integer tensor [B, S], got {input_ids.dtype} {tuple(input_ids.shape)}."
        )
    b, s = input_ids.shape
    check_sequence_length(s, mesh.ring_degree, mesh.ulysses_degree, mesh.ring_layout)
    device = next(model.parameters()).device
    ids = input_ids.to(device=device, dtype=torch.long)
    labels = torch.full_like(ids, IGNORE_INDEX)
    labels[:, :-1] = ids[:, 1:]  # targets on the global sequence, then sharded like the tokens
    pos = torch.arange(s, device=device).expand(b, -1)
    local = _local_losses(
        model,
        shard_sequence(ids, mesh),
        shard_sequence(labels, mesh),
        shard_sequence(pos, mesh),
        transform=lm_head_transform(model.config),
        chunk_size=chunk_size,
    )
    return gather_sequence(local, mesh)  # [B, S]


def bucket_losses(
    losses: torch.Tensor, bucket_size: int, *, valid_len: int | None = None
) -> list[dict[str, Any]]:
    """Mean loss and perplexity per position bucket ``[k * bucket_size, (k + 1) * bucket_size)``.

    ``losses`` ``[B, S]`` from :func:`token_losses`; only positions ``< valid_len`` (default ``S - 1``: the
    last column has no target) count. Bucket ``k`` holds the losses of predicting tokens at positions
    ``k * bucket_size + 1 ...`` from their prefixes. Returns ``[{"start", "end", "tokens", "loss", "ppl"}]``.
    """
    if bucket_size < 1:
        raise ValueError(f"eval.bucket_size={bucket_size} must be >= 1 (tokens per position bucket).")
    s = losses.size(1)
    valid_len = s - 1 if valid_len is None else valid_len
    rows = []
    for start in range(0, valid_len, bucket_size):
        end = min(start + bucket_size, valid_len)
        chunk = losses[:, start:end].double()
        mean = float(chunk.mean())
        rows.append(
            {"start": start, "end": end, "tokens": chunk.numel(), "loss": mean, "ppl": math.exp(mean)}
        )
    return rows


# --- during training: the validation loader, bucketed by position in the document --------------------------
@contextmanager
def _unsharded(model: nn.Module) -> Iterator[None]:
    """Gather an FSDP2 root's own parameters (embeddings, final norm, lm_head) for a forward that bypasses the
    root's ``forward`` (the decoder layers gather their own), and reshard them after. No-op without FSDP2."""
    if not isinstance(model, FSDPModule):
        yield
        return
    model.unshard()
    try:
        yield
    finally:
        model.reshard()


@torch.no_grad()
def loader_position_losses(
    loss_model: nn.Module,
    loader: Any,
    mesh: SPMesh,
    device: torch.device,
    *,
    bucket_size: int,
    chunk_size: int = 4096,
) -> dict[str, Any]:
    """One pass over ``loader`` (the trainer's validation loader): token-weighted mean loss per bucket of
    position *in the document* (the batches' ``position_ids``), summed over every rank.

    ``loss_model`` is the trainer's model (:class:`usp.train.loss.ChunkedCausalLMLoss`, FSDP2-wrapped or not;
    its ``.model`` is the apply_usp'd causal LM). Collective over every rank (two all-reduces). Returns
    ``{"bucket_size", "start": [...], "tokens": [...], "loss": [...], "ppl": [...]}`` (the same on every rank;
    buckets without tokens are left out).
    """
    if bucket_size < 1:
        raise ValueError(f"eval.bucket_size={bucket_size} must be >= 1 (tokens per position bucket).")
    model = loss_model.model
    transform = lm_head_transform(model.config)
    acc = torch.zeros(2, 0, dtype=torch.float64, device=device)  # [loss sum, tokens] per bucket, grows
    with _unsharded(loss_model):
        for batch in loader:
            labels = batch["labels"].to(device)
            pos = batch["position_ids"].to(device)
            cu = batch.get("cu_seqlens")
            losses = _local_losses(
                model,
                batch["input_ids"].to(device),
                labels,
                pos,
                transform=transform,
                cu_seqlens=None if cu is None else cu.to(dtype=torch.int32),
                chunk_size=chunk_size,
            )
            valid = labels != IGNORE_INDEX
            bucket = (pos[valid] // bucket_size).long()  # [targets]
            n = int(bucket.max()) + 1 if bucket.numel() else 0
            if n > acc.size(1):
                acc = F.pad(acc, (0, n - acc.size(1)))
            acc[0].index_add_(0, bucket, losses[valid].double())
            acc[1].index_add_(0, bucket, torch.ones_like(bucket, dtype=torch.float64))
    group = mesh.group("fsdp")
    width = torch.tensor([acc.size(1)], dtype=torch.int64, device=device)
    dist.all_reduce(width, op=dist.ReduceOp.MAX, group=group)  # ranks saw different largest positions
    total = F.pad(acc, (0, int(width) - acc.size(1)))
    dist.all_reduce(total, group=group)
    keep = [k for k in range(int(width)) if total[1, k] > 0]
    loss = [float(total[0, k] / total[1, k]) for k in keep]
    return {
        "bucket_size": bucket_size,
        "start": [k * bucket_size for k in keep],
        "tokens": [int(total[1, k]) for k in keep],
        "loss": loss,
        "ppl": [math.exp(x) for x in loss],
    }


def val_ppl_by_position(
    loss_model: nn.Module,
    loader: Any,
    mesh: SPMesh,
    device: torch.device,
    *,
    bucket_size: int,
    chunk_size: int = 4096,
) -> dict[str, float]:
    """The trainer's ``val_ppl_by_position`` metric: ``{"<bucket start>": perplexity}`` in position order
    (from :func:`loader_position_losses`). A flat mapping, so wandb charts one line per bucket
    (``val_ppl_by_position.<start>``) and metrics.jsonl keeps one small object per evaluation."""
    table = loader_position_losses(
        loss_model, loader, mesh, device, bucket_size=bucket_size, chunk_size=chunk_size
    )
    return {str(start): ppl for start, ppl in zip(table["start"], table["ppl"])}
