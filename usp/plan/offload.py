"""What offloading costs: host memory per node, copies over the host link, and the optimizer step on the host.

Three things can live in host memory (``B`` the compute dtype's size, ``s`` local tokens, ``P`` parameters,
``shard`` the FSDP shard degree):

- checkpoint offload (``parallel.activation_checkpointing=offload``): every layer's input, ``L x s x h x B``
  per rank, in one pinned arena of exactly those bytes (:class:`usp.train.checkpoint_offload.HostCheckpointStore`). Each is copied out after its layer's forward and back before its recompute;
  a copy overlaps the compute of a neighbouring layer (the next layer's forward; the current layer's recompute
  and backward), so per layer and direction only ``max(0, copy - compute)`` adds to the step;
- offloaded states (FSDP2 CPU offload: ``optim.name=deepspeed_cpu_adam`` or ``adamw_cpu_offload``, or
  ``parallel.cpu_offload=true``): the fp32 parameter, gradient and Adam moments, 16 B per parameter shard,
  the parameter and gradient shards pinned one block each, as torch's caching host allocator rounds them
  (:func:`offloaded_state_bytes`).
  Every micro step copies the fp32 parameter shard in for the forward and the backward all-gathers and the
  gradient shard out, behind compute like the all-gathers themselves; then the optimizer steps on the host,
  which nothing overlaps (the next forward needs the parameters).

LoRA (:attr:`usp.plan.layout.Workload.lora`): every parameter shard (the adapters' too) is pinned and copied in
as above, but only the trainable parameters have gradient shards, Adam moments and a host Adam step
(:mod:`usp.plan.lora`).

The host Adam step reads parameter, gradient, ``m`` and ``v`` and writes parameter, ``m``, ``v``: 28 B per
parameter, bound by the node's DRAM bandwidth (``DeviceSpec.host_mem_gbps``) over all of its ranks' shards
(what DeepSpeed's vectorized ``DeepSpeedCPUAdam`` approaches; torch's AdamW on the host is slower and not
modelled apart).
A GPU's copies run at ``min(host_link_gbps, host_mem_gbps / ranks per node)``: the GPUs of a node copy at
the same time and share its DRAM. Usable host memory is :data:`HOST_USABLE_FRAC` of ``host_mem_gib`` (the
operating system, the data loader and the Python processes keep the rest).
"""

from __future__ import annotations

import math
from typing import Any

from usp.plan.hardware import GB, GIB, DeviceSpec
from usp.plan.layout import Candidate, Workload, from_keywords
from usp.plan.lora import LoraPlan, adapted_linears, total_params, trainable_params
from usp.plan.memory import checkpointed_layers, shard_degree
from usp.plan.models import ModelSpec

HOST_USABLE_FRAC = 0.85
HOST_ADAM_BYTES_PER_PARAM = 28  # read param, grad, m, v (fp32); write param, m, v
OFFLOAD_OPTIMIZER = "deepspeed_cpu_adam"
"""The ``optim.name`` the planner proposes for states and step on the host (``DeepSpeedCPUAdam``)."""


def host_bytes(work: Workload, cand: Candidate) -> dict[str, float]:
    """Host bytes of one rank (``checkpoints``, ``states``, ``rank``) and of one node (``node``)."""
    model = work.model
    s = work.seq_len / (cand.ulysses_degree * cand.ring_degree) * work.micro_batch_size
    ckpt = 0.0
    if cand.activation_checkpointing == "offload":
        n = checkpointed_layers(model.num_layers, cand.activation_checkpointing)
        ckpt = n * s * model.hidden_size * work.compute_bytes
    shard = shard_degree(cand.world_size, cand.node_size, cand.fsdp_mode)
    states = offloaded_state_bytes(model, shard, work.lora) if cand.states_on_host else 0.0
    rank = ckpt + states
    return {
        "checkpoints": ckpt,
        "states": states,
        "rank": rank,
        "node": rank * min(cand.node_size, cand.world_size),
    }


def pinned_block_bytes(nbytes: float) -> float:
    """What torch's caching host allocator takes for one pinned allocation: ``nbytes`` rounded up to a power
    of two (``CachingHostAllocator``); FSDP2's CPU offload pins every parameter shard and gradient this way."""
    return float(2 ** math.ceil(math.log2(nbytes))) if nbytes > 0 else 0.0


def offloaded_state_bytes(model: ModelSpec, shard: int, lora: LoraPlan | None = None) -> float:
    """Host bytes of one rank's states under FSDP2 CPU offload: each fp32 parameter shard and its fp32 gradient
    shard pinned (each its own block, rounded by :func:`pinned_block_bytes`), the Adam moments ``m, v`` in
    plain host memory (8 B per parameter of the shard). A MoE layer's tensors: transformers' (router
    ``[E, h]``, stacked experts ``gate_up [E, 2 I_e, h]`` and ``down [E, h, I_e]``, their biases, the shared
    experts' projections). ``lora``: the adapters' ``A [r, in]`` and ``B [out, r]`` pinned too; gradient shards
    and moments for the trainable tensors only (the adapters, and the embedding and norms when they train)."""
    if lora is not None:
        return _lora_offloaded_state_bytes(model, shard, lora)
    h, d, inter, V = model.hidden_size, model.head_dim, model.intermediate_size, model.vocab_size
    layer = [h * model.num_heads * d] * 2 + [h * model.num_kv_heads * d] * 2 + [h * inter] * 3 + [h] * 2
    root = [V * h] * (1 if model.tie_word_embeddings else 2) + [h]
    if model.moe is None:
        pinned = sum(pinned_block_bytes(4 * math.ceil(n / shard)) for n in layer) * model.num_layers
    else:  # a MoE layer's tensors in place of the MLP's: router, the experts' stacked weights, shared experts
        m = model.moe
        E, I_e, I_s = m.num_experts, m.expert_intermediate_size, m.shared_intermediate_size
        moe = layer[:4] + [h] * 2 + [E * h] + [E * 2 * I_e * h, E * h * I_e]
        moe += ([E] if m.router_bias else []) + ([E * 2 * I_e, E * h] if m.expert_bias else [])
        moe += ([h * I_s] * 3 if I_s else []) + ([h] if m.shared_expert_gate else [])
        kind_bytes = {
            kind: sum(pinned_block_bytes(4 * math.ceil(n / shard)) for n in (moe if kind else layer))
            for kind in (False, True)
        }
        pinned = sum(kind_bytes[kind] for kind in m.layers)
    pinned += sum(pinned_block_bytes(4 * math.ceil(n / shard)) for n in root)
    return 2 * pinned + 8 * model.num_params / shard


def _lora_offloaded_state_bytes(model: ModelSpec, shard: int, lora: LoraPlan) -> float:
    """:func:`offloaded_state_bytes` with LoRA: every parameter shard pinned as in full training (the base's
    blocks, the adapters'), a pinned gradient shard for each trainable tensor, Adam moments of the trainable
    parameters."""
    h, V = model.hidden_size, model.vocab_size

    def pinned(sizes: list[int]) -> float:
        return sum(pinned_block_bytes(4 * math.ceil(n / shard)) for n in sizes)

    # full training pins one parameter block and one gradient block per tensor: half of it is the parameters
    base = (offloaded_state_bytes(model, shard) - 8 * model.num_params / shard) / 2
    per_kind = {
        kind: pinned(
            [
                n
                for i, o in adapted_linears(model, lora, kind).values()
                for n in (lora.rank * i, lora.rank * o)
            ]
        )
        for kind in set(model.layer_kinds)
    }
    adapters = sum(per_kind[kind] for kind in model.layer_kinds)  # A and B of every adapted layer
    grads = adapters
    if lora.train_embeddings_and_norms:  # the embedding's (a tied LM head's with it) and every norm's
        grads += pinned([V * h]) + pinned([h] * (2 * model.num_layers + 1))
    return base + adapters + grads + 8 * trainable_params(model, lora) / shard


def usable_host_bytes(device: DeviceSpec) -> float:
    """Host memory one node can give the job (:data:`HOST_USABLE_FRAC` of ``host_mem_gib``)."""
    return HOST_USABLE_FRAC * device.host_mem_gib * GIB


def host_link_gbps(device: DeviceSpec, ranks_per_node: int) -> float:
    """One GPU's host copy bandwidth while all ranks of its node copy: the link, or its share of the DRAM."""
    return min(device.host_link_gbps, device.host_mem_gbps / max(1, ranks_per_node))


def offload_seconds(
    work: Workload, cand: Candidate, device: DeviceSpec, *, layer_fwd_s: float = 0.0, layer_bwd_s: float = 0.0
) -> dict[str, float]:
    """Seconds the offloads add (module docstring).

    ``layer_fwd_s`` / ``layer_bwd_s``: one layer's forward, and its recompute + backward, on this rank (what
    a checkpoint copy hides behind). Returns ``ckpt_copy_s`` (one layer's copy, one direction),
    ``ckpt_offload_exposed_s`` (per micro step), ``fsdp_offload_s`` (per micro step, to add to the FSDP
    traffic that hides behind compute), and per optimizer step ``host_adam_s``.
    """
    model = work.model
    ranks = min(cand.node_size, cand.world_size)
    bw = host_link_gbps(device, ranks) * GB
    s = work.seq_len / (cand.ulysses_degree * cand.ring_degree) * work.micro_batch_size
    out = {
        "ckpt_copy_s": 0.0,
        "ckpt_offload_exposed_s": 0.0,
        "fsdp_offload_s": 0.0,
        "host_adam_s": 0.0,
    }
    if cand.activation_checkpointing == "offload":
        copy = s * model.hidden_size * work.compute_bytes / bw
        L = model.num_layers
        out["ckpt_copy_s"] = copy
        out["ckpt_offload_exposed_s"] = L * (max(0.0, copy - layer_fwd_s) + max(0.0, copy - layer_bwd_s))
    shard = shard_degree(cand.world_size, cand.node_size, cand.fsdp_mode)
    shard_params = model.num_params / shard
    if cand.states_on_host and work.lora is not None:  # every parameter copied in, trainable gradients out
        trained = trainable_params(model, work.lora) / shard
        out["fsdp_offload_s"] = (2 * total_params(model, work.lora) / shard + trained) * 4 / bw
        out["host_adam_s"] = trained * ranks * HOST_ADAM_BYTES_PER_PARAM / (device.host_mem_gbps * GB)
    elif cand.states_on_host:
        out["fsdp_offload_s"] = shard_params * 4 * 3 / bw  # param shard in (forward, backward), grad out
        node_params = shard_params * ranks
        out["host_adam_s"] = node_params * HOST_ADAM_BYTES_PER_PARAM / (device.host_mem_gbps * GB)
    return out


# Keyword forms (the public API): the fields of a Workload and a Candidate as keywords (from_keywords).


def host_memory(model: ModelSpec, **keywords: Any) -> dict[str, float]:
    """:func:`host_bytes` of the workload and layout these keywords describe (:func:`usp.plan.layout.from_keywords`:
    ``seq_len``, the degrees, ``world_size``, ``node_size``, ...); ``states_on_host=True`` puts the sharded states on
    the host."""
    return host_bytes(*from_keywords(model, Candidate, **keywords))


def offload_time(
    model: ModelSpec,
    device: DeviceSpec,
    *,
    layer_fwd_s: float = 0.0,
    layer_bwd_s: float = 0.0,
    **keywords: Any,
) -> dict[str, float]:
    """:func:`offload_seconds` of the workload and layout these keywords describe (as :func:`host_memory`)."""
    work, cand = from_keywords(model, Candidate, **keywords)
    return offload_seconds(work, cand, device, layer_fwd_s=layer_fwd_s, layer_bwd_s=layer_bwd_s)
