"""Peak memory of one rank during a training step, item by item.

Precision assumed (FSDP2 mixed precision, what ``usp.train`` runs): fp32 sharded parameters, fp32 sharded
gradients and two fp32 Adam moments (16 bytes per parameter, divided by the shard degree); bf16 parameters
all-gathered for compute; bf16 activations; fp32 gradient reduction.

Saved activations of one Llama decoder layer, per local token, in bytes (``B`` the compute dtype's size, ``h``
hidden, ``H`` query heads, ``d`` head dim, ``I`` MLP width, ``kv = max(KV heads, ulysses_degree)`` after GQA
replication), as autograd keeps them for the Hugging Face layer (measured in ``tests/test_plan_memory.py``)::

    2 h (4 + 2B)     each RMSNorm: its input upcast to fp32, the normalized input, the output (= next matmul input)
    (H + 2kv) d B    q, k, v after the all-to-all (kept by the attention kernel)
    H d B (x2 if U>1) attention output (kept by the kernel); the o_proj input is a view of it, or with
                     Ulysses the separate result of the all-to-all back
    4 H + 8          log-sum-exp and the two norms' rsqrt, fp32
    4 I B            gate, up, silu(gate), silu(gate) * up

Outside the layers a forward keeps the rotary tables (cos and sin, ``2 d B`` per token, shared by every layer)
and the final RMSNorm's ``h (4 + 2B)`` (as a layer's norm; its output is what the chunked loss keeps). The
loss's last chunk is not recomputed (its backward comes first): it keeps its fp32 log-probabilities, ``4 V`` per
token of that chunk, until the backward starts.

With ``full`` checkpointing a layer keeps only its input (``h``) and one layer is recomputed at a time.
With ``offload`` those inputs live in host memory: the device holds :data:`OFFLOAD_DEVICE_CHECKPOINTS` of them
(the one being copied out or prefetched back, and the one in use) instead of ``L``.

With ``mlp_tiles = T > 1`` (:mod:`usp.train.tiling`) every RMSNorm is fused into its consumers, which run
over the sequence in ``T`` tiles and recompute each tile in backward: the post-attention norm and the MLP in
one tile (keeping the residual stream, ``B h``), the input norm inside each of the q/k/v projections (keeping
the layer input, ``B h``), the final norm inside the loss chunks (keeping the pre-norm hidden, ``B h``). A
layer keeps ``2 B h + (H + 2kv) d B + H d B (x2 if U>1) + 4 H`` per token: no norm output, nothing of the
MLP, no rsqrt; one MLP tile's ``4 I B s / T`` exists at a time. Of those ``2 B h``, the layer input is the
checkpoint's own when the layer is checkpointed: the recomputed layer adds ``B h`` less (measured in
``tests/test_plan_memory.py``).

Gathered parameters (FSDP2, more than one rank or states on the host): through every layer's backward, the
current layer and the prefetched one in ``B`` bytes, the layer's gradients in ``B`` bytes and the fp32
reduce-scatter input of the layer above (one unsharded layer gradient), and the root unit
(embedding, final norm, LM head), which FSDP2 does not reshard after forward and reduce-scatters only after the
whole backward: its parameters in ``B`` bytes and the LM head's ``[V, h]`` gradient.

Sharded states: 16 B per parameter on the device; with them offloaded (``offload``: FSDP2 CPU offload, what
``parallel.cpu_offload=true`` and an ``optim.name`` that steps on the host both select) nothing stays on the
device between uses.

LoRA on a frozen base (:attr:`usp.plan.layout.Workload.lora`, :mod:`usp.plan.lora`): every parameter stays an
fp32 shard (``4 B`` per parameter, the adapters' too) and is gathered as above; the gradients (compute dtype, the
fp32 reduce-scatter input, the fp32 shards) and the Adam moments exist for the trainable parameters only (``12 B``
per trainable parameter, ``8 B`` before the backward); a frozen LM head has no ``[V, h]`` gradient. A layer keeps
what :func:`usp.plan.lora.layer_lora_bytes` says in place of the norms' and projections' inputs above: no
normalized input of a frozen norm, no input no adapted layer reads, and ``r B`` per adapter (measured in
``tests/test_plan_lora.py``).

Mixture-of-experts layers (:class:`usp.plan.models.MoESpec`: ``E`` experts, ``k`` per token, expert width
``I_e``, shared experts ``I_s``) keep, per local token, in place of the dense MLP's ``4 I B``, what
transformers' ``grouped_mm`` experts (its default) and the family's router save (measured in
``tests/test_plan_moe.py``)::

    4 E              router probabilities over every expert, fp32 (softmax output; gpt-oss: B k, a softmax
                     over the k chosen logits)
    8 k              the top-k indices, int64
    4 k + 4          the fp32 top-k probabilities and their sum, when renormalized (norm_topk_prob, Mixtral)
    8 k (3 + b)      int64 [T k]: the sort by expert, each copy's token, the inverse permutation (and, with
                     expert biases, b = 1, each copy's expert)
    2 k h B          the token copies sorted by expert (the grouped matmuls' input), the experts' outputs
    w k              each copy's routing weight (w = 4 when the family keeps them fp32: Mixtral; else B)
    a k I_e B        each copy's expert intermediates: a = 4 for SwiGLU (gate_up 2 I_e, silu(gate), the
                     product), 7 for gpt-oss's clamped GLU
    4 I_s B          the shared experts (a dense MLP), + h B + B with Qwen2-MoE's sigmoid gate

(and ``4 E`` bytes per layer, not per token: the int32 group offsets). Llama 4's block in transformers
(:attr:`usp.plan.models.MoESpec.every_expert_runs`) runs every expert on every token instead, and keeps
``4 E + 8 k`` (the fp32 sigmoid scores over every expert, the top-k indices), ``E B`` (each copy's score),
``2 E h B`` (the input repeated ``E`` times and its scaled copy), ``4 E I_e B`` (every expert's SwiGLU) and its
shared expert's ``4 I_s B`` (measured in ``tests/test_plan_moe.py``): ``E`` copies where the grouped experts
keep ``k``, no index tensors, no group offsets. Only the MoE layers keep this; a model's dense layers (Llama
4's layers not in ``moe_layers``) keep the dense MLP's ``4 I B`` of their own width. Under checkpointing a MoE layer keeps
its input like any layer and the recomputed one holds the above. A family with a router load-balancing loss
(:attr:`MoESpec.router_aux_loss`; :mod:`usp.train.router_loss`) also keeps, per token and MoE layer, whatever
the checkpointing, the router logits ``E B`` (recorded with their graph until the loss) and the loss's fp32
softmax ``4 E`` (at the layer peaks the logits' waiting gradients take that place): held item ``router``. A
MoE layer's backward (:func:`moe_backward_bytes_per_token`, an estimate, not measured) allocates at its peak
the experts' output gradient ``k h B`` and, at the product's backward, the gradients of silu(gate) and up
``2 k I_e B`` (and ``2 I_s B`` for the shared experts; ``E`` copies for Llama 4's), where the dense MLP's
allocates ``2 I B``. MLP tiles
are refused for MoE layers, as the trainer refuses them. Gathered parameters: one decoder layer with all of
its experts (:attr:`ModelSpec.layer_params`), so a MoE's per-layer gathers are its total parameters.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

from usp.mlp_tiles import check_mlp_tiles_setting, resolve_mlp_tiles
from usp.modes import AC_MODES
from usp.plan.attention_memory import attention_backward_bytes, attention_phase_bytes_per_token
from usp.plan.comm import ACT_BYTES
from usp.plan.hardware import GIB, DeviceSpec
from usp.plan.layout import Candidate, Workload, from_keywords
from usp.plan.lora import (
    LoraPlan,
    gathered_layer_params,
    head_trains,
    layer_lora_bytes,
    norm_bytes_per_token,
    root_grad_matrix,
    total_params,
    trainable_decoder_params,
    trainable_layer_params,
    trainable_params,
    trainable_root_params,
)
from usp.plan.models import ModelSpec

STATE_BYTES_PER_PARAM = 16  # fp32 master param + fp32 grad + Adam m and v
FRAGMENTATION_FRAC = 0.05
"""Allocator fragmentation allowance on top of the tensor peak, with ``expandable_segments:True`` (which usp
sets, :func:`usp.parallel.process_group.configure_cuda_allocator`): segments grow in place, so what is lost
is the rounding of blocks and the blocks cached on side streams."""
NCCL_GIB_PER_GROUP = 0.5
"""Device memory of one NCCL communicator (a process group that runs collectives), GiB: NCCL's channel buffers
(``NCCL_BUFFSIZE`` 4 MiB per channel, per peer and direction, ``NCCL_MAX_NCHANNELS`` up to 32 on H100
NVLink: 2 x 32 x 4 MiB = 256 MiB for a ring's two peers) plus its proxy and NVLink SHARP (NVLS) buffers on
NVSwitch systems; NCCL's environment-variable documentation. A planning figure, to be checked against
``torch.cuda.mem_get_info`` around the first collectives on a GPU (``scripts/gpu_check.sh``)."""
OFFLOAD_DEVICE_CHECKPOINTS = 2  # checkpoint offload: the layer input in flight + the one in use


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes per rank at the peak of a training step."""

    sharded_states: float
    gathered_params: float
    activations: float
    attention_workspace: float
    loss_buffer: float
    overhead: float

    def items(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) for f in fields(self)}  # (asdict deep-copies: slow in a search)

    @property
    def total(self) -> float:
        return sum(self.items().values())

    @property
    def total_gib(self) -> float:
        return self.total / GIB

    def as_gib(self) -> dict[str, float]:
        return {k: v / GIB for k, v in self.items().items()} | {"total": self.total_gib}


def activation_bytes_per_token_layer(
    model: ModelSpec,
    ulysses_degree: int,
    compute_bytes: int = ACT_BYTES,
    tiled: bool = False,
    routed: bool | None = None,
    lora: LoraPlan | None = None,
    mixer: bool = False,
    sp_degree: int | None = None,
) -> float:
    """Saved activations of one decoder layer per local token, in bytes (module docstring).

    ``tiled`` (``mlp_tiles > 1``, :mod:`usp.train.tiling`): the RMSNorms are recomputed per tile by their
    consumers, so the layer keeps its input (``B h``, for the q/k/v tiles) and the residual after attention
    (``B h``, for the norm + MLP tiles) instead of ``2 h (4 + 2B)``, two rsqrt and the MLP's ``4 I B``.
    ``routed``: a MoE layer (its block's :func:`moe_bytes_per_token` in place of the MLP's) or a dense one;
    None: the model's larger kind (dense models: the dense layer). ``lora``: adapters on a frozen base
    (:func:`usp.plan.lora.layer_lora_bytes`: the norms, the o_proj and down_proj inputs, the adapters).
    ``mixer``: a hybrid model's mixer layer (:meth:`usp.plan.mixers.MixerSpec.kept_bytes_per_token` in place of
    attention's, over ``sp_degree`` ranks: ``ulysses x ring``, default ``ulysses_degree``)."""
    if routed is None:
        return max(
            activation_bytes_per_token_layer(
                model, ulysses_degree, compute_bytes, tiled, kind, lora, mix, sp_degree
            )
            for kind, mix in set(model.layer_keys)
        )
    h, d, H, B = model.hidden_size, model.head_dim, model.num_heads, compute_bytes
    if mixer and model.mixer is not None:  # no tiles or LoRA on hybrids (check_hybrid)
        kept = model.mixer.kept_bytes_per_token(sp_degree or ulysses_degree, h, B)
        mlp = moe_bytes_per_token(model, B) if routed else mlp_bytes_per_token(model, B)
        return 2 * h * (4 + 2 * B) + kept + 8 + mlp
    kv = model.kv_heads_per_rank(ulysses_degree) * ulysses_degree  # max(Hkv, U) when even
    if lora is not None:
        part = layer_lora_bytes(model, lora, ulysses_degree, B, routed=routed, tiled=tiled)
        attention = (H + 2 * kv) * d * B + H * d * B + part["o_proj_input"]
        if tiled:
            return 2 * h * B + attention + 4 * H + part["adapters"]
        norms = part["input_norm"] + part["post_norm"]
        mlp = (
            moe_bytes_per_token(model, B) if routed else 3 * model.intermediate_size * B + part["down_input"]
        )
        return norms + attention + 4 * H + 8 + mlp + part["adapters"]
    attention = (H + 2 * kv) * d * B + H * d * B * (2 if ulysses_degree > 1 else 1)
    if tiled:
        return 2 * h * B + attention + 4 * H
    norms = 2 * h * (4 + 2 * B)
    mlp = moe_bytes_per_token(model, compute_bytes) if routed else mlp_bytes_per_token(model, compute_bytes)
    return norms + attention + 4 * H + 8 + mlp


def mlp_bytes_per_token(model: ModelSpec, compute_bytes: int = ACT_BYTES) -> int:
    """What the MLP keeps per token for backward: gate, up, silu(gate), silu(gate) * up (``4 I B``)."""
    return 4 * model.intermediate_size * compute_bytes


def moe_bytes_per_token(model: ModelSpec, compute_bytes: int = ACT_BYTES) -> int:
    """What a MoE layer's router and experts keep per token for backward (module docstring; 0 when dense)."""
    m = model.moe
    if m is None:
        return 0
    E, k, h, B = m.num_experts, m.top_k, model.hidden_size, compute_bytes
    router = 4 * E if m.router_softmax == "all" else B * k  # softmax output over every expert / the top-k
    router += 8 * k + (4 * k + 4 if m.norm_topk_prob else 0)  # top-k indices; renormalized weights and sum
    if m.every_expert_runs:  # E copies of each token, each scaled by its score (0 unless chosen): no indices
        copies = E
        dispatch = 2 * E * h * B + (4 if m.routing_weights_fp32 else B) * E
    else:
        copies = k
        dispatch = (
            8 * k * (3 + m.expert_bias) + 2 * k * h * B
        )  # index tensors; token copies in, expert outputs
        dispatch += (4 if m.routing_weights_fp32 else B) * k  # each copy's routing weight
    experts = m.expert_widths * copies * m.expert_intermediate_size * B
    shared = 4 * m.shared_intermediate_size * B + ((h + 1) * B if m.shared_expert_gate else 0)
    return router + dispatch + experts + shared


def moe_backward_bytes_per_token(model: ModelSpec, compute_bytes: int = ACT_BYTES) -> int:
    """What a MoE layer's block backward allocates at its peak per token (module docstring; an estimate):
    the experts' output gradient ``k h B``, the gradients of silu(gate) and up ``2 k I_e B`` (``E`` copies
    when every expert runs), and the shared experts' ``2 I_s B``."""
    m = model.moe
    if m is None:
        return 0
    B = compute_bytes
    copies = m.num_experts if m.every_expert_runs else m.top_k
    return (
        copies * (model.hidden_size + 2 * m.expert_intermediate_size) * B + 2 * m.shared_intermediate_size * B
    )


def router_held_bytes_per_token(model: ModelSpec, compute_bytes: int = ACT_BYTES) -> int:
    """What a family's router load-balancing loss keeps per local token over all MoE layers, whatever the
    checkpointing: the recorded logits ``E B`` and the loss's fp32 softmax ``4 E`` per MoE layer (module
    docstring); 0 when dense or without that loss."""
    m = model.moe
    if m is None or not m.router_aux_loss:
        return 0
    return m.num_moe_layers * m.num_experts * (compute_bytes + 4)


def check_hybrid(model: ModelSpec, mlp_tiles: int | None, lora: LoraPlan | None) -> None:
    """``ValueError`` when MLP tiles or LoRA are asked of a hybrid model: the planner does not model either
    beside mixer layers (:mod:`usp.plan.mixers`)."""
    if model.mixer is None:
        return
    if mlp_tiles is not None and mlp_tiles != 1:
        raise ValueError(
            f"parallel.mlp_tiles={mlp_tiles}: the planner does not model MLP tiles on a hybrid model's mixer "
            "layers; plan with parallel.mlp_tiles=1."
        )
    if lora is not None:
        raise ValueError(
            "model.lora.rank > 0: the planner does not model LoRA on a hybrid model's mixer layers; plan full "
            "training (model.lora.rank=0) or set the degrees yourself."
        )


def check_moe_tiles(model: ModelSpec, mlp_tiles: int | None) -> None:
    """``ValueError`` when MLP tiles are asked of a mixture-of-experts model (the trainer refuses them,
    :func:`usp.train.parallelize.parallelize`)."""
    if model.is_moe and mlp_tiles is not None and mlp_tiles != 1:
        raise ValueError(
            f"parallel.mlp_tiles={mlp_tiles}: MLP tiles are not supported for mixture-of-experts layers (the "
            "router's loss needs the routing graph that tiling drops); set parallel.mlp_tiles=1."
        )


def checkpointed_layer_indices(num_layers: int, activation_checkpointing: str, ac_every_k: int = 2) -> range:
    """The decoder layers that keep only their input (:func:`checkpointed_layers` of them): all, none, or
    under ``every_k`` layers ``0, k, 2k, ...`` (:mod:`usp.train.parallelize`)."""
    n = checkpointed_layers(num_layers, activation_checkpointing, ac_every_k)
    if activation_checkpointing == "every_k":
        return range(0, num_layers, ac_every_k)
    return range(n)


def check_mlp_tiles(mlp_tiles: int, local_tokens: float) -> None:
    """``parallel.mlp_tiles`` must be an integer >= 1 that splits the local tokens evenly (the rule and its
    messages: :mod:`usp.mlp_tiles`; the planner costs resolved counts, so ``auto`` is refused here)."""
    if mlp_tiles == "auto" or isinstance(mlp_tiles, str):
        raise ValueError(
            f"parallel.mlp_tiles={mlp_tiles!r}: the planner costs a tile count (an integer >= 1)."
        )
    check_mlp_tiles_setting(mlp_tiles)
    if mlp_tiles > 1 and local_tokens % mlp_tiles:
        if local_tokens == int(local_tokens):
            resolve_mlp_tiles(
                mlp_tiles, local_tokens=int(local_tokens), hidden_size=1
            )  # raises, naming divisors
        raise ValueError(
            f"parallel.mlp_tiles={mlp_tiles} does not divide the {local_tokens:g} local tokens per rank; use a "
            "divisor of seq_len / (ulysses_degree x ring_degree)."
        )


def device_states_bytes(
    model: ModelSpec, shard: int, *, states_on_host: bool = False, lora: LoraPlan | None = None
) -> float:
    """Sharded parameters, gradients and optimizer states left on one device (module docstring); with ``lora``
    the fp32 parameters of the base and the adapters, the gradients and Adam moments of the trainable ones."""
    if states_on_host:
        return 0.0
    if lora is not None:
        return (4 * total_params(model, lora) + 12 * trainable_params(model, lora)) / shard
    return model.num_params * STATE_BYTES_PER_PARAM / shard


# Keyword forms: the public API, the fields of a Workload and a Candidate as keywords (from_keywords). The
# planner itself passes the records to the functions below.


def held_activation_bytes(model: ModelSpec, **keywords: Any) -> dict[str, float]:
    """:func:`held_bytes` of the workload and layout these keywords describe (:func:`usp.plan.layout.from_keywords`:
    ``seq_len``, ``ulysses_degree``, ``ring_degree``, ``activation_checkpointing``, ``mlp_tiles``, ...). No
    sharding enters the held bytes: ``world_size`` and ``node_size`` default to ``ulysses_degree x ring_degree``."""
    ranks = keywords.get("ulysses_degree", 1) * keywords.get("ring_degree", 1)
    return held_bytes(
        *from_keywords(model, Candidate, **({"world_size": ranks, "node_size": ranks} | keywords))
    )


def training_memory(model: ModelSpec, device: DeviceSpec, **keywords: Any) -> MemoryBreakdown:
    """:func:`peak_memory` of the workload and layout these keywords describe (:func:`usp.plan.layout.from_keywords`:
    ``seq_len``, the degrees, ``world_size``, ``node_size``, ``activation_checkpointing``, ``mlp_tiles``,
    ``compute_bytes``, ...); ``states_on_host=True`` puts the sharded states on the host."""
    work, cand = from_keywords(model, Candidate, **keywords)
    return peak_memory(work, cand, device)


def held_bytes(work: Workload, cand: Candidate) -> dict[str, float]:
    """Bytes autograd keeps on the device at the end of a training forward, per rank (what
    :func:`usp.bench.track_memory.track_memory` measures as held bytes): ``layers`` (every saved activation of the
    layers that are not checkpointed, the input of those that are, nothing of the inputs ``offload`` moved to
    the host), ``rotary`` (cos and sin), ``final_norm`` (what the final norm and the loss keep: with tiles
    only the pre-norm hidden, ``B h`` per token) and ``loss_chunk`` (the loss's last chunk, which is not
    recomputed: its fp32 log-probabilities ``4 V`` per token, and under tiles its final norm's tensors); a MoE model also ``router`` (what its router loss keeps,
    :func:`router_held_bytes_per_token`); ``total`` their sum."""
    model, seq_len, micro_batch_size, compute_bytes = (
        work.model,
        work.seq_len,
        work.micro_batch_size,
        work.compute_bytes,
    )
    ulysses_degree, ring_degree = cand.ulysses_degree, cand.ring_degree
    activation_checkpointing, ac_every_k, mlp_tiles = (
        cand.activation_checkpointing,
        cand.ac_every_k,
        cand.mlp_tiles,
    )
    B, h = compute_bytes, model.hidden_size
    s = seq_len / (ulysses_degree * ring_degree) * micro_batch_size
    check_mlp_tiles(mlp_tiles, s)
    check_moe_tiles(model, mlp_tiles)
    check_hybrid(model, mlp_tiles, work.lora)
    tiled = mlp_tiles > 1
    n_ckpt = checkpointed_layers(model.num_layers, activation_checkpointing, ac_every_k)
    inputs = 0 if activation_checkpointing == "offload" else n_ckpt
    lora = work.lora
    if model.moe is None and model.mixer is None:
        per_layer = activation_bytes_per_token_layer(model, ulysses_degree, B, tiled, lora=lora)
        kept = (model.num_layers - n_ckpt) * per_layer
    else:  # each layer not checkpointed keeps its own kind's activations
        ckpt = set(checkpointed_layer_indices(model.num_layers, activation_checkpointing, ac_every_k))
        sp = ulysses_degree * ring_degree
        per_kind = {
            (routed, mix): activation_bytes_per_token_layer(
                model, ulysses_degree, B, tiled, routed, lora, mixer=mix, sp_degree=sp
            )
            for routed, mix in set(model.layer_keys)
        }
        kept = sum(per_kind[key] for i, key in enumerate(model.layer_keys) if i not in ckpt)
    # the final norm: its output is the loss chunks' input; a frozen one keeps no normalized input
    final_norm = h * B if tiled else norm_bytes_per_token(model, lora, B, output_kept=True)
    # the loss's last chunk is not recomputed (usp.train.loss): it keeps its fp32 log-probabilities and, under
    # tiles, what its final norm keeps
    last_chunk = s - (math.ceil(s / work.loss_chunk_size) - 1) * work.loss_chunk_size
    last_chunk_per_token = 4 * model.vocab_size
    if tiled:
        last_chunk_per_token += norm_bytes_per_token(model, lora, B, output_kept=True)
    out = {
        "layers": (kept + inputs * h * B) * s,
        "rotary": 2 * model.head_dim * B * s,
        "final_norm": final_norm * s,
        "loss_chunk": last_chunk_per_token * last_chunk,
    }
    if model.moe is not None:  # the router loss's logits and softmax (module docstring)
        out["router"] = router_held_bytes_per_token(model, B) * s
    return out | {"total": sum(out.values())}


def checkpointed_layers(num_layers: int, activation_checkpointing: str, ac_every_k: int = 2) -> int:
    """How many decoder layers keep only their input (and recompute their forward in backward); under
    ``every_k`` layers ``0, k, 2k, ...`` are checkpointed."""
    if activation_checkpointing == "none":
        return 0
    if activation_checkpointing in ("full", "offload"):
        return num_layers
    if activation_checkpointing == "every_k":
        if ac_every_k < 1:
            raise ValueError(f"parallel.ac_every_k={ac_every_k} must be >= 1.")
        return -(-num_layers // ac_every_k)  # layers 0, k, 2k, ... (usp.train.parallelize): ceil(L / k)
    raise ValueError(
        f"parallel.activation_checkpointing={activation_checkpointing!r} is invalid; use {AC_MODES}."
    )


def shard_degree(world_size: int, node_size: int, fsdp_mode: str) -> int:
    """Ranks a parameter is sharded over: all of them (full_shard) or the node (hybrid_shard)."""
    if fsdp_mode == "full_shard":
        return world_size
    if fsdp_mode == "hybrid_shard":
        return min(node_size, world_size)
    raise ValueError(f"parallel.fsdp_mode={fsdp_mode!r} is invalid; choose full_shard or hybrid_shard.")


def untracked_bytes(cand: Candidate, device: DeviceSpec) -> dict[str, float]:
    """Device memory no tensor tracker sees, per rank: ``context`` (CUDA context and cuBLAS workspaces,
    :attr:`DeviceSpec.reserved_gib`) and ``nccl`` (:data:`NCCL_GIB_PER_GROUP` for each process group usp runs
    collectives on: FSDP's (two under HSDP), the Ulysses group when ``U > 1``, the ring group when ``R > 1``;
    none in a world of one)."""
    groups = 0
    if cand.world_size > 1:
        groups += 2 if cand.fsdp_mode == "hybrid_shard" and cand.world_size > cand.node_size else 1
        groups += (cand.ulysses_degree > 1) + (cand.ring_degree > 1)
    nccl = groups * NCCL_GIB_PER_GROUP * GIB if device.name != "cpu" else 0.0
    return {"context": device.reserved_gib * GIB, "nccl": nccl}


def peak_memory(work: Workload, cand: Candidate, device: DeviceSpec) -> MemoryBreakdown:
    """Peak bytes per rank on the device: the larger of the step's two peaks (module docstring), plus what no
    tracker sees (:func:`untracked_bytes`) and :attr:`Workload.overhead_frac` of the tensors for allocator
    fragmentation (with ``expandable_segments``, which usp sets). ``offload`` moves the sharded states to host
    memory (FSDP2 CPU offload); ``activation_checkpointing=offload`` keeps the layer inputs there;
    ``mlp_tiles`` runs the MLPs and norms in tiles; ``attn_head_chunks`` runs the attention over that many
    groups of heads in turn, dividing the kernel's buffers (and on a ring its K/V, dK/dV and fp32
    accumulators) by it; ``compute_bytes`` is 2 for bf16 compute, 4 for an fp32 run. Host bytes:
    :func:`usp.plan.offload.host_memory`."""
    model, seq_len, micro_batch_size, compute_bytes = (
        work.model,
        work.seq_len,
        work.micro_batch_size,
        work.compute_bytes,
    )
    loss_chunk_size, overhead_frac = work.loss_chunk_size, work.overhead_frac
    world_size, node_size, fsdp_mode, offload = (
        cand.world_size,
        cand.node_size,
        cand.fsdp_mode,
        cand.states_on_host,
    )
    activation_checkpointing, ac_every_k = cand.activation_checkpointing, cand.ac_every_k
    mlp_tiles = cand.mlp_tiles
    ulysses_degree, ring_degree = cand.ulysses_degree, cand.ring_degree
    B = compute_bytes
    U, R = ulysses_degree, ring_degree
    L = model.num_layers
    s = seq_len / (U * R) * micro_batch_size  # local tokens
    h = model.hidden_size
    check_mlp_tiles(mlp_tiles, s)
    check_moe_tiles(model, mlp_tiles)
    check_hybrid(model, mlp_tiles, work.lora)
    tiled = mlp_tiles > 1
    # per layer: a MoE layer (True) or dense; the top layer's and the bottom's below
    kinds = model.layer_kinds
    keys = model.layer_keys  # per layer: (MoE, mixer)

    shard = shard_degree(world_size, node_size, fsdp_mode)
    lora = work.lora
    # fp32 parameters and Adam moments; the fp32 gradient shards come into being during the backward, after
    # both peaks (and with gradient accumulation they live from the first micro step: counted then)
    dp = world_size // (U * R)
    accumulating = work.global_batch is not None and work.global_batch > dp
    if lora is None:
        states = device_states_bytes(model, shard, states_on_host=offload) * (16 if accumulating else 12) / 16
    else:  # every parameter's fp32 shard; the trainable ones' moments (and accumulated gradients)
        grads_and_moments = (12 if accumulating else 8) * trainable_params(model, lora)
        states = 0.0 if offload else (4 * total_params(model, lora) + grads_and_moments) / shard
    # what gets gradients (everything without LoRA: the layer's, the decoder's, the root's parameters)
    layer_trainable = trainable_layer_params(model, lora)
    decoder_trainable = trainable_decoder_params(model, lora)
    # FSDP2's compute copies: the root unit (embedding, final norm, LM head) is gathered in the compute dtype
    # for the forward and kept until the end of the backward; one decoder layer at a time is gathered (two
    # through the backward: the current one and the prefetched one); the LM head's [V, h] gradient in the compute
    # dtype, from the loss's backward to the root's reduce-scatter at the end. A world of one casts as well (an
    # fp32 run does not: the parameters are used where they live).
    casts = world_size > 1 or offload or B < 4
    root = (model.embedding_params + model.head_params + h) * B if casts else 0.0
    layer = gathered_layer_params(model, lora) * B if casts else 0.0
    head_grad = model.vocab_size * h * B if head_trains(model, lora) else 0.0

    def layer_bytes(key: tuple[bool, bool]) -> float:
        """One layer of that kind's saved activations (module docstring), all local tokens."""
        routed, mix = key
        per_token = activation_bytes_per_token_layer(
            model, U, B, tiled=tiled, routed=routed, lora=lora, mixer=mix, sp_degree=U * R
        )
        return per_token * s

    per_layer = layer_bytes(keys[-1])
    n_ckpt = checkpointed_layers(L, activation_checkpointing, ac_every_k)
    held = held_activation_bytes(
        model,
        seq_len=seq_len,
        ulysses_degree=U,
        ring_degree=R,
        activation_checkpointing=activation_checkpointing,
        ac_every_k=ac_every_k,
        mlp_tiles=mlp_tiles,
        micro_batch_size=micro_batch_size,
        compute_bytes=B,
    )
    # the top layer's backward comes first: its full activations (held, or recomputed from its checkpoint)
    # replace what it held; the layers below still hold theirs
    top_checkpointed = checkpointed_layers(L, activation_checkpointing, ac_every_k) > 0 and (
        activation_checkpointing != "every_k" or (L - 1) % ac_every_k == 0
    )
    if top_checkpointed:
        top_held = 0.0 if activation_checkpointing == "offload" else h * B * s
    else:
        top_held = 0.0
    # checkpoint offload: the input being copied out (forward) or prefetched (backward) and the one in use
    in_flight = (
        min(n_ckpt, OFFLOAD_DEVICE_CHECKPOINTS) * h * s * B if activation_checkpointing == "offload" else 0
    )
    tile = mlp_bytes_per_token(model, B) * s / mlp_tiles if tiled else 0.0
    # a MoE's router loss keeps its logits and softmax through the backward (module docstring)
    router = held.get("router", 0)
    layer_acts = held["layers"] + held["rotary"] + router

    def _attention_phase(checkpointed: bool, key: tuple[bool, bool] = (False, False)) -> float:
        """Per local token, a layer during its attention backward (its input kept by an on-device checkpoint,
        or by the tiled q/k/v projections of a layer that is not checkpointed); a mixer layer during its
        mixer's backward (what the layer keeps less its MLP's, and its input when a checkpoint keeps it)."""
        on_device = activation_checkpointing != "offload"
        if key[1]:
            mlp_part = moe_bytes_per_token(model, B) if key[0] else mlp_bytes_per_token(model, B)
            return layer_bytes(key) / s - mlp_part + (h * B if checkpointed and on_device else 0)
        keeps = (checkpointed and on_device) or (tiled and not checkpointed)
        return attention_phase_bytes_per_token(model, U, B, tiled=tiled, keeps_input=keeps, lora=lora)

    # the attention backward's allocations (usp.plan.attention_memory): the kernel's buffers and gradients, and
    # on a ring its travelling K/V and fp32 accumulators; a mixer's backward (usp.plan.mixers)
    attn_workspace = attention_backward_bytes(work, cand)

    def _workspace(key: tuple[bool, bool]) -> float:
        if key[1] and model.mixer is not None:
            return model.mixer.backward_bytes_per_token(U * R, h, B) * s
        return attn_workspace

    # peak 1, the loss's backward: one checkpointed chunk of the cross-entropy at its peak (log-softmax backward:
    # the fp32 log-probabilities it saved, their gradient and the gradient it returns, 3 x 4 B per logit), what
    # the final norm and the loss keep, every layer's held activations, the gathered top layer
    chunk = min(loss_chunk_size, s)
    # ... and the gradient of the final hidden states, which the chunks' backwards fill in (h B per token);
    # under tiles the final norm runs inside each chunk: the chunk's fp32 upcast, normalized and scaled copies
    loss = chunk * model.vocab_size * 12 + held["final_norm"] + h * B * s
    if tiled:
        loss += chunk * h * (4 + 2 * B)
    # (no offloaded input is on the device then: the forward's copies are out, the top layer's prefetch starts
    # at its backward; traced)
    peak_loss = (states, root + layer + head_grad, layer_acts, 0.0, loss)
    # peak 2, the top layer's backward (standing for any layer's: the peak layer has one above and one below):
    # its full activations, the backward's buffers, two layers gathered, the layer's gradients in the compute
    # dtype and FSDP2's fp32 reduce-scatter input of the layer above (one unsharded layer gradient, held until
    # the next post-backward; measured, docs/memory.md)
    layer_gathers = root + head_grad + 2 * layer + layer_trainable * B + 4 * layer_trainable
    # inside a layer's backward the larger of two phases (they never overlap: the MLP's backward ends before
    # the attention's begins). The MLP backward, with its recomputed activations still alive: at the product's
    # backward, the gradient of the down projection's input replaces the product it saved, and the gradients
    # of silu(gate) and of up come on top; silu_backward then writes its output in place of what it frees.
    # Under tiles that is one tile's (``2 I B s / T``) next to the tile's own saved ``4 I B s / T`` (``tile``),
    # plus the tiled MLP's input-gradient buffer over the whole local sequence (``h B s``) and, per tile, its
    # recomputed normed input, output-gradient slice and input gradient (``3 h B``) and the norm's fp32 upcast
    # (``4 h``), each ``s / T`` tokens (measured: docs/memory.md). The attention backward runs after the tile's
    # tensors are freed.
    mlp_backward = 2 * model.intermediate_size * B * s / mlp_tiles
    if tiled:
        mlp_backward += h * B * s + (3 * h * B + 4 * h) * s / mlp_tiles
    # a MoE layer's block backward instead (module docstring): the top layer's kind here, the bottom's below
    moe_backward = moe_backward_bytes_per_token(model, B) * s
    # The attention backward of the top layer: the layers below hold theirs, the top layer what its attention
    # backward still needs (usp.plan.attention_memory) in place of what it held after the forward. A hybrid
    # model's layers differ in kind: the top layer stands for each kind present, the largest peak wins.
    peak_layer = (0.0,) * 5
    for key in set(keys) if model.mixer is not None else (keys[-1],):
        full = layer_bytes(key)
        top_full_k = full - (h * B * s if tiled and activation_checkpointing != "offload" else 0.0)
        top_full_k = top_full_k if top_checkpointed else 0.0
        top_after_forward = top_held if top_checkpointed else full
        mlp_acts = layer_acts - top_held + top_full_k + in_flight + tile
        attn_acts = layer_acts - top_after_forward + _attention_phase(top_checkpointed, key) * s + in_flight
        peak_layer = max(
            peak_layer,
            (states, layer_gathers, mlp_acts, moe_backward if key[0] else mlp_backward, 0.0),
            (states, layer_gathers, attn_acts, _workspace(key), 0.0),
            key=sum,
        )
    # peak 3, the bottom layer's backward: the layers above have freed their activations but left their fp32
    # gradient shards (on the device unless the states are offloaded); the bottom layer's full activations
    if lora is None:
        bottom_params = model.params_of_layer(0)
    else:
        bottom_params = trainable_layer_params(model, lora, kinds[0])
    grads_above = 0.0 if offload else 4 * (decoder_trainable - bottom_params) / shard
    bottom_layer = per_layer
    if keys[0] != keys[-1]:
        bottom_layer = layer_bytes(keys[0])
    bottom = (
        held["rotary"]
        + bottom_layer
        - (h * B * s if tiled and n_ckpt and activation_checkpointing != "offload" else 0.0)
    )
    bottom += (h * B * s if n_ckpt and activation_checkpointing != "offload" else 0.0) + in_flight + tile
    bottom += router
    bottom_attn = held["rotary"] + _attention_phase(n_ckpt > 0, keys[0]) * s + in_flight + router
    peak_bottom = max(
        (states + grads_above, layer_gathers, bottom, moe_backward if kinds[0] else mlp_backward, 0.0),
        (states + grads_above, layer_gathers, bottom_attn, _workspace(keys[0]), 0.0),
        key=sum,
    )
    # peak 4, the root's reduce-scatter after the whole backward: every layer's fp32 gradient shard, the
    # root's gradients in the compute dtype (one left), their fp32 copies (none in an fp32 run), FSDP2's flat
    # reduce-scatter input and its output shard
    root_params = trainable_root_params(model, lora)
    grads_all = 0.0 if offload else 4 * decoder_trainable / shard
    root_grad = model.vocab_size * h * B if root_grad_matrix(model, lora) else 0.0
    reduce = root_grad + root_params * ((4 if B < 4 else 0) + 4 + 4 / shard)
    # (a MoE's router logits are still held by the loss's recorder: E B per token and MoE layer)
    logits = model.moe.num_moe_layers * model.moe.num_experts * B * s if router else 0.0
    peak_root = (states + grads_all, reduce, logits, 0.0, 0.0)
    terms = max(peak_loss, peak_layer, peak_bottom, peak_root, key=sum)
    extra = untracked_bytes(cand, device)
    overhead = overhead_frac * sum(terms) + extra["context"] + extra["nccl"]
    return MemoryBreakdown(*terms, overhead)
