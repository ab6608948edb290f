"""Sequence tiling of per-token blocks: the MLP and the RMSNorms run ``mlp_tiles`` slices of the sequence at a
time, in forward and in backward, so their sequence-long working set exists one tile at a time.

``parallel.mlp_tiles`` (``1`` = off, an integer dividing the local tokens, or ``auto``):

- **MLP** of every decoder layer: DeepSpeed's ``TiledMLP`` (``deepspeed.runtime.sequence_parallel.ulysses_sp``).
  Forward runs the tiles under ``no_grad`` and keeps only the MLP input ``[B, S_local, h]``; backward
  recomputes each tile with grad and backpropagates it at once, writing the tile's slice of the input
  gradient and accumulating the weight gradients on FSDP2's unsharded parameters (summed over tiles, then
  reduce-scattered once by FSDP2 after the layer's backward). The ``[tokens, intermediate]`` tensors
  (gate, up, silu(gate), their product: ``4 x I x bytes`` per token) exist for one tile at a time, in forward
  and in backward; cost: one more MLP forward per step (three with activation checkpointing).
- **RMSNorms** (both of every layer and the final one): ours, each tile under the non-reentrant checkpoint
  (DeepSpeed's ``sequence_tiled_compute`` keeps its inputs on the autograd context, outside saved-tensor
  hooks, which would pin every checkpointed layer's residual on the device; see docs/memory.md). A norm then
  keeps only its input (a view: no copy) instead of its fp32 upcast and normalized copy (``4 h`` bytes per
  token saved per norm), and its fp32 temporaries exist per tile.
- The loss is already tiled (:mod:`usp.train.loss`, ``trainer.loss_chunk_size``); the embedding's backward
  builds a ``[vocab, h]`` gradient whatever the sequence (no sequence-long working set): neither is changed.

Tiling is exact: each token's result depends on that token only; the weight gradients are sums over tiles
(fp32: equal to the untiled sums up to summation order).

``auto`` (:func:`resolve_mlp_tiles`): tiles of about ``hidden_size`` tokens (a tile's ``[tile, I]`` tensors
then take about as much memory as one MLP weight), i.e. the smallest divisor of the local tokens that is
at least ``ceil(local_tokens / hidden_size)``; 1 when the local sequence is no longer than ``hidden_size``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from usp.train.deepspeed_parts import import_deepspeed_part


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def resolve_mlp_tiles(setting: Any, *, local_tokens: int, hidden_size: int) -> int:
    """``parallel.mlp_tiles`` -> a tile count that divides ``local_tokens`` (``ValueError`` naming what works).

    ``local_tokens``: tokens per rank per sequence (``trainer.seq_len / (ulysses x ring)``). ``auto``: the
    module docstring's rule, the one used with explicit degrees; when the planner chooses the degrees, its own
    tile count is used instead (:func:`usp.train.validate.resolve_layout`).
    """
    if local_tokens < 1:
        raise ValueError(f"local tokens per rank must be >= 1 (got {local_tokens})")
    divisors = _divisors(local_tokens)
    if setting == "auto":
        want = math.ceil(local_tokens / hidden_size)
        return next(d for d in divisors if d >= want)
    if isinstance(setting, str) and setting.isdigit():
        setting = int(setting)
    shown = ", ".join(str(d) for d in divisors[:12]) + (", ..." if len(divisors) > 12 else "")
    if isinstance(setting, bool) or not isinstance(setting, int) or setting < 1:
        raise ValueError(f"parallel.mlp_tiles={setting!r} is invalid: use an integer >= 1 (1 = off) or auto.")
    if local_tokens % setting != 0:
        raise ValueError(
            f"parallel.mlp_tiles={setting} does not divide the {local_tokens} local tokens per rank "
            f"(trainer.seq_len / (ulysses_degree x ring_degree)); use one of its divisors ({shown}) or auto."
        )
    return setting


def _require_tiled_mlp() -> Any:
    return import_deepspeed_part(
        "deepspeed.runtime.sequence_parallel.ulysses_sp", "TiledMLP", setting="parallel.mlp_tiles > 1",
        alternative="parallel.mlp_tiles=1",
    )  # fmt: skip


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


def _tile_module(module: nn.Module, run: Any) -> None:
    inner = module.forward  # the module's own forward (FSDP2 / checkpoint hooks live on __call__ of outer modules)

    def forward(x: torch.Tensor) -> torch.Tensor:
        return run(inner, x)

    module.forward = forward


def apply_sequence_tiling(layers: Iterable[nn.Module], final_norm: nn.Module | None, tiles: int) -> int:
    """Tile each layer's ``mlp`` (DeepSpeed ``TiledMLP``) and its two RMSNorms, and ``final_norm``; returns the
    number of modules tiled (0 when ``tiles == 1``).

    Replaces ``forward`` on the module instances (parameter names unchanged). Apply before FSDP2.
    """
    if tiles < 1:
        raise ValueError(f"parallel.mlp_tiles={tiles} must be >= 1.")
    if tiles == 1:
        return 0
    tiled_mlp = _require_tiled_mlp()
    n = 0

    def norm(inner: Any, x: torch.Tensor) -> torch.Tensor:
        return tiled_checkpoint(inner, x, tiles)

    def mlp(inner: Any, x: torch.Tensor) -> torch.Tensor:
        # compute_params=[]: nothing for DeepSpeed ZeRO to flag; FSDP2 reduces the summed tile gradients
        return tiled_mlp.apply(lambda _module, t: inner(t), None, x, tiles, [])

    for layer in layers:
        _tile_module(layer.mlp, mlp)
        for name in ("input_layernorm", "post_attention_layernorm"):
            _tile_module(getattr(layer, name), norm)
        n += 3
    if final_norm is not None:
        _tile_module(final_norm, norm)
        n += 1
    return n
