"""The named modes of a run, each list defined once.

The config schema (``usp.config``), the mesh (``usp.parallel``), the trainer (``usp.train.parallelize``), the
attention kernels (``usp.attention.kernels``), the planner and the command-line tools all import these, so
adding a mode is one edit here plus the code that implements it.
"""

from __future__ import annotations

from typing import Literal, get_args

RingLayout = Literal["zigzag", "contiguous"]
"""Which sequence chunks each ring rank holds (``parallel.ring_layout``)."""
RING_LAYOUTS: tuple[str, ...] = get_args(RingLayout)

FsdpMode = Literal["full_shard", "hybrid_shard"]
"""``parallel.fsdp_mode``: shard over every rank, or shard inside a node and replicate across nodes."""
FSDP_MODES: tuple[str, ...] = get_args(FsdpMode)

AcMode = Literal["none", "full", "every_k"]
"""``parallel.activation_checkpointing``: which decoder layers are recomputed in backward."""
AC_MODES: tuple[str, ...] = get_args(AcMode)

AttentionBackend = Literal["auto", "flash_attn", "sdpa_flash", "sdpa_efficient", "sdpa_cudnn", "cpu_flash", "math"]
"""``model.attention_backend``: the local attention kernel (``auto`` picks one for the device and dtype)."""
ATTENTION_BACKENDS: tuple[str, ...] = get_args(AttentionBackend)
CUDA_BACKENDS: tuple[str, ...] = ("flash_attn", "sdpa_flash", "sdpa_efficient", "sdpa_cudnn")
"""The backends that run on CUDA devices only."""
