"""Sequence tiling of per-token blocks: the MLP, the q/k/v projections and the RMSNorms run ``mlp_tiles``
slices of the sequence at a time, in forward and in backward, so their sequence-long working set exists one
tile at a time, and no RMSNorm output is kept for backward.

``parallel.mlp_tiles`` (``1`` = off: the plain Hugging Face layer; an integer dividing the local tokens; or
``auto``):

- **post-attention RMSNorm + MLP** of every decoder layer: one DeepSpeed ``TiledMLP``
  (``deepspeed.runtime.sequence_parallel.ulysses_sp``) over ``mlp(norm(t))``. Forward runs the tiles under
  ``no_grad`` and keeps only the residual stream ``[B, S_local, h]`` (the norm's input); backward recomputes
  each tile's norm and MLP with grad and backpropagates it at once, writing the tile's slice of the input
  gradient and accumulating the weight gradients (MLP and norm) on FSDP2's unsharded parameters (summed over
  tiles, reduce-scattered once by FSDP2 after the layer's backward). The ``[tokens, intermediate]`` tensors
  (gate, up, silu(gate), their product: ``4 x I x bytes`` per token) and the norm's output and fp32
  temporaries exist for one tile at a time. The norm module's own forward becomes the identity.
- **input RMSNorm + q/k/v projections**: each of ``q_proj``, ``k_proj``, ``v_proj`` computes
  ``proj(norm(t))`` per tile, each tile under the non-reentrant checkpoint (ours: ``TiledMLP`` needs an
  output as wide as its input, and k/v are narrower under GQA). Each keeps only views of the layer input
  (which the layer keeps anyway: it is the residual, or the layer checkpoint's input) instead of the norm's
  output; the norm runs three times per pass instead of once (an elementwise pass over ``h`` per token,
  against ``2 h (H + 2 KV) d`` FLOPs of the projections). The norm module's own forward becomes the identity.
- **final RMSNorm**: :class:`DeferrableNorm`. :class:`usp.train.loss.ChunkedCausalLMLoss` defers it into its
  checkpointed loss chunks, so a step keeps the pre-norm hidden states only; other callers of the decoder
  get the norm, tiled, as before.
- The embedding's backward builds a ``[vocab, h]`` gradient whatever the sequence (no sequence-long working
  set): not changed.

Why not DeepSpeed's ``sequence_tiled_compute`` for the norms: it keeps its inputs on the autograd context,
outside saved-tensor hooks, which would pin every checkpointed layer's residual on the device (docs/memory.md).

Only ``forward`` of module instances changes: parameter names, state-dict keys and FSDP2 units are those of
the plain model, and every parameter is used inside its own layer's forward and backward (the final norm
inside the root's, with ``lm_head``). Tiling is exact: each token's result depends on that token only; the
weight gradients are sums over tiles (and, for the input norm, over its three consumers): in fp32 equal to
the untiled sums up to summation order.

``auto`` (:func:`usp.mlp_tiles.resolve_mlp_tiles`): tiles of about ``hidden_size`` tokens (a tile's ``[tile, I]`` tensors
then take about as much memory as one MLP weight), i.e. the smallest divisor of the local tokens that is
at least ``ceil(local_tokens / hidden_size)``; 1 when the local sequence is no longer than ``hidden_size``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from usp.train.deepspeed_parts import import_deepspeed_part


def _require_tiled_mlp() -> Any:
    return import_deepspeed_part(
        "deepspeed.runtime.sequence_parallel.ulysses_sp",
        "TiledMLP",
        setting="parallel.mlp_tiles > 1",
        alternative="parallel.mlp_tiles=1",
    )


def check_tiling_available(tiles: int) -> None:
    """``ValueError`` naming ``parallel.mlp_tiles`` when tiles are asked for and DeepSpeed is missing."""
    if tiles > 1:
        _require_tiled_mlp()


def tiled_checkpoint(fn: Any, x: torch.Tensor, tiles: int) -> torch.Tensor:
    """``fn`` (per-token, ``[..., S, h] -> [..., S, h']``) over ``tiles`` slices of dim -2, each checkpointed.

    Saves only the tiles of ``x`` (views: no copy); ``fn``'s intermediates exist one tile at a time in forward
    and in backward. Without grad the tiles just run one after another.
    """
    parts = x.chunk(tiles, dim=-2)  # tiles x [..., S / tiles, h]
    if torch.is_grad_enabled() and x.requires_grad:
        outs = [checkpoint(fn, p, use_reentrant=False) for p in parts]
    else:
        outs = [fn(p) for p in parts]
    return torch.cat(outs, dim=-2)  # [..., S, h']


def _norm_recomputed_by_consumers(x: torch.Tensor) -> torch.Tensor:
    """A fused RMSNorm's ``forward``: the identity; its consumers apply the norm per tile (module docstring)."""
    return x


def _fuse_norm_into(norm: nn.Module, consumers: Iterable[nn.Module], run: Any) -> None:
    """Replace ``norm``'s forward by the identity and each consumer's ``forward(y)`` by
    ``run(lambda t: consumer(norm(t)), x)``: the norm's output is recomputed per tile inside each consumer
    and never kept for the whole layer. Exact: a consumer sees ``norm(x)`` as before, and the norm weight's
    gradient is the sum of its consumers' (fp32: equal up to summation order)."""
    apply_norm = norm.forward

    def fused(inner: Any) -> Any:
        def forward(x: torch.Tensor) -> torch.Tensor:
            return run(lambda t: inner(apply_norm(t)), x)

        return forward

    for consumer in consumers:
        consumer.forward = fused(consumer.forward)
    norm.forward = _norm_recomputed_by_consumers


class DeferrableNorm:
    """The final RMSNorm's ``forward`` under tiling: the norm, tiled; inside :meth:`deferred`, the identity.

    :class:`usp.train.loss.ChunkedCausalLMLoss` runs the decoder under :meth:`deferred` and applies
    :attr:`norm` to each loss chunk inside the chunk's checkpoint, so a training step keeps the pre-norm hidden
    states only (not the norm's output as well). Any other caller of the decoder (evaluation, decoding) gets
    the normalized hidden states as before.
    """

    def __init__(self, norm: Any, tiles: int):
        self.norm = norm  # the norm module's own forward: [..., h] -> [..., h]
        self.tiles = tiles
        self._deferred = 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x if self._deferred else tiled_checkpoint(self.norm, x, self.tiles)

    @contextmanager
    def deferred(self) -> Iterator[None]:
        self._deferred += 1
        try:
            yield
        finally:
            self._deferred -= 1


def deferrable_final_norm(decoder: nn.Module) -> DeferrableNorm | None:
    """The decoder's final norm's :class:`DeferrableNorm` when :func:`apply_sequence_tiling` installed one."""
    forward = getattr(getattr(decoder, "norm", None), "forward", None)
    return forward if isinstance(forward, DeferrableNorm) else None


def apply_sequence_tiling(layers: Iterable[nn.Module], final_norm: nn.Module | None, tiles: int) -> int:
    """Tile each layer's ``mlp`` (DeepSpeed ``TiledMLP``) and ``q_proj``/``k_proj``/``v_proj`` with the RMSNorm
    before them fused in, and make ``final_norm`` a :class:`DeferrableNorm`; returns the number of modules
    tiled (5 per layer, +1 for the final norm; 0 when ``tiles == 1``).

    Replaces ``forward`` on module instances only (parameter names, state-dict keys and FSDP2 units
    unchanged). Apply before activation checkpointing and FSDP2.
    """
    if tiles < 1:
        raise ValueError(f"parallel.mlp_tiles={tiles} must be >= 1.")
    if tiles == 1:
        return 0
    tiled_mlp = _require_tiled_mlp()
    n = 0

    def tiled(fn: Any, x: torch.Tensor) -> torch.Tensor:
        return tiled_checkpoint(fn, x, tiles)

    def mlp(fn: Any, x: torch.Tensor) -> torch.Tensor:
        # compute_params=[]: nothing for DeepSpeed ZeRO to flag; FSDP2 reduces the summed tile gradients
        return tiled_mlp.apply(lambda _module, t: fn(t), None, x, tiles, [])

    for layer in layers:
        attn = layer.self_attn
        _fuse_norm_into(layer.input_layernorm, (attn.q_proj, attn.k_proj, attn.v_proj), tiled)
        _fuse_norm_into(layer.post_attention_layernorm, (layer.mlp,), mlp)
        n += 5
    if final_norm is not None:
        final_norm.forward = DeferrableNorm(final_norm.forward, tiles)
        n += 1
    return n
