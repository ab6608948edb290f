"""usp.train.deepspeed_parts.load_cpu_adam_op: DeepSpeed's CPU Adam op built once per machine and version set.

- the cache key changes with each component it holds (Python, torch, DeepSpeed, CPU capability, accelerator)
  and is a plain directory name; the cache directory honours ``XDG_CACHE_HOME``;
- a ``cpu_adam.so`` in the cache directory is what gets loaded (no JIT build: DeepSpeed's builder is made to
  fail), and it is registered where ``CPUAdamBuilder().load()`` (``DeepSpeedCPUAdam.__init__``) finds it;
- without one, DeepSpeed's JIT build runs once and its ``.so`` is copied in whole (no temporary file left),
  so the next process imports it; a loader that finds another builder holding the cache's lock waits for it
  and imports that build instead of compiling its own.

A stand-in extension module (a few lines of C exporting ``PyInit_cpu_adam``, compiled here in about a second)
takes the place of the real op, whose build takes minutes; the real op through this cache is exercised by
``tests/test_train_memory_run.py::test_deepspeed_cpu_adam_trains_and_resumes_like_adamw``.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
import sysconfig
import threading
from pathlib import Path

import pytest

pytest.importorskip("deepspeed")

from usp.train import deepspeed_parts  # noqa: E402

STAND_IN = r"""
#include <Python.h>
static struct PyModuleDef def = {PyModuleDef_HEAD_INIT, "cpu_adam", NULL, -1, NULL};
PyMODINIT_FUNC PyInit_cpu_adam(void) {
    PyObject *m = PyModule_Create(&def);
    if (m) PyModule_AddStringConstant(m, "MARKER", MARKER);
    return m;
}
"""


def stand_in_op(directory: Path, marker: str) -> Path:
    """``directory/cpu_adam.so``: an extension module named ``cpu_adam`` whose ``MARKER`` is ``marker``."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler for the stand-in extension module")
    directory.mkdir(parents=True, exist_ok=True)
    src = directory / "stand_in.c"
    src.write_text(STAND_IN)
    out = directory / "cpu_adam.so"
    include = sysconfig.get_paths()["include"]
    subprocess.run(
        [cc, "-shared", "-fPIC", f"-I{include}", f'-DMARKER="{marker}"', str(src), "-o", str(out)], check=True
    )
    return out


@pytest.fixture
def fresh_registry(monkeypatch, tmp_path):
    """No op loaded yet in this process, and the cache under ``tmp_path`` (``XDG_CACHE_HOME``)."""
    from deepspeed.ops.op_builder.builder import OpBuilder

    monkeypatch.setattr(OpBuilder, "_loaded_ops", {})
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setattr(deepspeed_parts, "_prebuilt", lambda name: False)
    return OpBuilder._loaded_ops


def test_cache_key_changes_with_each_component(monkeypatch, tmp_path):
    base = {
        "python": "3.11",
        "torch": "2.13.0+cpu",
        "deepspeed": "0.19.8",
        "cpu_capability": "AVX2",
        "accelerator": "cpu",
    }
    key = deepspeed_parts.op_cache_key(**base)
    assert key == "py3.11-torch2.13.0+cpu-ds0.19.8-AVX2-cpu"
    other = {
        "python": "3.12",
        "torch": "2.13.1+cpu",
        "deepspeed": "0.19.9",
        "cpu_capability": "AVX512",
        "accelerator": "cuda",
    }
    for name, value in other.items():
        assert deepspeed_parts.op_cache_key(**{**base, name: value}) != key, name
    odd = deepspeed_parts.op_cache_key(**{**base, "torch": "2.13.0/../x y"})
    assert "/" not in odd and " " not in odd  # one directory level, whatever a version string holds

    current = deepspeed_parts.current_op_cache_key()
    assert current.startswith(f"py{sys.version_info.major}.{sys.version_info.minor}-torch")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert deepspeed_parts.cpu_adam_cache_dir() == tmp_path / "usp" / "ops" / f"cpu_adam-{current}"
    monkeypatch.setenv("XDG_CACHE_HOME", "")
    assert (
        deepspeed_parts.cpu_adam_cache_dir() == Path.home() / ".cache" / "usp" / "ops" / f"cpu_adam-{current}"
    )


def test_a_cached_op_is_what_gets_loaded(fresh_registry, monkeypatch):
    from deepspeed.ops.op_builder import CPUAdamBuilder

    def no_build(self, verbose=True):
        raise AssertionError("JIT build attempted although the op is cached")

    monkeypatch.setattr(CPUAdamBuilder, "jit_load", no_build)
    cached = stand_in_op(deepspeed_parts.cpu_adam_cache_dir(), "from-the-cache")
    op = deepspeed_parts.load_cpu_adam_op()
    assert op.MARKER == "from-the-cache" and Path(op.__file__) == cached
    assert fresh_registry["cpu_adam"] is op
    assert CPUAdamBuilder().load() is op  # what DeepSpeedCPUAdam.__init__ calls
    assert deepspeed_parts.load_cpu_adam_op() is op


def test_a_missing_op_is_built_once_and_cached_whole(fresh_registry, monkeypatch, tmp_path):
    from deepspeed.ops.op_builder import CPUAdamBuilder

    built = stand_in_op(tmp_path / "torch_extensions" / "cpu_adam", "built")
    calls = []

    def fake_build(self, verbose=True):
        calls.append(self.name)
        op = deepspeed_parts._import_extension("cpu_adam", built)
        fresh_registry[self.name] = op  # as DeepSpeed's jit_load does
        return op

    monkeypatch.setattr(CPUAdamBuilder, "jit_load", fake_build)
    op = deepspeed_parts.load_cpu_adam_op()
    assert calls == ["cpu_adam"] and op.MARKER == "built"
    cache = deepspeed_parts.cpu_adam_cache_dir()
    assert (cache / "cpu_adam.so").read_bytes() == built.read_bytes()
    assert sorted(p.name for p in cache.iterdir()) == [".lock", "cpu_adam.so"]  # no temporary file left

    fresh_registry.clear()  # the next process: the cached file, no build
    again = deepspeed_parts.load_cpu_adam_op()
    assert calls == ["cpu_adam"] and Path(again.__file__) == cache / "cpu_adam.so"


def test_a_second_builder_waits_for_the_first_and_imports_its_build(fresh_registry, monkeypatch, tmp_path):
    from deepspeed.ops.op_builder import CPUAdamBuilder

    def no_build(self, verbose=True):
        raise AssertionError("JIT build attempted although another builder was publishing the op")

    monkeypatch.setattr(CPUAdamBuilder, "jit_load", no_build)
    cache = deepspeed_parts.cpu_adam_cache_dir()
    cache.mkdir(parents=True)
    other = stand_in_op(tmp_path / "other", "the-first-builder")
    got: dict = {}
    with deepspeed_parts._file_lock(cache / ".lock"):  # the first builder, mid-build
        waiter = threading.Thread(target=lambda: got.update(op=deepspeed_parts.load_cpu_adam_op()))
        waiter.start()
        waiter.join(1.0)
        assert waiter.is_alive() and not got  # blocked on the lock, not building
        shutil.copyfile(other, cache / ".cpu_adam.so.tmp")
        os.replace(cache / ".cpu_adam.so.tmp", cache / "cpu_adam.so")  # the first builder publishes
    waiter.join(60)
    assert got["op"].MARKER == "the-first-builder"


def test_prebuilt_op_is_left_to_deepspeed(fresh_registry, monkeypatch):
    """DeepSpeed installed with the op compiled in (``DS_BUILD_CPU_ADAM=1``): its own ``load()``, no cache."""
    from deepspeed.ops.op_builder import CPUAdamBuilder

    sentinel = dataclasses.make_dataclass("Op", [])()
    monkeypatch.setattr(deepspeed_parts, "_prebuilt", lambda name: True)
    monkeypatch.setattr(CPUAdamBuilder, "load", lambda self, verbose=False: sentinel)
    assert deepspeed_parts.load_cpu_adam_op() is sentinel
    assert not deepspeed_parts.cpu_adam_cache_dir().exists()
