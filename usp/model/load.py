"""Loading a local Hugging Face causal LM checkpoint: validation first, RoPE overrides, dtype.

Everything here runs on every rank and touches only local files. :func:`check_model_dir` reads nothing but
``config.json`` and file names, so a bad ``model.path`` fails fast (a ``ValueError`` naming the setting)
before any weights, data or process-group work.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from usp.model.capabilities import Purpose, causal_lm_class, model_capabilities
from usp.model.lora import base_key, base_state, has_lora, is_adapter_key
from usp.model.moe_weights import ExpertFill, plan_weights

DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float16": torch.float16,
}

_WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin")


def parse_dtype(name: str, setting: str = "model.dtype") -> torch.dtype:
    """``"bfloat16"`` -> ``torch.bfloat16``; ``ValueError`` naming ``setting`` for anything else."""
    if name not in DTYPES:
        raise ValueError(f"{setting}={name!r} is not supported; use one of {sorted(DTYPES)}.")
    return DTYPES[name]


def check_model_dir(path: str | os.PathLike | None, purpose: Purpose = "train") -> PretrainedConfig:
    """Validate a local checkpoint dir and return its config, without loading weights.

    Raises ``ValueError`` (naming ``model.path`` and the fix) when the dir is missing, has no ``config.json``
    or no weight files, the config does not parse, or the model needs something usp does not implement for
    ``purpose`` (``train``, or ``forward`` for evaluation): the capability gate,
    :meth:`usp.model.capabilities.ModelCapabilities.check`, which names the config field.
    """
    if path is None or str(path) in ("", "???"):
        raise ValueError(
            "model.path is not set: point it at a local Hugging Face checkpoint dir "
            "(config.json + *.safetensors + tokenizer files), e.g. model.path=/ckpts/Meta-Llama-3.1-8B."
        )
    p = Path(path)
    if not p.is_dir():
        raise ValueError(
            f"model.path={str(path)!r} does not exist or is not a directory. Point it at a local Hugging Face "
            f"checkpoint dir (config.json + *.safetensors + tokenizer files); nothing is downloaded."
        )
    if not (p / "config.json").is_file():
        raise ValueError(
            f"model.path={str(path)!r} has no config.json, so it is not a Hugging Face checkpoint dir. "
            f"Point model.path at the dir that holds config.json and the *.safetensors files."
        )
    try:
        config = AutoConfig.from_pretrained(str(p), local_files_only=True)
    except Exception as e:  # noqa: BLE001 - any parse failure is the user's file
        raise ValueError(
            f"model.path={str(path)!r}: config.json could not be read ({type(e).__name__}: {e}). "
            f"Fix or replace the file (it must be a transformers model config)."
        ) from e
    model_capabilities(config).check(purpose, setting=f"model.path={str(path)!r}")
    if not any(any(p.glob(pattern)) for pattern in _WEIGHT_PATTERNS):
        raise ValueError(
            f"model.path={str(path)!r} has config.json but no weight files (*.safetensors or "
            f"pytorch_model*.bin). Copy the complete checkpoint there."
        )
    return config


def check_weight_headers(path: str | os.PathLike) -> None:
    """``ValueError`` naming ``model.path`` when a ``*.safetensors`` file of ``path`` does not open (a truncated
    or damaged header: an interrupted copy). Reads the headers only."""
    from safetensors import safe_open

    for f in sorted(Path(path).glob("*.safetensors")):
        try:
            with safe_open(str(f), framework="pt"):
                pass
        except Exception as e:  # noqa: BLE001 - SafetensorError and OSError alike: the user's file
            raise ValueError(f"model.path={str(path)!r}: {f.name}: {_unreadable(e, 'usp')}") from e


def apply_rope_overrides(
    config: PretrainedConfig,
    *,
    rope_theta: float | None = None,
    rope_scaling: dict[str, Any] | None = None,
    max_position_embeddings: int | None = None,
) -> PretrainedConfig:
    """Apply context-extension overrides to ``config`` in place (and return it).

    transformers 5.x keeps RoPE settings in ``config.rope_parameters`` (``rope_type``, ``rope_theta``,
    ``factor``, ...); 4.x kept top-level ``rope_theta`` and ``rope_scaling``. Both spellings are handled:
    ``rope_scaling`` may use ``type`` or ``rope_type``.
    """
    if rope_scaling is not None and not isinstance(rope_scaling, dict):
        raise ValueError(
            f"model.rope_scaling={rope_scaling!r} must be a mapping such as {{rope_type: linear, factor: 4.0}}."
        )
    scaling = dict(rope_scaling or {})
    if "type" in scaling and "rope_type" not in scaling:
        scaling["rope_type"] = scaling.pop("type")
    if rope_theta is not None and rope_theta <= 0:
        raise ValueError(f"model.rope_theta={rope_theta} must be positive.")
    if getattr(config, "rope_parameters", None) is not None:
        params = dict(config.rope_parameters)
        params.update(scaling)
        if rope_theta is not None:
            params["rope_theta"] = float(rope_theta)
        config.rope_parameters = params
    else:  # transformers 4.x spelling
        if rope_theta is not None:
            config.rope_theta = float(rope_theta)
        if scaling:
            config.rope_scaling = scaling
    if max_position_embeddings is not None:
        if max_position_embeddings < 1:
            raise ValueError(f"model.max_position_embeddings={max_position_embeddings} must be >= 1.")
        config.max_position_embeddings = int(max_position_embeddings)
    return config


def rope_settings(config: PretrainedConfig) -> dict[str, Any]:
    """The RoPE settings in effect, whichever spelling the config uses (for logs and tests)."""
    if getattr(config, "rope_parameters", None) is not None:
        return dict(config.rope_parameters)
    return {
        "rope_theta": getattr(config, "rope_theta", None),
        **(getattr(config, "rope_scaling", None) or {}),
    }


def _loading_attention(config: PretrainedConfig) -> str:
    """The attention a model is built with before ``apply_usp`` switches it: ``sdpa`` where the family has it,
    else ``eager`` (Gemma 2 has no SDPA: asking for it failed the load)."""
    cls = causal_lm_class(config)
    return "sdpa" if cls is None or getattr(cls, "_supports_sdpa", False) else "eager"


def load_causal_lm(
    path: str | os.PathLike,
    *,
    dtype: torch.dtype = torch.bfloat16,
    rope_theta: float | None = None,
    rope_scaling: dict[str, Any] | None = None,
    max_position_embeddings: int | None = None,
    config: PretrainedConfig | None = None,
) -> PreTrainedModel:
    """Load the checkpoint at ``path`` on CPU in ``dtype``, with the RoPE overrides applied.

    ``config`` may be the one :func:`check_model_dir` returned (it is modified in place by the overrides).
    The model is returned in train mode with the KV cache off; attention is ``sdpa`` until
    :func:`usp.model.apply_usp` switches it.
    """
    if config is None:
        config = check_model_dir(path)
    apply_rope_overrides(
        config,
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=max_position_embeddings,
    )
    config.use_cache = False
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(path),
            config=config,
            dtype=dtype,
            local_files_only=True,
            attn_implementation=_loading_attention(config),
        )
    except Exception as e:  # noqa: BLE001 - SafetensorError, OSError...: a damaged or incomplete file
        if isinstance(e, ValueError) and str(e).startswith("model.path="):
            raise
        raise ValueError(f"model.path={str(path)!r}: {_unreadable(e, 'transformers')}") from e
    model.train()
    return model


# --- memory-frugal loading: empty model first, weights after FSDP2 sharding -------------------------------
_BUFFERS_ATTR = "_usp_non_persistent_buffers"


@contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Build modules with every parameter on the meta device as it is registered (before any initialisation
    runs on it) and every buffer on the CPU, as constructed: non-persistent buffers (RoPE ``inv_freq``,
    Gemma's ``embed_scale``) are computed by the constructors and are not in a checkpoint."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def build_empty_causal_lm(config: PretrainedConfig) -> PreTrainedModel:
    """The model's skeleton with its parameters on the meta device (no memory), fp32, train mode.

    Shard it (``usp.train.parallelize``), then :func:`load_sharded_weights` fills this rank's shards: no rank
    ever holds the whole model in fp32. The non-persistent buffers the constructors computed are kept aside
    (on the model, host copies) and put back by :func:`materialize_empty`.
    """
    config.use_cache = False
    with _parameters_on_meta():
        model = AutoModelForCausalLM.from_config(
            config, dtype=torch.float32, attn_implementation=_loading_attention(config)
        )
    kept = {}
    for name, module in model.named_modules():
        for buf in getattr(module, "_non_persistent_buffers_set", ()):
            value = module._buffers.get(buf)
            if value is not None:
                kept[(name, buf)] = value.detach().clone()
    setattr(model, _BUFFERS_ATTR, kept)
    for module in model.modules():  # buffers follow the parameters to meta; materialize_empty places them
        for buf, value in module._buffers.items():
            if value is not None:
                module._buffers[buf] = value.to("meta")
    model.train()
    return model


def read_full_state_dict(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint at ``path`` on CPU, in its stored dtype (``*.safetensors`` or ``*.bin``)."""
    from safetensors.torch import load_file

    p = Path(path)
    state: dict[str, torch.Tensor] = {}
    files = sorted(p.glob("*.safetensors"))
    if files:
        for f in files:
            state.update(load_file(str(f), device="cpu"))
    else:
        for f in sorted(p.glob("pytorch_model*.bin")):
            state.update(torch.load(f, map_location="cpu", weights_only=True, mmap=True))
    return state


def reset_rotary_buffers(model: nn.Module, device: torch.device) -> None:
    """Recompute non-persistent buffers (RoPE ``inv_freq``) on ``device``; neither ``to_empty`` nor a load
    fills them."""
    for name, module in model.named_modules():
        own = getattr(module, "_non_persistent_buffers_set", set())
        if not own:
            continue
        if not type(module).__name__.endswith("RotaryEmbedding"):
            raise ValueError(
                f"{name} ({type(module).__name__}) has non-persistent buffers {sorted(own)} that the sharded "
                f"loader cannot rebuild; this model family is not supported."
            )
        fresh = type(module)(config=module.config)
        for buf_name, buf in fresh.named_buffers(recurse=False):
            module._buffers[buf_name] = buf.to(
                device
            )  # on the compute device, even when params are offloaded
        if hasattr(fresh, "attention_scaling"):
            module.attention_scaling = fresh.attention_scaling


def weight_devices(device: torch.device, *, cpu_offload: bool = False) -> tuple[torch.device, torch.device]:
    """``(param_device, buffer_device)`` for materializing a sharded model that computes on ``device``.

    FSDP2's ``CPUOffloadPolicy`` keeps the parameter shards in host memory and copies them to the device per
    layer, so it requires them materialized on the CPU; the RoPE ``inv_freq`` buffers are not managed by FSDP2
    and must stay on the compute device.
    """
    return (torch.device("cpu") if cpu_offload else device), device


def _shared_parameters(
    model: nn.Module,
) -> list[tuple[nn.Module, str, list[tuple[nn.Module, str]]]]:
    """Each parameter registered in more than one place: its first ``(module, name)`` and the others."""
    seen: dict[int, tuple[nn.Module, str, list[tuple[nn.Module, str]]]] = {}
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is None:
                continue
            entry = seen.setdefault(id(param), (module, name, []))
            if entry[0] is not module or entry[1] != name:
                entry[2].append((module, name))
    return [entry for entry in seen.values() if entry[2]]


@torch.no_grad()
def materialize_empty(
    model: nn.Module, *, device: torch.device, param_device: torch.device | None = None
) -> None:
    """Allocate a meta-device (possibly FSDP2-sharded) model: parameters and persistent buffers (uninitialised)
    on ``param_device`` (default ``device``), then the non-persistent buffers (RoPE ``inv_freq``, Gemma's
    ``embed_scale``, ...) on ``device``: those :func:`build_empty_causal_lm` kept, else the RoPE buffers
    rebuilt from the config. A parameter that several modules share (tied embeddings) stays one parameter:
    ``to_empty`` gives each module its own copy of a plain one (FSDP2's shards keep the sharing; a world of one
    without FSDP2, :func:`usp.train.parallelize.needs_fsdp`, has plain ones), and a load fills only the first."""
    shared = _shared_parameters(model)
    model.to_empty(device=param_device or device)
    for owner, name, others in shared:
        param = owner._parameters[name]
        for module, attr in others:
            module._parameters[attr] = param
    kept = getattr(model, _BUFFERS_ATTR, None)
    if kept is None:  # not built by build_empty_causal_lm: rebuild the RoPE buffers from the config
        reset_rotary_buffers(model, device)
        return
    modules = dict(model.named_modules())
    for (name, buf), value in kept.items():  # on the compute device, even when params are offloaded
        modules[name]._buffers[buf] = value.to(device)


def _weights_mismatch(
    model: nn.Module, stored: set[str]
) -> tuple[dict[str, str], dict[str, ExpertFill], str | None]:
    """``(model key -> stored key, model key -> ExpertFill, error)``: which stored tensor fills each model tensor,
    how each fused expert parameter is built from per-expert stored tensors (:mod:`usp.model.moe_weights`:
    transformers' conversion rules for the model), or what does not fit.

    A tied ``lm_head.weight`` missing from the files is filled from ``model.embed_tokens.weight``; RoPE
    ``inv_freq`` buffers that old exports saved are ignored.
    """
    stored = {k for k in stored if not k.endswith("rotary_emb.inv_freq")}
    head, embed = "lm_head.weight", "model.embed_tokens.weight"
    try:
        plan = plan_weights(model, stored)
    except ValueError as e:  # an expert layout the rules cannot map: named by plan_weights
        return {}, {}, str(e)
    sources = dict(plan.identity)
    if getattr(model.config, "tie_word_embeddings", False) and head not in stored and embed in stored:
        sources[head] = embed
    missing = sorted(k for k in plan.missing if k not in sources)
    unexpected = sorted(plan.unexpected)
    if not missing and not unexpected:
        return sources, plan.experts, None
    return (
        sources,
        plan.experts,
        (
            f"the weights do not match the model its config.json describes (missing {missing[:5]}"
            f"{' ...' if len(missing) > 5 else ''}, unexpected {unexpected[:5]}"
            f"{' ...' if len(unexpected) > 5 else ''}). Point model.path at a complete checkpoint whose "
            f"weights and config.json belong together."
        ),
    )


def _unreadable(e: Exception, who: str) -> str:
    return (
        f"{who} could not read the weights ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}). "
        f"A weight file is damaged or incomplete (an interrupted copy?): copy the checkpoint again, then rerun."
    )


@torch.no_grad()
def load_sharded_weights(
    model: PreTrainedModel,
    path: str | os.PathLike,
    *,
    device: torch.device,
    param_device: torch.device | None = None,
    materialize: bool = True,
) -> None:
    """Materialize a meta-device, FSDP2-sharded ``model`` and load the checkpoint into it.

    ``materialize=False``: ``model`` holds weights already (the same shapes); they are overwritten in place
    (DPO's reference checkpoint loaded into the training model for one pass, then the policy's again).

    ``device`` is the compute device (RoPE buffers live there); ``param_device`` (default ``device``) holds the
    parameter shards: the CPU under FSDP2 CPU offload (:func:`weight_devices`).

    Collective: call on every rank. ``*.safetensors`` checkpoints are read shard by shard: every rank reads
    only the slices of its own parameter shards (``torch.distributed.checkpoint`` with its Hugging Face
    storage reader), so no host holds the whole model (a 70B checkpoint is ~140 GB). ``pytorch_model*.bin``
    checkpoints cannot be sliced: rank 0 reads them and broadcasts each tensor. Mixture-of-experts checkpoints
    store each expert's tensors apart while the model holds them fused (``experts.gate_up_proj`` ``[E, 2I, H]``):
    transformers' conversion rules say which stored tensors build which parameter
    (:func:`usp.model.moe_weights.plan_weights`); each rank reads the tensors of the experts of its own
    ``Shard(0)`` rows only, and the broadcast path builds the fused tensors on rank 0. Either way the values are
    upcast to the fp32 parameters, missing or unexpected keys raise, and a checkpoint some rank cannot read
    (a truncated or corrupt file) raises ``ValueError`` naming ``model.path`` on *every* rank.
    """
    if materialize:
        materialize_empty(model, device=device, param_device=param_device)
    if any(Path(path).glob("*.safetensors")):
        _load_safetensors_shards(model, path)
    else:
        _load_broadcast_from_rank0(model, path)


def _load_safetensors_shards(model: PreTrainedModel, path: str | os.PathLike) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from safetensors import safe_open
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.checkpoint.api import CheckpointException

    error: str | None = None
    sources: dict[str, str] = {}
    experts: dict[str, ExpertFill] = {}
    files: dict[str, str] = {}  # stored tensor -> its file
    try:  # headers only: every rank computes the same answer, no collective needed
        for f in sorted(Path(path).glob("*.safetensors")):
            with safe_open(str(f), framework="pt") as handle:
                files.update(dict.fromkeys(handle.keys(), str(f)))
    except Exception as e:  # noqa: BLE001 - a header that does not parse is a damaged file
        error = _unreadable(e, "this rank")
    if error is None:
        sources, experts, error = _weights_mismatch(model, set(files))
    if error is None and experts:
        error = _expert_shapes_mismatch(experts, files)
    if error is not None:
        raise ValueError(f"model.path={str(path)!r}: {error}")
    state = base_state(model)  # DTensor shards: DCP reads only the slices this rank owns, in place
    if experts:  # fused expert parameters: each rank reads the per-expert tensors of its own experts
        _load_expert_shards(state, experts, files, path)
    # identity tensors (renamed ones too); not the tied lm_head, whose source is the embedding already requested
    request = {src: state[key] for key, src in sources.items() if key == src or src not in state}
    try:
        dcp.load(request, storage_reader=HuggingFaceStorageReader(str(path)), process_group=dist.group.WORLD)
    except CheckpointException as e:  # raised on every rank when any rank failed to read
        failures = getattr(e, "failures", {}) or {}
        first = next(iter(failures.values()), e)
        raise ValueError(
            f"model.path={str(path)!r}: {_unreadable(first, f'rank(s) {sorted(failures)}')}"
        ) from e


def _expert_shapes_mismatch(experts: dict[str, ExpertFill], files: dict[str, str]) -> str | None:
    """What does not fit between the fused expert parameters and the shapes in the safetensors headers."""
    from safetensors import safe_open

    by_file: dict[str, list[str]] = {}
    for fill in experts.values():
        for part in fill.parts:
            for name in part:
                by_file.setdefault(files[name], []).append(name)
    shapes: dict[str, list[int]] = {}
    try:
        for f, names in by_file.items():
            with safe_open(f, framework="pt") as handle:
                shapes.update({name: handle.get_slice(name).get_shape() for name in names})
    except Exception as e:  # noqa: BLE001 - a header that does not parse is a damaged file
        return _unreadable(e, "this rank")
    try:
        for key, fill in experts.items():
            fill.check_shapes(key, shapes)
    except ValueError as e:
        return str(e)
    return None


def _first_local_row(param: torch.Tensor) -> int:
    """The global index along dim 0 of the first row of this rank's shard of ``param``: a plain tensor, or a
    DTensor replicated or sharded along dim 0 (FSDP2's ``Shard(0)``; uneven: the last ranks hold fewer rows, or
    none)."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(param, DTensor):
        return 0
    start, length = 0, param.shape[0]
    for mesh_dim, placement in enumerate(param.placements):
        if isinstance(placement, Shard) and placement.dim == 0:
            n, i = param.device_mesh.size(mesh_dim), param.device_mesh.get_local_rank(mesh_dim)
            chunk = -(-length // n)  # torch.chunk's split, as DTensor's Shard
            first, end = min(i * chunk, length), min((i + 1) * chunk, length)
            start, length = start + first, end - first
        elif placement.is_shard():
            length = -1
            break
    if length != param.to_local().shape[0]:
        raise ValueError(
            f"a fused expert parameter is sharded as {param.placements} over {param.device_mesh}; usp's expert "
            f"loader reads parameters sharded along the experts dim (Shard(0), as FSDP2) or replicated."
        )
    return start


def _load_expert_shards(
    state: dict[str, torch.Tensor],
    experts: dict[str, ExpertFill],
    files: dict[str, str],
    path: str | os.PathLike,
) -> None:
    """Collective: fill each fused expert parameter's local rows from the stored tensors of this rank's experts
    (``safe_open(...).get_tensor``, upcast by the copy); a rank that cannot read raises on every rank."""
    import torch.distributed as dist

    from usp.parallel.agree import raise_if_any_failed

    error: ValueError | None = None
    try:  # the same answer on every rank (shards of one model); agreed on below all the same
        firsts = {key: _first_local_row(state[key]) for key in experts}
    except ValueError as e:
        error = ValueError(f"model.path={str(path)!r}: {e}")
    if error is None:
        try:
            _read_local_experts(state, experts, files, firsts)
        except Exception as e:  # noqa: BLE001 - shared with every rank below, then raised there
            error = ValueError(f"model.path={str(path)!r}: {_unreadable(e, f'rank {dist.get_rank()}')}")
    raise_if_any_failed(error, "loading the expert weights")


def _read_local_experts(
    state: dict[str, torch.Tensor],
    experts: dict[str, ExpertFill],
    files: dict[str, str],
    firsts: dict[str, int],
) -> None:
    """Copy rows ``firsts[key] ..`` of each fused expert parameter from their per-expert stored tensors."""
    from contextlib import ExitStack

    from safetensors import safe_open
    from torch.distributed.tensor import DTensor

    with ExitStack() as stack:
        handles: dict[str, Any] = {}

        def read(name: str) -> torch.Tensor:
            f = files[name]
            if f not in handles:
                handles[f] = stack.enter_context(safe_open(f, framework="pt"))
            return handles[f].get_tensor(name)

        for key, fill in experts.items():
            param = state[key]
            local = param.to_local() if isinstance(param, DTensor) else param
            if local.shape[0] == 0:  # uneven sharding: this rank holds none of the experts
                continue
            if local.device.type == "cpu":
                fill.fill_rows(local, firsts[key], read)
            else:  # built on the host, one copy to the device
                rows = torch.empty(local.shape, dtype=local.dtype)
                fill.fill_rows(rows, firsts[key], read)
                local.copy_(rows)


def _load_broadcast_from_rank0(model: PreTrainedModel, path: str | os.PathLike) -> None:
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    from usp.parallel.agree import raise_if_any_failed

    state: dict[str, torch.Tensor] = {}
    error: str | None = None
    if dist.get_rank() == 0:
        try:
            state = read_full_state_dict(path)
        except Exception as e:  # noqa: BLE001 - shared with every rank below, then raised there
            error = _unreadable(e, "rank 0")
        sources, experts, mismatch = _weights_mismatch(model, set(state))
        error = error or mismatch
        fused: dict[str, torch.Tensor] = {}
        if error is None:  # the fused expert parameters, whole, built here and broadcast like the rest
            try:
                shapes = {name: list(tensor.shape) for name, tensor in state.items()}
                for key, fill in experts.items():
                    fill.check_shapes(key, shapes)
                    fused[key] = fill.build(state.__getitem__)
            except ValueError as e:
                error = str(e)
        state = {key: state[src] for key, src in sources.items() if src in state} | fused
    raise_if_any_failed(
        None if error is None else ValueError(f"model.path={str(path)!r}: {error}"), "loading weights"
    )
    adapted = has_lora(model)  # LoRA: the base's names -> the model's; the adapters are initialized apart
    if adapted and dist.get_rank() == 0:
        names = {base_key(k): k for k in model.state_dict() if not is_adapter_key(k)}
        state = {names[k]: v for k, v in state.items()}
    set_model_state_dict(
        model,
        state,
        options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=not adapted),
    )
