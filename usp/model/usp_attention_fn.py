"""``apply_usp``: wire Unified Sequence Parallel attention into a transformers causal LM from outside.

Nothing in the modeling code changes. We register an attention function under the name ``"usp"`` with
transformers' ``AttentionInterface`` and switch the model to it. The modeling code then hands us, per layer,
query/key/value of this rank's token slice after RoPE (``[B, H, S_local, D]``); we call
:func:`usp.attention.usp_attention`, which exchanges heads/tokens over the mesh and returns this rank's
slice of the attention output.

Why it is exact:

- every rank feeds the *global* position id of each of its tokens (``shard_sequence(position_ids)``), so
  RoPE rotates each token as in the unsharded model, whatever order zigzag puts the tokens in;
- everything outside attention (embeddings, norms, MLP, lm_head) is per token, so it needs no exchange;
- ``"usp"`` is not in transformers' mask registry, so ``create_causal_mask`` builds no dense mask (it
  returns ``None``); causality and document boundaries (``cu_seqlens``, global offsets) are the attention
  kernel's job. Extra forward kwargs such as ``cu_seqlens`` travel through the decoder layers to us.

The mesh and kernel choice live on each attention module (attribute ``usp_state``), not in a global, so two
models with different meshes can coexist in one process.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers import AttentionInterface, PretrainedConfig, PreTrainedModel

from usp.model.capabilities import (
    LayerSpec,
    ModelCapabilities,
    attention_modules,
    decoder_of,
    model_capabilities,
)
from usp.parallel import SPMesh

ATTN_IMPLEMENTATION = "usp"
_STATE_ATTR = "usp_state"

_IGNORED_KWARGS = frozenset(
    {
        "position_ids",
        "cache_position",
        "use_cache",
        "output_attentions",
        "past_key_values",
        "past_key_value",
        "max_length_q",
        "max_length_k",
        "is_causal",
        "usp_kv_cache",
        "usp_global_token_index",
        "position_embeddings",
        "layer_idx",
        "return_dict",
        "output_router_logits",
    }
)
"""Keyword arguments transformers' decoders pass that do not change the attention (causal LM, no cache in
training; the rest are read elsewhere). Any other non-None keyword is refused: never silently ignored."""


@dataclass(frozen=True)
class USPAttentionState:
    """What the registered attention function needs to know, attached to each attention module."""

    mesh: SPMesh
    backend: str = "auto"
    attn_head_chunks: int = 1
    """``parallel.attn_head_chunks``: the ring runs over this many groups of heads one after another."""
    layer: LayerSpec = LayerSpec("full")
    """This module's layer: full, sliding window or chunked (from the model's capability record)."""
    family: str = "llama"


def check_heads(config: PretrainedConfig, ulysses_degree: int) -> None:
    """``ValueError`` unless the model's heads can be split over ``ulysses_degree`` ranks: any degree from 1
    to the query head count (uneven counts are split as evenly as possible, :mod:`usp.attention.heads`), and
    the query heads a multiple of the key/value heads."""
    from usp.attention.heads import ulysses_heads

    hq = config.num_attention_heads
    ulysses_heads(hq, getattr(config, "num_key_value_heads", None) or hq, ulysses_degree)


def usp_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    cu_seq_lens_k: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    usp_shared_prefix: torch.Tensor | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """The function registered as ``"usp"`` (transformers' attention-function signature).

    ``query`` ``[B, Hq, S_local, D]``, ``key``/``value`` ``[B, Hkv, S_local, D]`` (this rank's tokens, RoPE
    applied with global positions). Document boundaries arrive under transformers' packed-sequence names
    (:func:`packed_sequence_kwargs`): ``cu_seq_lens_q`` = ``cu_seq_lens_k``, int32 ``[num_docs + 1]`` *global*
    offsets (on the host), or ``None`` for one causal sequence; ``cu_seqlens`` is accepted as an alias.
    ``max_length_q/k`` are not needed here (the ring plans blocks from the offsets). ``usp_shared_prefix``
    (int ``[num_docs]`` on the host, or None): per document, the leading tokens of the document before it that
    it also attends to (DPO's shared prompt, :func:`usp.attention.usp_attention`'s ``shared_prefix``). Returns
    ``([B, S_local, Hq, D], None)`` as transformers expects.

    The forward kwarg ``usp_kv_cache`` (a :class:`usp.eval.decode.ShardedKVCache`, distributed decoding) keeps
    this rank's ``k, v`` after the prefill's USP attention, and once it is ``decoding`` answers single-token
    steps itself (attention over every rank's K/V shard, merged exactly).
    """
    state: USPAttentionState | None = getattr(module, _STATE_ATTR, None)
    assert state is not None, (
        "the 'usp' attention function runs only on modules prepared by usp.model.apply_usp"
    )
    if cu_seq_lens_k is not None and (cu_seq_lens_q is None or not torch.equal(cu_seq_lens_k, cu_seq_lens_q)):
        raise ValueError(
            "usp attention is self-attention over packed documents: cu_seq_lens_k must equal cu_seq_lens_q "
            "(the global document boundaries)."
        )
    cu_seqlens = cu_seq_lens_q if cu_seq_lens_q is not None else cu_seqlens
    if attention_mask is not None:
        raise ValueError(
            "apply_usp'd models take no attention_mask (padding masks are not supported under sequence "
            "parallelism); pack documents and pass position_ids (restarting per document) and cu_seqlens."
        )
    if dropout:
        raise ValueError(
            f"attention dropout {dropout} is not supported by usp attention; set attention_dropout=0."
        )
    kv_cache = kwargs.get(
        "usp_kv_cache"
    )  # distributed decoding (usp.eval.decode): a forward kwarg, no global
    window = kwargs.pop("sliding_window", None)  # the model's own statement, per call
    softcap = kwargs.pop("softcap", None)
    sinks = kwargs.pop("s_aux", None)
    layer = state.layer
    if kv_cache is not None and (
        layer.kind != "full" or softcap is not None or sinks is not None or value.size(-1) != query.size(-1)
    ):
        raise ValueError(
            f"usp's sharded KV-cache decoding (usp.eval.decode) implements full causal attention only; "
            f"{state.family} layer {module.layer_idx} has {layer.kind} attention, softcap or sinks. Evaluate "
            f"generation on one rank (parallel.ulysses_degree=1 parallel.ring_degree=1)."
        )
    if kv_cache is not None and kv_cache.decoding:
        return kv_cache.decode_attention(module.layer_idx, query, key, value, scaling), None
    unknown = sorted(
        name for name, value in kwargs.items() if value is not None and name not in _IGNORED_KWARGS
    )
    if unknown:
        raise ValueError(
            f"{state.family}'s attention passes {unknown} to the attention function, which usp attention does not "
            f"implement; it refuses rather than ignore them (see docs/models.md)."
        )
    if window is None and layer.kind == "sliding":
        window = layer.window
    assert layer.window is None or window == layer.window, (
        f"layer {module.layer_idx}: the model passes sliding_window={window}, its capability record says "
        f"{layer.window}"
    )
    from usp.attention import usp_attention  # the attention engineer's module; imported late on purpose

    q = query.transpose(1, 2)  # [B, S_local, Hq, D]
    k = key.transpose(1, 2)  # [B, S_local, Hkv, D]
    v = value.transpose(1, 2)
    v_dim = v.size(-1)
    if v_dim != q.size(-1):  # MLA: values narrower than queries/keys travel zero-padded (exact)
        assert v_dim < q.size(-1), f"value head dim {v_dim} > query head dim {q.size(-1)}"
        v = torch.nn.functional.pad(v, (0, q.size(-1) - v_dim))
    out = usp_attention(
        q,
        k,
        v,
        mesh=state.mesh,
        causal=True,
        softmax_scale=scaling,
        backend=state.backend,
        cu_seqlens=cu_seqlens,
        attn_head_chunks=state.attn_head_chunks,
        window=window,
        chunk=layer.chunk,
        softcap=softcap,
        sinks=sinks,
        shared_prefix=usp_shared_prefix,
    )
    if v_dim != out.size(-1):
        out = out[..., :v_dim]
    if kv_cache is not None:  # prefill: keep this rank's K/V shard for the decode steps
        kv_cache.keep(module.layer_idx, k, v)
    return out, None  # out: [B, S_local, Hq, D]


def packed_sequence_kwargs(
    cu_seqlens: torch.Tensor | None, shared_prefix: torch.Tensor | None = None
) -> dict[str, object]:
    """The model-call keywords that carry packed-document boundaries, under transformers' own names.

    ``cu_seqlens``: int32 ``[num_docs + 1]`` global offsets of the packed row (``None``: one causal sequence,
    no keywords). Returns ``{cu_seq_lens_q, cu_seq_lens_k, max_length_q, max_length_k}``, the names
    transformers' flash-attention path reads for packed sequences, so the same call works with the ``usp``
    attention (sequence-parallel) and with stock ``flash_attention_2`` on one GPU. ``shared_prefix`` (int
    ``[num_docs]``, DPO's shared prompt) adds ``usp_shared_prefix``, which only the ``usp`` attention reads.
    """
    if cu_seqlens is None:
        assert shared_prefix is None, "a shared prefix links documents: it needs cu_seqlens"
        return {}
    longest = int((cu_seqlens[1:] - cu_seqlens[:-1]).max()) if cu_seqlens.numel() > 1 else 0
    out: dict[str, object] = {
        "cu_seq_lens_q": cu_seqlens,
        "cu_seq_lens_k": cu_seqlens,
        "max_length_q": longest,
        "max_length_k": longest,
    }
    if shared_prefix is not None:
        out["usp_shared_prefix"] = shared_prefix
    return out


def _check_forward_inputs(module: nn.Module, args: tuple, kwargs: dict) -> None:
    # transformers drops the mask for attention functions without a mask builder, so refuse it here
    if kwargs.get("attention_mask") is not None or (len(args) > 1 and args[1] is not None):
        raise ValueError(
            "apply_usp'd models take no attention_mask (padding masks are not supported under sequence "
            "parallelism); pack documents and pass position_ids (restarting per document) and cu_seqlens."
        )
    mesh = getattr(module, _STATE_ATTR).mesh
    if mesh.sp_degree > 1 and kwargs.get("position_ids") is None:
        raise ValueError(
            "an apply_usp'd model needs position_ids under sequence parallelism: pass "
            "shard_sequence(global_position_ids, mesh) with this rank's input_ids slice."
        )


def apply_usp(
    model: PreTrainedModel,
    mesh: SPMesh,
    *,
    backend: str = "auto",
    attn_head_chunks: int = 1,
    capabilities: ModelCapabilities | None = None,
) -> PreTrainedModel:
    """Make ``model`` compute attention with USP over ``mesh`` (in place; returns ``model``).

    Afterwards ``model(input_ids=x, position_ids=p, **packed_sequence_kwargs(c))`` with
    ``x = shard_sequence(ids, mesh)``, ``p = shard_sequence(global_position_ids, mesh)`` (``[B, S_local]``) and
    ``c`` the global int32 document boundaries (or ``None``; ``cu_seqlens=c`` works too) returns this rank's
    slice of the logits ``[B, S_local, V]``, equal to the unsharded model's logits at those positions. Every
    rank of the mesh must call the model together.

    Any transformers causal LM whose every feature usp implements (docs/models.md): per-layer sliding windows
    and chunked attention, attention logit softcapping, sinks, MLA's narrower value heads, LongRoPE and Llama
    4's attention temperature (computed from global positions), and hybrid models' recurrent and convolution
    mixers (:mod:`usp.model.mixers`: gated DeltaNet, Mamba / Mamba2, short convolutions). Anything else raises ``ValueError`` naming
    the family and the config field (:func:`usp.model.capabilities.model_capabilities`; ``capabilities``
    passes a record already built). Also raises if the heads do not split over ``mesh.ulysses_degree`` (or
    into ``attn_head_chunks``).
    """
    config = model.config
    caps = capabilities if capabilities is not None else model_capabilities(config, model)
    caps.check("forward", setting=f"apply_usp({type(model).__name__})")
    check_heads(config, mesh.ulysses_degree)
    from usp.attention import check_attn_head_chunks
    from usp.model.global_positions import apply_global_positions
    from usp.model.mixers import apply_sequence_mixers

    hq = config.num_attention_heads
    check_attn_head_chunks(
        attn_head_chunks, hq, getattr(config, "num_key_value_heads", None) or hq, mesh.ulysses_degree
    )
    modules = attention_modules(model)
    AttentionInterface.register(ATTN_IMPLEMENTATION, usp_attention_forward)
    state = USPAttentionState(
        mesh=mesh, backend=backend, attn_head_chunks=attn_head_chunks, family=caps.model_type
    )
    assert len(modules) == sum(spec.attention for spec in caps.layers), (
        "the capability gate counted one attention module per attention layer"
    )
    for m in modules:
        layer = caps.layers[m.layer_idx]
        setattr(m, _STATE_ATTR, USPAttentionState(mesh, backend, attn_head_chunks, layer, caps.model_type))
    decoder = decoder_of(model)
    if not hasattr(decoder, _STATE_ATTR):
        decoder.register_forward_pre_hook(_check_forward_inputs, with_kwargs=True)
    setattr(decoder, _STATE_ATTR, state)
    apply_global_positions(model, mesh)
    apply_sequence_mixers(model, mesh)
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    return model
