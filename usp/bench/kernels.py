"""Local kernel check and speed: every backend's forward/backward (with lse) vs a float64 reference, and the
ring-step kernel's TFLOP/s vs plain ``scaled_dot_product_attention`` on the same shape.

This is the one script to run when a GPU is available (``python -m usp.bench.kernels --out kernels.json``);
on the CPU it checks ``cpu_flash`` against ``math``. For each backend usable on the device and each dtype:

- ``max_err_out``, ``max_err_lse``, ``max_err_dq/dk/dv``: max abs difference to the ``math`` backend run in
  float64 on the same inputs, causal, GQA;
- ``max_err_doc_*``: the same with packed documents (``--doc-len``; lengths cycle ``L, L/8, 1``) as causal
  segments: on a GPU-sized block this is the per-segment SDPA path (or flash_attn's varlen kernel);
- ``kernel_tflops``: causal forward+backward FLOPs / time of :func:`usp.attention.kernels.attention_forward`
  + ``attention_backward`` (what one ring step runs), ``sdpa_tflops``: the same for
  ``torch.nn.functional.scaled_dot_product_attention`` + autograd pinned to a fused kernel
  (``sdpa_backend``: flash for fp16/bf16, mem-efficient for fp32; :func:`sdpa_baseline`), and their ratio
  (goal >= 0.90).
"""

from __future__ import annotations

import argparse
import datetime
import json
import time
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from usp.attention.kernels import (
    CUDA_BACKENDS,
    HALF_ONLY,
    attention_backward,
    attention_forward,
    flash_attn_available,
)


def usable_backends(device: torch.device) -> list[str]:
    if device.type == "cuda":
        return [b for b in CUDA_BACKENDS if b != "flash_attn" or flash_attn_available()]
    return ["cpu_flash"]


def _time(fn, iters: int, device: torch.device) -> float:
    fn()  # warm-up (and compile/autotune on CUDA)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) / iters


def document_segments(seq_len: int, doc_len: int) -> torch.Tensor:
    """Causal diagonal segments ``[n, 4]`` of documents whose lengths cycle ``doc_len, doc_len // 8, 1``."""
    bounds, pos, i = [0], 0, 0
    while pos < seq_len:
        pos = min(seq_len, pos + (doc_len, max(1, doc_len // 8), 1)[i % 3])
        bounds.append(pos)
        i += 1
    return torch.tensor([[a, b, a, b] for a, b in zip(bounds, bounds[1:])], dtype=torch.int64)


def _max_errors(prefix, backend, q, k, v, dout, kw) -> dict:
    out, lse = attention_forward(q, k, v, backend=backend, **kw)
    grads = attention_backward(dout, q, k, v, out, lse, backend=backend, **kw)
    qd, kd, vd, dd = (t.double() for t in (q, k, v, dout))  # the float64 reference on the same inputs
    ref_out, ref_lse = attention_forward(qd, kd, vd, backend="math", **kw)
    ref_grads = attention_backward(dd, qd, kd, vd, ref_out, ref_lse, backend="math", **kw)
    finite = torch.isfinite(ref_lse)  # rows with no key: -inf in both
    record = {
        f"{prefix}out": float((out.double() - ref_out).abs().max()),
        f"{prefix}lse": float((lse.double() - ref_lse)[finite].abs().max()),
    }
    assert torch.equal(torch.isinf(lse), ~finite), "rows without keys must have lse = -inf"
    for name, a, b in zip(("dq", "dk", "dv"), grads, ref_grads):
        record[f"{prefix}{name}"] = float((a.double() - b).abs().max())
    return record


def check_backend(
    backend: str, *, device, dtype, batch, seq_len, heads, kv_heads, head_dim, iters, doc_len=None
) -> dict:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(batch, seq_len, heads, head_dim, generator=g).to(device, dtype)
    k = torch.randn(batch, seq_len, kv_heads, head_dim, generator=g).to(device, dtype)
    v = torch.randn(batch, seq_len, kv_heads, head_dim, generator=g).to(device, dtype)
    dout = torch.randn(batch, seq_len, heads, head_dim, generator=g).to(device, dtype)
    scale = head_dim**-0.5
    kw = dict(causal=True, softmax_scale=scale)
    record = {
        "backend": backend,
        "dtype": str(dtype).removeprefix("torch."),
        "shape": [batch, seq_len, heads, kv_heads, head_dim],
    }
    record.update(_max_errors("max_err_", backend, q, k, v, dout, kw))
    if doc_len:  # documents: batch size 1, as cu_seqlens requires
        segments = document_segments(seq_len, doc_len)
        record["doc_len"] = doc_len
        record.update(
            _max_errors("max_err_doc_", backend, q[:1], k[:1], v[:1], dout[:1], dict(kw, segments=segments))
        )

    def kernel_step():
        o, lse_ = attention_forward(q, k, v, backend=backend, **kw)
        attention_backward(dout, q, k, v, o, lse_, backend=backend, **kw)

    sdpa_step, baseline = sdpa_baseline(q, k, v, dout, scale)
    record.update(baseline)

    flops = (
        3.5 * 4 * batch * heads * head_dim * seq_len * seq_len / 2
    )  # causal fwd (4 S^2 D / 2) + bwd (2.5x)
    t_kernel = _time(kernel_step, iters, device)
    t_sdpa = _time(sdpa_step, iters, device) if sdpa_step is not None else None
    record.update(
        kernel_ms=t_kernel * 1e3,
        sdpa_ms=t_sdpa * 1e3 if t_sdpa else None,
        kernel_tflops=flops / t_kernel / 1e12,
        sdpa_tflops=flops / t_sdpa / 1e12 if t_sdpa else None,
        kernel_over_sdpa=t_sdpa / t_kernel if t_sdpa else None,
    )
    return record


def sdpa_baseline(q, k, v, dout, scale) -> tuple[Callable[[], None] | None, dict]:
    """The plain-SDPA step to compare the ring-step kernel with: a *fused* kernel, pinned with ``sdpa_kernel``.

    Unpinned, ``scaled_dot_product_attention`` picks what it can: in fp32 with grouped heads that is the math
    kernel (flash has no fp32 and mem-efficient no grouped heads), the slowest one. Here the first fused
    kernel that takes the shape: flash then mem-efficient for fp16/bf16 on CUDA, mem-efficient for fp32, CPU
    flash on the CPU. If a kernel refuses grouped heads (``enable_gqa``), K/V are expanded to the query heads
    once, outside the timed step. Returns the step (None when no fused kernel takes the shape, e.g. a head
    dim that is not a multiple of 8 in bf16) and ``{"sdpa_backend", "sdpa_gqa"}`` for the record.
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if q.device.type != "cuda":
        candidates = [SDPBackend.FLASH_ATTENTION]  # torch's CPU flash kernel
    elif q.dtype in (torch.float16, torch.bfloat16):
        candidates = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
    else:
        candidates = [SDPBackend.EFFICIENT_ATTENTION]
    qs, ks, vs = (t.transpose(1, 2).detach().requires_grad_() for t in (q, k, v))  # [B, H, S, D]
    group = qs.size(1) // ks.size(1)
    expanded = None
    dot = dout.transpose(1, 2)

    def step(fused, kt, vt, gqa):
        with sdpa_kernel([fused]):
            out = F.scaled_dot_product_attention(qs, kt, vt, is_causal=True, scale=scale, enable_gqa=gqa)
            out.backward(dot)

    for fused in candidates:
        for gqa in (True, False) if group > 1 else (False,):
            if gqa:
                kt, vt = ks, vs
            else:
                if expanded is None:
                    expanded = tuple(
                        t.detach().repeat_interleave(group, dim=1).requires_grad_() for t in (ks, vs)
                    )
                kt, vt = expanded  # [B, Hq, S, D]
            try:
                step(fused, kt, vt, gqa)
            except RuntimeError:  # "No available kernel": this kernel does not take the shape
                continue
            info = {"sdpa_backend": fused.name.lower(), "sdpa_gqa": gqa}
            return (lambda fused=fused, kt=kt, vt=vt, gqa=gqa: step(fused, kt, vt, gqa)), info
    return None, {"sdpa_backend": None, "sdpa_gqa": None}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m usp.bench.kernels", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--dtypes", default=None, help="comma-separated; default bfloat16,float32 (CUDA) / float32 (CPU)"
    )
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=None, help="tokens per block; default 8192 (CUDA) / 512 (CPU)")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument(
        "--doc-len",
        type=int,
        default=None,
        help="document check: longest document; default seq // 8 + 3, 0 = off",
    )
    p.add_argument("--out", default=None)
    return p


def main(argv: Sequence[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    dtypes = args.dtypes or ("bfloat16,float32" if device.type == "cuda" else "float32")
    seq = args.seq or (8192 if device.type == "cuda" else 512)
    records = []
    for name in dtypes.split(","):
        dtype = getattr(torch, name)
        for backend in usable_backends(device):
            if backend in HALF_ONLY and (dtype == torch.float32 or args.head_dim % 8):
                continue  # flash and cuDNN: fp16/bf16 and head_dim % 8 == 0 only (resolve_backend refuses them)
            records.append(
                check_backend(
                    backend,
                    device=device,
                    dtype=dtype,
                    batch=args.batch,
                    seq_len=seq,
                    heads=args.heads,
                    kv_heads=args.kv_heads,
                    head_dim=args.head_dim,
                    iters=args.iters,
                    doc_len=seq // 8 + 3 if args.doc_len is None else args.doc_len,
                )
            )
    report = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "results": records,
    }
    cols = [
        "backend",
        "dtype",
        "max_err_out",
        "max_err_lse",
        "max_err_dq",
        "max_err_dk",
        "max_err_dv",
        "kernel_tflops",
        "sdpa_tflops",
        "kernel_over_sdpa",
    ]
    if records and "max_err_doc_out" in records[0]:
        cols[7:7] = ["max_err_doc_out", "max_err_doc_dq"]
    print(
        f"kernels  {report['date']}  device={report['device']}  shape={records[0]['shape'] if records else []}"
    )
    print("  ".join(cols))
    for r in records:
        print("  ".join(f"{r[c]:.3g}" if isinstance(r[c], float) else str(r[c]) for c in cols))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
    return report


if __name__ == "__main__":
    main()
