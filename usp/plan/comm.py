"""Communication of one micro step: Ulysses all-to-all, ring K/V passing, FSDP all-gather / reduce-scatter.

Bytes are what one rank sends; times are bytes over the per-GPU, per-direction bandwidth of the slowest link
the collective crosses. Ulysses groups are adjacent ranks (NVLink, inside a node); ring groups are strided by
``ulysses_degree`` and cross nodes once ``ulysses x ring`` exceeds the node (then the network sets the pace).
"""

from __future__ import annotations

from usp.plan.compute import ATTN_BWD_OVER_FWD_HW, compute_time
from usp.plan.hardware import GB, DeviceSpec
from usp.plan.lora import LoraPlan, total_params, trainable_params
from usp.plan.models import ModelSpec

ACT_BYTES = 2  # bf16 activations and gathered parameters (``compute_bytes``; 4 for an fp32 run)
GRAD_REDUCE_BYTES = 4  # fp32 gradient reduce-scatter (parallel.reduce_dtype)


def kv_block_bytes(
    model: ModelSpec, seq_len: int, ulysses_degree: int, ring_degree: int, compute_bytes: int = ACT_BYTES
) -> float:
    """K and V of one rank's ring block for one layer: ``S/R`` tokens x the rank's KV heads x ``head_dim``."""
    tokens = seq_len / ring_degree
    return 2 * tokens * model.kv_heads_per_rank(ulysses_degree) * model.head_dim * compute_bytes


def ring_bandwidth_gbps(device: DeviceSpec, ulysses_degree: int, ring_degree: int, node_size: int) -> float:
    """Ring neighbours are ``ulysses_degree`` ranks apart: NVLink while the whole group fits in a node."""
    return device.intra_node_gbps if ulysses_degree * ring_degree <= node_size else device.inter_node_gbps


def ring_comm(
    model: ModelSpec,
    device: DeviceSpec,
    *,
    seq_len: int,
    ulysses_degree: int,
    ring_degree: int,
    node_size: int,
    attention_s: float,
    compute_bytes: int = ACT_BYTES,
) -> dict[str, float]:
    """Ring P2P per micro step and the part that does not hide behind the attention of each step.

    Forward: ``R - 1`` transfers of the K/V block per layer. Backward: ``R - 1`` K/V transfers, and the fp32
    dK/dV accumulators travel with them and take one more hop home (``R`` transfers). Each step overlaps its
    transfer with the attention of the block in hand, so the exposed time per step is
    ``max(0, transfer - compute)``; the final dK/dV hop has nothing to hide behind.
    """
    R = ring_degree
    if R == 1:
        return {"ring_bytes": 0.0, "ring_s": 0.0, "ring_exposed_s": 0.0, "ring_step_comm_s": 0.0}
    kv = kv_block_bytes(model, seq_len, ulysses_degree, R, compute_bytes)
    dkv = kv_block_bytes(model, seq_len, ulysses_degree, R, 4)
    bw = ring_bandwidth_gbps(device, ulysses_degree, R, node_size) * GB
    L = model.num_attention_layers
    fwd_step, bwd_step, home = kv / bw, (kv + dkv) / bw, dkv / bw
    # attention_s covers fwd + bwd of all layers; split it over the 2 x R steps per layer by pass weight.
    per_layer = attention_s / L
    passes = 1 + ATTN_BWD_OVER_FWD_HW
    fwd_compute = per_layer / passes / R
    bwd_compute = per_layer * ATTN_BWD_OVER_FWD_HW / passes / R
    exposed = L * ((R - 1) * (max(0.0, fwd_step - fwd_compute) + max(0.0, bwd_step - bwd_compute)) + home)
    return {
        "ring_bytes": L * ((R - 1) * 2 * kv + R * dkv),
        "ring_s": L * ((R - 1) * (fwd_step + bwd_step) + home),
        "ring_exposed_s": exposed,
        "ring_step_comm_s": fwd_step,
    }


def ulysses_comm(
    model: ModelSpec,
    device: DeviceSpec,
    *,
    seq_len: int,
    ulysses_degree: int,
    ring_degree: int,
    compute_bytes: int = ACT_BYTES,
) -> dict[str, float]:
    """All-to-all per micro step: q, k, v in and the output back, forward and backward, on the critical path.

    A rank sends ``(U - 1) / U`` of its local q/k/v/out; with GQA replication (``U`` > KV heads) each KV head
    is repeated to ``U`` heads before the exchange. Uneven heads (``U`` not dividing them): the busiest
    rank's sizes (:meth:`ModelSpec.ulysses_a2a_heads`).
    """
    U = ulysses_degree
    if U == 1:
        return {"ulysses_bytes": 0.0, "ulysses_s": 0.0}
    local_tokens = seq_len / (U * ring_degree)
    per_layer = (
        local_tokens * model.ulysses_a2a_heads(U) * model.head_dim * compute_bytes
    )  # forward + backward
    total = per_layer * model.num_attention_layers
    return {"ulysses_bytes": total, "ulysses_s": total / (device.intra_node_gbps * GB)}


def mixer_comm(
    model: ModelSpec,
    device: DeviceSpec,
    *,
    seq_len: int,
    sp_degree: int,
    node_size: int,
    compute_bytes: int = ACT_BYTES,
) -> dict[str, float]:
    """A hybrid model's mixer exchanges per micro step (:meth:`usp.plan.mixers.MixerSpec.comm_bytes`: the
    head all-to-alls or the gather, forward and backward), on the critical path, over NVLink while the sp
    group fits in a node, else the network. Zero without mixer layers."""
    m = model.mixer
    if m is None or sp_degree == 1:
        return {"mixer_bytes": 0.0, "mixer_comm_s": 0.0}
    per_layer = m.comm_bytes(seq_len / sp_degree, sp_degree, model.hidden_size, compute_bytes)
    total = per_layer * m.num_layers
    gbps = device.intra_node_gbps if sp_degree <= node_size else device.inter_node_gbps
    return {"mixer_bytes": total, "mixer_comm_s": total / (gbps * GB)}


def fsdp_comm(
    model: ModelSpec,
    device: DeviceSpec,
    *,
    world_size: int,
    node_size: int,
    fsdp_mode: str,
    compute_bytes: int = ACT_BYTES,
    lora: LoraPlan | None = None,
) -> dict[str, float]:
    """Parameter all-gathers (forward and again in backward, bf16) and gradient reduction, per micro step.

    ``full_shard``: ring collectives over all ranks, at the network bandwidth once the job spans nodes.
    ``hybrid_shard``: all-gather and reduce-scatter inside the node (NVLink), then an all-reduce of each
    rank's gradient shard across the nodes. ``lora``: every parameter (the adapters too) is all-gathered, only
    the trainable ones' gradients are reduced (:mod:`usp.plan.lora`).
    """
    if lora is None:
        P = Pg = model.num_params  # all-gathered; reduced
    else:
        P, Pg = total_params(model, lora), trainable_params(model, lora)
    nodes = max(1, world_size // node_size)
    if fsdp_mode == "full_shard":
        n = world_size
        if n == 1:
            return {"fsdp_bytes": 0.0, "fsdp_s": 0.0}
        bw = (device.intra_node_gbps if nodes == 1 else device.inter_node_gbps) * GB
        frac = (n - 1) / n
        if lora is None:
            nbytes = P * frac * (2 * compute_bytes + GRAD_REDUCE_BYTES)
        else:
            nbytes = (P * 2 * compute_bytes + Pg * GRAD_REDUCE_BYTES) * frac
        return {"fsdp_bytes": nbytes, "fsdp_s": nbytes / bw}
    if fsdp_mode == "hybrid_shard":
        n = min(node_size, world_size)
        frac = (n - 1) / n
        if lora is None:
            intra = P * frac * (2 * compute_bytes + GRAD_REDUCE_BYTES)
        else:
            intra = (P * 2 * compute_bytes + Pg * GRAD_REDUCE_BYTES) * frac
        inter = 2 * (nodes - 1) / nodes * Pg / n * GRAD_REDUCE_BYTES if nodes > 1 else 0.0
        seconds = intra / (device.intra_node_gbps * GB) + inter / (device.inter_node_gbps * GB)
        return {"fsdp_bytes": intra + inter, "fsdp_s": seconds}
    raise ValueError(f"parallel.fsdp_mode={fsdp_mode!r} is invalid; choose full_shard or hybrid_shard.")


def fsdp_layer_balance(
    model: ModelSpec,
    device: DeviceSpec,
    *,
    seq_len: int,
    world_size: int,
    node_size: int,
    ulysses_degree: int = 1,
    ring_degree: int = 1,
    compute_bytes: int = ACT_BYTES,
) -> dict[str, float]:
    """One decoder layer's ``full_shard`` FSDP traffic against its compute, per rank and micro step (one
    sequence of ``seq_len`` over ``ulysses x ring`` ranks): where expert parallelism would start to pay for a
    mixture of experts.

    FSDP moves every parameter of the layer (all of a MoE layer's experts: :attr:`ModelSpec.layer_params`)
    as :func:`fsdp_comm` does (bf16 all-gather in forward and again in backward, fp32 reduce-scatter:
    ``P (n - 1) / n (2 B + 4)`` bytes, at NVLink inside a node, else the network), while the layer computes
    only what its tokens go through: ``6 x`` :attr:`ModelSpec.layer_matmul_params` FLOPs per token (with the
    idle experts a Llama 4 layer runs anyway: :attr:`ModelSpec.executed_layer_matmul_params`) at the
    dense efficiency, and its attention (:func:`usp.plan.compute.compute_time`, its mean layer, without
    recomputation). Returns, for one layer: ``layer_params``, ``layer_matmul_params``, ``fsdp_bytes``,
    ``fsdp_s``, ``local_tokens``, ``matmul_s``, ``attention_s``, ``compute_s`` (their sum), ``fsdp_over_compute``
    (above 1: the traffic no longer hides behind the layer's compute, and sharding the experts by expert
    parallelism, which moves tokens instead of weights, starts to pay) and ``break_even_tokens`` (the tokens
    per rank at which the traffic equals the matmuls alone: the bound without attention). ``ep_bytes``: what
    expert parallelism over the same ``n`` ranks would send instead for a MoE layer (each token's ``k``
    copies out to their experts and back, forward and backward: ``4 k h B (n - 1) / n`` per local token;
    0 when dense), which grows with the tokens where FSDP's does not."""
    n = world_size
    P = model.layer_params
    nodes = max(1, world_size // node_size)
    bw = (device.intra_node_gbps if nodes == 1 else device.inter_node_gbps) * GB
    nbytes = P * (n - 1) / n * (2 * compute_bytes + GRAD_REDUCE_BYTES) if n > 1 else 0.0
    per_token = 6.0 * model.executed_layer_matmul_params / (device.peak_flops * device.dense_efficiency)
    local = seq_len / (ulysses_degree * ring_degree)
    times = compute_time(
        model, device, seq_len=seq_len, ulysses_degree=ulysses_degree, ring_degree=ring_degree
    )
    attention = times["attention_s"] / model.num_layers
    compute = per_token * local + attention
    top_k = model.moe.top_k if model.moe is not None else 0
    ep_bytes = 4 * top_k * model.hidden_size * compute_bytes * (n - 1) / n * local
    return {
        "layer_params": float(P),
        "layer_matmul_params": float(model.layer_matmul_params),
        "fsdp_bytes": nbytes,
        "fsdp_s": nbytes / bw,
        "local_tokens": local,
        "matmul_s": per_token * local,
        "attention_s": attention,
        "compute_s": compute,
        "fsdp_over_compute": nbytes / bw / compute,
        "break_even_tokens": nbytes / bw / per_token,
        "ep_bytes": ep_bytes,
    }
