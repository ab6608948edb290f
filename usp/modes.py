"""The named modes of a run, each list defined once.

The config schema (``usp.config``), the mesh (``usp.parallel``), the trainer (``usp.train.parallelize``), the
attention kernels (``usp.attention.kernels``), the planner and the command-line tools all import these, so
adding a mode is one edit here plus the code that implements it.
"""

from __future__ import annotations

from typing import Literal, get_args

RingLayout = Literal["zigzag", "contiguous", "balanced"]
"""Which sequence chunks each ring rank holds (``parallel.ring_layout``): ``zigzag`` chunks ``r`` and ``2R-1-r``
(balanced causal work over one sequence), ``contiguous`` chunk ``r``, ``balanced`` placed from the packed row's
document boundaries so every ring rank does the same attention work (zigzag without them)."""
RING_LAYOUTS: tuple[str, ...] = get_args(RingLayout)


def check_ring_layout(ring_layout: object, setting: str = "parallel.ring_layout") -> None:
    """``ValueError`` naming ``setting`` unless ``ring_layout`` is one of :data:`RING_LAYOUTS`."""
    if ring_layout not in RING_LAYOUTS:
        raise ValueError(f"{setting}={ring_layout!r} is invalid; choose one of {', '.join(RING_LAYOUTS)}.")


def chunks_per_ring_rank(ring_layout: str) -> int:
    """Sequence chunks each ring rank holds: 1 for ``contiguous``, 2 for ``zigzag`` and ``balanced`` (which
    cut the sequence into ``2 x ring_degree`` chunks). The sequence must divide into
    ``chunks_per_ring_rank x ring_degree x ulysses_degree`` equal parts."""
    check_ring_layout(ring_layout)
    return 1 if ring_layout == "contiguous" else 2


FsdpMode = Literal["full_shard", "hybrid_shard"]
"""``parallel.fsdp_mode``: shard over every rank, or shard inside a node and replicate across nodes."""
FSDP_MODES: tuple[str, ...] = get_args(FsdpMode)

AcMode = Literal["none", "full", "every_k", "offload"]
"""``parallel.activation_checkpointing``: which decoder layers are recomputed in backward (``offload``: every
layer, with the saved layer inputs in host memory; ``usp.train.checkpoint_offload``)."""
AC_MODES: tuple[str, ...] = get_args(AcMode)

OptimName = Literal["adamw", "adamw_cpu_offload", "deepspeed_cpu_adam"]
"""``optim.name``: the AdamW implementation; all but ``adamw`` keep the optimizer states on the host
(``usp.config.states_on_host``)."""
OPTIMIZERS: tuple[str, ...] = get_args(OptimName)

AttentionBackend = Literal[
    "auto", "flash_attn", "sdpa_flash", "sdpa_efficient", "sdpa_cudnn", "cpu_flash", "math"
]
"""``model.attention_backend``: the local attention kernel (``auto`` picks one for the device and dtype)."""
ATTENTION_BACKENDS: tuple[str, ...] = get_args(AttentionBackend)
CUDA_BACKENDS: tuple[str, ...] = ("flash_attn", "sdpa_flash", "sdpa_efficient", "sdpa_cudnn")
"""The backends that run on CUDA devices only."""

DataFormat = Literal["text", "chat", "preference"]
"""``data.format`` / ``usp-prepare-data --format``: plain documents (every token trained), conversations
rendered with the tokenizer's chat template, with a ``loss_mask`` per token (``usp.data.chat``), or preference
pairs ``{prompt, chosen, rejected}`` for DPO, two documents per pair with ``document_roles``
(``usp.data.preference``)."""
DATA_FORMATS: tuple[str, ...] = get_args(DataFormat)

LossOn = Literal["assistant", "all", "last_assistant"]
"""``data.loss_on``: which tokens of a conversation are targets: every assistant message's content and the
end-of-turn marker closing it (the default for chat), every token, or only the last assistant message's."""
LOSS_ON: tuple[str, ...] = get_args(LossOn)

LongConversations = Literal["truncate", "drop"]
"""``data.long_conversations``: what packing does with a conversation longer than ``seq_len`` (unless
``data.split_long_conversations``): keep its first ``seq_len`` tokens, or leave it out (both counted)."""
LONG_CONVERSATIONS: tuple[str, ...] = get_args(LongConversations)
