"""Which stored tensors fill each model tensor, from transformers' checkpoint conversion rules (MoE experts).

Layout contract. transformers 5 keeps a mixture-of-experts layer's experts as fused 3D parameters, experts first:
``experts.gate_up_proj`` ``[E, 2I, H]`` (expert ``e`` is ``cat(gate_e, up_e)`` along its dim 0, i.e. the
parameter's dim 1) and ``experts.down_proj`` ``[E, H, I]``. On disk (what ``save_pretrained`` writes, and what
published checkpoints hold) each expert is its own tensor: qwen3_moe's
``model.layers.L.mlp.experts.e.{gate,up,down}_proj.weight``, mixtral's
``model.layers.L.block_sparse_moe.experts.e.w{1,3,2}.weight``. transformers' rules for the model type
(``transformers.conversion_mapping``) say how one becomes the other: ``WeightRenaming`` s rename keys (mixtral:
``block_sparse_moe`` -> ``mlp``), a ``WeightConverter`` with ``[MergeModulelist(dim=0)]`` stacks the experts'
tensors along dim 0, one with ``[MergeModulelist(dim=0), Concatenate(dim=d)]`` stacks each source pattern's
tensors, then concatenates the stacks along ``d``.

:func:`plan_weights` applies those rules to the stored tensor names (never to the data) and says, for every model
tensor, how it is filled: from one stored tensor (identity, possibly renamed), or, for a fused expert
parameter, by an :class:`ExpertFill`: row ``e`` (dim 0, the experts dim, FSDP2's ``Shard(0)``) is built from
the stored tensors of expert ``e`` only, so a rank reads the experts of its own shard and nothing else.
Checkpoints stored already fused (gpt_oss, llama4, usp's exports before it reverted the conversion) are identity.
A rule whose operations are anything else, or a stored layout a rule cannot map completely, is a ``ValueError``
naming the model tensor and what could not be mapped; the loader prefixes the ``model.path`` setting.
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from usp.model.lora import base_state

_API = (
    "transformers.conversion_mapping.get_checkpoint_conversion_mapping and core_model_loading's WeightConverter, "
    "WeightRenaming (.rename_source_key), MergeModulelist and Concatenate"
)


def _version() -> str:
    import transformers

    return transformers.__version__


def _natural(key: str) -> list[tuple[int, int | str]]:
    """Sort key: ``experts.10`` after ``experts.9`` (transformers' order of the stored keys)."""
    return [(0, int(p)) if p.isdigit() else (1, p) for p in key.split(".")]


def _rule_classes() -> tuple[type, type] | None:
    """transformers' ``(WeightConverter, WeightRenaming)``, or None when this transformers lacks the rules API
    usp reads (:data:`_API`): then no rule applies, and a per-expert checkpoint is refused naming the API."""
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping  # noqa: F401
        from transformers.core_model_loading import (  # noqa: F401
            Concatenate,
            MergeModulelist,
            WeightConverter,
            WeightRenaming,
        )
    except ImportError:
        return None
    if not all(callable(getattr(c, "rename_source_key", None)) for c in (WeightConverter, WeightRenaming)):
        return None
    return WeightConverter, WeightRenaming


def conversion_rules(model: nn.Module, *, legacy: bool = True) -> list[Any] | None:
    """transformers' checkpoint conversion rules for ``model``, looked up as ``from_pretrained`` does for the root
    model: its class name first (FSDP2's ``FSDP<Class>`` unwrapped), then ``config.model_type``; then (``legacy``)
    the ``legacy`` renamings. ``None`` when this transformers has no such rules (:data:`_API`)."""
    if _rule_classes() is None:
        return None
    from torch.distributed.fsdp import FSDPModule
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping

    cls = next((c for c in type(model).__mro__ if not issubclass(c, FSDPModule)), type(model))
    rules = get_checkpoint_conversion_mapping(cls.__name__)
    if rules is None:
        rules = get_checkpoint_conversion_mapping(getattr(model.config, "model_type", None) or "")
    return [*(rules or []), *((legacy and get_checkpoint_conversion_mapping("legacy")) or [])]


@dataclass(frozen=True)
class ExpertFill:
    """How one fused expert parameter (``shape``, experts along dim 0) is built from per-expert stored tensors.

    ``parts[j][e]`` is the stored tensor of expert ``e`` for source pattern ``j`` (the rule's order); row ``e`` of
    the parameter is ``parts[0][e]`` when ``cat_dim`` is None (stack), else ``cat([parts[j][e] for j],
    dim=cat_dim - 1)`` (stack, then concatenate along the parameter's ``cat_dim``)."""

    shape: tuple[int, ...]
    parts: tuple[tuple[str, ...], ...]
    cat_dim: int | None
    rule: str

    @property
    def num_experts(self) -> int:
        return len(self.parts[0])

    def check_shapes(self, key: str, stored: Mapping[str, Sequence[int]]) -> None:
        """``ValueError`` naming ``key`` when the stored tensors' shapes do not build ``self.shape``."""
        per_part = []
        for part in self.parts:
            counts = Counter(tuple(stored[name]) for name in part)
            common = counts.most_common(1)[0][0]
            odd = [f"{name} is {list(stored[name])}" for name in part if tuple(stored[name]) != common]
            if odd:
                raise ValueError(
                    f"the stored tensors that build {key} differ in shape: {', '.join(odd[:3])}, the other "
                    f"experts' {list(common)} ({self.rule})."
                )
            per_part.append(list(common))
        row = per_part[0]
        if self.cat_dim is not None:
            d = self.cat_dim - 1
            rest = {tuple(s[:d] + s[d + 1 :]) for s in per_part}
            if len(rest) == 1 and 0 <= d < len(row):
                row = [*row[:d], sum(s[d] for s in per_part), *row[d + 1 :]]
            else:
                row = ["?"]  # not concatenable: reported below
        if (self.num_experts, *row) != self.shape:
            raise ValueError(
                f"{key} has shape {list(self.shape)} but its stored tensors ({self.rule}: {per_part} for each of "
                f"{self.num_experts} experts) do not build it. Point model.path at a checkpoint whose weights "
                f"and config.json belong together."
            )

    def fill_rows(self, dst: torch.Tensor, start: int, read: Callable[[str], torch.Tensor]) -> None:
        """Copy experts ``start .. start + len(dst)`` into ``dst`` (their rows), reading only their tensors with
        ``read(name)``; ``copy_`` casts to ``dst``'s dtype and device."""
        for k in range(dst.shape[0]):
            offset = 0
            for part in self.parts:
                tensor = read(part[start + k])
                if self.cat_dim is None:
                    dst[k].copy_(tensor)
                else:
                    size = tensor.shape[self.cat_dim - 1]
                    dst[k].narrow(self.cat_dim - 1, offset, size).copy_(tensor)
                    offset += size

    def build(self, read: Callable[[str], torch.Tensor]) -> torch.Tensor:
        """The whole fused tensor, in the stored dtype (rank 0 of the broadcast path)."""
        out = torch.empty(self.shape, dtype=read(self.parts[0][0]).dtype)
        self.fill_rows(out, 0, read)
        return out


@dataclass(frozen=True)
class WeightPlan:
    """:func:`plan_weights`' answer. ``identity``: model key -> the one stored tensor that fills it; ``experts``:
    model key -> :class:`ExpertFill`; ``missing``: model keys nothing fills (a tied ``lm_head`` is the caller's);
    ``unexpected``: stored tensors that fill nothing."""

    identity: dict[str, str]
    experts: dict[str, ExpertFill]
    missing: tuple[str, ...]
    unexpected: tuple[str, ...]


def _check_ops(converter: Any, target: str, model_type: str) -> int | None:
    """The concatenation dim of a converter :class:`ExpertFill` implements (None: stack only), else
    ``ValueError`` naming the rule and its operations."""
    from transformers.core_model_loading import Concatenate, MergeModulelist

    ops = list(converter.operations)
    if ops and isinstance(ops[0], MergeModulelist) and ops[0].dim == 0:
        if len(ops) == 1 and len(converter.source_patterns) == 1:
            return None
        if len(ops) == 2 and isinstance(ops[1], Concatenate) and ops[1].dim >= 1:
            return ops[1].dim
    raise ValueError(
        f"transformers builds {target} of a {model_type!r} model from the stored tensors "
        f"{converter.source_patterns} with {ops}, which usp's sharded loader does not implement (it stacks "
        f"experts along dim 0: [MergeModulelist(dim=0)], optionally followed by Concatenate(dim>=1))."
    )


def _stacks(converter: Any) -> bool:
    """Whether a converter stacks per-expert tensors (its first operation is ``MergeModulelist``)."""
    from transformers.core_model_loading import MergeModulelist

    return bool(converter.operations) and isinstance(converter.operations[0], MergeModulelist)


def _expert_pattern(source_pattern: str) -> re.Pattern[str]:
    """transformers' source pattern (``*`` stands for the expert index) with the index captured as a number."""
    pattern = source_pattern.replace("*.", r"(?P<expert>\d+)\.")
    return re.compile(pattern + (r"(?!\w)" if re.search(r"[a-zA-Z0-9]$", pattern) else ""))


def plan_weights(model: nn.Module, stored: Iterable[str]) -> WeightPlan:
    """How ``model``'s tensors (``model.state_dict()``: global shapes, FSDP2 or not) are filled from the stored
    tensor names ``stored``, by transformers' rules for the model (:func:`conversion_rules`), applied as
    ``from_pretrained`` applies them: every ``WeightRenaming`` in turn, then the first ``WeightConverter`` that
    matches; a stored name that is a model key and whose renamed form is not stays as it is.

    ``ValueError`` naming the model tensor when a rule's operations are not the stacking
    :class:`ExpertFill` implements, when the experts of a fused parameter are stored incompletely or with
    indices other than ``0 .. E-1``, or when a fused expert parameter's stored tensors match no rule.
    """
    shapes = {k: tuple(v.shape) for k, v in base_state(model).items()}  # LoRA: the base checkpoint's names
    model_type = getattr(model.config, "model_type", "?")
    rules, classes = conversion_rules(model), _rule_classes()
    converters = [r for r in rules or [] if classes and isinstance(r, classes[0])]
    renamings = [r for r in rules or [] if classes and isinstance(r, classes[1])]
    identity: dict[str, str] = {}
    grouped: dict[str, dict[str, list[tuple[str, str]]]] = defaultdict(lambda: defaultdict(list))
    rule_of: dict[str, Any] = {}
    unexpected: dict[str, str] = {}  # stored -> renamed
    for key in sorted(stored, key=_natural):
        renamed = key
        for renaming in renamings:
            renamed, _ = renaming.rename_source_key(renamed)
        target, pattern = renamed, None
        for converter in converters:
            target, pattern = converter.rename_source_key(renamed)
            if pattern is not None:
                rule_of[target] = converter
                break
        if target not in shapes and key in shapes:
            target, pattern = key, None
        if target not in shapes:
            unexpected[key] = renamed
        elif pattern is None:
            if target in identity:
                raise ValueError(f"both {identity[target]} and {key} are stored for {target}.")
            identity[target] = key
        else:
            grouped[target][pattern].append((renamed, key))
    experts: dict[str, ExpertFill] = {}
    for target, by_pattern in grouped.items():
        converter = rule_of[target]
        cat_dim = _check_ops(converter, target, model_type)
        rule = f"{converter.source_patterns} -> {target}"
        if target in identity:
            raise ValueError(f"{target} is stored both fused ({identity[target]}) and per expert ({rule}).")
        n = shapes[target][0]
        parts = []
        for pattern in converter.source_patterns:
            regex, by_index = _expert_pattern(pattern), {}
            for renamed, key in by_pattern.get(pattern, []):
                match = regex.search(renamed)
                if match is None or int(match["expert"]) in by_index:
                    raise ValueError(
                        f"cannot tell which expert of {target} the stored tensor {key} is ({rule})."
                    )
                by_index[int(match["expert"])] = key
            if sorted(by_index) != list(range(n)):
                absent = sorted(set(range(n)) - set(by_index))
                extra = sorted(set(by_index) - set(range(n)))
                near = sorted(
                    k for k, r in unexpected.items() if r.startswith(target.rsplit(".", 1)[0] + ".")
                )
                raise ValueError(
                    f"the experts of {target} ({n} in config.json) are stored incompletely: transformers' rule "
                    f"{rule} finds {pattern!r} for experts {sorted(by_index)}"
                    + (f", none for {absent}" if absent else "")
                    + (f", extra {extra}" if extra else "")
                    + (f"; stored tensors there that no rule maps: {near[:6]}" if near else "")
                    + ". Point model.path at a complete checkpoint whose weights and config.json belong together."
                )
            parts.append(tuple(by_index[e] for e in range(n)))
        experts[target] = ExpertFill(shapes[target], tuple(parts), cat_dim, rule)
    missing = sorted(k for k in shapes if k not in identity and k not in experts)
    for key in missing:
        module = key.rsplit(".", 1)[0] + "."
        stray = sorted(k for k, r in unexpected.items() if r.startswith(module))
        builder = next(
            (c for c in converters if _stacks(c) and any(map(key.endswith, c.target_patterns))), None
        )
        if builder is not None:
            raise ValueError(
                f"no stored tensor fills {key}: transformers stacks it from {builder.source_patterns} (one "
                f"tensor per expert), and the checkpoint has none of them"
                + (f"; stored tensors there that no rule maps: {stray[:6]}" if stray else "")
                + ". Point model.path at a complete checkpoint whose weights and config.json belong together."
            )
        if "expert" in module and any(re.match(re.escape(module) + r"\d+\.", r) for r in unexpected.values()):
            hint = "" if rules is not None else f" (transformers {_version()} lacks {_API})"
            raise ValueError(
                f"{key} is a fused expert parameter {list(shapes[key])} but the checkpoint stores its experts one "
                f"tensor each ({stray[:3]} ...) and no transformers conversion rule for model_type "
                f"{model_type!r} maps them onto it{hint}."
            )
    return WeightPlan(identity, experts, tuple(missing), tuple(sorted(unexpected)))
