"""Long-context inference arithmetic (the 70B-at-1M inference case of docs/planning.md, 'Inference'): KV cache per GPU, batch capacity, prefill, decode.

One request is sharded over every GPU (``ulysses x ring = world``), weights are FSDP-sharded in bf16 and
gathered layer by layer. Sizes are in 1e9-byte GB, as that case counts them.

- KV cache per GPU: ``S / ring`` tokens x (KV heads / ulysses, at least 1 after GQA replication) x ``d`` x
  2 (K, V) x layers x 2 bytes. Ulysses at 8 and ring at 8 give the same figure; only the ring keeps
  shrinking it past the KV head count.
- batch capacity: ``floor((memory - weights/world - overhead) / (KV cache + activations per request))`` where
  the activations are one layer's q, k, v for the local tokens.
- prefill: the training forward (dense ``2 N`` per token + causal attention) at the device's efficiency.
- decode: memory-bound; each token reads every layer's full (gathered) weights and the local KV cache from HBM.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from usp.plan.compute import (
    ATTN_BWD_OVER_FWD_MODEL,
    attention_fwd_flops,
    attention_pairs,
    block_efficiency,
    causal_imbalance,
    mfu,
    model_flops_per_token,
)
from usp.plan.estimate import split_layout
from usp.plan.hardware import GB, GIB, DeviceSpec
from usp.plan.models import ModelSpec

BF16 = 2


def kv_cache_bytes_per_gpu(model: ModelSpec, seq_len: int, ulysses_degree: int, ring_degree: int) -> float:
    """KV cache of one request on one GPU (see module docstring)."""
    tokens = seq_len / ring_degree
    return tokens * model.kv_heads_per_rank(ulysses_degree) * model.head_dim * 2 * model.num_layers * BF16


@dataclass
class InferenceEstimate:
    ulysses_degree: int
    ring_degree: int
    kv_cache_gb_per_gpu: float
    weights_gb_per_gpu: float
    activations_gb_per_request: float
    mem_gib_per_gpu: float
    """Weights + overhead + one request, GiB."""
    batch_capacity: int
    prefill_s: float
    tokens_per_s_per_gpu: float
    mfu: float
    decode_hbm_s_per_token: float
    """Weights and local KV read from HBM per generated token (the figure docs/planning.md quotes)."""
    decode_allgather_s_per_token: float
    """FSDP all-gather of every layer per generated token, on top (why that case moves decode to tensor parallelism)."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "ulysses_degree": self.ulysses_degree,
            "ring_degree": self.ring_degree,
            "dp_degree": 1,
            "kv_cache_gb_per_gpu": round(self.kv_cache_gb_per_gpu, 4),
            "weights_gb_per_gpu": round(self.weights_gb_per_gpu, 4),
            "activations_gb_per_request": round(self.activations_gb_per_request, 4),
            "mem_gib_per_gpu": round(self.mem_gib_per_gpu, 3),
            "batch_capacity": self.batch_capacity,
            "step_time_s": self.prefill_s,
            "prefill_s": self.prefill_s,
            "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu,
            "mfu": round(self.mfu, 4),
            "decode_hbm_s_per_token": self.decode_hbm_s_per_token,
            "decode_allgather_s_per_token": self.decode_allgather_s_per_token,
        }


def estimate_inference(
    model: ModelSpec,
    device: DeviceSpec,
    *,
    seq_len: int,
    ulysses_degree: int,
    ring_degree: int,
    node_size: int,
    overhead_gb: float = 2.0,
    ring_layout: str = "zigzag",
) -> InferenceEstimate:
    U, R = ulysses_degree, ring_degree
    W = U * R
    L = model.num_layers
    kv = kv_cache_bytes_per_gpu(model, seq_len, U, R)
    weights = model.num_params * BF16 / W
    local = seq_len / W
    acts = local * (model.num_heads + 2 * model.kv_heads_per_rank(U) * U) * model.head_dim * BF16
    free = device.memory_bytes - weights - overhead_gb * GB
    capacity = max(0, math.floor(free / (kv + acts)))
    # Prefill: forward only.
    dense = 2.0 * model.executed_matmul_params * local / (device.peak_flops * device.dense_efficiency)
    pairs = attention_pairs([[seq_len]])
    attn_flops = 4.0 * pairs * model.num_heads * model.head_dim / W * causal_imbalance(R, ring_layout) * L
    step = attention_fwd_flops(model, seq_len / R, seq_len / R, model.q_heads_per_rank(U)) / 2
    attn = attn_flops / (device.peak_flops * block_efficiency(step, device))
    prefill = dense + attn
    # model FLOPs of the forward: the training count (fwd + 2x bwd) over its passes
    fwd_flops = model_flops_per_token(model, seq_len) * seq_len / (1 + ATTN_BWD_OVER_FWD_MODEL)
    tps = seq_len / prefill / W
    # Decode: per layer, read the gathered layer weights and the local KV of that layer.
    hbm = device.hbm_tbps * 1e12
    per_layer_bytes = model.layer_params * BF16 + kv / L
    decode_hbm = L * per_layer_bytes / hbm
    bw = (device.intra_node_gbps if W <= node_size else device.inter_node_gbps) * GB
    gather = L * model.layer_params * BF16 * (W - 1) / W / bw
    return InferenceEstimate(
        ulysses_degree=U,
        ring_degree=R,
        kv_cache_gb_per_gpu=kv / GB,
        weights_gb_per_gpu=weights / GB,
        activations_gb_per_request=acts / GB,
        mem_gib_per_gpu=(weights + overhead_gb * GB + kv + acts) / GIB,
        batch_capacity=capacity,
        prefill_s=prefill,
        tokens_per_s_per_gpu=tps,
        mfu=mfu(fwd_flops, prefill, W, device.peak_flops)[1],
        decode_hbm_s_per_token=decode_hbm,
        decode_allgather_s_per_token=gather,
    )


def plan_inference(
    model: ModelSpec,
    device: DeviceSpec,
    *,
    seq_len: int,
    world_size: int,
    node_size: int,
    overhead_gb: float = 2.0,
    ring_layout: str = "zigzag",
) -> list[InferenceEstimate]:
    """Every valid ``ulysses x ring = world`` split for one request, largest batch capacity first.
    ``ValueError`` for a hybrid model: usp's sharded decoding keeps attention's K/V only, so it refuses to
    generate with recurrent mixer layers (docs/attention.md, "Hybrid layers"), and this estimate would count
    attention in every layer."""
    if model.mixer is not None:
        raise ValueError(
            f"--inference: {model.name} is a hybrid model; usp's sharded decoding keeps attention's K/V only and "
            "refuses to generate with recurrent mixer layers, so there is no inference layout to plan. Plan "
            "training without --inference."
        )
    out: list[InferenceEstimate] = []
    reasons: list[str] = []
    for U in [u for u in range(1, world_size + 1) if world_size % u == 0]:
        R = world_size // U
        dims, why = split_layout(
            model, world_size=world_size, ulysses_degree=U, ring_degree=R, node_size=node_size
        )
        if dims is None:
            reasons.append(f"ulysses={U}: {why}")
            continue
        out.append(
            estimate_inference(
                model,
                device,
                seq_len=seq_len,
                ulysses_degree=U,
                ring_degree=R,
                node_size=node_size,
                overhead_gb=overhead_gb,
                ring_layout=ring_layout,
            )
        )
    fitting = [e for e in out if e.batch_capacity >= 1]
    if not fitting:
        need = min((e.mem_gib_per_gpu for e in out), default=float("nan"))
        raise ValueError(
            f"one {seq_len}-token request of {model.name} does not fit {world_size} x {device.name} "
            f"({device.memory_gib:g} GiB; best layout needs {need:.1f} GiB). Use more GPUs (the ring keeps "
            f"dividing the KV cache), a shorter sequence, or a device with more memory."
            + (f" Rejected: {'; '.join(reasons)}" if reasons else "")
        )
    return sorted(fitting, key=lambda e: (-e.batch_capacity, e.prefill_s))
