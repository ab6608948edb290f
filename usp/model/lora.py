"""Low-rank adapters (LoRA, through ``peft``) on a frozen base model, before it is sharded.

:func:`apply_lora` injects ``peft``'s LoRA layers in place (``peft.inject_adapter_in_model``: no ``PeftModel``
wrapper, so the decoder, its layers and ``apply_usp`` see the model they know). Each adapted ``nn.Linear``
``X`` becomes a ``peft`` ``lora.Linear`` whose base weight is ``X.base_layer.weight`` and whose adapter is
``X.lora_A.default.weight`` ``[r, in]`` and ``X.lora_B.default.weight`` ``[out, r]``; the forward adds
``(alpha / r) * B(A(dropout(x)))``. Everything else is frozen (``requires_grad=False``) unless
``train_embeddings_and_norms`` (LongLoRA: the input embeddings and every normalization layer train too).

The names matter to three other places, which use the helpers here:

- loading the base checkpoint (:func:`base_key`: ``X.base_layer.weight`` is stored as ``X.weight``; the adapter
  tensors are not in it and are initialized by :func:`init_adapter_weights`);
- the distributed checkpoint (frozen parameters are not saved: the base is ``model.path`` itself);
- the exports (:func:`peft_adapter_state`: ``peft``'s own adapter file layout; :func:`merged_state`: the base
  weights with ``W + (alpha / r) B A``, a plain Hugging Face checkpoint).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import torch
from torch import nn

ADAPTER = "default"
"""The ``peft`` adapter name usp trains (one adapter per model)."""
_ADAPTER_PARTS = (".lora_A.", ".lora_B.")


@dataclasses.dataclass(frozen=True)
class LoraSpec:
    """What :func:`apply_lora` builds (``model.lora.*`` of the run config)."""

    rank: int
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] | None = None
    """Last-component names of the adapted linear layers; ``None``: :func:`default_target_modules`."""
    train_embeddings_and_norms: bool = False

    @property
    def scale(self) -> float:
        """The adapter's output scale ``alpha / rank``."""
        return self.alpha / self.rank


def _decoder_linears(model: nn.Module) -> dict[str, nn.Linear]:
    """Every ``nn.Linear`` inside the decoder blocks (``*.layers.<i>.*``), by qualified name."""
    return {
        name: m
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear) and ".layers." in f".{name}" and "lora_" not in name
    }


def default_target_modules(model: nn.Module) -> tuple[str, ...]:
    """The attention and MLP projections: the last-component names of the decoder blocks' linear layers that
    end in ``proj`` (``q_proj`` ... ``down_proj``, MLA's ``kv_a_proj_with_mqa``; not a router's ``gate``)."""
    names = {name.rsplit(".", 1)[-1] for name in _decoder_linears(model)}
    return tuple(sorted(n for n in names if "proj" in n))


def check_lora_spec(spec: LoraSpec, model: nn.Module, setting: str = "model.lora") -> tuple[str, ...]:
    """``ValueError`` naming the setting for an impossible LoRA setting; returns the target module names.

    ``model`` may live on the meta device (only its module names and classes are read)."""
    if isinstance(spec.rank, bool) or not isinstance(spec.rank, int) or spec.rank < 1:
        raise ValueError(f"{setting}.rank={spec.rank!r} must be an integer >= 1 (0 turns LoRA off).")
    if not spec.alpha > 0:
        raise ValueError(f"{setting}.alpha={spec.alpha!r} must be > 0 (the adapters' scale is alpha / rank).")
    if not 0 <= spec.dropout < 1:
        raise ValueError(f"{setting}.dropout={spec.dropout!r} must be in [0, 1).")
    linears = {name.rsplit(".", 1)[-1] for name in _decoder_linears(model)}
    if spec.target_modules is None:
        targets = default_target_modules(model)
        if not targets:
            raise ValueError(
                f"{setting}.target_modules: {type(model).__name__} has no linear layer named *proj* in its "
                f"decoder blocks; name the layers to adapt, e.g. {setting}.target_modules=[{sorted(linears)[0]}]"
                if linears
                else f"{setting}: {type(model).__name__} has no linear layers in its decoder blocks to adapt."
            )
        return targets
    targets = tuple(spec.target_modules)
    unknown = sorted(set(targets) - linears)
    if not targets or unknown:
        raise ValueError(
            f"{setting}.target_modules={list(targets)}: "
            + (f"no linear layer of the decoder blocks is named {unknown}" if unknown else "empty")
            + f". Choose among {sorted(linears)} (or leave it null: the attention and MLP projections)."
        )
    return targets


def resolve_lora(spec: LoraSpec, model: nn.Module) -> LoraSpec:
    """``spec`` checked (:func:`check_lora_spec`) with its target modules named (the default resolved); call on
    the model before :func:`apply_lora`."""
    return dataclasses.replace(spec, target_modules=check_lora_spec(spec, model))


def _peft_config(spec: LoraSpec, targets: tuple[str, ...]):  # noqa: ANN202 - peft is imported lazily
    from peft import LoraConfig

    return LoraConfig(
        r=spec.rank,
        lora_alpha=spec.alpha,
        lora_dropout=spec.dropout,
        target_modules=list(targets),
        bias="none",
    )


def embeddings_and_norms(model: nn.Module) -> list[str]:
    """Qualified names of the input embeddings and every normalization module (LongLoRA's trainable extras)."""
    embed = model.get_input_embeddings()
    names = []
    for name, m in model.named_modules():
        if m is embed or type(m).__name__.endswith(("Norm", "RMSNorm", "LayerNorm")):
            if any(True for _ in m.parameters(recurse=False)):
                names.append(name)
    return names


def apply_lora(model: nn.Module, spec: LoraSpec) -> tuple[str, ...]:
    """Inject LoRA adapters into ``model`` in place and freeze the rest; returns the adapted module names.

    Call before ``apply_usp`` and FSDP2 (their parameters are sharded with the rest; a frozen parameter gets no
    gradient, no reduce-scatter and no optimizer state). ``model`` may be on the meta device: the adapters'
    values come from :func:`init_adapter_weights` after the base weights are loaded.
    """
    from peft import inject_adapter_in_model

    targets = check_lora_spec(spec, model) if spec.target_modules is None else tuple(spec.target_modules)
    inject_adapter_in_model(_peft_config(spec, targets), model, adapter_name=ADAPTER)
    for name, p in model.named_parameters():
        p.requires_grad_(is_adapter_key(name))
    if spec.train_embeddings_and_norms:
        modules = dict(model.named_modules())
        for name in embeddings_and_norms(model):
            for p in modules[name].parameters(recurse=False):
                p.requires_grad_(True)
    return targets


def has_lora(model: nn.Module) -> bool:
    """Whether ``model`` carries adapters injected by :func:`apply_lora`."""
    return any(is_adapter_key(name) for name, _ in model.named_parameters())


def is_adapter_key(name: str) -> bool:
    """``...lora_A.default.weight`` / ``...lora_B.default.weight``: an adapter tensor."""
    return any(part in name for part in _ADAPTER_PARTS)


def base_key(name: str) -> str:
    """The name a base tensor of an adapted layer has in the base checkpoint (``X.base_layer.weight`` ->
    ``X.weight``); other names unchanged."""
    return name.replace(".base_layer.", ".")


def base_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` as the base checkpoint names it: adapter tensors left out, ``base_layer`` names
    undone (:func:`base_key`). The same tensors (views of the parameters): loading into them fills the model.
    For a model without adapters, its state dict."""
    return {base_key(k): v for k, v in model.state_dict().items() if not is_adapter_key(k)}


@torch.no_grad()
def init_adapter_weights(model: nn.Module, seed: int) -> None:
    """Give every adapter ``peft``'s initial values: ``A`` Kaiming-uniform (``a = sqrt(5)``), ``B`` zero, so
    the adapted model starts equal to the base.

    The values are drawn whole, from one generator seeded with ``seed``, in the module order, then each rank
    keeps its own shard (FSDP2 ``DTensor`` parameters; plain ones are filled whole): every layout starts from
    the same adapters. No collective.
    """
    from torch.distributed.tensor import DTensor, distribute_tensor

    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if not is_adapter_key(name):
            continue
        full = torch.zeros(p.shape, dtype=p.dtype)
        if ".lora_A." in name:
            nn.init.kaiming_uniform_(full, a=math.sqrt(5), generator=gen)
        if isinstance(p, DTensor):
            local = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None).to_local()
            p.to_local().copy_(local)
        else:
            p.copy_(full)


def _module_of(key: str) -> str:
    return key.rsplit(".", 1)[0]


def tied_output_module(model: nn.Module) -> tuple[str, str] | None:
    """``(output embedding, input embedding)`` module names when the config ties the two (``lm_head``,
    ``model.embed_tokens``), else ``None``."""
    if not getattr(getattr(model, "config", None), "tie_word_embeddings", False):
        return None
    out, embed = model.get_output_embeddings(), model.get_input_embeddings()
    names = {id(m): n for n, m in model.named_modules()}
    if out is None or id(out) not in names or id(embed) not in names:
        return None
    return names[id(out)], names[id(embed)]


def peft_adapter_state(
    state: Mapping[str, torch.Tensor], trained_modules: list[str], tied_output: tuple[str, str] | None = None
) -> dict[str, torch.Tensor]:
    """The tensors of ``peft``'s adapter file (``adapter_model.safetensors``) from the full model state dict.

    Adapter tensors ``X.lora_A.default.weight`` -> ``base_model.model.X.lora_A.weight``; the weights of each
    module in ``trained_modules`` (PEFT ``modules_to_save``: trained embeddings and norms) ->
    ``base_model.model.<module>.<param>``, as ``peft``'s ``get_peft_model_state_dict`` writes them.
    ``tied_output``: the output embedding tied to trained input embeddings (:func:`tied_output_module`): its
    weight is written too (the embedding's values), as ``peft`` with ``ensure_weight_tying`` loads it.
    """
    out = {}
    trained = set(trained_modules)
    for key, value in state.items():
        if is_adapter_key(key):
            out["base_model.model." + key.replace(f".{ADAPTER}.", ".")] = value
        elif _module_of(base_key(key)) in trained:
            out["base_model.model." + base_key(key)] = value
    if tied_output is not None:
        output, embed = tied_output
        out[f"base_model.model.{output}.weight"] = out[f"base_model.model.{embed}.weight"].clone()
    return out


def peft_adapter_config(  # noqa: ANN201 - peft is imported lazily
    spec: LoraSpec, trained_modules: list[str], base_path: str, tied_output: tuple[str, str] | None = None
):
    """The ``peft.LoraConfig`` of the exported adapter (``adapter_config.json``); ``spec`` resolved
    (:func:`resolve_lora`)."""
    assert spec.target_modules is not None, "resolve_lora first"
    config = _peft_config(spec, tuple(spec.target_modules))
    config.base_model_name_or_path = base_path
    config.modules_to_save = list(trained_modules) or None
    if tied_output is not None:  # the trained embedding is the output layer too: peft keeps them tied
        config.ensure_weight_tying = True
    return config


def merged_state(state: Mapping[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    """The base model's state dict with every adapter merged: ``X.weight = W + scale * B @ A`` (computed in
    float64, cast back to ``W``'s dtype), ``base_layer`` names undone, adapter tensors dropped. Entries are moved
    out of a copy of ``state`` one by one (peak: one layer's extra tensors)."""
    state = dict(state)
    out: dict[str, torch.Tensor] = {}
    for key in list(state):
        if key not in state or is_adapter_key(key):
            continue
        value = state.pop(key)
        if ".base_layer." in key and key.endswith(".weight"):
            module = key[: -len(".base_layer.weight")]
            a = state.pop(f"{module}.lora_A.{ADAPTER}.weight")
            b = state.pop(f"{module}.lora_B.{ADAPTER}.weight")
            delta = (b.double() @ a.double()) * scale
            value = (value.double() + delta).to(value.dtype)
        out[base_key(key)] = value
    assert not any(is_adapter_key(k) for k in out)
    return out
