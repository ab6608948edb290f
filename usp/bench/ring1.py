"""``usp_attention`` without a ring (world of 1: ulysses 1, ring 1) against torch's own SDPA: peak bytes and time.

Without a ring ``usp_attention`` calls the local kernel directly (:mod:`usp.attention.ring`): its forward and
backward should cost what torch's ``scaled_dot_product_attention(..., enable_gqa=True)`` costs on the same
``q [B, S, Hq, D]``, ``k, v [B, S, Hkv, D]`` (passed to SDPA as ``[B, H, S, D]`` views of the same memory),
which on the CPU runs the same CPU flash kernel. For each point it reports the peak bytes of one forward +
backward (:func:`usp.bench.track_memory.track_memory`, the CPU profiler's allocation events; deterministic), the
ratio usp / SDPA, and the median wall time of ``--iters`` forward + backward passes of each, run alternately.

Run::

    python -m usp.bench.ring1 --seq 4096,16384 --dtype float32,bfloat16 --json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from usp.attention import usp_attention
from usp.bench.flags import comma_ints
from usp.bench.track_memory import track_memory
from usp.parallel import SPMesh, init_sp_mesh
from usp.parallel.process_group import init_distributed

Step = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


def make_inputs(
    seq_len: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int = 0
):
    """``q, k, v, dout`` (``[1, S, H, D]``, ``dout`` like ``q``) on the CPU."""
    g = torch.Generator().manual_seed(seed)
    heads = (num_heads, num_kv_heads, num_kv_heads, num_heads)
    return [torch.randn(1, seq_len, h, head_dim, generator=g).to(dtype) for h in heads]


def usp_step(mesh: SPMesh) -> Step:
    """Forward + backward of ``usp_attention`` (causal) on ``mesh``."""

    def step(q, k, v, dout):
        usp_attention(q, k, v, mesh=mesh).backward(dout)

    return step


def sdpa_step(q, k, v, dout) -> None:
    """Forward + backward of torch's causal SDPA with ``enable_gqa=True`` on the same memory."""
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
    )  # [B, Hq, S, D]
    out.transpose(1, 2).backward(dout)


def _leaves(tensors):
    q, k, v, dout = tensors
    return [t.detach().clone().requires_grad_() for t in (q, k, v)] + [dout]


def peak_bytes(step: Step, tensors) -> int:
    """Peak bytes allocated by one forward + backward of ``step``, above what was allocated before it."""
    args = _leaves(tensors)
    with track_memory("cpu") as mem:
        step(*args)
    return mem.peak_bytes


def median_seconds(step: Step, tensors, iters: int) -> float:
    times = []
    for _ in range(iters):
        args = _leaves(tensors)
        t0 = time.perf_counter()
        step(*args)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_point(
    mesh: SPMesh,
    *,
    seq_len: int,
    dtype: torch.dtype,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    iters: int,
) -> dict:
    tensors = make_inputs(seq_len, num_heads, num_kv_heads, head_dim, dtype)
    ours = usp_step(mesh)
    point = {
        "seq_len": seq_len,
        "dtype": str(dtype).removeprefix("torch."),
        "num_heads": num_heads,
        "num_kv_heads": num_kv_heads,
        "head_dim": head_dim,
    }
    point["usp_peak_bytes"] = peak_bytes(ours, tensors)
    point["sdpa_peak_bytes"] = peak_bytes(sdpa_step, tensors)
    point["peak_ratio"] = point["usp_peak_bytes"] / point["sdpa_peak_bytes"]
    if iters:
        usp_s, sdpa_s = [], []
        for _ in range(iters):  # alternate, so both see the same load on a shared machine
            usp_s.append(median_seconds(ours, tensors, 1))
            sdpa_s.append(median_seconds(sdpa_step, tensors, 1))
        point["usp_s"], point["sdpa_s"] = statistics.median(usp_s), statistics.median(sdpa_s)
        point["time_ratio"] = point["usp_s"] / point["sdpa_s"]
    return point


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m usp.bench.ring1", description=__doc__.split("\n")[0])
    p.add_argument("--seq", type=comma_ints, default="4096,16384", help="comma-separated sequence lengths")
    p.add_argument("--dtype", default="float32,bfloat16", help="comma-separated dtypes")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument(
        "--iters", type=int, default=3, help="timed forward + backward passes of each (0: no timing)"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    return p


def main(argv: Sequence[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    dtypes = []
    for name in args.dtype.split(","):
        dtype = getattr(torch, name, None)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise SystemExit(f"usp.bench.ring1: error: --dtype {name!r} is not a floating torch dtype")
        dtypes.append(dtype)
    init_distributed(torch.device("cpu"))  # one process: a world of 1
    mesh = init_sp_mesh(1, 1)
    header = f"{'seq':>7} {'dtype':>9} {'usp MiB':>9} {'sdpa MiB':>9} {'peak x':>7} {'usp s':>7} {'sdpa s':>7} {'time x':>7}"
    if not args.json:
        print(header, flush=True)
    points = []
    for s in args.seq:
        for dt in dtypes:
            p = bench_point(
                mesh,
                seq_len=int(s),
                dtype=dt,
                num_heads=args.heads,
                num_kv_heads=args.kv_heads,
                head_dim=args.head_dim,
                iters=args.iters,
            )
            points.append(p)
            if not args.json:  # one row as each point is measured
                t = f"{p['usp_s']:>7.3f} {p['sdpa_s']:>7.3f} {p['time_ratio']:>7.2f}" if "usp_s" in p else ""
                print(
                    f"{p['seq_len']:>7} {p['dtype']:>9} {p['usp_peak_bytes'] / 2**20:>9.2f} "
                    f"{p['sdpa_peak_bytes'] / 2**20:>9.2f} {p['peak_ratio']:>7.3f} {t}",
                    flush=True,
                )
    report = {"threads": torch.get_num_threads(), "points": points}
    if args.json:
        print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
