"""Distributed greedy decoding with a sharded KV cache ("pass-Q"): ``generate(model, input_ids, mesh, n)``.

The KV cache never sits on one rank. Each sp rank (``mesh.sp_degree = ring x ulysses`` of them) keeps the
keys and values of its own tokens, per layer:

1. **Prefill.** The longest prefix of the prompt that fits the sequence layout (a multiple of
   ``mesh.sequence_multiple()`` tokens) runs through the model once, sharded like training (USP attention:
   Ulysses all-to-all x ring). Each rank's attention call gets its own tokens' ``k, v`` (``[B, S_local, Hkv,
   D]``, RoPE applied at their global positions) and keeps them. The logits of the last prompt token are
   computed by the rank that holds it and broadcast over the sp group (``B x V`` fp32).
2. **Decode.** Every rank runs the model on the same new token (weights are replicated; the token id is the
   only thing every rank must agree on, and greedy argmax over identical logits does). In each layer every
   rank therefore holds the new token's query: this is "sending Q to every rank" at no cost in bytes. Each
   rank computes attention of that query over its K/V shard, ``(out [B, 1, Hq, D], lse [B, Hq, 1])`` in
   fp32 (``out = 0, lse = -inf`` on a rank whose shard is empty), the partial results are all-gathered over
   the sp group, and every rank merges them the same way, in sp-rank order::

       m = max_r lse_r,   w_r = exp(lse_r - m),   out = sum_r w_r out_r / sum_r w_r

   which is exactly softmax attention over the union of the shards (the log-sum-exp identity). The new
   token's ``k, v`` are appended to one rank only: the one holding the fewest tokens (ties: lowest sp rank),
   so the shards stay within one token of each other.
3. Prompt tokens past the prefilled prefix (fewer than ``sequence_multiple``) go through step 2 one at a
   time with their known ids, so any prompt length works, down to a one-token prompt (all shards empty).

Bytes per generated token, per rank, all-gather over the sp group: ``num_layers x (sp - 1) x B x Hq x (D +
1) x 4`` received (fp32 out and lse). Memory of the cache per rank: ``2 x num_layers x Hkv x D x e`` bytes
per token held, ``~ (prompt + new) / sp`` tokens. Every collective is on ``mesh.sp_group``; dp replicas of
the mesh decode the same input independently (identical results).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from usp.attention import attention_forward, resolve_backend
from usp.model import decoder_of
from usp.model.mixers import mixer_modules
from usp.parallel import SPMesh, shard_sequence, sp_permutation


@dataclass
class DecodeResult:
    """What :func:`decode` returns: the tokens and where the time went (seconds, this rank's clock)."""

    tokens: torch.Tensor
    """LongTensor ``[B, n]``, identical on every rank: ``n = max_new_tokens``, or fewer when ``stop`` ended
    the generation early."""
    prefill_tokens: int
    """Prompt tokens (all rows) that went through the sharded prefill."""
    prefill_s: float
    decode_steps: int
    """Single-token steps: prompt tail tokens plus generated tokens after the first."""
    decode_s: float
    kv_tokens: list[int]
    """Tokens held by each sp rank's cache at the end (sp-rank order)."""
    logits: torch.Tensor | None = None
    """fp32 ``[B, max_new_tokens, V]``, the logits each token was chosen from (``keep_logits=True`` only)."""


class ShardedKVCache:
    """This rank's keys and values, per layer, and the rule that picks which rank stores a new token.

    Passed to the model as the forward kwarg ``usp_kv_cache``; :func:`usp.model.usp_attention_forward` calls
    :meth:`keep` during the prefill and :meth:`decode_attention` once ``decoding`` is set.
    """

    def __init__(self, mesh: SPMesh, num_layers: int, backend: str = "auto", reserve: int = 0) -> None:
        self.mesh = mesh
        self.backend = backend
        self.reserve = reserve  # free slots per layer beyond the prefill, so appends rarely reallocate
        self.k: list[torch.Tensor | None] = [None] * num_layers  # [B, capacity, Hkv, D]
        self.v: list[torch.Tensor | None] = [None] * num_layers
        self.used = [0] * num_layers  # filled slots of this rank's buffers
        self.held = [0] * mesh.sp_degree  # tokens each sp rank holds (every rank knows every count)
        self.owner = 0
        self.decoding = False

    def keep(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Prefill: store this rank's ``k, v`` ``[B, S_local, Hkv, D]`` of ``layer`` (plus ``reserve`` slots)."""
        self.k[layer] = _with_room(k.detach(), k, self.reserve)
        self.v[layer] = _with_room(v.detach(), v, self.reserve)
        self.used[layer] = k.size(1)

    def prefilled(self, tokens_per_rank: int) -> None:
        self.held = [tokens_per_rank] * self.mesh.sp_degree

    def next_token(self) -> None:
        """Choose the rank that stores the next token's K/V: the fewest tokens held, lowest sp rank on ties."""
        self.owner = min(range(self.mesh.sp_degree), key=lambda r: (self.held[r], r))
        self.held[self.owner] += 1

    def _append(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor) -> None:
        """Write one token ``[B, 1, Hkv, D]`` into the next free slot (the buffer doubles when full)."""
        n = self.used[layer]
        if self.k[layer] is None or n == self.k[layer].size(1):
            room = max(1, n, self.reserve)
            self.k[layer] = _with_room(self.k[layer], k_new, room)
            self.v[layer] = _with_room(self.v[layer], v_new, room)
        self.k[layer][:, n : n + 1] = k_new
        self.v[layer][:, n : n + 1] = v_new
        self.used[layer] = n + 1

    def decode_attention(
        self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float | None
    ) -> torch.Tensor:
        """One new token: ``query [B, Hq, 1, D]``, ``key/value [B, Hkv, 1, D]`` (the same on every rank) ->
        ``out [B, 1, Hq, D]`` over every rank's keys, identical on every rank. Collective over the sp group."""
        q = query.transpose(1, 2)  # [B, 1, Hq, D]
        if self.owner == self.mesh.sp_rank:
            self._append(layer, key.transpose(1, 2), value.transpose(1, 2))  # [B, 1, Hkv, D]
        b, _, hq, d = q.shape
        n = self.used[layer]
        acc = torch.promote_types(q.dtype, torch.float32)  # fp32 merge; a float64 model (tests) stays float64
        if n == 0:  # no key here yet: contributes nothing to the merge
            out = torch.zeros(b, 1, hq, d, dtype=acc, device=q.device)
            lse = torch.full((b, hq, 1), float("-inf"), dtype=acc, device=q.device)
        else:
            scale = d**-0.5 if scaling is None else float(scaling)
            kernel = resolve_backend(self.backend, q.device, q.dtype, head_dim=d)
            # every key held is at or before the query's position: no mask
            kc, vc = self.k[layer][:, :n], self.v[layer][:, :n]  # [B, n, Hkv, D]
            out, lse = attention_forward(q, kc, vc, causal=False, softmax_scale=scale, backend=kernel)
        merged = merge_partials(out.to(acc), lse.to(acc), self.mesh)
        return merged.to(query.dtype)  # [B, 1, Hq, D]


def _with_room(x: torch.Tensor | None, like: torch.Tensor, room: int) -> torch.Tensor:
    """``x`` ``[B, n, Hkv, D]`` (or nothing) followed by ``room`` empty slots along the sequence dim."""
    free = like.new_empty(like.shape[0], room, *like.shape[2:])  # [B, room, Hkv, D]
    return free if x is None else torch.cat([x, free], dim=1)


def merge_partials(out: torch.Tensor, lse: torch.Tensor, mesh: SPMesh) -> torch.Tensor:
    """All-gather every sp rank's ``(out [B, 1, Hq, D], lse [B, Hq, 1])`` (fp32) and merge them exactly.

    Every rank merges the same gathered list in sp-rank order, so the result is bitwise identical on every
    rank. A rank with ``lse = -inf`` (no key) gets weight 0. At least one rank must hold a key.
    """
    b, _, hq, d = out.shape
    packed = torch.cat([out.reshape(b, hq, d), lse.reshape(b, hq, 1)], dim=-1)  # [B, Hq, D + 1]
    if mesh.sp_degree > 1:
        parts = [torch.empty_like(packed) for _ in range(mesh.sp_degree)]
        dist.all_gather(parts, packed.contiguous(), group=mesh.sp_group)
        stacked = torch.stack(parts)  # [sp, B, Hq, D + 1]
    else:
        stacked = packed[None]
    outs, lses = stacked[..., :d], stacked[..., d]  # [sp, B, Hq, D], [sp, B, Hq]
    top = lses.amax(dim=0)  # [B, Hq], finite: some rank holds the new token itself
    w = torch.exp(lses - top)  # [sp, B, Hq]; exp(-inf) = 0 for empty shards
    merged = (w[..., None] * outs).sum(0) / w.sum(0)[..., None]  # [B, Hq, D]
    return merged[:, None]  # [B, 1, Hq, D]


def _model_backend(model: nn.Module) -> str:
    for m in model.modules():
        state = getattr(m, "usp_state", None)
        if state is not None:
            return state.backend
    raise ValueError("generate needs a model prepared by usp.model.apply_usp(model, mesh); this one is not.")


def _check_inputs(input_ids: torch.Tensor, max_new_tokens: int) -> None:
    if input_ids.dim() != 2 or input_ids.dtype not in (torch.int32, torch.int64) or input_ids.size(1) < 1:
        raise ValueError(
            f"input_ids must be an integer tensor [B, S] with S >= 1 (the whole prompt, the same on every "
            f"rank), got {input_ids.dtype} {tuple(input_ids.shape)}."
        )
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1.")


def _owner_of_last(seq_len: int, mesh: SPMesh) -> tuple[int, int]:
    """``(sp rank, local index)`` of global position ``seq_len - 1`` in the mesh's layout."""
    perm = sp_permutation(seq_len, mesh.ring_degree, mesh.ulysses_degree, mesh.ring_layout)
    flat = int((perm == seq_len - 1).nonzero()[0, 0])
    local = seq_len // mesh.sp_degree
    return flat // local, flat % local


def _logits(model: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    logits = model.get_output_embeddings()(hidden)  # [B, V]
    return logits.to(torch.promote_types(logits.dtype, torch.float32))  # fp32, or float64 for a float64 model


def _broadcast_sp(t: torch.Tensor, src_sp_rank: int, mesh: SPMesh) -> torch.Tensor:
    if mesh.sp_degree > 1:
        dist.broadcast(t, src=dist.get_global_rank(mesh.sp_group, src_sp_rank), group=mesh.sp_group)
    return t


@torch.no_grad()
def decode(
    model: nn.Module,
    input_ids: torch.Tensor,
    mesh: SPMesh,
    max_new_tokens: int,
    *,
    keep_logits: bool = False,
    stop: Callable[[torch.Tensor], bool] | None = None,
) -> DecodeResult:
    """:func:`generate` with timings, the final cache sizes and (``keep_logits``) the logits of every step.

    ``stop(tokens)``, called with the tokens generated so far (``[B, n]``, identical on every rank, so every
    rank decides the same), ends the generation after ``n`` tokens when it returns True (EOS or a stop string
    in every row: the caller's rule)."""
    _check_inputs(input_ids, max_new_tokens)
    mixers = sorted({type(m).__name__ for _, m in mixer_modules(model)})
    if mixers:
        raise ValueError(
            f"usp's sharded KV-cache decoding keeps softmax attention's K/V only; this model's "
            f"{', '.join(mixers)} layers carry a recurrent / convolution state it does not keep, on any "
            f"layout; perplexity by position (eval=ppl) runs sharded and exact."
        )
    backend = _model_backend(model)
    device = next(model.parameters()).device
    ids = input_ids.to(device=device, dtype=torch.long)
    b, s = ids.shape
    decoder = decoder_of(model)
    prefix = (s // mesh.sequence_multiple()) * mesh.sequence_multiple()
    reserve = -(-(s - prefix + max_new_tokens) // mesh.sp_degree)  # appended tokens per rank, rounded up
    cache = ShardedKVCache(mesh, model.config.num_hidden_layers, backend, reserve=reserve)
    logits: torch.Tensor | None = None

    t0 = time.perf_counter()
    if prefix:
        pos = torch.arange(prefix, device=device).expand(b, -1)
        hidden = decoder(
            input_ids=shard_sequence(ids[:, :prefix], mesh),
            position_ids=shard_sequence(pos, mesh),
            use_cache=False,
            usp_kv_cache=cache,
        ).last_hidden_state  # [B, prefix / sp, H]
        cache.prefilled(prefix // mesh.sp_degree)
        if prefix == s:
            owner, index = _owner_of_last(prefix, mesh)
            vocab = model.get_output_embeddings().weight.size(0)
            dtype = torch.promote_types(model.get_output_embeddings().weight.dtype, torch.float32)
            logits = torch.empty(b, vocab, dtype=dtype, device=device)
            if mesh.sp_rank == owner:
                logits.copy_(_logits(model, hidden[:, index]))
            _broadcast_sp(logits, owner, mesh)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t1 = time.perf_counter()

    cache.decoding = True
    steps = 0

    def step(token: torch.Tensor, position: int) -> torch.Tensor:
        nonlocal steps
        steps += 1
        cache.next_token()
        pos = torch.full((b, 1), position, dtype=torch.long, device=device)
        hidden = decoder(
            input_ids=token, position_ids=pos, use_cache=False, usp_kv_cache=cache
        ).last_hidden_state
        return _logits(model, hidden[:, -1])  # [B, V], the same on every rank

    for p in range(prefix, s):  # the prompt's tail that does not fill the layout
        logits = step(ids[:, p : p + 1], p)
    assert logits is not None
    out = torch.empty(b, max_new_tokens, dtype=torch.long, device=device)
    kept = []
    for i in range(max_new_tokens):
        if keep_logits:
            kept.append(logits)
        token = logits.argmax(dim=-1)  # [B]
        _broadcast_sp(token, 0, mesh)  # identical already; this makes "identical on every rank" a guarantee
        out[:, i] = token
        if stop is not None and stop(out[:, : i + 1]):
            out = out[:, : i + 1]
            break
        if i + 1 < max_new_tokens:
            logits = step(token[:, None], s + i)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t2 = time.perf_counter()
    return DecodeResult(
        tokens=out,
        prefill_tokens=b * prefix,
        prefill_s=t1 - t0,
        decode_steps=steps,
        decode_s=t2 - t1,
        kv_tokens=list(cache.held),
        logits=torch.stack(kept, dim=1) if keep_logits else None,
    )


def generate(model: nn.Module, input_ids: torch.Tensor, mesh: SPMesh, max_new_tokens: int) -> torch.Tensor:
    """Greedy decoding of ``max_new_tokens`` tokens after the prompt ``input_ids`` with a sharded KV cache.

    Args:
        model: a causal LM prepared by :func:`usp.model.apply_usp` over ``mesh`` (weights whole on every rank).
        input_ids: ``[B, S]`` integer prompt, the whole (global) prompt, the same on every rank; any ``S >= 1``
            (the longest prefix that fits the layout is prefilled sharded, the rest decoded token by token).
        mesh: the :class:`~usp.parallel.SPMesh` the model was prepared with.
        max_new_tokens: how many tokens to generate (no stop at EOS: cut the result at EOS yourself).

    Returns:
        LongTensor ``[B, max_new_tokens]`` on the model's device, identical on every rank; the same tokens as
        single-process greedy decoding (``transformers`` ``generate(do_sample=False)``) up to ties within
        floating-point rounding.

    Collective: every rank of the mesh calls it with the same arguments.
    """
    return decode(model, input_ids, mesh, max_new_tokens).tokens
