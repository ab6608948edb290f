"""Local attention kernels behind one interface: forward -> ``(out, lse)``, backward from the *global* lse.

Layout (flash-attn convention): ``q [B, Sq, Hq, D]``, ``k, v [B, Sk, Hkv, D]`` with ``Hq % Hkv == 0`` (GQA is
handled inside the kernel, locally; nothing is expanded before communication), ``out [B, Sq, Hq, D]`` in
``q.dtype`` and ``lse [B, Hq, Sq]`` in fp32, fp64 for fp64 inputs (:func:`accumulation_dtype`; natural log of the softmax denominator, scale included).

Masking is described, not materialized, by the caller:

- ``causal``: top-left aligned lower triangle; only used with ``Sq == Sk`` on the same positions.
- ``segments``: int64 ``[n, 4]`` rows ``(q0, q1, k0, k1)``: query rows ``[q0, q1)`` attend only to keys
  ``[k0, k1)`` (with ``causal``: each segment is its own aligned lower triangle, ``q1 - q0 == k1 - k0``).
  Rows outside every segment attend to nothing: their ``out`` is 0 and their ``lse`` is ``-inf``. This is how
  document masking reaches a kernel: varlen kernels (flash_attn) pack the segments; the dense ones (SDPA,
  CPU flash) run large blocks one unmasked call per segment (:mod:`usp.attention.segmented`, no ``[Sq, Sk]``
  mask) and small ones with a mask; ``math`` always builds the mask (it is the reference; float64 inputs
  run it in float64, lse included). Segments are read on the host, so keep them on the CPU (ring plans do): then no call here syncs with the device.

``attention_backward`` takes the merged (global) ``out`` and ``lse`` of the rows it is given, so a ring block's
gradients are exact pieces of the full gradient without recomputing the merge.
"""

from __future__ import annotations

import functools
import importlib.util
import math

import torch

from usp.attention.cuda_kernels import (
    FLASH_ATTN_MIN,
    flash_attn_backward,
    flash_attn_forward,
    flash_attn_version,
    sdpa_backward,
    sdpa_forward,
)
from usp.attention.masks import RowRanges, dense_mask
from usp.attention.segmented import (
    accumulation_dtype,
    clear_uncovered_rows_,
    host_segments,
    per_segment_calls,
    segmentwise_backward,
    segmentwise_forward,
)
from usp.modes import ATTENTION_BACKENDS, CUDA_BACKENDS, AttentionBackend

Backend = AttentionBackend
BACKENDS: tuple[str, ...] = ATTENTION_BACKENDS


@functools.lru_cache(maxsize=1)
def flash_attn_import_error() -> str | None:
    """Why ``flash_attn`` cannot be used (None when it imports), tried once per process.

    ``find_spec`` alone is not enough: a wheel built for another torch/CUDA ABI is found but fails to import
    (undefined symbols), and picking it would crash the first attention call. Releases older than
    :data:`~usp.attention.cuda_kernels.FLASH_ATTN_MIN` (unchecked) are refused with their version named.
    """
    if importlib.util.find_spec("flash_attn") is None:
        return "flash_attn is not installed"
    try:
        import flash_attn
        from flash_attn import flash_attn_interface  # noqa: F401
    except (ImportError, OSError, RuntimeError) as exc:  # undefined symbols, a missing .so, ABI checks
        return f"import flash_attn failed: {type(exc).__name__}: {exc}"
    try:
        version = flash_attn_version(flash_attn)
    except ValueError as exc:
        return str(exc)
    if version < FLASH_ATTN_MIN:
        return (
            f"flash_attn {flash_attn.__version__} is older than the oldest release checked, "
            f"{'.'.join(map(str, FLASH_ATTN_MIN))} (pip install 'flash-attn>=2.5.9')"
        )
    return None


def flash_attn_available() -> bool:
    """Whether ``flash_attn`` is installed *and* imports (cached: the import is tried once)."""
    return flash_attn_import_error() is None


HALF_ONLY: tuple[str, ...] = ("flash_attn", "sdpa_flash", "sdpa_cudnn")
"""CUDA kernels with fp16/bf16 only and ``head_dim % 8 == 0`` (their backward checks it)."""


def resolve_backend(
    backend: str, device: torch.device, dtype: torch.dtype | None = None, head_dim: int | None = None
) -> str:
    """Map ``backend`` (``"auto"`` or a name in ``BACKENDS``) to a concrete kernel for ``device``, ``dtype``, ``head_dim``.

    ``"auto"``: on CUDA, flash_attn when installed (>= 2.6, see :func:`flash_attn_import_error`) and the dtype is
    fp16/bf16, else torch's flash SDPA for fp16/bf16 and mem-efficient SDPA for fp32 (flash kernels have no
    fp32) or a head dim that is not a multiple of 8; on CPU, torch's CPU flash. An explicit CUDA backend that
    cannot run the dtype or head dim raises ``ValueError`` naming the backends that can.
    """
    if backend not in BACKENDS:
        raise ValueError(f"attention backend={backend!r} is unknown; choose one of {BACKENDS}.")
    odd_head = head_dim is not None and head_dim % 8 != 0
    if backend == "auto":
        if device.type == "cuda":
            half = dtype in (torch.float16, torch.bfloat16) or dtype is None
            if not half or odd_head:
                return "sdpa_efficient"
            return "flash_attn" if flash_attn_available() else "sdpa_flash"
        return "cpu_flash" if device.type == "cpu" else "math"
    if backend in CUDA_BACKENDS and device.type != "cuda":
        raise ValueError(
            f"attention backend={backend!r} needs CUDA tensors but got {device.type}; use backend='auto', "
            f"'cpu_flash' or 'math' on {device.type}."
        )
    if backend == "cpu_flash" and device.type != "cpu":
        raise ValueError(
            f"attention backend='cpu_flash' needs CPU tensors, got {device.type}; use backend='auto'."
        )
    if backend in HALF_ONLY and odd_head:
        raise ValueError(
            f"attention backend={backend!r} needs head_dim % 8 == 0 (its backward checks it), got "
            f"head_dim={head_dim}; use backend='sdpa_efficient' (or 'auto', which picks it) or 'math'."
        )
    if backend in HALF_ONLY and dtype is not None and dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(
            f"attention backend={backend!r} runs float16/bfloat16 only, got {str(dtype).removeprefix('torch.')}; "
            f"use backend='sdpa_efficient' (or 'auto', which picks it) or 'math', or a half-precision dtype."
        )
    if backend == "flash_attn" and not flash_attn_available():
        raise ValueError(
            f"attention backend='flash_attn' but {flash_attn_import_error()}; use backend='auto' (torch SDPA) "
            f"or install a flash-attn build matching this torch and CUDA."
        )
    return backend


def default_scale(head_dim: int, softmax_scale: float | None) -> float:
    return 1.0 / math.sqrt(head_dim) if softmax_scale is None else float(softmax_scale)


# --- math reference ----------------------------------------------------------------------------------------


def _math_scores(q, k, scale, mask, softcap=None):
    """Scores ``[B, Hq, Sq, Sk]`` in the accumulation dtype; with ``softcap`` the capped scores
    ``c * tanh(s / c)`` (Gemma 2's attention logit softcapping, applied before the mask as the model does)."""
    group = q.size(2) // k.size(2)
    acc = accumulation_dtype(q.dtype)
    qf = q.to(acc).transpose(1, 2)  # [B, Hq, Sq, D]
    kf = k.to(acc).transpose(1, 2).repeat_interleave(group, dim=1)  # [B, Hq, Sk, D]
    s = torch.matmul(qf, kf.transpose(-1, -2)) * scale  # [B, Hq, Sq, Sk]
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return s


def _math_forward(q, k, v, causal, scale, segments, softcap=None):
    mask = dense_mask(q.size(1), k.size(1), causal, segments, q.device)
    s = _math_scores(q, k, scale, mask, softcap)
    acc = s.dtype
    lse = torch.logsumexp(s, dim=-1)  # [B, Hq, Sq], -inf on rows with no key
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
    group = q.size(2) // k.size(2)
    vf = v.to(acc).transpose(1, 2).repeat_interleave(group, dim=1)  # [B, Hq, Sk, D]
    out = torch.matmul(p, vf).transpose(1, 2)  # [B, Sq, Hq, D]
    return out.to(q.dtype), lse


def _math_backward(dout, q, k, v, out, lse, causal, scale, segments, softcap=None):
    mask = dense_mask(q.size(1), k.size(1), causal, segments, q.device)
    s = _math_scores(q, k, scale, mask, softcap)
    acc = s.dtype
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse.to(acc))[..., None])  # [B, Hq, Sq, Sk]
    group = q.size(2) // k.size(2)
    b, sk, hkv, d = k.shape
    do = dout.to(acc).transpose(1, 2)  # [B, Hq, Sq, D]
    vf = v.to(acc).transpose(1, 2).repeat_interleave(group, dim=1)
    kf = k.to(acc).transpose(1, 2).repeat_interleave(group, dim=1)
    delta = (do * out.to(acc).transpose(1, 2)).sum(-1, keepdim=True)  # [B, Hq, Sq, 1]
    ds = p * (torch.matmul(do, vf.transpose(-1, -2)) - delta)
    if softcap is not None:  # d(c tanh(x / c))/dx = 1 - tanh^2 = 1 - (s / c)^2; masked entries have p = 0
        capped = torch.where(torch.isinf(s), 0.0, s) / softcap
        ds = ds * (1.0 - capped * capped)
    dq = torch.matmul(ds, kf) * scale
    dk = torch.matmul(ds.transpose(-1, -2), q.to(acc).transpose(1, 2)) * scale  # [B, Hq, Sk, D]
    dv = torch.matmul(p.transpose(-1, -2), do)
    dk = dk.view(b, hkv, group, sk, d).sum(2)  # sum the GQA group back onto its KV head
    dv = dv.view(b, hkv, group, sk, d).sum(2)
    return tuple(t.transpose(1, 2).to(x.dtype) for t, x in ((dq, q), (dk, k), (dv, v)))


# --- torch CPU flash ---------------------------------------------------------------------------------------


def _additive_mask(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    if mask is None:
        return None
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, float("-inf"))


def _cpu_flash_forward(q, k, v, causal, scale, segments):
    mask = (
        None
        if segments is None
        else _additive_mask(dense_mask(q.size(1), k.size(1), causal, segments, q.device), q.dtype)
    )
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        0.0,
        causal and segments is None,
        attn_mask=mask,
        scale=scale,
    )  # out [B, Hq, Sq, D] (stored as [B, Sq, Hq, D]), lse [B, Hq, Sq]
    return out.transpose(1, 2), lse.to(accumulation_dtype(q.dtype))


def _cpu_flash_backward(dout, q, k, v, out, lse, causal, scale, segments):
    mask = (
        None
        if segments is None
        else _additive_mask(dense_mask(q.size(1), k.size(1), causal, segments, q.device), q.dtype)
    )
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout.transpose(1, 2),
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        out.transpose(1, 2),
        lse.to(
            accumulation_dtype(q.dtype)
        ),  # fp32 (fp64 for fp64 inputs), read by its strides: no copy (its forward's is strided)
        0.0,
        causal and segments is None,
        attn_mask=mask,
        scale=scale,
    )
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


OWN_AUTOGRAD_BACKENDS: tuple[str, ...] = ("cpu_flash",)
"""Backends whose kernel pair aten registers with an autograd formula (the forward saves ``out`` and ``lse``, the
backward calls the backward kernel on them): :func:`attention_own_autograd` runs them with no Python in the
backward."""


def attention_own_autograd(
    backend: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, softmax_scale: float
) -> torch.Tensor:
    """``out [B, S, Hq, D]`` of one unmasked block (``causal`` or full) covering all of ``q``'s rows and
    ``k``'s keys, differentiated by aten's own formula for the kernel: the same forward and backward kernel
    calls as :func:`attention_forward` / :func:`attention_backward` on that block (so the same numbers), with
    the backward in C++ rather than an autograd ``Function``'s Python. ``backend`` in
    :data:`OWN_AUTOGRAD_BACKENDS`."""
    assert backend == "cpu_flash", f"no autograd formula registered for backend {backend!r}"
    out, _ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.0, causal, scale=softmax_scale
    )  # [B, Hq, S, D], stored as [B, S, Hq, D]
    return out.transpose(1, 2)


# --- document segments on the dense kernels, one call per segment or group (usp.attention.segmented) -------

_PER_SEGMENT = ("sdpa_flash", "sdpa_efficient", "sdpa_cudnn", "cpu_flash")  # "math" stays the dense reference


def _dense_forward(backend: str):
    """``(q, k, v, causal, scale, segments)`` -> ``(out, lse)`` of one group (small mask or none)."""
    if backend == "cpu_flash":
        return _cpu_flash_forward
    return lambda *args: sdpa_forward(backend, *args)


def _dense_backward(backend: str):
    if backend == "cpu_flash":
        return _cpu_flash_backward
    return lambda *args: sdpa_backward(backend, *args)


# --- the interface -----------------------------------------------------------------------------------------


def _masked_backend(backend: str, segments, softcap: float | None) -> str:
    """The kernel that runs a block: softcapped scores only in ``math`` (no fused kernel here caps them);
    a banded block (:class:`~usp.attention.masks.RowRanges`) on a kernel that takes a mask (flash_attn takes
    none: mem-efficient SDPA runs it)."""
    if softcap is not None:
        return "math"
    if isinstance(segments, RowRanges) and backend == "flash_attn":
        return "sdpa_efficient"
    return backend


def _clear_rows_(out: torch.Tensor, lse: torch.Tensor, rows: list[tuple[int, int]]) -> None:
    for a, b in rows:
        out[:, a:b] = 0.0
        lse[:, :, a:b] = float("-inf")


def _band_call_forward(q, k, v, scale, backend, band: RowRanges, softcap):
    """One masked kernel call over a whole band (no tiles); rows that attend to nothing cleared."""
    if backend == "math":
        out, lse = _math_forward(q, k, v, False, scale, band, softcap)
    elif backend == "cpu_flash":
        out, lse = _cpu_flash_forward(q, k, v, False, scale, band)
    else:
        out, lse = sdpa_forward(backend, q, k, v, False, scale, band)
    _clear_rows_(out, lse, band.empty_rows())
    return out, lse


def _band_call_backward(dout, q, k, v, out, lse, scale, backend, band: RowRanges, softcap):
    if band.empty:  # rows with no key here: an lse of +inf makes their P = exp(-inf - lse) exactly 0 (no NaN
        lse = lse.clone()  # when the row attends nowhere at all and its global lse is -inf)
        for a, b in band.empty:
            lse[:, :, a:b] = float("inf")
    if backend == "math":
        return _math_backward(dout, q, k, v, out, lse, False, scale, band, softcap)
    if backend == "cpu_flash":
        return _cpu_flash_backward(dout, q, k, v, out, lse, False, scale, band)
    return sdpa_backward(backend, dout, q, k, v, out, lse, False, scale, band)


def _banded_forward(q, k, v, scale, backend, band: RowRanges, softcap):
    """``(out, lse)`` of a banded block, one masked call per tile (:class:`RowRanges`); rows outside every
    tile attend to nothing (``out = 0``, ``lse = -inf``)."""
    if not band.tiles:
        return _band_call_forward(q, k, v, scale, backend, band, softcap)
    b, sq, hq, _ = q.shape
    out = q.new_zeros(q.shape)
    lse = torch.full((b, hq, sq), float("-inf"), dtype=accumulation_dtype(q.dtype), device=q.device)
    for a, e, k0, k1, sub in band.tiles:
        o, l_tile = _band_call_forward(q[:, a:e], k[:, k0:k1], v[:, k0:k1], scale, backend, sub, softcap)
        out[:, a:e] = o
        lse[:, :, a:e] = l_tile
    return out, lse


def _banded_backward(dout, q, k, v, out, lse, scale, backend, band: RowRanges, softcap):
    """``(dq, dk, dv)`` of :func:`_banded_forward`, tile by tile (the tiles' key ranges overlap: ``+=``)."""
    if not band.tiles:
        return _band_call_backward(dout, q, k, v, out, lse, scale, backend, band, softcap)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for a, e, k0, k1, sub in band.tiles:
        rows, keys = slice(a, e), slice(k0, k1)
        gq, gk, gv = _band_call_backward(
            dout[:, rows],
            q[:, rows],
            k[:, keys],
            v[:, keys],
            out[:, rows],
            lse[:, :, rows],
            scale,
            backend,
            sub,
            softcap,
        )
        dq[:, rows] = gq
        dk[:, keys] += gk
        dv[:, keys] += gv
    return dq, dk, dv


def attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    softmax_scale: float,
    backend: str,
    segments: torch.Tensor | RowRanges | None = None,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One attention block: ``(out [B, Sq, Hq, D] q.dtype, lse [B, Hq, Sq] fp32 or fp64)``; see the module docstring.

    ``backend`` must already be resolved (:func:`resolve_backend`). Rows with no allowed key get ``out = 0``,
    ``lse = -inf`` whatever the kernel does with them. ``segments`` may be a banded
    :class:`~usp.attention.masks.RowRanges` (windows, chunks); ``softcap`` caps the scores (``c * tanh(s / c)``).
    """
    if isinstance(segments, RowRanges) or softcap is not None:
        band = (
            segments
            if isinstance(segments, RowRanges)
            else RowRanges.of_block(q.size(1), k.size(1), causal, segments)
        )
        return _banded_forward(q, k, v, softmax_scale, _masked_backend(backend, band, softcap), band, softcap)
    segs = None if segments is None else host_segments(segments)
    if segs is not None and backend in _PER_SEGMENT and per_segment_calls(q.size(1), k.size(1), segs):
        return segmentwise_forward(_dense_forward(backend), q, k, v, causal, softmax_scale, segs)
    if backend == "math":
        out, lse = _math_forward(q, k, v, causal, softmax_scale, segments)
    elif backend == "cpu_flash":
        out, lse = _cpu_flash_forward(q, k, v, causal, softmax_scale, segments)
    elif backend == "flash_attn":
        out, lse = flash_attn_forward(q, k, v, causal, softmax_scale, segments)
    else:
        out, lse = sdpa_forward(backend, q, k, v, causal, softmax_scale, segments)
    if segs is not None:
        clear_uncovered_rows_(out, lse, segs)
    return out, lse


def attention_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    causal: bool,
    softmax_scale: float,
    backend: str,
    segments: torch.Tensor | RowRanges | None = None,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients ``(dq, dk, dv)`` of one block, shaped like ``q, k, v``.

    ``out`` and ``lse`` are the *merged* results over all blocks for these query rows (global softmax), and
    must be finite-or-``-inf``-free where a row attends to anything; with them the block's contribution is
    exact: ``P = exp(S - lse)``, ``dS = P * (dP - rowsum(dout * out))`` (times ``1 - tanh^2`` under a softcap).
    """
    if isinstance(segments, RowRanges) or softcap is not None:
        band = (
            segments
            if isinstance(segments, RowRanges)
            else RowRanges.of_block(q.size(1), k.size(1), causal, segments)
        )
        backend = _masked_backend(backend, band, softcap)
        return _banded_backward(dout, q, k, v, out, lse, softmax_scale, backend, band, softcap)
    if segments is not None and backend in _PER_SEGMENT and per_segment_calls(q.size(1), k.size(1), segments):
        segs = host_segments(segments)
        return segmentwise_backward(
            _dense_backward(backend), dout, q, k, v, out, lse, causal, softmax_scale, segs
        )
    if backend == "math":
        return _math_backward(dout, q, k, v, out, lse, causal, softmax_scale, segments)
    if backend == "cpu_flash":
        return _cpu_flash_backward(dout, q, k, v, out, lse, causal, softmax_scale, segments)
    if backend == "flash_attn":
        return flash_attn_backward(dout, q, k, v, out, lse, causal, softmax_scale, segments)
    return sdpa_backward(backend, dout, q, k, v, out, lse, causal, softmax_scale, segments)
