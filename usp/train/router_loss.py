"""The router load-balancing loss of mixture-of-experts models, exact under sequence and data parallelism.

transformers' MoE causal LMs (qwen3_moe, mixtral, olmoe, gpt_oss, phimoe, granitemoe, ... : 31 families share one
``load_balancing_loss_func``) add ``router_aux_loss_coef * aux`` to the LM loss, where, over the ``R`` routed
rows of one forward (every token of every layer, all layers pooled)::

    aux = E * sum_e (c_e / R) * (P_e / R),   c_e = top-k selections of expert e,   P_e = sum of softmax probs

``c`` is a count (no gradient); ``P`` is a sum over rows, so ``aux`` is linear in each rank's rows once ``c``
and ``R`` are global. Each rank therefore adds the share ``E * sum_e (c_e / R) * (P_local_e / R)`` with
``c``, ``R`` all-reduced over every rank of the job (sequence shards and data-parallel replicas: one
``all_reduce`` of ``2 L E + 1`` numbers per micro-batch): the shares sum to the unsharded model's ``aux`` on the
same tokens, and FSDP2's summed gradients (``usp.train.loss``) are its exact gradient.

One forward is one micro-batch of every rank, as transformers computes it per forward call; with gradient
accumulation the step's loss is the mean over micro-batches (the accumulation transformers' Trainer does), or,
with ``model.router_loss_scope=step``, the ``aux`` of the whole step: a routing pass without gradients counts
every micro-batch's selections first (one more forward per micro-batch), and each micro-batch then adds its
part of the step's ``aux`` (linear in its probabilities once the step's counts are fixed).
Families whose CausalLM adds no router loss (deepseek_v3, glm4_moe: bias-balanced routing) get none, as
their own loss has none; a family with another formula is refused by :func:`router_aux_spec`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from usp.model.capabilities import MOE_FIELDS, router_loss_kind


@dataclass(frozen=True)
class RouterAuxSpec:
    """What a family's router loss needs: read once from the model (:func:`router_aux_spec`)."""

    num_experts: int
    top_k: int
    coef: float
    router_class: type[nn.Module]
    output_index: int  # the router's output that holds its logits [tokens, experts]


@dataclass(frozen=True)
class RouterStats:
    """One micro-batch's routing over every rank (detached): the aux loss and the per-layer expert loads."""

    aux: torch.Tensor  # scalar, the unsharded model's aux (without the coefficient)
    expert_tokens: torch.Tensor  # [L, E] top-k selections per layer and expert, summed over every rank


def is_moe(model: nn.Module) -> bool:
    """Whether the model routes tokens to experts (its config names more than one expert)."""
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return any((getattr(text, f, None) or 0) > 1 for f in MOE_FIELDS)


def router_aux_spec(model: nn.Module, coef: float | None = None) -> RouterAuxSpec | None:
    """The router loss of ``model``'s family, or ``None`` when its causal LM adds none.

    ``coef`` overrides the config's ``router_aux_loss_coef``. ``ValueError`` when the family computes a router
    loss with a formula other than the one implemented here (its loss would not be the model's own).
    """
    own_coef = getattr(model, "router_aux_loss_coef", None)
    kind = router_loss_kind(type(model))
    if own_coef is None or kind == "none":
        return None
    model_type = getattr(model.config, "model_type", "?")
    if kind == "other":
        raise ValueError(
            f"model.path: {model_type}'s router load-balancing loss ({type(model).__module__}) is "
            f"not the one usp computes under sequence parallelism, so the training loss would not be the "
            f"model's own; train a family whose loss usp implements (qwen3_moe, mixtral, olmoe, gpt_oss, ...)."
        )
    recorder = getattr(model, "_can_record_outputs", None) or {}
    spec = recorder.get("router_logits")
    if spec is None or getattr(spec, "layer_name", None) is not None:
        raise ValueError(
            f"model.path: usp cannot find the router modules of {model_type} (no plain router_logits recorder)."
        )
    return RouterAuxSpec(
        num_experts=int(model.num_experts),
        top_k=int(model.num_experts_per_tok),
        coef=float(own_coef if coef is None else coef),
        router_class=spec.target_class,
        output_index=int(spec.index),
    )


class RouterLogitsRecorder:
    """Forward hooks on every router of a model; while :meth:`recording`, each router call appends its logits
    ``[tokens, E]`` (with their graph). Recomputation under activation checkpointing (in backward, outside
    :meth:`recording`) records nothing."""

    def __init__(self, model: nn.Module, spec: RouterAuxSpec) -> None:
        self.logits: list[torch.Tensor] = []
        self._active = False
        self._index = spec.output_index
        routers = [m for m in model.modules() if isinstance(m, spec.router_class)]
        assert routers, f"no {spec.router_class.__name__} in the model"
        self._handles = [m.register_forward_hook(self._hook) for m in routers]

    def _hook(self, module: nn.Module, args: tuple, output: tuple | torch.Tensor) -> None:
        if self._active:
            self.logits.append(output[self._index] if isinstance(output, (tuple, list)) else output)

    @contextmanager
    def recording(self) -> Iterator[list[torch.Tensor]]:
        self.logits = []
        self._active = True
        try:
            yield self.logits
        finally:
            self._active = False

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def routing_counts(logits: list[torch.Tensor], spec: RouterAuxSpec) -> torch.Tensor:
    """``[L E + 1]`` (fp64): this rank's top-k selections per layer and expert, then its routed rows; summed over
    the micro-batches of a step and all-reduced, the ``routing`` of :func:`load_balancing_share`."""
    dtype = torch.promote_types(logits[0].dtype, torch.float32)
    counts = [  # chosen as load_balancing_share chooses them: top-k of the softmax
        torch.bincount(
            torch.topk(torch.softmax(layer.to(dtype), dim=-1), spec.top_k, dim=-1).indices.reshape(-1),
            minlength=spec.num_experts,
        )
        for layer in logits
    ]
    rows = sum(layer.shape[0] for layer in logits)
    return torch.cat(
        [torch.stack(counts).reshape(-1).double(), torch.tensor([float(rows)], dtype=torch.float64)]
    )


def load_balancing_share(
    logits: list[torch.Tensor],
    spec: RouterAuxSpec,
    group: dist.ProcessGroup | None,
    routing: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, RouterStats]:
    """This rank's share of the load-balancing loss of one micro-batch, and the micro-batch's routing stats.

    ``logits``: one ``[tokens_local, E]`` tensor per MoE layer, in layer order, this rank's tokens. ``group``:
    every rank whose tokens belong to the micro-batch (the FSDP group: dp x ring x ulysses). Collective: one
    ``all_reduce`` (a sum) of the per-layer counts, the detached probability sums and the row count. The share
    (fp32, fp64 for fp64 logits) carries the gradient of this rank's rows; the shares of all ranks sum to the
    unsharded ``aux``.

    ``routing``: ``(counts [L, E], rows)`` of the whole step over every rank (``model.router_loss_scope=step``):
    then only the probability sums are all-reduced, the share is this micro-batch's part of the step's ``aux``
    (linear in the probabilities once the counts are fixed: the parts of all micro-batches and ranks sum to it),
    and ``RouterStats.aux`` is this micro-batch's part of the step's ``aux``.
    """
    assert logits, "a MoE forward recorded no router logits"
    num_experts, dtype = spec.num_experts, torch.promote_types(logits[0].dtype, torch.float32)
    counts, prob_sums = [], []
    for layer in logits:
        probs = torch.softmax(layer.to(dtype), dim=-1)  # [T, E]
        chosen = torch.topk(probs, spec.top_k, dim=-1).indices  # [T, k]
        counts.append(torch.bincount(chosen.reshape(-1), minlength=num_experts).to(dtype))
        prob_sums.append(probs.sum(dim=0))  # [E], with the graph
    local_probs = torch.stack(prob_sums)  # [L, E]
    rows = sum(layer.shape[0] for layer in logits)
    distributed = group is not None and dist.is_initialized() and dist.get_world_size(group) > 1
    layers = local_probs.shape[0]
    if routing is not None:  # the step's counts, from the routing pass
        global_probs = local_probs.detach().clone()
        if distributed:
            dist.all_reduce(global_probs, group=group)
        global_counts, total_rows = routing[0].to(dtype), routing[1].to(dtype)
    else:
        packed = torch.cat([torch.stack(counts).reshape(-1), local_probs.detach().reshape(-1)])
        packed = torch.cat([packed, packed.new_tensor([rows])])  # [2 L E + 1]
        if distributed:
            dist.all_reduce(packed, group=group)
        global_counts = packed[: layers * num_experts].reshape(layers, num_experts)
        global_probs = packed[layers * num_experts : -1].reshape(layers, num_experts)
        total_rows = packed[-1]
    tokens_per_expert = global_counts.sum(dim=0) / total_rows  # [E], pooled over layers as transformers does
    share = num_experts * (tokens_per_expert * local_probs.sum(dim=0) / total_rows).sum()
    aux = num_experts * (tokens_per_expert * global_probs.sum(dim=0) / total_rows).sum()
    return share, RouterStats(aux=aux, expert_tokens=global_counts)


def router_metrics(aux_loss: float, expert_tokens: list[list[int]]) -> dict[str, object]:
    """A step's router figures for ``metrics.jsonl``: ``aux_loss``; ``expert_tokens`` (per expert, summed over the
    MoE layers); ``expert_load_max_mean``: the largest ``max / mean`` tokens per expert of any layer (1.0 is
    perfectly balanced; ``E / k`` means one layer sends every token to the same k experts)."""
    per_layer = torch.tensor(expert_tokens, dtype=torch.float64)  # [L, E]
    means = per_layer.mean(dim=1).clamp(min=1e-12)
    return {
        "aux_loss": aux_loss,
        "expert_tokens": [int(v) for v in per_layer.sum(dim=0).tolist()],
        "expert_load_max_mean": float((per_layer.max(dim=1).values / means).max()),
    }
