"""The DeepSpeed parts usp uses, imported on demand with a ``ValueError`` naming the setting that needs them.

DeepSpeed is optional (``pip install 'usp[deepspeed]'``; in ``dev``): ``parallel.mlp_tiles > 1`` uses its
``TiledMLP`` and ``optim.name=deepspeed_cpu_adam`` its ``DeepSpeedCPUAdam``. Versions before
:data:`MIN_VERSION` are refused (the interfaces used here were checked against it; see docs/memory.md).

DeepSpeed JIT-compiles ``DeepSpeedCPUAdam``'s C++ op through torch's ``cpp_extension``, whose cache
(``TORCH_EXTENSIONS_DIR``) rebuilds whenever the compile command changes, and that command holds the
virtualenv's absolute include paths: every new virtualenv (each CI clone) compiled it again, 2 to 7 minutes on
2 cores. :func:`load_cpu_adam_op` keeps one build per machine and version set instead, in
:func:`cpu_adam_cache_dir` (``$XDG_CACHE_HOME/usp/ops/cpu_adam-<key>/cpu_adam.so``, default ``~/.cache``; the
key: Python major.minor, torch, DeepSpeed, torch's CPU capability and DeepSpeed's accelerator).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import re
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

MIN_VERSION = (0, 19, 8)
CPU_ADAM = "cpu_adam"  # DeepSpeed's op name: its JIT module, .so file and PyInit are named after it


def _version_tuple(version: str) -> tuple[int, ...]:
    parts = []
    for piece in version.split("+")[0].split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def import_deepspeed_part(module: str, name: str, *, setting: str, alternative: str) -> Any:
    """``getattr(import_module(module), name)``; ``ValueError`` naming ``setting`` and ``alternative`` when
    DeepSpeed is missing, older than :data:`MIN_VERSION`, or lacks the part."""
    wanted = ".".join(map(str, MIN_VERSION))
    try:
        import deepspeed

        part = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(
            f"{setting} uses DeepSpeed's {name}, which is not importable ({e}); install deepspeed>={wanted} "
            f"(pip install 'usp[deepspeed]') or set {alternative}."
        ) from e
    if _version_tuple(getattr(deepspeed, "__version__", "0")) < MIN_VERSION:
        raise ValueError(
            f"{setting} uses DeepSpeed's {name}, checked against deepspeed>={wanted}, but {deepspeed.__version__} "
            f"is installed; upgrade it (pip install 'usp[deepspeed]') or set {alternative}."
        )
    return part


# --- DeepSpeed's CPU Adam op: one build per machine and version set -----------------------------------------
def op_cache_key(*, python: str, torch: str, deepspeed: str, cpu_capability: str, accelerator: str) -> str:
    """The directory-name-safe key of one compiled op: everything its binary depends on besides the machine
    (the extension ABI of Python ``major.minor``, the torch and DeepSpeed versions, torch's CPU capability,
    e.g. ``AVX2``, for DeepSpeed's ``-march=native`` SIMD build, and DeepSpeed's accelerator, whose builder
    class picks the flags)."""
    raw = f"py{python}-torch{torch}-ds{deepspeed}-{cpu_capability}-{accelerator}"
    return re.sub(r"[^A-Za-z0-9._+-]", "_", raw)


def current_op_cache_key() -> str:
    """:func:`op_cache_key` of this interpreter, torch, DeepSpeed and CPU."""
    import deepspeed
    import torch
    from deepspeed.accelerator import get_accelerator

    return op_cache_key(
        python=f"{sys.version_info.major}.{sys.version_info.minor}",
        torch=torch.__version__,
        deepspeed=deepspeed.__version__,
        cpu_capability=torch.backends.cpu.get_cpu_capability(),
        accelerator=get_accelerator()._name,
    )


def cpu_adam_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/usp/ops/cpu_adam-<key>`` (``~/.cache`` when ``XDG_CACHE_HOME`` is unset or empty)."""
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "usp" / "ops" / f"{CPU_ADAM}-{current_op_cache_key()}"


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """An exclusive ``flock`` on ``path`` (created if missing), released on exit or when the process dies."""
    import fcntl

    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _import_extension(name: str, path: Path) -> ModuleType:
    """The compiled extension module ``name`` (its ``PyInit_<name>``) from the file ``path``."""
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load the extension module {name} from {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _prebuilt(name: str) -> bool:
    """Whether DeepSpeed was installed with the op compiled in (``DS_BUILD_CPU_ADAM=1``) for this accelerator:
    then its own ``load()`` imports that build and there is nothing to cache."""
    from deepspeed.accelerator import get_accelerator
    from deepspeed.git_version_info import accelerator_name, installed_ops

    return bool(installed_ops.get(name, False)) and accelerator_name == get_accelerator()._name


def load_cpu_adam_op() -> ModuleType:
    """DeepSpeed's CPU Adam op, from the per-machine cache when it is there, else JIT-compiled once and cached.

    The op is registered where DeepSpeed's ``CPUAdamBuilder().load()`` (called by
    ``DeepSpeedCPUAdam.__init__``) looks first (``OpBuilder._loaded_ops``), so the optimizer uses it without a
    compile. A missing cache file is built under an exclusive lock on the cache directory (a second process
    building at the same time waits, then imports the first one's file) and copied in through a temporary
    name and ``os.replace``: readers see the whole file or none. DeepSpeed's own build, if it was installed
    with the op compiled in, is used as is.
    """
    from deepspeed.ops.op_builder import CPUAdamBuilder
    from deepspeed.ops.op_builder.builder import OpBuilder

    if CPU_ADAM in OpBuilder._loaded_ops:
        return OpBuilder._loaded_ops[CPU_ADAM]
    builder = CPUAdamBuilder()
    if _prebuilt(CPU_ADAM):
        return builder.load()
    cache = cpu_adam_cache_dir()
    target = cache / f"{CPU_ADAM}.so"
    if not target.is_file():
        cache.mkdir(parents=True, exist_ok=True)
        with _file_lock(cache / ".lock"):
            if not target.is_file():
                module = builder.jit_load(verbose=False)  # registers itself in OpBuilder._loaded_ops
                tmp = cache / f".{CPU_ADAM}.so.{os.getpid()}.tmp"
                try:
                    shutil.copyfile(module.__file__, tmp)
                    os.replace(tmp, target)
                finally:
                    tmp.unlink(missing_ok=True)
                return module
    module = _import_extension(CPU_ADAM, target)
    OpBuilder._loaded_ops[CPU_ADAM] = module
    return module
