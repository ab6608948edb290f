"""Fake CUDA for the CPU test tier: FakeTensorMode plus the contracts of torch's CUDA SDPA kernels.

``fake_cuda()`` enters ``torch._subclasses.fake_tensor.FakeTensorMode`` (tensors created on ``"cuda"`` inside
it are FakeTensors on ``cuda:0``, no GPU or CUDA build needed) and, on top of it, :class:`SdpaContracts`, a
dispatch mode that sees every call of torch's CUDA SDPA ops. For each call it checks what the CUDA kernel
checks or assumes and the fake kernel does not (dtypes, head counts, head dims, causal alignment, lse layouts
and ranks, the strides cuDNN's backward graph insists on), lets torch's registered meta kernel compute the
outputs (asserting they are FakeTensors on the inputs' CUDA device: the meta/fake kernel is what ran), and
records the call. The rules come from reading torch's kernels (``aten/src/ATen/native/transformers``):
they are written down here because the meta kernels accept almost anything.

What this proves: op schemas, arities, output shapes/dtypes/devices and the layouts the wrappers feed back
into each backward. What it cannot prove: numerics, performance, and rules of the CUDA kernels not listed
here. Those need a GPU (``scripts/gpu_check.sh``).

Never call ``torch.nn.functional.scaled_dot_product_attention`` on these tensors: on a CPU-only build its
backend selection falls back to the math kernel, whose device guard aborts the process.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
HALF = (torch.float16, torch.bfloat16)


class ContractError(RuntimeError):
    """A CUDA kernel's input contract is violated (on a GPU the kernel would raise or compute garbage)."""


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ContractError(msg)


def _bind(func, args, kwargs) -> dict:
    names = [a.name for a in func._schema.arguments]
    bound = dict(zip(names, args))
    bound.update(kwargs)
    if "grad_out_" in bound:  # the mem-efficient backward's schema spells it with an underscore
        bound["grad_out"] = bound.pop("grad_out_")
    return bound


def dense_strides(t: torch.Tensor, order=(0, 2, 1, 3)) -> tuple[int, ...]:
    """Strides of a dense tensor of ``t``'s shape whose memory order is ``order`` (outermost first).

    ``(0, 2, 1, 3)``: a ``[B, H, S, D]`` view of dense ``[B, S, H, D]`` memory, the wrappers' layout.
    """
    strides, step = [0] * t.dim(), 1
    for dim in reversed(order):
        strides[dim] = step
        step *= t.size(dim)
    return tuple(strides)


@dataclass
class Call:
    op: str
    shapes: dict[str, tuple[int, ...]]
    outputs: list[tuple[int, ...]] = field(default_factory=list)


class SdpaContracts(TorchDispatchMode):
    """Checks every call of torch's CUDA SDPA ops against the kernel's contract (see the module docstring).

    ``cudnn_lse_rank``: the rank of the lse the cuDNN forward returns. None keeps this torch's (its meta
    kernel: ``[B, H, S, 1]``); 3 emulates the older releases that return ``[B, H, S]``. Either way the cuDNN
    backward must get the lse back with the rank its forward produced.
    """

    def __init__(self, cudnn_lse_rank: int | None = None):
        super().__init__()
        self.cudnn_lse_rank = cudnn_lse_rank
        self.calls: list[Call] = []

    def ops(self) -> list[str]:
        return [c.op for c in self.calls]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        check = _CHECKS.get(func)
        if check is None:
            return func(*args, **kwargs)
        a = _bind(func, args, kwargs)
        if a["query"].device.type == "meta":  # a probe of the op's meta kernel (cudnn_lse_rank), not a call
            out = func(*args, **kwargs)
            if func is aten._scaled_dot_product_cudnn_attention.default and self.cudnn_lse_rank == 3:
                out = (out[0], out[1].squeeze(-1), *out[2:])
            return out
        check(self, a)
        out = func(*args, **kwargs)
        tensors = [t for t in out if isinstance(t, torch.Tensor)]
        device = a["query"].device
        for t in tensors:
            if t.device.type != "meta":  # seeds/offsets are meta by design (torch's Note [Seed and Offset])
                _require(
                    isinstance(t, FakeTensor) and t.device == device, f"{func}: output not fake on {device}"
                )
        if func is aten._scaled_dot_product_cudnn_attention.default and self.cudnn_lse_rank == 3:
            out = (out[0], out[1].squeeze(-1), *out[2:])
        shapes = {k: tuple(v.shape) for k, v in a.items() if isinstance(v, torch.Tensor)}
        self.calls.append(Call(str(func.overloadpacket.__name__), shapes, [tuple(t.shape) for t in tensors]))
        return out


def _qkv(a: dict, *, dtypes, gqa: bool, head_dim_multiple: int, name: str) -> tuple[int, int, int, int, int]:
    q, k, v = a["query"], a["key"], a["value"]
    for t in (q, k, v):
        _require(isinstance(t, FakeTensor) and t.device.type == "cuda", f"{name}: inputs must be (fake) CUDA")
        _require(t.dim() == 4, f"{name}: inputs are [B, H, S, D], got {tuple(t.shape)}")
        _require(t.stride(-1) == 1, f"{name}: last dim must be contiguous")
        _require(t.dtype == q.dtype and t.device == q.device, f"{name}: q, k, v differ in dtype/device")
    _require(q.dtype in dtypes, f"{name}: dtype {q.dtype} not supported (kernel takes {dtypes})")
    b, hq, sq, d = q.shape
    _, hk, sk, _ = k.shape
    _require(
        k.shape == v.shape and k.size(0) == b and k.size(3) == d, f"{name}: k/v shapes {k.shape} {v.shape}"
    )
    if gqa:
        _require(hq % hk == 0, f"{name}: num_heads {hq} not a multiple of num_heads_k {hk}")
    else:
        _require(hq == hk, f"{name}: kernel has no grouped heads (Hq {hq}, Hkv {hk}): expand K/V first")
    _require(
        d % head_dim_multiple == 0, f"{name}: head_size should be a multiple of {head_dim_multiple}, got {d}"
    )
    if a.get("is_causal"):
        # flash aligns causal bottom-right, mem-efficient and cuDNN top-left: only square blocks agree
        _require(sq == sk, f"{name}: causal block must be square (Sq {sq} != Sk {sk})")
    return b, hq, sq, sk, d


def _lse(t: torch.Tensor, shape: tuple[int, ...], name: str) -> None:
    _require(t.dtype == torch.float32, f"{name}: lse must be fp32, got {t.dtype}")
    _require(tuple(t.shape) == tuple(shape), f"{name}: lse shape {tuple(t.shape)}, kernel expects {shape}")
    _require(t.is_contiguous(), f"{name}: lse must be contiguous")


def _like(t: torch.Tensor, ref: torch.Tensor, what: str, name: str) -> None:
    _require(
        t.shape == ref.shape and t.dtype == ref.dtype and t.device == ref.device,
        f"{name}: {what} {tuple(t.shape)} {t.dtype} does not match {tuple(ref.shape)} {ref.dtype}",
    )


def _flash_fwd(mode, a):
    _qkv(a, dtypes=HALF, gqa=True, head_dim_multiple=8, name="flash fwd")


def _flash_bwd(mode, a):
    b, hq, sq, sk, _ = _qkv(a, dtypes=HALF, gqa=True, head_dim_multiple=8, name="flash bwd")
    _like(a["grad_out"], a["query"], "grad_out", "flash bwd")
    _like(a["out"], a["query"], "out", "flash bwd")
    _lse(a["logsumexp"], (b, hq, sq), "flash bwd")
    _require((a["max_q"], a["max_k"]) == (sq, sk), "flash bwd: max_q/max_k must be Sq/Sk")


def _efficient_bias(a, b, hq, sq, sk, name):
    bias = a["attn_bias"]
    if bias is None:
        return
    _require(bias.dtype == a["query"].dtype, f"{name}: bias dtype {bias.dtype} != q dtype")
    _require(tuple(bias.shape) == (b, hq, sq, sk), f"{name}: bias shape {tuple(bias.shape)}")
    _require(bias.stride(-1) == 1 and bias.stride(-2) % 16 == 0, f"{name}: bias rows must be 16-aligned")
    _require(
        not a.get("is_causal", False),
        f"{name}: causal goes into the bias, not the flag, when a bias is given",
    )


def _efficient_fwd(mode, a):
    b, hq, sq, sk, _ = _qkv(a, dtypes=(*HALF, torch.float32), gqa=False, head_dim_multiple=1, name="eff fwd")
    _efficient_bias(a, b, hq, sq, sk, "eff fwd")


def _efficient_bwd(mode, a):
    b, hq, sq, sk, _ = _qkv(a, dtypes=(*HALF, torch.float32), gqa=False, head_dim_multiple=1, name="eff bwd")
    _efficient_bias(a, b, hq, sq, sk, "eff bwd")
    _like(a["grad_out"], a["query"], "grad_out", "eff bwd")
    _like(a["out"], a["query"], "out", "eff bwd")
    _lse(a["logsumexp"], (b, hq, math.ceil(sq / 32) * 32), "eff bwd")  # the forward pads lse rows to 32


def _cudnn_fwd(mode, a):
    _, _, _, sk, _ = _qkv(a, dtypes=HALF, gqa=False, head_dim_multiple=8, name="cudnn fwd")
    _require(a["attn_bias"] is None, "cudnn fwd: the wrappers pass no bias")
    _require(sk != 1, "cudnn fwd: cuDNN SDPA does not support key/value sequence length 1")


def _cudnn_bwd(mode, a):
    b, hq, sq, sk, _ = _qkv(a, dtypes=HALF, gqa=False, head_dim_multiple=8, name="cudnn bwd")
    _require(sk != 1, "cudnn bwd: cuDNN SDPA does not support key/value sequence length 1")
    rank = mode.cudnn_lse_rank or 4
    _lse(a["logsumexp"], (b, hq, sq, 1)[:rank], "cudnn bwd")
    _require((a["max_q"], a["max_k"]) == (sq, sk), "cudnn bwd: max_q/max_k must be Sq/Sk")
    # the backward graph is built with O/dO strides derived from a dense q and checks them exactly
    for name in ("query", "key", "value", "out", "grad_out"):
        t = a[name]
        _require(
            t.stride() == dense_strides(t),
            f"cudnn bwd: {name} strides {t.stride()} != dense {dense_strides(t)}",
        )
    _like(a["grad_out"], a["query"], "grad_out", "cudnn bwd")
    _like(a["out"], a["query"], "out", "cudnn bwd")


_CHECKS = {
    aten._scaled_dot_product_flash_attention.default: _flash_fwd,
    aten._scaled_dot_product_flash_attention_backward.default: _flash_bwd,
    aten._scaled_dot_product_efficient_attention.default: _efficient_fwd,
    aten._scaled_dot_product_efficient_attention_backward.default: _efficient_bwd,
    aten._scaled_dot_product_cudnn_attention.default: _cudnn_fwd,
    aten._scaled_dot_product_cudnn_attention_backward.default: _cudnn_bwd,
}


# --- Python indexing on fake CUDA tensors -------------------------------------------------------------------
# ``t[...]``, ``t[...] = x``, ``~t`` and ``t.contiguous()`` go through C++ bindings that take a device guard, and a
# CPU-only build has no CUDA guard ("PyTorch is not linked with support for cuda devices"). Inside fake_cuda()
# they are spelled with the aten ops they stand for (select, slice, index, index_put_, copy_, bitwise_not, clone).

_GETITEM, _SETITEM, _CONTIGUOUS = torch.Tensor.__getitem__, torch.Tensor.__setitem__, torch.Tensor.contiguous


def _basic(t: torch.Tensor, idx) -> tuple[torch.Tensor, list]:
    """Apply ints, slices, None and Ellipsis as views; return the view and per-dim tensor indices (or None)."""
    idx = idx if isinstance(idx, tuple) else (idx,)
    if any(i is Ellipsis for i in idx):
        pos = next(n for n, i in enumerate(idx) if i is Ellipsis)
        used = sum(1 for i in idx if i is not None and i is not Ellipsis)
        idx = idx[:pos] + (slice(None),) * (t.dim() - used) + idx[pos + 1 :]
    out, dim, advanced = t, 0, []
    for i in idx:
        if i is None:
            out, dim = out.unsqueeze(dim), dim + 1
            advanced.append(None)
        elif isinstance(i, int):
            out = out.select(dim, i)
        elif isinstance(i, slice):
            start, stop, step = i.indices(out.size(dim))
            out = aten.slice.Tensor(out, dim, start, max(start, stop), step)
            dim += 1
            advanced.append(None)
        elif isinstance(i, torch.Tensor):
            assert i.dtype in (torch.int64, torch.int32), "fake indexing: integer tensor indices only"
            dim += 1
            advanced.append(i.to(out.device))
        else:
            raise TypeError(f"fake indexing does not handle {type(i).__name__}")
    return out, advanced


def _getitem(self, idx):
    if self.device.type != "cuda":
        return _GETITEM(self, idx)
    out, advanced = _basic(self, idx)
    if any(a is not None for a in advanced):
        out = aten.index.Tensor(out, advanced)
    return out


def _setitem(self, idx, value):
    if self.device.type != "cuda":
        return _SETITEM(self, idx, value)
    view, advanced = _basic(self, idx)
    if not isinstance(value, torch.Tensor):
        value = torch.full((), value, dtype=self.dtype, device=self.device)
    target = _getitem(self, idx).shape  # the fake index_put_ does not check that the value fits: do it here
    if torch.broadcast_shapes(value.shape, target) != target:
        raise RuntimeError(f"shape mismatch: value {tuple(value.shape)} cannot go into {tuple(target)}")
    if any(a is not None for a in advanced):
        aten.index_put_.default(view, advanced, value.to(self.dtype))
    else:
        aten.copy_.default(view, value)


def _contiguous(self, memory_format=torch.contiguous_format):
    if self.device.type != "cuda":
        return _CONTIGUOUS(self, memory_format=memory_format)
    if self.is_contiguous(memory_format=memory_format):
        return self
    return aten.clone.default(self, memory_format=memory_format)


def _invert(self):
    return aten.bitwise_not.default(self)


_PATCHED = {
    "__getitem__": _getitem,
    "__setitem__": _setitem,
    "contiguous": _contiguous,
    "__invert__": _invert,
}


@contextlib.contextmanager
def fake_cuda(cudnn_lse_rank: int | None = None):
    """``with fake_cuda() as contracts:`` fake CUDA tensors, torch's meta kernels, the SDPA contracts checked."""
    originals = {name: getattr(torch.Tensor, name) for name in _PATCHED}
    for name, fn in _PATCHED.items():
        setattr(torch.Tensor, name, fn)
    try:
        with FakeTensorMode(allow_non_fake_inputs=True), SdpaContracts(cudnn_lse_rank) as contracts:
            yield contracts
    finally:
        for name, fn in originals.items():
            setattr(torch.Tensor, name, fn)


def cuda_randn(*shape, dtype=torch.bfloat16) -> torch.Tensor:
    """A fake CUDA tensor (inside :func:`fake_cuda`); contents are meaningless, only metadata is real."""
    return torch.empty(*shape, dtype=dtype, device="cuda")
