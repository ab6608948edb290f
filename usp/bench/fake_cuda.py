"""A fake CUDA device for measuring a training step's memory on a CPU-only machine (no GPU memory is touched).

Three layers, each the smallest that lets the real code run unchanged on ``FakeTensorMode`` CUDA tensors:

1. **A no-op CUDA device guard and CUDA hooks** (:func:`preload`). A CPU-only torch build registers neither,
   so every C++ binding that takes a device guard (``copy_``, indexing, ``contiguous``) and the autograd
   engine's stream bookkeeping (``at::accelerator::getAccelerator``) fail on a ``cuda`` tensor. A 20-line C++
   library (compiled once with the system ``g++`` against torch's headers, cached under
   ``~/.cache/usp/fake_cuda``) registers c10's ``FakeGuardImpl<CUDA>`` and ``CUDAHooks`` that report one
   device. torch reads its CUDA hooks once, at import, so the library must be loaded *before* ``import torch``:
   :func:`preload` does that, and refuses (``RuntimeError``) when torch is already imported. On a CUDA build
   nothing is loaded (its own guard serves fake tensors).
2. **torch.cuda's Python runtime** (:func:`fake_cuda_runtime`): ``current_device``, ``Stream``, ``Event``,
   ``current_stream``, ``stream``, ``synchronize`` as no-ops on device 0 (FSDP2's side streams, checkpoint
   offload's copy stream, ``record_stream``), and ``pin_memory`` for host buffers (a plain host tensor: its bytes are what is
   measured).
3. **The attention kernels' buffers** (:mod:`usp.bench.fake_kernels`): the meta kernels of torch's SDPA ops
   allocate only their outputs; the stand-ins add what the CUDA kernels allocate inside the call.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import importlib.util
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

_GUARD_SRC = r"""
// A CUDA device guard and CUDA hooks for a CPU-only torch build: FakeTensorMode CUDA tensors then pass
// through every binding that takes a device guard (usp.bench.fake_cuda).
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/FakeGuardImpl.h>
namespace at {
struct UspFakeCUDAHooks : CUDAHooksInterface {
  explicit UspFakeCUDAHooks(CUDAHooksArgs) {}
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  bool hasCUDA() const override { return true; }
  bool hasPrimaryContext(DeviceIndex) const override { return true; }
  DeviceIndex deviceCount() const override { return 1; }
  int getNumGPUs() const override { return 1; }
};
C10_REGISTER_TYPED_CLASS(CUDAHooksRegistry, "CUDAHooks", UspFakeCUDAHooks)
}  // namespace at
namespace {
c10::impl::DeviceGuardImplRegistrar usp_fake_cuda_guard(
    c10::DeviceType::CUDA, new c10::impl::FakeGuardImpl<c10::DeviceType::CUDA>());
}
"""
_LOADED: list[str] = []


def _torch_dir() -> Path:
    spec = importlib.util.find_spec("torch")
    assert spec is not None and spec.submodule_search_locations, "torch is not installed"
    return Path(list(spec.submodule_search_locations)[0])


def _cpu_only_build(torch_dir: Path) -> bool:
    """No CUDA runtime library ships with this torch (read from its files: torch is not imported yet)."""
    return not any((torch_dir / "lib").glob("libtorch_cuda*"))


def build_library(cache_dir: str | os.PathLike | None = None) -> Path:
    """Compile the fake guard library for this torch (once; keyed by torch's build) and return its path.

    ``RuntimeError`` naming what is missing when there is no C++ compiler."""
    torch_dir = _torch_dir()
    lib = torch_dir / "lib" / "libtorch_cpu.so"
    key = hashlib.sha256(_GUARD_SRC.encode() + str(lib.stat().st_size).encode() + str(torch_dir).encode())
    cache = Path(cache_dir or os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "usp" / "fake_cuda"
    out = cache / f"fake_cuda_{key.hexdigest()[:16]}.so"
    if out.exists():
        return out
    cache.mkdir(parents=True, exist_ok=True)
    src = out.with_suffix(".cpp")
    src.write_text(_GUARD_SRC)
    tmp = out.with_suffix(f".{os.getpid()}.tmp")
    cmd = [
        os.environ.get("CXX", "g++"),
        "-shared",
        "-fPIC",
        "-O0",
        "-std=c++17",
        f"-I{torch_dir / 'include'}",
        str(src),
        f"-L{torch_dir / 'lib'}",
        "-lc10",
        "-ltorch_cpu",
        "-o",
        str(tmp),
    ]
    try:
        subprocess.run(cmd, check=True, capture_output=True, text=True)
    except FileNotFoundError as e:
        raise RuntimeError(
            f"the fake CUDA device needs a C++ compiler ({cmd[0]}): install g++ or set CXX"
        ) from e
    except subprocess.CalledProcessError as e:
        raise RuntimeError(f"building the fake CUDA guard failed:\n{e.stderr[-2000:]}") from e
    tmp.replace(out)
    return out


def unsupported_reason() -> str | None:
    """Why the fake CUDA device cannot run in this environment (``None`` when it can). A CUDA build of torch
    with no GPU visible refuses it: its real CUDA hooks, which the shim does not replace, reject device 0 once
    autograd's device threads start (seen with torch 2.14.1+cu130 on a CPU-only machine)."""
    import torch

    if torch.version.cuda is not None and not torch.cuda.is_available():
        return (
            f"the fake CUDA step needs torch's CPU build, or a GPU: this torch {torch.__version__} is a CUDA "
            "build and sees no GPU (install torch's CPU build, e.g. pip install torch==2.13.0, in a venv)"
        )
    return None


def preload() -> None:
    """Load the fake CUDA guard and hooks into this process before torch is imported (module docstring)."""
    if _LOADED:
        return
    torch_dir = _torch_dir()
    if not _cpu_only_build(torch_dir):
        _LOADED.append("")
        return
    if "torch" in sys.modules:
        raise RuntimeError(
            "usp.bench.fake_cuda.preload() must run before torch is imported (torch reads its CUDA hooks once); "
            "run the fake step in a fresh process: python -m usp.bench.fake_memory ..."
        )
    lib = build_library()
    for name in ("libc10.so", "libtorch_cpu.so"):
        ctypes.CDLL(str(torch_dir / "lib" / name), mode=ctypes.RTLD_GLOBAL)
    ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL)
    _LOADED.append(str(lib))


class _Stream:
    """A CUDA stream that orders nothing (fake tensors have no data to race on)."""

    def __init__(self, device=None, priority: int = 0, **_kw) -> None:
        import torch

        self.device = torch.device("cuda", 0)
        self.priority = priority

    def wait_stream(self, _s) -> None: ...
    def wait_event(self, _e) -> None: ...
    def synchronize(self) -> None: ...
    def query(self) -> bool:
        return True

    def record_event(self, _e=None):
        return _Event()


class _Event:
    def __init__(self, *_a, **_k) -> None: ...
    def record(self, _stream=None) -> None: ...
    def wait(self, _stream=None) -> None: ...
    def synchronize(self) -> None: ...
    def query(self) -> bool:
        return True


_CUDA_KEY_LIBS: list = []
_CUDA_KEY_OPS = ("silu_backward",)
"""Ops whose only kernel a CPU-only build offers the CUDA key is their ``CompositeImplicitAutograd`` one (the
CPU and CUDA kernels sit on the structured ``.grad_input`` variant): on a fake CUDA tensor it would run above
``FakeTensorMode`` as a pointwise decomposition, allocating temporaries a CUDA build's one fused kernel does
not (``silu_backward``: sigmoid, ``1 - sigmoid``, ... about 2 extra ``[s, I]`` per MLP). A CUDA-key
placeholder sends them to the fake mode, which runs their meta kernel (the output only); never called."""


def _register_cuda_keys() -> None:
    import torch

    if _CUDA_KEY_LIBS or torch.cuda._is_compiled() and torch.version.cuda:
        return

    def never(*args):
        raise AssertionError("a fake-CUDA placeholder kernel ran outside FakeTensorMode")

    lib = torch.library.Library("aten", "IMPL")
    for op in _CUDA_KEY_OPS:
        lib.impl(op, never, "CUDA")
    _CUDA_KEY_LIBS.append(lib)


@contextlib.contextmanager
def fake_cuda_runtime() -> Iterator[None]:
    """torch.cuda's Python runtime as no-ops on one device, and host pinning as plain host memory (module
    docstring). Restores everything on exit."""
    import torch

    stream = _Stream()
    patches = {
        "current_device": lambda: 0,
        "Stream": _Stream,
        "Event": _Event,
        "device_count": lambda: 1,
        "current_stream": lambda device=None: stream,
        "default_stream": lambda device=None: stream,
        "stream": lambda s=None: contextlib.nullcontext(),
        "synchronize": lambda device=None: None,
        "set_device": lambda d: None,
    }
    saved = {k: getattr(torch.cuda, k) for k in patches}
    pin, record = torch.Tensor.pin_memory, torch.Tensor.record_stream
    for k, v in patches.items():
        setattr(torch.cuda, k, v)
    torch.Tensor.pin_memory = lambda self, device=None: self  # type: ignore[method-assign]
    torch.Tensor.record_stream = lambda self, stream: None  # type: ignore[method-assign]
    _register_cuda_keys()
    try:
        yield
    finally:
        for k, v in saved.items():
            setattr(torch.cuda, k, v)
        torch.Tensor.pin_memory, torch.Tensor.record_stream = pin, record  # type: ignore[method-assign]
