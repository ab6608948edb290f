"""Fake stand-ins for the CUDA attention kernels: the real wrappers, plus the buffers the kernels allocate inside.

On fake CUDA tensors torch's SDPA ops run their meta kernels, which allocate the outputs only (forward: ``out``
and the fp32 ``lse``; backward: ``dq, dk, dv``). The CUDA kernels allocate more inside the call, freed when it
returns; :func:`usp.plan.attention_memory.kernel_workspace_bytes` lists them per backend, and :func:`fake_attention_kernels` makes
``usp.attention.kernels`` allocate them around each call (so a memory tracker sees them at the kernel's peak).
Sources (each kernel's host code, read for what it allocates; ``Sr`` = the length rounded up to 128 rows,
``Dr`` = the head dim rounded up to 32):

- ``flash_attn`` (flash-attn 2, ``csrc/flash_attn/flash_api.cpp``): ``mha_fwd`` allocates ``out`` and
  ``softmax_lse [B, Hq, Sq]`` fp32 (``p`` only with dropout). ``mha_bwd`` allocates ``softmax_d
  [B, Hq, Sq_r]`` fp32 and ``dq_accum [B, Sq_r, Hq, Dr]`` fp32 (the non-deterministic path); under GQA
  (``Hkv < Hq``) ``dk_expanded, dv_expanded [B, Sk, Hq, D]`` in the input dtype, summed into ``dk, dv``
  after the kernel.
- ``sdpa_flash`` (torch's vendored copy of the same code, ``aten/src/ATen/native/transformers/cuda/flash_attn/
  flash_api.cpp``, reached from ``_flash_attention_backward``): the same buffers; torch takes GQA K/V natively.
- ``sdpa_efficient`` (``aten/src/ATen/native/transformers/cuda/attention_backward.cu``,
  ``_efficient_attention_backward``): ``delta [B, Hq, Sq]`` fp32 and, when the kernel accumulates
  ``grad_q`` across key blocks (long keys), a ``workspace`` of ``B Sq Hq D`` fp32. usp expands K/V to the
  query heads for it (:mod:`usp.attention.cuda_kernels`): those copies and the expanded ``dk, dv`` are real
  allocations of the wrapper and are tracked as such.
- ``sdpa_cudnn`` (``aten/src/ATen/native/cudnn/MHA.cpp``, cuDNN frontend SDPA backward): a workspace holding an
  fp32 ``dQ`` accumulator ``[B, Hq, Sq, D]`` and the fp32 softmax sums ``[B, Hq, Sq]``; K/V expanded by usp as
  for mem-efficient.

The forward kernels allocate nothing beyond their outputs (flash keeps its tile state in shared memory).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from usp.plan.attention_memory import kernel_workspace_bytes

__all__ = ["kernel_workspace_bytes", "fake_attention_kernels"]


def _with_workspace(backend: str, fn):
    def backward(*args):
        kind = args[0] if isinstance(args[0], str) else backend
        dout, q, k = args[1:4] if isinstance(args[0], str) else args[:3]
        b, sq, hq, d = q.shape
        sk, hkv = k.size(1), k.size(2)
        if kind != "flash_attn" and kind in ("sdpa_efficient", "sdpa_cudnn"):
            hkv = hq  # the wrapper expanded K/V already; the kernel sees Hq heads
        n = kernel_workspace_bytes(kind, batch=b, sq=sq, sk=sk, hq=hq, hkv=hkv, d=d, elem=q.element_size())
        scratch = torch.empty(n, dtype=torch.uint8, device=q.device) if n else None
        try:
            return fn(*args)
        finally:
            del scratch

    return backward


def _flash_attn_as_sdpa_flash(name: str):
    """flash_attn's wrappers on torch's vendored flash kernel (same code, same shapes; fake CUDA has no
    flash_attn extension): forward, and backward with flash-attn's buffers."""
    from usp.attention import cuda_kernels

    if name == "forward":
        return lambda q, k, v, causal, scale, segments: cuda_kernels.sdpa_forward(
            "sdpa_flash", q, k, v, causal, scale, segments
        )
    return _with_workspace("flash_attn", lambda *a: cuda_kernels.sdpa_backward("sdpa_flash", *a))


@contextlib.contextmanager
def fake_attention_kernels() -> Iterator[None]:
    """Inside: ``usp.attention.kernels`` allocates each CUDA backward's workspace around the call, and
    ``flash_attn`` is available (run on torch's vendored flash kernel). Documents (segments) on flash_attn
    are not emulated (``ValueError``)."""
    from usp.attention import kernels

    saved = {
        n: getattr(kernels, n)
        for n in ("sdpa_backward", "flash_attn_forward", "flash_attn_backward", "flash_attn_import_error")
    }

    def no_segments(fn):
        def call(*args):
            if args[-1] is not None:
                raise ValueError(
                    "the fake flash_attn stand-in has no varlen kernel: data.document_masking=false"
                )
            return fn(*args)

        return call

    kernels.sdpa_backward = _with_workspace("", saved["sdpa_backward"])
    kernels.flash_attn_forward = no_segments(_flash_attn_as_sdpa_flash("forward"))
    kernels.flash_attn_backward = no_segments(_flash_attn_as_sdpa_flash("backward"))
    kernels.flash_attn_import_error = lambda: None
    try:
        yield
    finally:
        for n, v in saved.items():
            setattr(kernels, n, v)
