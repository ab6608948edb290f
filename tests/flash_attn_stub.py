"""Released flash-attn Python interfaces over a stub of their compiled extension, for the CPU test tier.

:func:`release` fetches a flash-attn source distribution from PyPI (``pip download``; cached under
``$XDG_CACHE_HOME/usp/flash-attn``, default ``~/.cache``), extracts only ``flash_attn/__init__.py``,
``flash_attn/flash_attn_interface.py`` and ``csrc/flash_attn/flash_api.cpp``, and imports that release's
real Python interface on top of a stub ``flash_attn_2_cuda`` built from the release's ``flash_api.cpp``:

- each pybind entry (``fwd``, ``varlen_fwd``, ``bwd``, ``varlen_bwd``) takes exactly the C++ function's
  parameters, in order, with the C++ types (tensor, optional tensor, number, bool, generator) checked;
- it applies the ``TORCH_CHECK``s our calls could trip (fp16/bf16, CUDA, contiguous last dim, grouped
  heads, ``head_size % 8`` where that function checks it, int32 ``cu_seqlens``);
- it returns what the C++ returns (names from its ``return {...}``), the lse in the shape the C++ allocates
  (``softmax_lse = torch::empty({...})``), and a backward checks the lse it gets has its forward's layout.

Nothing of flash-attn is copied into this repository: the files are read from the release at test time.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tarfile
import types
from pathlib import Path

import torch

HALF = (torch.float16, torch.bfloat16)


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "usp" / "flash-attn"


def fetch(version: str) -> Path:
    """The extracted release directory; raises RuntimeError (with pip's output) when it cannot be fetched."""
    root = cache_dir()
    target = root / f"flash_attn-{version}"
    files = ["flash_attn/__init__.py", "flash_attn/flash_attn_interface.py", "csrc/flash_attn/flash_api.cpp"]
    if all((target / f).is_file() for f in files):
        return target
    root.mkdir(parents=True, exist_ok=True)
    sdist = root / f"flash_attn-{version}.tar.gz"
    if not sdist.is_file():
        # pip prepares the sdist's metadata (runs its setup.py): with torch importable, no CUDA build
        env = dict(os.environ, FLASH_ATTENTION_SKIP_CUDA_BUILD="TRUE")
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--no-binary",
            ":all:",
            "--timeout",
            "30",
            "--retries",
            "2",
            "--no-build-isolation",
            f"flash-attn=={version}",
            "-d",
            str(root),
        ]
        try:
            run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise RuntimeError(f"pip download flash-attn=={version}: {exc}") from exc
        if run.returncode != 0 or not sdist.is_file():
            raise RuntimeError(f"pip download flash-attn=={version} failed: {run.stderr.strip()[-400:]}")
    with tarfile.open(sdist) as tar:
        for f in files:
            member = tar.getmember(f"flash_attn-{version}/{f}")
            data = tar.extractfile(member).read()
            (target / f).parent.mkdir(parents=True, exist_ok=True)
            (target / f).write_bytes(data)
    return target


# --- flash_api.cpp -> a stub extension ----------------------------------------------------------------------


def _strip_comments(text: str) -> str:
    return re.sub(r"//[^\n]*", "", text)


def parse_api(cpp: str) -> dict[str, dict]:
    """``{pybind name: {"params": [(type, name)], "returns": [...], "lse": [...] | None, "head8": bool}}``."""
    api = {}
    for py_name, fn in re.findall(r'm\.def\("(\w+)",\s*&(?:\w+::)*(\w+)', cpp):
        m = re.search(r"\n" + fn + r"\((.*?)\)\s*\{(.*?)\n\}\n", cpp, re.S)
        assert m, f"{fn} not found in flash_api.cpp"
        params = []
        for p in _strip_comments(m[1]).split(","):
            p = " ".join(p.split())
            name = re.search(r"(\w+)$", p)[1]
            params.append((p[: -len(name)].strip(), name))
        body = _strip_comments(m[2])
        returns = [r.strip() for r in re.findall(r"return\s*\{([^}]*)\};", body)[-1].split(",")]
        lse = re.search(r"softmax_lse = torch::empty\(\{([^}]*)\}", body)
        api[py_name] = {
            "fn": fn,
            "params": params,
            "returns": returns,
            "lse": [d.strip() for d in lse[1].split(",")] if lse else None,
            "head8": re.search(r"TORCH_CHECK\(head_size % 8 == 0", body) is not None,
        }
    return api


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise RuntimeError(msg)  # what TORCH_CHECK raises


def _check_type(fn: str, ctype: str, name: str, value) -> None:
    if "Generator" in ctype:
        _check(value is None, f"{fn}: {name} must be None")
    elif "optional" in ctype and "Tensor" in ctype:
        _check(value is None or isinstance(value, torch.Tensor), f"{fn}: {name} must be a tensor or None")
    elif "Tensor" in ctype:
        _check(isinstance(value, torch.Tensor), f"{fn}: {name} must be a tensor, got {type(value).__name__}")
    elif ctype.endswith("bool"):
        _check(isinstance(value, bool), f"{fn}: {name} must be a bool, got {value!r}")
    elif ctype.endswith("int"):
        _check(isinstance(value, int) and not isinstance(value, bool), f"{fn}: {name} must be an int")
    elif ctype.endswith("float"):
        _check(
            isinstance(value, (int, float)) and not isinstance(value, bool), f"{fn}: {name} must be a float"
        )


def _lse_shape(dims: list[str], a: dict, varlen: bool) -> tuple[int, ...]:
    q = a["q"]
    sizes = {
        "batch_size": a["cu_seqlens_q"].numel() - 1 if varlen else q.size(0),
        "num_heads": q.size(-2),
        "seqlen_q": q.size(1),
        "total_q": q.size(0),
        "max_seqlen_q": a.get("max_seqlen_q"),
    }
    return tuple(sizes[d] for d in dims)


def _kernel(py_name: str, spec: dict, fwd_spec: dict):
    params, fn = spec["params"], spec["fn"]
    varlen = "varlen" in py_name

    def call(*args):
        _check(
            len(args) == len(params), f"{py_name}(): {len(args)} arguments given, {fn} takes {len(params)}"
        )
        a = {}
        for (ctype, name), value in zip(params, args):
            _check_type(fn, ctype, name, value)
            a[name] = value
        q, k, v = a["q"], a["k"], a["v"]
        for t in (q, k, v):
            _check(t.device.type == "cuda", f"{fn}: tensors must be on CUDA")
            _check(t.stride(-1) == 1, f"{fn}: Input tensor must have contiguous last dimension")
            _check(t.dtype == q.dtype, f"{fn}: query and key/value must have the same dtype")
        _check(q.dtype in HALF, "FlashAttention only support fp16 and bf16 data type")
        _check(
            q.size(-2) % k.size(-2) == 0, "Number of heads in key/value must divide number of heads in query"
        )
        if spec["head8"]:
            _check(q.size(-1) % 8 == 0, "head_size should be a multiple of 8")
        if varlen:
            for c in (a["cu_seqlens_q"], a["cu_seqlens_k"]):
                _check(
                    c.dtype == torch.int32 and c.dim() == 1 and c.is_contiguous(), "cu_seqlens must be int32"
                )
        lse_shape = _lse_shape(fwd_spec["lse"], a, varlen)
        if "dout" in a:  # backward: the lse must be in the layout the forward wrote
            _check(
                tuple(a["softmax_lse"].shape) == lse_shape,
                f"{fn}: softmax_lse {tuple(a['softmax_lse'].shape)}, the forward writes {lse_shape}",
            )
            _check(a["softmax_lse"].is_contiguous(), f"{fn}: softmax_lse must be contiguous")
            for g, x in (("dq", q), ("dk", k), ("dv", v)):
                _check(a[g + "_"] is None or a[g + "_"].shape == x.shape, f"{fn}: {g} shape")
        made = {
            "out": torch.empty_like(q),
            "q_padded": q,
            "k_padded": k,
            "v_padded": v,
            "out_padded": torch.empty_like(q),
            "softmax_lse": torch.empty(lse_shape, dtype=torch.float32, device=q.device),
            "p": torch.empty(0, dtype=q.dtype, device=q.device),
            "rng_state": torch.empty(2, dtype=torch.int64, device=q.device),
            "dq": a.get("dq_"),
            "dk": a.get("dk_"),
            "dv": a.get("dv_"),
            "softmax_d": torch.empty(0, dtype=torch.float32, device=q.device),
        }
        return [made[name] for name in spec["returns"]]

    call.__name__ = py_name
    return call


def stub_extension(cpp: str) -> types.ModuleType:
    api = parse_api(cpp)
    ext = types.ModuleType("flash_attn_2_cuda")
    for py_name in ("fwd", "varlen_fwd", "bwd", "varlen_bwd"):
        fwd_name = py_name.replace("bwd", "fwd")
        setattr(ext, py_name, _kernel(py_name, api[py_name], api[fwd_name]))
    ext.api = api
    return ext


_LOADED: dict[str, dict[str, types.ModuleType]] = {}
_NAMES = ("flash_attn", "flash_attn.flash_attn_interface", "flash_attn_2_cuda")


def release(version: str) -> dict[str, types.ModuleType]:
    """``{module name: module}`` of one release's interface over the stub, imported once per process.

    Once: releases >= 2.7 register ``torch.library`` ops named ``flash_attn::...`` at import, which cannot be
    registered twice (so one of them per process). For those ops the real body is made the fake kernel, so
    under FakeTensorMode the call still reaches the stubbed extension.
    """
    if version in _LOADED:
        return _LOADED[version]
    root = fetch(version)
    saved = {n: sys.modules.pop(n) for n in _NAMES if n in sys.modules}
    sys.modules["flash_attn_2_cuda"] = stub_extension((root / "csrc/flash_attn/flash_api.cpp").read_text())
    sys.path.insert(0, str(root))
    try:
        import flash_attn
        from flash_attn import flash_attn_interface as fai
    finally:
        sys.path.remove(str(root))
        modules = {n: sys.modules.pop(n) for n in _NAMES if n in sys.modules}
        sys.modules.update(saved)
    assert flash_attn.__version__ == version and modules["flash_attn"] is flash_attn
    fai._release_fakes = {}  # the release's own fake kernels, kept to compare with the stub
    for name in (
        "_flash_attn_forward",
        "_flash_attn_varlen_forward",
        "_flash_attn_backward",
        "_flash_attn_varlen_backward",
    ):
        op = getattr(fai, name)
        if hasattr(op, "register_fake") and hasattr(op, "_init_fn"):
            fai._release_fakes[name] = op._abstract_fn
            op.register_fake(op._init_fn)
    _LOADED[version] = modules
    return modules
