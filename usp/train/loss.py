"""Chunked, token-weighted cross-entropy: exact global-mean loss without materializing ``[S, vocab]`` logits.

Labels arrive already shifted on the *global* sequence (``labels[t] = input_ids[t + 1]``, ``-100`` where
there is no target), then sharded like the tokens, so a token at a shard boundary keeps its target.

The loss of one optimizer step is the mean over every target token of every micro-batch on every rank::

    loss = sum_{ranks, micro-batches, tokens} ce(logits_t, label_t) / N,   N = number of targets (all_reduce)

Each rank backpropagates ``local_sum / N``; its gradients are this rank's share of the global gradient, and
FSDP2 must *sum* the shares (``usp.train.parallelize`` sets its divide factor to 1), which yields exactly the
single-process gradient of the mean loss.

Memory: the final norm'd hidden states ``[B, S_local, H]`` go through ``lm_head`` ``chunk_size`` tokens at a
time, each chunk but the last under activation checkpointing (the last one's backward comes first, where its
recompute would allocate what it keeps), so at most one chunk's ``[chunk, vocab]`` fp32 logits exist
in forward and in backward. With sequence tiling the final norm runs inside the chunks too, and only the
pre-norm hidden states are kept.

Logits: a family's own transform of ``lm_head``'s output (Gemma's final softcap, Granite's ``logits_scaling``,
Cohere's ``logit_scale``: :class:`usp.model.LMHeadTransform`, read from the config once per model) is applied to
each chunk's fp32 logits before the cross-entropy, so the loss is the model's own; Llama's identity costs no op.
A softcap's backward holds its ``tanh`` output, one more ``[chunk, vocab]`` fp32 tensor, inside the checkpoint.

Precision: under bf16 compute the ``lm_head`` weight is FSDP2's gathered bf16 copy, so its gradient is the
sum of the per-chunk bf16 gradients, accumulated by autograd in bf16 (one rounding per chunk, before the
``reduce_dtype`` reduce-scatter). Fewer, larger chunks (``trainer.loss_chunk_size``) mean fewer roundings.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import PreTrainedModel

from usp.model.capabilities import decoder_of
from usp.model.lm_head import LMHeadTransform, lm_head_transform
from usp.model.usp_attention_fn import packed_sequence_kwargs
from usp.train.router_loss import (
    RouterAuxSpec,
    RouterLogitsRecorder,
    RouterStats,
    load_balancing_share,
    routing_counts,
)
from usp.train.tiling import deferrable_final_norm

IGNORE_INDEX = -100


def _chunk_ce_sum(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    norm: Callable[[torch.Tensor], torch.Tensor] | None = None,
    transform: LMHeadTransform | None = None,
    segments: torch.Tensor | None = None,
    num_segments: int = 0,
) -> torch.Tensor:
    if norm is not None:
        hidden = norm(hidden)  # the deferred final norm, [chunk, H]
    logits = F.linear(hidden, weight, bias)  # [chunk, V]
    if logits.dtype not in (torch.float32, torch.float64):
        logits = logits.float()  # bf16/fp16 compute: log-softmax in fp32
    if transform is not None:
        logits = transform.apply(logits)  # the model's softcap / scale, in fp32
    if segments is None:
        return F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")
    per_token = F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="none")  # 0 if ignored
    return per_token.new_zeros(num_segments).index_add(0, segments, per_token)  # [num_segments]


def chunked_cross_entropy_sum(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    chunk_size: int,
    bias: torch.Tensor | None = None,
    norm: Callable[[torch.Tensor], torch.Tensor] | None = None,
    transform: LMHeadTransform | None = None,
    segments: torch.Tensor | None = None,
    num_segments: int = 0,
) -> torch.Tensor:
    """Sum of token cross-entropies of ``lm_head(hidden)`` against ``labels`` (``-100`` ignored).

    ``hidden`` ``[B, S, H]`` (after the final norm), ``weight`` ``[V, H]`` (``lm_head.weight``), ``labels``
    ``[B, S]``. Returns an fp32 scalar. Differentiable with respect to ``hidden``, ``weight`` and ``bias``;
    each chunk of ``chunk_size`` tokens is recomputed in backward, so peak extra memory is one chunk's logits.
    Not the last chunk: its backward is the first one, right after the forward (every caller's next step), so
    it keeps its logits instead, which is what its recompute would allocate at that very point; the same
    memory peak and, the recompute being exact, the same gradients bit for bit, one ``lm_head`` product less
    (a whole step's, when one chunk holds every token: a 7% step on SmolLM2-135M, docs/performance.md).
    The result is fp32 (fp64 for fp64 inputs). ``norm`` (per token, ``[n, H] -> [n, H]``): when given,
    ``hidden`` is *before* the final norm and ``norm`` is applied to each chunk inside its checkpoint, so
    only ``hidden`` is kept for backward (:class:`usp.train.tiling.DeferrableNorm`). ``transform``: the model's
    :class:`~usp.model.LMHeadTransform`, applied to each chunk's fp32 logits (``None`` or the identity: none).
    ``segments`` (int64 ``[B, S]``, values in ``[0, num_segments)``): return the sums per segment instead,
    ``[num_segments]`` (a sequence's summed log-probability is minus its entry: DPO, :mod:`usp.train.dpo`).
    """
    if chunk_size < 1:
        raise ValueError(
            f"trainer.loss_chunk_size={chunk_size} must be >= 1 (tokens per cross-entropy chunk)."
        )
    assert hidden.shape[:-1] == labels.shape, f"hidden {tuple(hidden.shape)} vs labels {tuple(labels.shape)}"
    h = hidden.reshape(-1, hidden.size(-1))  # [B*S, H]
    y = labels.reshape(-1)  # [B*S]
    seg = None if segments is None else segments.reshape(-1)  # [B*S]
    if transform is not None and transform.is_identity:
        transform = None  # Llama: not even a call
    dtype = torch.promote_types(hidden.dtype, torch.float32)
    total = hidden.new_zeros(() if seg is None else (num_segments,), dtype=dtype)
    for start in range(0, h.size(0), chunk_size):
        end = min(start + chunk_size, h.size(0))
        args = (h[start:end], weight, bias, y[start:end], norm, transform)
        args += (None if seg is None else seg[start:end], num_segments)
        if end == h.size(0):  # the last chunk: not recomputed (see below)
            total = total + _chunk_ce_sum(*args)
        else:
            total = total + checkpoint(_chunk_ce_sum, *args, use_reentrant=False)
    return total


def count_targets(labels: torch.Tensor) -> int:
    """Number of tokens with a target (``label != -100``)."""
    return int((labels != IGNORE_INDEX).sum().item())


def global_target_count(
    local_count: int, group: dist.ProcessGroup | None = None, device: torch.device | str = "cpu"
) -> int:
    """Sum of ``local_count`` over ``group`` (every rank of the job: dp x ring x ulysses); one all_reduce
    (none in a world of one)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return int(local_count)
    t = torch.tensor([local_count], dtype=torch.int64, device=device)
    dist.all_reduce(t, group=group)
    return int(t.item())


class ChunkedCausalLMLoss(nn.Module):
    """Wraps a transformers causal LM so that one ``forward`` runs the decoder *and* the chunked loss.

    FSDP2 is applied with this wrapper as its root, so ``lm_head`` (in the root's parameter group) is gathered
    by the root's hooks even though the model's own ``forward`` (which would build full logits) is bypassed.
    ``self.model`` stays the plain transformers model: checkpoints and exports use it, with its usual names.
    When sequence tiling made the decoder's final norm deferrable (:mod:`usp.train.tiling`, ``mlp_tiles > 1``)
    the decoder runs without it and each loss chunk applies it. The model's LM-head transform
    (:func:`usp.model.lm_head_transform`) is read from its config here, once.

    Mixture-of-experts models: with ``router_aux`` (:func:`usp.train.router_loss.router_aux_spec`) each forward
    also adds ``coef * aux_scale *`` this rank's share of the router load-balancing loss over ``aux_group``
    (every rank of the job; :mod:`usp.train.router_loss`), and keeps the detached parts of its last forward in
    ``last_cross_entropy`` (this rank's cross-entropy share) and ``last_router_stats``.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        chunk_size: int,
        router_aux: RouterAuxSpec | None = None,
        aux_group: dist.ProcessGroup | None = None,
        router_scope: str = "micro_batch",
    ):
        super().__init__()
        if chunk_size < 1:
            raise ValueError(
                f"trainer.loss_chunk_size={chunk_size} must be >= 1 (tokens per cross-entropy chunk)."
            )
        self.model = model
        self.chunk_size = chunk_size
        self.lm_head_transform = lm_head_transform(model.config)
        self.router_aux = router_aux
        self.aux_group = aux_group
        self.router_scope = router_scope  # model.router_loss_scope: micro_batch | step (train_step reads it)
        self._router_recorder = None if router_aux is None else RouterLogitsRecorder(model, router_aux)
        self.last_cross_entropy: torch.Tensor | None = None
        self.last_router_stats: RouterStats | None = None

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        *,
        position_ids: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        num_targets: int | float = 1.0,
        aux_scale: float = 1.0,
        routing: tuple[torch.Tensor, torch.Tensor] | None = None,
        routing_only: bool = False,
        segments: torch.Tensor | None = None,
        num_segments: int = 0,
        shared_prefix: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``sum of this rank's token losses / num_targets`` (fp32 scalar), plus, for a MoE with ``router_aux``,
        ``coef * aux_scale * `` this rank's router-loss share (collective over ``aux_group``).

        ``input_ids``, ``labels``, ``position_ids``: this rank's slice ``[B, S_local]``; ``cu_seqlens``: global
        document boundaries or ``None``; ``num_targets``: the global target count of the whole step;
        ``aux_scale``: ``1 / micro-batches`` of the step (the router loss is the mean over micro-batches); 0 for
        evaluation (the same on every rank: no router loss, no collective). ``routing``: the step's router counts
        (:func:`usp.train.router_loss.load_balancing_share`). ``routing_only`` (a MoE, under ``torch.no_grad``):
        run the decoder only and return this rank's :func:`usp.train.router_loss.routing_counts`.
        ``segments`` (int64 ``[B, S_local]``, this rank's slice): return this rank's cross-entropy sums per
        segment, ``[num_segments]``, undivided and without a router term (DPO's sequence log-probabilities,
        :mod:`usp.train.dpo`; through ``forward`` so that FSDP2's root hooks gather ``lm_head``).
        ``shared_prefix``: with ``cu_seqlens``, DPO's shared prompt (int ``[num_docs]``, on the host; see
        :func:`usp.attention.usp_attention`).
        """
        # transformers' names: cu_seq_lens_q/k, max_length_q/k (and usp_shared_prefix)
        extra = packed_sequence_kwargs(cu_seqlens, shared_prefix)
        decoder = decoder_of(self.model)
        final_norm = deferrable_final_norm(decoder)
        recorder = self._router_recorder
        with (
            final_norm.deferred() if final_norm is not None else nullcontext(),
            recorder.recording() if recorder is not None else nullcontext() as router_logits,
        ):
            out = decoder(input_ids=input_ids, position_ids=position_ids, use_cache=False, **extra)
        if routing_only:
            assert self.router_aux is not None and not torch.is_grad_enabled(), "routing pass: a MoE, no grad"
            return routing_counts(router_logits, self.router_aux)
        hidden = out.last_hidden_state  # [B, S_local, H], after the final norm (before it when deferred)
        head = self.model.get_output_embeddings()
        loss_sum = chunked_cross_entropy_sum(
            hidden,
            head.weight,
            labels,
            chunk_size=self.chunk_size,
            bias=head.bias,
            norm=None if final_norm is None else final_norm.norm,
            transform=self.lm_head_transform,
            segments=segments,
            num_segments=num_segments,
        )
        if segments is not None:
            return loss_sum  # [num_segments]
        loss = loss_sum / num_targets
        if self.router_aux is None or aux_scale == 0:  # evaluation: the cross-entropy alone
            return loss
        share, self.last_router_stats = load_balancing_share(
            router_logits, self.router_aux, self.aux_group, routing
        )
        self.last_cross_entropy = loss.detach()
        return loss + (self.router_aux.coef * aux_scale) * share
