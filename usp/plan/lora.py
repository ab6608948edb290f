"""LoRA in the planner: what a run of low-rank adapters on a frozen base trains, stores and computes.

A :class:`LoraPlan` (``usp-plan --lora-rank R``, ``model.lora.*`` of a run: :meth:`LoraPlan.from_config`) is
the :attr:`usp.plan.layout.Workload.lora` of a search; ``None`` is full training. What it changes, as usp trains
it (:mod:`usp.model.lora`, :mod:`usp.train.parallelize`, :mod:`usp.train.optim`):

- **Parameters.** Every parameter, frozen or not, is an fp32 FSDP2 shard (the base is built in fp32 and loaded
  into those shards as in full training, :func:`usp.model.load.build_empty_causal_lm`), all-gathered in the
  compute dtype for the forward and again for the backward: ``4 (P + P_a) / shard`` bytes on the device and the
  same all-gathers as full training, ``P`` the base's parameters and ``P_a`` the adapters'
  (:func:`adapter_params`: ``r (in + out)`` for every adapted linear layer, ``A [r, in]`` and ``B [out, r]``).
- **Gradients and optimizer states** only for the trainable parameters ``P_t`` (:func:`trainable_params`: the
  adapters, plus the input embeddings and every norm with ``train_embeddings_and_norms``; a tied LM head is
  the embedding and trains with it): AdamW's ``m, v`` (8 B each), the fp32 gradient shards (4 B each), the
  compute-dtype gradients of a layer and FSDP2's fp32 reduce-scatter input hold only these, and only they are
  reduce-scattered. A frozen LM head has no ``[V, h]`` gradient.
- **Adapted layers** (:func:`adapted_linears`): by default every linear layer of the decoder blocks named
  ``*proj*`` (:func:`usp.model.lora.default_target_modules`): q, k, v, o and the dense MLP's gate, up, down in
  every layer, and a mixture of experts' shared experts (the router is no ``*proj*``). ``target_modules``
  narrows that. Not modelled: transformers 5 stores a MoE's routed experts as stacked 3D parameters, which
  ``peft`` adapts too for some families when a dense layer's gate/up/down names are targeted (its
  ``ParamWrapper``, e.g. Qwen3-MoE with ``mlp_only_layers``: per-expert adapters, and ``W + B A`` of every expert
  materialized in each forward); the planner costs the linear layers' adapters only.
- **Activations** (per local token and layer, measured in ``tests/test_plan_lora.py``; ``B`` the compute dtype's
  size): a frozen linear layer keeps no input (its backward needs only its weight, for the input gradient),
  the adapter's ``A`` keeps the layer's input (the same tensor the full-training count already holds) and its
  ``B`` the ``r``-wide output of ``A``: ``r B`` per adapted layer. A frozen norm keeps no normalized input
  (``B h`` less per norm). An input no adapted layer reads is not kept: the norms' outputs when none of their
  consumers is adapted, the o_proj input the Ulysses all-to-all returns, the down projection's input. The
  dropout of ``model.lora.dropout > 0`` (its mask and dropped copy of each adapted input) is not counted: usp's
  recipes train with 0. The first layer without trained embeddings keeps ``4 h + 4`` less (its input needs no
  gradient): not counted (the planner costs every layer alike). A mixture of experts' block keeps what full
  training keeps (an upper bound: a frozen expert's input is not needed for its backward either).
- **Model FLOPs** (:func:`usp.plan.compute.training_flops` with ``trainable_matmul_params``): ``2 N`` forward
  and ``2 N`` input gradients per token over every matmul weight ``N`` (the adapters' too), and ``2 N_t``
  weight gradients over the trainable ones (:func:`trainable_matmul_params`): ``4 N_frozen + 6 N_t``, where
  full training counts ``6 N``. The rank-``r`` matmuls are costed at the dense efficiency (they are memory
  bound on a GPU: optimistic by their few percent of the time).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from usp.plan.models import ModelSpec

ATTENTION_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_LINEARS = ("gate_proj", "up_proj", "down_proj")
"""A dense MLP's (and shared experts') linear layers, as the Llama-style families in transformers name them."""


@dataclass(frozen=True)
class LoraPlan:
    """The adapters a run trains (``model.lora.*``; the planner needs no ``alpha`` nor ``dropout``)."""

    rank: int
    """``model.lora.rank``: the adapters' rank ``r`` (>= 1)."""
    train_embeddings_and_norms: bool = False
    """``model.lora.train_embeddings_and_norms``: the input embeddings and every norm train too."""
    target_modules: tuple[str, ...] | None = None
    """``model.lora.target_modules``: the adapted layers' names (:data:`ATTENTION_LINEARS`,
    :data:`MLP_LINEARS`); ``None``: every ``*proj*`` layer of the decoder blocks."""

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"LoRA rank {self.rank!r} must be an integer >= 1 (0 means full training).")
        if self.target_modules is not None:
            object.__setattr__(self, "target_modules", tuple(self.target_modules))

    @classmethod
    def from_config(cls, lora: Any) -> LoraPlan | None:
        """The plan of a run's ``model.lora`` (a :class:`usp.config.schema.LoraConfig`, a
        :class:`usp.model.lora.LoraSpec` or the plain dict a saved config holds); ``None`` when it is off
        (``rank`` 0 or missing)."""
        if lora is None:
            return None
        get = (
            lora.get if isinstance(lora, Mapping) else (lambda key, default=None: getattr(lora, key, default))
        )
        rank = int(get("rank", 0) or 0)
        if rank == 0:
            return None
        targets = get("target_modules", None)
        return cls(
            rank,
            bool(get("train_embeddings_and_norms", False)),
            None if targets is None else tuple(targets),
        )

    def describe(self) -> str:
        """``LoRA rank 16 on q_proj,v_proj + embeddings and norms`` (the run's log and the tables' heading)."""
        on = "" if self.target_modules is None else " on " + ",".join(self.target_modules)
        extra = " + embeddings and norms" if self.train_embeddings_and_norms else ""
        return f"LoRA rank {self.rank}{on}{extra}"

    def overrides(self) -> list[str]:
        """The Hydra overrides that train these adapters (``model.lora.*``)."""
        out = [f"model.lora.rank={self.rank}"]
        if self.train_embeddings_and_norms:
            out.append("model.lora.train_embeddings_and_norms=true")
        if self.target_modules is not None:
            out.append(f"model.lora.target_modules=[{','.join(self.target_modules)}]")
        return out


def layer_linears(model: ModelSpec, routed: bool = False) -> dict[str, tuple[int, int]]:
    """The linear layers of one decoder layer, ``name -> (in, out)``: q, k, v, o, and the dense MLP's gate, up,
    down (a MoE layer: its shared experts' projections, none without shared experts; the routed experts are no
    linear layers)."""
    h, d = model.hidden_size, model.head_dim
    q, kv = model.num_heads * d, model.num_kv_heads * d
    out = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h)}
    width = model.intermediate_size
    if routed:
        assert model.moe is not None
        width = model.moe.shared_intermediate_size
    if width:
        out |= {"gate_proj": (h, width), "up_proj": (h, width), "down_proj": (width, h)}
    return out


def target_names(model: ModelSpec, lora: LoraPlan) -> tuple[str, ...]:
    """The adapted layers' names: ``lora.target_modules``, or every ``*proj*`` layer the model has. ``ValueError``
    for a name the planner does not know (it models the Llama-style projections only)."""
    known = {name for kind in set(model.layer_kinds) for name in layer_linears(model, kind)}
    if lora.target_modules is None:
        return tuple(n for n in (*ATTENTION_LINEARS, *MLP_LINEARS) if n in known)
    unknown = sorted(set(lora.target_modules) - known)
    if unknown or not lora.target_modules:
        raise ValueError(
            f"model.lora.target_modules={list(lora.target_modules)}: the planner models the adapters of "
            f"{sorted(known)}" + (f", not {unknown}" if unknown else "") + "."
        )
    return lora.target_modules


def adapted_linears(model: ModelSpec, lora: LoraPlan, routed: bool = False) -> dict[str, tuple[int, int]]:
    """The adapted linear layers of one decoder layer of this kind, ``name -> (in, out)``."""
    targets = set(target_names(model, lora))
    return {name: shape for name, shape in layer_linears(model, routed).items() if name in targets}


def adapter_layer_params(model: ModelSpec, lora: LoraPlan, routed: bool = False) -> int:
    """The adapters of one decoder layer of this kind: ``r (in + out)`` per adapted linear layer."""
    return sum(lora.rank * (i + o) for i, o in adapted_linears(model, lora, routed).values())


def adapter_params(model: ModelSpec, lora: LoraPlan | None) -> int:
    """Every adapter parameter of the model (0 without LoRA); they are matmul weights every token runs."""
    if lora is None:
        return 0
    per_kind = {kind: adapter_layer_params(model, lora, kind) for kind in set(model.layer_kinds)}
    return sum(per_kind[kind] for kind in model.layer_kinds)


def total_params(model: ModelSpec, lora: LoraPlan | None) -> int:
    """Every parameter FSDP2 shards and all-gathers: the base's and the adapters'."""
    return model.num_params + adapter_params(model, lora)


def gathered_layer_params(model: ModelSpec, lora: LoraPlan | None) -> int:
    """One decoder layer as FSDP2 gathers it: :attr:`ModelSpec.layer_params` and, with LoRA, its adapters (the
    largest kind's)."""
    if lora is None:
        return model.layer_params
    return model.layer_params + max(
        adapter_layer_params(model, lora, kind) for kind in set(model.layer_kinds)
    )


def trainable_layer_params(model: ModelSpec, lora: LoraPlan | None, routed: bool | None = None) -> int:
    """The trainable parameters of one decoder layer (``routed``: of a MoE layer or a dense one; ``None``: the
    largest kind, :attr:`ModelSpec.layer_params` without LoRA): its adapters, and its two norms when they
    train."""
    if lora is None:
        return (
            model.layer_params if routed is None else model.params_of_layer(model.layer_kinds.index(routed))
        )
    kinds = set(model.layer_kinds) if routed is None else {routed}
    norms = 2 * model.hidden_size if lora.train_embeddings_and_norms else 0
    return max(adapter_layer_params(model, lora, kind) for kind in kinds) + norms


def trainable_decoder_params(model: ModelSpec, lora: LoraPlan | None) -> int:
    """The trainable parameters of all decoder layers (:attr:`ModelSpec.decoder_params` without LoRA)."""
    if lora is None:
        return model.decoder_params
    norms = 2 * model.hidden_size * model.num_layers if lora.train_embeddings_and_norms else 0
    return adapter_params(model, lora) + norms


def trainable_root_params(model: ModelSpec, lora: LoraPlan | None) -> int:
    """The trainable parameters of the root unit (embedding, final norm, LM head): all of them without LoRA;
    with it the embedding (the tied LM head with it) and the final norm when they train, else none (an untied
    LM head stays frozen)."""
    if lora is None:
        return model.embedding_params + model.head_params + model.hidden_size
    return model.embedding_params + model.hidden_size if lora.train_embeddings_and_norms else 0


def trainable_params(model: ModelSpec, lora: LoraPlan | None) -> int:
    """What gets gradients and AdamW states (:attr:`ModelSpec.num_params` without LoRA)."""
    return trainable_decoder_params(model, lora) + trainable_root_params(model, lora)


def head_trains(model: ModelSpec, lora: LoraPlan | None) -> bool:
    """Whether the LM head gets a ``[V, h]`` weight gradient in the loss's backward: always in full training;
    with LoRA only when it is tied to the embedding and the embedding trains."""
    return lora is None or (model.tie_word_embeddings and lora.train_embeddings_and_norms)


def root_grad_matrix(model: ModelSpec, lora: LoraPlan | None) -> bool:
    """Whether the root unit ends the backward with a ``[V, h]`` gradient in the compute dtype (the LM head's,
    or the embedding's): full training, or LoRA training the embeddings."""
    return lora is None or lora.train_embeddings_and_norms


def matmul_params(model: ModelSpec, lora: LoraPlan | None) -> int:
    """Every matmul weight a token goes through (the model-FLOP count's ``N``): the base's
    :attr:`ModelSpec.matmul_params` and the adapters."""
    return model.matmul_params + adapter_params(model, lora)


def trainable_matmul_params(model: ModelSpec, lora: LoraPlan | None) -> int | None:
    """The matmul weights that get a weight gradient (``N_t``): ``None`` without LoRA (all of them); with it
    the adapters, and a tied LM head when the embeddings train (the embedding itself is a lookup)."""
    if lora is None:
        return None
    head = model.vocab_size * model.hidden_size if head_trains(model, lora) else 0
    return adapter_params(model, lora) + head


def norm_bytes_per_token(
    model: ModelSpec, lora: LoraPlan | None, compute_bytes: int, *, output_kept: bool
) -> int:
    """What one RMSNorm keeps per token (rsqrt aside): its fp32 input ``4 h``, its normalized input ``B h``
    when its weight trains (for that weight's gradient), its output ``B h`` when a consumer keeps it
    (``output_kept``); full training: ``h (4 + 2 B)``."""
    h, B = model.hidden_size, compute_bytes
    trains = lora is None or lora.train_embeddings_and_norms
    return 4 * h + (B * h if trains else 0) + (B * h if output_kept else 0)


def layer_lora_bytes(
    model: ModelSpec, lora: LoraPlan, ulysses_degree: int, compute_bytes: int, *, routed: bool, tiled: bool
) -> dict[str, int]:
    """What LoRA changes in one decoder layer's saved activations per local token (module docstring), as the
    keys :func:`usp.plan.memory.activation_bytes_per_token_layer` sums: ``input_norm`` and ``post_norm`` (each
    norm's :func:`norm_bytes_per_token`), ``o_proj_input`` (the all-to-all's result kept for o_proj under
    Ulysses: ``H d B`` when o_proj is adapted), ``down_input`` (``I B`` when down_proj is adapted) and
    ``adapters`` (``r B`` for each adapted layer's ``B``; tiled, only o_proj's: the others run inside
    checkpointed tiles). A MoE layer's post-attention norm keeps its output (the router and experts read it)."""
    B = compute_bytes
    adapted = adapted_linears(model, lora, routed)
    qkv = any(n in adapted for n in ("q_proj", "k_proj", "v_proj"))
    mlp_in = routed or any(n in adapted for n in ("gate_proj", "up_proj"))
    o_adapted = "o_proj" in adapted
    return {
        "input_norm": norm_bytes_per_token(model, lora, B, output_kept=qkv),
        "post_norm": norm_bytes_per_token(model, lora, B, output_kept=mlp_in),
        "o_proj_input": model.num_heads * model.head_dim * B if ulysses_degree > 1 and o_adapted else 0,
        "down_input": model.intermediate_size * B if "down_proj" in adapted and not routed else 0,
        "adapters": lora.rank * B * (int(o_adapted) if tiled else len(adapted)),
    }


__all__ = [
    "ATTENTION_LINEARS",
    "MLP_LINEARS",
    "LoraPlan",
    "adapted_linears",
    "adapter_layer_params",
    "adapter_params",
    "gathered_layer_params",
    "head_trains",
    "layer_linears",
    "layer_lora_bytes",
    "matmul_params",
    "norm_bytes_per_token",
    "root_grad_matrix",
    "target_names",
    "total_params",
    "trainable_decoder_params",
    "trainable_layer_params",
    "trainable_matmul_params",
    "trainable_params",
    "trainable_root_params",
]
