"""Memory per GPU of evaluating one long prompt on the mesh (prefill, then decode with the sharded KV cache).

From the planner's shapes (:class:`usp.plan.models.ModelSpec`) and terms, for a prompt of ``S`` tokens plus
``new`` generated ones over ``sp = ring x ulysses`` ranks, ``e`` bytes per element (``model.dtype``):

- **weights**: the whole model on every GPU (evaluation does not shard it), ``params x e``;
- **KV cache** (:mod:`usp.eval.decode`: each rank keeps its own tokens' K and V, every KV head):
  ``ceil((S + new) / sp) x 2 x layers x kv_heads x head_dim x e``;
- **prefill activations**: one decoder layer's working set for the local ``S / sp`` tokens, bounded by what a
  training forward saves per layer (:func:`usp.plan.memory.activation_bytes_per_token_layer`: norms, q/k/v after
  the all-to-all, attention output, the MLP's four intermediates), plus the residual stream.

A prediction (no allocator overhead, no CUDA context); the exactness of the cache's size is checked in
``tests/test_eval_ruler_run.py`` against :class:`usp.eval.decode.DecodeResult`'s ``kv_tokens``.
"""

from __future__ import annotations

from typing import Any

from usp.plan.hardware import GIB
from usp.plan.memory import activation_bytes_per_token_layer
from usp.plan.models import ModelSpec


def eval_memory_per_gpu(
    config: Any, seq_len: int, new_tokens: int, *, ulysses_degree: int, ring_degree: int, dtype_bytes: int
) -> dict[str, float]:
    """``{"weights_gib", "kv_cache_gib", "prefill_activations_gib", "total_gib", "kv_tokens_per_gpu"}`` for one
    prompt of ``seq_len`` tokens; ``config`` an HF config (object or dict)."""
    spec = ModelSpec.from_hf_config(config if isinstance(config, dict) else config.to_dict())
    sp = ulysses_degree * ring_degree
    kv_tokens = -(-(seq_len + new_tokens) // sp)
    local = seq_len / sp
    weights = spec.num_params * dtype_bytes
    kv = kv_tokens * spec.kv_bytes_per_token(dtype_bytes)
    prefill = local * (
        activation_bytes_per_token_layer(spec, ulysses_degree, dtype_bytes) + spec.hidden_size * dtype_bytes
    )
    return {
        "weights_gib": weights / GIB,
        "kv_cache_gib": kv / GIB,
        "prefill_activations_gib": prefill / GIB,
        "total_gib": (weights + kv + prefill) / GIB,
        "kv_tokens_per_gpu": kv_tokens,
    }
