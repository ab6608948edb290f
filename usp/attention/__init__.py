"""USP attention: Ulysses all-to-all x ring attention (balanced, zigzag or contiguous layout), exact forward and backward.

Public entry: :func:`usp_attention`. Building blocks: :mod:`.kernels` (local ``(out, lse)`` kernel interface;
CUDA kernels in :mod:`.cuda_kernels`, document masks in :mod:`.masks`), :mod:`.ulysses` (all-to-all),
:mod:`.heads` (which heads each Ulysses rank holds, uneven counts included),
:mod:`.ring` (ring attention), :mod:`.blocks` (which blocks are computed), :mod:`.comm` (instrumented
communication), :mod:`.cost` (analytic bytes and work), :mod:`.reference` (single-process ground truth).
"""

from usp.attention.comm import CommStats, record_comm
from usp.attention.kernels import BACKENDS, attention_backward, attention_forward, resolve_backend
from usp.attention.usp import check_attn_head_chunks, usp_attention

__all__ = [
    "BACKENDS",
    "CommStats",
    "attention_backward",
    "attention_forward",
    "check_attn_head_chunks",
    "record_comm",
    "resolve_backend",
    "usp_attention",
]
