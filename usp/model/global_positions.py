"""``apply_global_positions``: position-dependent terms that a sharded forward would compute from its slice.

Under sequence parallelism a rank's forward sees only its slice of the tokens, yet a few model families compute
a term from the *whole call*, not per token. :func:`usp.model.apply_usp` makes RoPE exact by feeding global
``position_ids``; these terms need more, installed here with hooks on module instances (no transformers class
is patched, so other models in the process are untouched):

- ``longrope`` (Phi-3 / Phi-4, PhiMoE) and ``dynamic_rope`` (dynamic NTK): transformers' ``dynamic_rope_update``
  picks the RoPE frequencies from ``max(position_ids) + 1`` of the call (long or short factor set; NTK
  rescaling; PhiMoE's rotary also its ``long_mscale``/``short_mscale``), so a rank holding only early tokens
  would rotate with other frequencies than the unsharded model. A forward pre-hook on the rotary embedding
  all-reduces ``max(position_ids)`` over ``mesh.sp_group`` (MAX, one int64: 8 bytes per rotary module per
  forward) and appends that position as one extra column; transformers' own code then chooses from the global
  maximum, and a forward hook drops the extra column from ``cos``/``sin`` (every position's row is computed on
  its own, so the others are bitwise those of the unsharded call).
- ``attn_temperature_tuning`` (Llama 4 NoPE layers): the query scale ``log1p(floor((i + 1) / floor_scale)) *
  attn_scale + 1`` uses the token index ``i = arange(local length) + cached tokens``. A pre-hook on the
  decoder passes the global index of every local token (forward kwarg ``usp_global_token_index``, int64
  ``[S_local]``: :func:`usp.parallel.mesh_token_indices` of the mesh's layout, with ``cu_seqlens`` for
  ``balanced``; no communication), the NoPE attention modules compute the model's scale from it, a forward
  hook on their ``q_proj`` applies it, and the module's own (local) scaling is switched off on the instance.
  Everything else the model derives from positions already sees the global ``position_ids``; its mask
  builders return ``None`` for the ``usp`` attention.

Nothing is installed when ``mesh.sp_degree == 1`` (the model is then exact on its own).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

from usp.parallel import SPMesh
from usp.parallel.sequence import mesh_token_indices

LONGROPE = "longrope"
DYNAMIC_ROPE = "dynamic_rope"
TEMPERATURE_TUNING = "attn_temperature_tuning"
TOKEN_INDEX_KWARG = "usp_global_token_index"
"""The decoder forward kwarg carrying each local token's global index (int64 ``[S_local]``)."""

_MESH_ATTR = "usp_global_positions"  # the mesh a hooked module reads; its presence marks "installed"
_SCALES_ATTR = "usp_query_scales"  # on q_proj: this call's query scales, set by the attention's pre-hook


# --- what a config needs ------------------------------------------------------------------------------------
def _rope_types(config: PretrainedConfig) -> set[str]:
    """Every ``rope_type`` of the config (``rope_parameters`` may be one dict or one per layer type)."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    blocks = [params] if "rope_type" in params or "type" in params else list(params.values())
    return {str(b.get("rope_type") or b.get("type")) for b in blocks if isinstance(b, dict)}


def _rope_need(rope_type: str) -> str | None:
    # transformers' dynamic_rope_update: "dynamic" in rope_type -> NTK update, "longrope" -> factor choice
    if rope_type == "longrope":
        return LONGROPE
    if "dynamic" in rope_type:
        return DYNAMIC_ROPE
    return None


def needs_global_positions(config: PretrainedConfig) -> list[str]:
    """What :func:`apply_global_positions` would install for a model of ``config`` (read from the config only,
    so a start-up gate can ask before any weight loads): a subset of ``["longrope", "dynamic_rope",
    "attn_temperature_tuning"]``, empty for models that are exact under sequence parallelism as they are."""
    text = config.get_text_config(decoder=True)
    needs = sorted({n for t in _rope_types(text) if (n := _rope_need(t)) is not None})
    no_rope_layers = getattr(text, "no_rope_layers", None) or []
    if getattr(text, "attn_temperature_tuning", False) and 0 in no_rope_layers:
        needs.append(TEMPERATURE_TUNING)
    return needs


# --- longrope / dynamic rope: choose from the global maximum position ---------------------------------------
def _with_global_max(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Rotary pre-hook: ``position_ids [..., S_local]`` -> ``[..., S_local + 1]``, the extra column being the
    largest position id over the sp group (all-reduce MAX of one int64)."""
    mesh: SPMesh = getattr(module, _MESH_ATTR)
    in_kwargs = "position_ids" in kwargs
    pos = kwargs["position_ids"] if in_kwargs else args[1]
    top = pos.max().reshape(1)
    if mesh.sp_degree > 1:
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=mesh.sp_group)
    extended = torch.cat([pos, top.expand(*pos.shape[:-1], 1)], dim=-1)
    if in_kwargs:
        return args, {**kwargs, "position_ids": extended}
    return (args[0], extended, *args[2:]), kwargs


def _drop_extra_position(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
    """Rotary forward hook: drop the appended column (dim -2 of ``cos``/``sin`` ``[..., S + 1, D]``)."""
    if isinstance(output, tuple):
        return tuple(t[..., :-1, :].contiguous() for t in output)
    return output[..., :-1, :].contiguous()


def _rotary_modules(model: nn.Module) -> list[tuple[nn.Module, str]]:
    found = []
    for m in model.modules():
        rope_type = getattr(m, "rope_type", None)
        if rope_type is None or not type(m).__name__.endswith("RotaryEmbedding"):
            continue
        types = rope_type.values() if isinstance(rope_type, dict) else [rope_type]
        needs = {n for t in types if (n := _rope_need(str(t))) is not None}
        found += [(m, n) for n in sorted(needs)]
    return found


# --- Llama 4 attention temperature tuning: scale queries by the global token index ---------------------------
def _local_length(args: tuple, kwargs: dict) -> tuple[int, torch.device]:
    for name in ("position_ids", "input_ids", "inputs_embeds"):
        x = kwargs.get(name)
        if x is not None:
            return (x.shape[-1] if name == "position_ids" else x.shape[1]), x.device
    assert args and args[0] is not None, "the decoder got no input_ids, inputs_embeds or position_ids"
    return args[0].shape[1], args[0].device


def _pass_token_index(decoder: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Decoder pre-hook: add ``usp_global_token_index`` (int64 ``[S_local]``) to the forward kwargs."""
    mesh: SPMesh = getattr(decoder, _MESH_ATTR)
    s, device = _local_length(args, kwargs)
    kv_cache = kwargs.get("usp_kv_cache")
    if kv_cache is not None and kv_cache.decoding:
        # usp.eval.decode: every rank runs the same new token(s), unsharded; before them the sharded cache
        # holds sum(held) - s tokens (``held`` already counts the new ones), the model's "past seen tokens"
        index = torch.arange(s) + (sum(kv_cache.held) - s)
    elif mesh.sp_degree == 1:
        index = torch.arange(s)
    else:
        cu = kwargs.get("cu_seq_lens_q")
        cu = kwargs.get("cu_seqlens") if cu is None else cu
        # placed by the balanced layout only, ignored by the others (as shard_sequence does)
        index = mesh_token_indices(mesh, s * mesh.sp_degree, cu)
    return args, {**kwargs, TOKEN_INDEX_KWARG: index.to(device)}


def _temperature_scales(attn: nn.Module, args: tuple, kwargs: dict) -> None:
    """NoPE attention pre-hook: this call's query scales, Llama4TextAttention's formula on global indices."""
    index = kwargs.get(TOKEN_INDEX_KWARG)
    if index is None:
        raise ValueError(
            f"{type(attn).__name__} (layer {attn.layer_idx}) was called without {TOKEN_INDEX_KWARG}: under "
            "apply_global_positions its temperature tuning needs the decoder's forward (call the model, not a "
            "layer alone)."
        )
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    past = cache.get_seq_length(attn.layer_idx) if cache is not None else 0
    positions = index + past
    # as in transformers' Llama4TextAttention.forward (float32 scales, then query * scales)
    scales = torch.log1p(torch.floor((positions.float() + 1.0) / attn.floor_scale)) * attn.attn_scale + 1.0
    setattr(attn.q_proj, _SCALES_ATTR, scales)


def _scale_queries(q_proj: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
    """``q_proj`` forward hook: ``[B, S, Hq * D]`` times the scale of each token (dim 1)."""
    scales = getattr(q_proj, _SCALES_ATTR)
    assert scales is not None and scales.numel() == output.size(1), "query scales not set for this call"
    setattr(q_proj, _SCALES_ATTR, None)
    return (output * scales[:, None]).to(output.dtype)


def _tuned_attention_modules(model: nn.Module) -> list[nn.Module]:
    """Attention modules whose temperature tuning applies (NoPE layers), hooked before or not."""
    found = []
    for m in model.modules():
        if not (
            hasattr(m, "attn_temperature_tuning") and hasattr(m, "floor_scale") and hasattr(m, "use_rope")
        ):
            continue
        if getattr(m, _MESH_ATTR, None) is None and not (m.attn_temperature_tuning and not m.use_rope):
            continue
        if hasattr(m, "qk_norm") or not isinstance(getattr(m, "q_proj", None), nn.Linear):
            raise ValueError(
                f"{type(m).__name__} (layer {getattr(m, 'layer_idx', '?')}) uses attention temperature tuning "
                "with a query path other than q_proj -> scale (a norm in between, or no q_proj Linear); usp "
                "cannot make it exact under sequence parallelism. Set attn_temperature_tuning=false in the "
                "model config or train with parallel.ulysses_degree=1 parallel.ring_degree=1."
            )
        found.append(m)
    return found


def _layer_stack(model: nn.Module, tuned: list[nn.Module]) -> nn.Module:
    """The module whose forward runs the decoder layers holding ``tuned`` (its ``layers`` list).

    Not ``model.get_decoder()``: for ``Llama4ForCausalLM`` (transformers 5.24) that returns the whole LM,
    whose ``base_model_prefix`` names no attribute, and a direct call of the text model would miss the hook.
    """
    targets = {id(a) for a in tuned}
    for m in model.modules():
        layers = getattr(m, "layers", None)
        if isinstance(layers, nn.ModuleList) and any(id(x) in targets for x in layers.modules()):
            return m
    raise ValueError(
        f"apply_global_positions found no decoder-layer list (a `layers` ModuleList) holding the attention "
        f"modules of {type(model).__name__}; its attention temperature tuning cannot be made exact."
    )


# --- installation ---------------------------------------------------------------------------------------------
def installed_global_positions(model: nn.Module) -> list[str]:
    """The names of what :func:`apply_global_positions` has installed on ``model`` (for logs and tests)."""
    names = {need for m, need in _rotary_modules(model) if getattr(m, _MESH_ATTR, None) is not None}
    if any(getattr(m, _MESH_ATTR, None) is not None for m in _tuned_attention_modules(model)):
        names.add(TEMPERATURE_TUNING)
    return sorted(names)


def _install(module: nn.Module, mesh: SPMesh) -> bool:
    """Point ``module``'s hooks at ``mesh``; True when it had none yet (the caller registers them)."""
    new = getattr(module, _MESH_ATTR, None) is None
    setattr(module, _MESH_ATTR, mesh)
    return new


def apply_global_positions(model: PreTrainedModel, mesh: SPMesh) -> list[str]:
    """Make ``model``'s whole-call position terms those of the unsharded model on the same global inputs.

    In place, on a model :func:`usp.model.apply_usp` prepared (apply_usp calls it; a second call is harmless).
    Returns the names of what this call installed (a subset
    of :func:`needs_global_positions`' names; ``[]`` when ``mesh.sp_degree == 1`` or when everything was
    installed before: a second call only points the hooks at ``mesh``). Communication per forward, over
    ``mesh.sp_group``: one all-reduce of one int64 (8 bytes) per rotary embedding for ``longrope`` and
    ``dynamic_rope``; nothing for ``attn_temperature_tuning`` (each rank computes its tokens' global indices
    from the layout, host to device ``8 x S_local`` bytes). Every rank of the sp group must call the model
    together (as apply_usp requires anyway), with ``position_ids`` on the device of the sp group's backend.
    Raises ``ValueError`` for an attention whose temperature tuning is not ``q_proj -> scale``.
    """
    installed: list[str] = []
    if mesh.sp_degree == 1 and not any(getattr(m, _MESH_ATTR, None) is not None for m in model.modules()):
        return installed  # one rank holds the whole sequence: the model's own terms are the unsharded ones
    tuned = _tuned_attention_modules(model)  # its checks run before anything changes
    for rotary, need in _rotary_modules(model):
        if _install(rotary, mesh):
            rotary.register_forward_pre_hook(_with_global_max, with_kwargs=True)
            rotary.register_forward_hook(_drop_extra_position, with_kwargs=True)
            installed.append(need)
    if tuned:
        decoder = _layer_stack(model, tuned)
        new_decoder = _install(decoder, mesh)
        if new_decoder:
            decoder.register_forward_pre_hook(_pass_token_index, with_kwargs=True)
        new_attention = False
        for attn in tuned:
            if _install(attn, mesh):
                attn.attn_temperature_tuning = False  # the instance's local-index scaling; ours replaces it
                attn.register_forward_pre_hook(_temperature_scales, with_kwargs=True)
                setattr(attn.q_proj, _SCALES_ATTR, None)
                attn.q_proj.register_forward_hook(_scale_queries)
                new_attention = True
        assert new_decoder == new_attention, "decoder and attention hooks are installed together"
        if new_attention:
            installed.append(TEMPERATURE_TUNING)
    return sorted(set(installed))
