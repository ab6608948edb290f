"""Single-process attention on the whole sequence: the ground truth the sharded attention is tested against."""

from __future__ import annotations

import math

import torch


def document_mask(cu_seqlens: torch.Tensor, seq_len: int, causal: bool, device: torch.device) -> torch.Tensor:
    """Boolean ``[S, S]`` (True = attend): same document (and key not after query when ``causal``)."""
    pos = torch.arange(seq_len, device=device)
    doc = torch.searchsorted(cu_seqlens.to(device=device, dtype=torch.int64), pos, right=True) - 1
    mask = doc[:, None] == doc[None, :]
    if causal:
        mask &= pos[:, None] >= pos[None, :]
    return mask


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    softmax_scale: float | None = None,
    cu_seqlens: torch.Tensor | None = None,
    window: int | None = None,
    chunk: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain softmax attention, ``q [B, S, Hq, D]``, ``k, v [B, S, Hkv, D]`` -> ``[B, S, Hq, D]``.

    Computed in the inputs' dtype (pass float64 for a tight reference); differentiable by autograd.
    ``cu_seqlens``: document boundaries ``[num_docs + 1]``; attention stays inside each document.
    ``window``: keys ``j`` with ``i - window < j <= i``; ``chunk``: ``i`` and ``j`` in the same ``chunk``-token chunk of their document; ``softcap``:
    scores ``c * tanh(s / c)``; ``sinks [Hq]``: one more logit per head in every row's softmax, value 0
    (transformers' eager formulas, written out here as a dense mask).
    """
    b, s, hq, d = q.shape
    group = hq // k.size(2)
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else softmax_scale
    kx = k.repeat_interleave(group, dim=2).transpose(1, 2)  # [B, Hq, S, D]
    vx = v.repeat_interleave(group, dim=2).transpose(1, 2)
    scores = torch.matmul(q.transpose(1, 2), kx.transpose(-1, -2)) * scale  # [B, Hq, S, S]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if cu_seqlens is not None:
        mask = document_mask(cu_seqlens, s, causal, q.device)
    elif causal:
        mask = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
    else:
        mask = None
    pos = torch.arange(s, device=q.device)
    if window is not None:
        mask = (pos[:, None] - pos[None, :] < window) & (True if mask is None else mask)
    if chunk is not None:  # counted from each document's start
        start = torch.zeros_like(pos)
        if cu_seqlens is not None:
            cu = cu_seqlens.to(device=q.device, dtype=torch.int64)
            start = cu[torch.searchsorted(cu, pos, right=True) - 1]
        idx = (pos - start) // chunk
        mask = (idx[:, None] == idx[None, :]) & (True if mask is None else mask)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        return torch.matmul(torch.softmax(scores, dim=-1), vx).transpose(1, 2)  # [B, S, Hq, D]
    sink = sinks.to(scores.dtype).reshape(1, hq, 1, 1).expand(b, hq, s, 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]  # the sink's value is 0
    return torch.matmul(probs, vx).transpose(1, 2)
