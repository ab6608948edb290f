"""What the planner costs, as three small frozen records passed through its internals instead of keyword chains.

- :class:`Workload`: what is trained, the same for every layout of a search (model, sequence length, batch,
  precision, loss chunk, ring layout, packed documents, LoRA adapters) and how strictly a layout is judged (allocator margin,
  headroom);
- :class:`Candidate`: one layout being costed, i.e. a :class:`usp.parallel.ParallelLayout` (degrees, cluster
  shape, FSDP mode, checkpointing, memory tricks, where the states live);
- :class:`SearchSpace`: the candidates a search tries (the cluster and what the user pinned; ``None`` = the
  planner chooses).

The keyword forms (:func:`usp.plan.evaluate_layout`, :func:`usp.plan.training_memory`, ...) take the records'
fields as keywords; :func:`from_keywords` is the one place that turns them into records. Change one field with
:func:`dataclasses.replace` (``replace(work, seq_len=2 * work.seq_len)``).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, TypeVar

from usp.parallel.layout import STATE_PLACEMENTS, ParallelLayout
from usp.plan.compute import DocumentWork
from usp.plan.lora import LoraPlan
from usp.plan.models import ModelSpec


@dataclass(frozen=True)
class Workload:
    """What is trained, and the margins a layout must keep (the same for every candidate of a search)."""

    model: ModelSpec
    seq_len: int
    """Tokens per sequence (``trainer.seq_len``)."""
    global_batch: int | None = None
    """Sequences per optimizer step; ``None``: one per data-parallel rank."""
    micro_batch_size: int = 1
    """Sequences per rank per micro step (the planner's searches cost 1)."""
    compute_bytes: int = 2
    """Bytes of the compute dtype: 2 for bf16/fp16 ``model.dtype``, 4 for float32."""
    loss_chunk_size: int = 4096
    """``trainer.loss_chunk_size``: tokens per chunk of the cross-entropy's ``[chunk, vocab]`` logits."""
    ring_layout: str = "zigzag"
    """``parallel.ring_layout``: how the sequence is placed on the ring (its multiple and its balance)."""
    documents: DocumentWork | None = None
    """Packed documents (``--doc-lengths``): attention is costed over them; ``None``: one causal sequence."""
    overhead_frac: float = 0.05
    """Allocator fragmentation allowance, a fraction of the tensor peak (:data:`usp.plan.memory.FRAGMENTATION_FRAC`)."""
    attention_backend: str = "flash_attn"
    """The CUDA attention kernel whose backward buffers are counted (``model.attention_backend``; ``auto``
    picks flash_attn, or torch's flash kernel with the same buffers)."""
    headroom_gib: float | None = None
    """Device memory a layout must leave free; ``None``: :attr:`DeviceSpec.default_headroom_gib`."""
    lora: LoraPlan | None = None
    """LoRA adapters on a frozen base (``model.lora.*``, ``usp-plan --lora-rank``: :mod:`usp.plan.lora`);
    ``None``: full training."""


Candidate = ParallelLayout
"""One layout being costed: the run's own layout type (:class:`usp.parallel.ParallelLayout`: degrees, cluster
shape, FSDP mode, checkpointing, memory tricks, where the states live), so what the planner chooses is what
start-up builds the mesh from. ``Candidate`` is its name in the planner's vocabulary."""


@dataclass(frozen=True)
class SearchSpace:
    """The candidates a search tries on a cluster. ``None`` lets the planner choose; a value pins it."""

    world_size: int
    node_size: int
    ulysses_degree: int | None = None
    ring_degree: int | None = None
    fsdp_modes: tuple[str, ...] | None = None
    """FSDP modes tried; ``None``: ``full_shard``, and across nodes also ``hybrid_shard``."""
    ac_modes: tuple[str, ...] | None = None
    """Checkpointing modes tried; ``None``: all of them."""
    ac_every_k: int | None = None
    """The ``every_k`` candidate's k; ``None``: the planner's (2)."""
    mlp_tiles: int | None = None
    """A fixed tile count, or ``None`` (``auto``): 1, and when that does not fit the fewest tiles that fit."""
    attn_head_chunks: int | None = None
    """A fixed head chunk count (layouts whose heads it does not split are rejected), or ``None`` (``auto``)."""
    states: tuple[str, ...] = ("device",)
    """Placements of :data:`STATE_PLACEMENTS` tried."""


Layout = TypeVar("Layout", ParallelLayout, SearchSpace)


def from_keywords(
    model: ModelSpec, layout: type[Layout], /, *, states_on_host: bool = False, **keywords: Any
) -> tuple[Workload, Layout]:
    """The records of a keyword-form call (:func:`usp.plan.evaluate_layout`, :func:`usp.plan.plan_layouts`, ...):
    each keyword goes to the :class:`Workload` field or the ``layout`` field (:class:`Candidate` or
    :class:`SearchSpace`) of its name, and the fields not given keep their defaults. ``states_on_host=True`` is
    shorthand for the states on the host (``states="cpu_offload"``, a search's ``states=("cpu_offload",)``);
    ``states=None`` is the default placement. ``TypeError`` for a keyword neither record has, or a required
    field missing; ``ValueError`` for ``states_on_host`` with ``states``."""
    work_fields = {f.name for f in fields(Workload)} - {"model"}
    layout_fields = {f.name for f in fields(layout)}
    unknown = set(keywords) - work_fields - layout_fields
    if unknown:
        raise TypeError(
            f"unknown keyword(s) {sorted(unknown)}: the keywords are the fields of Workload {sorted(work_fields)}, "
            f"of {layout.__name__} {sorted(layout_fields)}, and states_on_host."
        )
    if keywords.get("states") is None:
        keywords.pop("states", None)
        if states_on_host:
            keywords["states"] = "cpu_offload" if layout is Candidate else ("cpu_offload",)
    elif states_on_host:
        raise ValueError(
            f"states_on_host=True and states={keywords['states']!r}: pass one (states_on_host=True means states='cpu_offload')."
        )
    work = Workload(model, **{k: v for k, v in keywords.items() if k in work_fields})
    return work, layout(**{k: v for k, v in keywords.items() if k in layout_fields})


__all__ = ["STATE_PLACEMENTS", "Candidate", "SearchSpace", "Workload", "from_keywords"]
