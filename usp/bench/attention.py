"""Benchmark of ``usp_attention`` over a grid of (ulysses, ring, layout, seq, heads, kv_heads).

For each point: fwd and fwd+bwd wall time (mean over ``--iters``, slowest rank), bytes each rank sent per call
MEASURED by the instrumented communication layer (:func:`usp.attention.record_comm`) next to the analytic
minimum (:func:`usp.attention.cost.analytic_bytes_sent`; the ratio must be 1.00), and per-rank attention work
max/mean: exact (q, k) pairs computed (measured), and computed block area (the block-level count; contiguous
causal shows ``N / ((N + 1) / 2)``, zigzag ``1.00 <= (2N + 1) / (2N)``).

With ``--doc-lengths SPEC`` (repeatable; :mod:`usp.data.doc_lengths`: ``lognormal:mean=8192``,
``lengths:2048,65536,2048x31``, ``fixed:2048``, ``file:PATH``) each point packs a row of that mixture
(``cu_seqlens``) and also reports each rank's own attention kernel time without communication
(:mod:`usp.bench.balance`): ``slowest_rank_attn_ms`` and its ``max / mean`` over ranks, per layout
(``--layouts zigzag,contiguous,balanced``).

Run::

    python -m usp.bench.attention --world 4 --ulysses 1,2,4 --ring 1,2,4 --seq 1024,4096 --out bench.json
    python -m usp.bench.attention --world 8 --ulysses 1 --ring 8 --seq 16384 --layouts zigzag,balanced \
        --doc-lengths lognormal:mean=2048 --doc-lengths lengths:256,8192,256x31
    torchrun --nproc-per-node 8 -m usp.bench.attention --ulysses 8 --ring 1 --seq 131072   # GPUs (nccl)

Without a launcher it spawns ``--world`` gloo ranks on the CPU. Grid points whose ``ulysses x ring`` does not
divide the world, or whose heads don't fit the Ulysses degree, are skipped (listed in the output).
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import platform
import socket
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from usp.attention import record_comm, usp_attention
from usp.attention.cost import analytic_bytes_sent, imbalance, ring_work
from usp.attention.kernels import resolve_backend
from usp.bench.balance import rank_attention_ms
from usp.bench.flags import comma_ints, comma_lengths, comma_ring_layouts
from usp.data.doc_lengths import boundaries, parse_doc_lengths
from usp.errors import guarded, pop_verbose
from usp.modes import ATTENTION_BACKENDS
from usp.parallel import init_sp_mesh, sequence_multiple
from usp.parallel.process_group import init_distributed, resolve_device

COLUMNS = [
    ("ulysses", "U", "{}"),
    ("ring", "R", "{}"),
    ("layout", "layout", "{}"),
    ("seq_len", "seq", "{}"),
    ("num_heads", "Hq", "{}"),
    ("num_kv_heads", "Hkv", "{}"),
    ("doc_len", "doc", "{}"),
    ("num_docs", "docs", "{}"),
    ("ring_steps", "steps", "{}"),
    ("fwd_ms", "fwd ms", "{:.2f}"),
    ("fwd_bwd_ms", "fwd+bwd ms", "{:.2f}"),
    ("fwd_bytes_measured", "fwd bytes", "{}"),
    ("fwd_bytes_ratio", "fwd ratio", "{:.2f}"),
    ("fwd_bwd_bytes_measured", "fwd+bwd bytes", "{}"),
    ("fwd_bwd_bytes_ratio", "f+b ratio", "{:.2f}"),
    ("pairs_max_over_mean", "pairs max/mean", "{:.3f}"),
    ("area_max_over_mean", "area max/mean", "{:.3f}"),
    ("target_max_over_mean", "target", "{:.3f}"),
    ("slowest_rank_attn_ms", "slowest rank attn ms", "{:.1f}"),
    ("rank_attn_max_over_mean", "rank ms max/mean", "{:.3f}"),
]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="usp-bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=4, help="gloo ranks to spawn when not launched by torchrun")
    p.add_argument("--ulysses", type=comma_ints, default=[1, 2, 4], help="ulysses degrees, comma-separated")
    p.add_argument("--ring", type=comma_ints, default=[1, 2, 4], help="ring degrees, comma-separated")
    p.add_argument(
        "--layouts",
        type=comma_ring_layouts,
        default="zigzag,contiguous",
        help="ring layouts, comma-separated",
    )
    p.add_argument(
        "--seq",
        type=comma_lengths,
        default=[1024, 4096],
        help="global sequence lengths, comma-separated (1024, 4K, 1M; default 1024,4096)",
    )
    p.add_argument("--heads", type=comma_ints, default=[8], help="query heads")
    p.add_argument("--kv-heads", type=comma_ints, default=[2, 8], help="KV heads")
    p.add_argument("--head-dim", type=int, default=64, help="dimension of each head (default 64)")
    p.add_argument("--batch", type=int, default=1, help="sequences per forward (default 1)")
    p.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16", "float16"],
        help="q/k/v dtype (default float32)",
    )
    p.add_argument("--no-causal", dest="causal", action="store_false", help="non-causal attention")
    p.add_argument(
        "--doc-len",
        type=int,
        default=0,
        help="pack documents of this many tokens (cu_seqlens; needs --batch 1)",
    )
    p.add_argument(
        "--doc-lengths",
        action="append",
        default=[],
        metavar="SPEC",
        help="pack documents drawn from SPEC (lognormal:mean=8192[,sigma=1.0][,seed=0], fixed:2048, "
        "lengths:2048,65536,2048x31, file:PATH); repeat for several mixtures; needs --batch 1",
    )
    p.add_argument(
        "--backend",
        default="auto",
        help=f"local attention kernel, as model.attention_backend: {', '.join(ATTENTION_BACKENDS)} (default auto)",
    )
    p.add_argument("--iters", type=int, default=3, help="timed iterations per case (default 3)")
    p.add_argument("--warmup", type=int, default=1, help="untimed iterations before them (default 1)")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    return p


@dataclass(frozen=True)
class BenchOptions:
    """The grid and the settings of every point (the flags of ``usp-bench``, same names and defaults)."""

    ulysses: tuple[int, ...] = (1, 2, 4)
    ring: tuple[int, ...] = (1, 2, 4)
    layouts: tuple[str, ...] = ("zigzag", "contiguous")
    seq: tuple[int, ...] = (1024, 4096)
    heads: tuple[int, ...] = (8,)
    kv_heads: tuple[int, ...] = (2, 8)
    head_dim: int = 64
    batch: int = 1
    dtype: str = "float32"
    causal: bool = True
    doc_len: int = 0
    doc_lengths: tuple[str, ...] = ()
    """Document-length specs (:func:`usp.data.doc_lengths.parse_doc_lengths`), one mixture each."""
    backend: str = "auto"
    iters: int = 3
    warmup: int = 1
    out: str | None = None
    """Write the report as JSON here (rank 0)."""

    @classmethod
    def from_flags(cls, flags: dict[str, Any]) -> BenchOptions:
        """From ``usp-bench``'s parsed flags by name (all but ``--world``, which says how to run, not what)."""
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in flags.items()})


def _timed(fn, iters: int, warmup: int, device: torch.device) -> float:
    """Mean ms per call of ``fn``, the slowest rank's. ``device`` carries the collectives (nccl: CUDA only)."""
    for _ in range(warmup):
        fn()
    _sync(device)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    _sync(device)
    elapsed = torch.tensor([(time.perf_counter() - start) / iters * 1e3], dtype=torch.float64, device=device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank sets the step time
    return elapsed.item()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _gather_ints(value: int, device: torch.device) -> list[int]:
    """``value`` from every rank, gathered on ``device`` (nccl takes CUDA tensors only)."""
    t = torch.tensor([value], dtype=torch.int64, device=device)
    out = [torch.zeros_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return torch.cat(out).tolist()


def _gather_floats(value: float, device: torch.device) -> list[float]:
    """``value`` from every rank, gathered on ``device`` (nccl takes CUDA tensors only)."""
    t = torch.tensor([value], dtype=torch.float64, device=device)
    out = [torch.zeros_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return torch.cat(out).tolist()


def bench_point(
    mesh, *, seq_len: int, num_heads: int, num_kv_heads: int, options: BenchOptions, device, doc_spec=None
) -> dict:
    """Time and measure one grid point on every rank of ``mesh``; returns the record (same on all ranks)."""
    o = options
    u, r = mesh.ulysses_degree, mesh.ring_degree
    dtype = getattr(torch, o.dtype)
    local = seq_len // (u * r)
    g = torch.Generator().manual_seed(0)
    shape_q, shape_kv = (
        (o.batch, local, num_heads, o.head_dim),
        (o.batch, local, num_kv_heads, o.head_dim),
    )
    q = torch.randn(*shape_q, generator=g).to(device, dtype).requires_grad_()
    k = torch.randn(*shape_kv, generator=g).to(device, dtype).requires_grad_()
    v = torch.randn(*shape_kv, generator=g).to(device, dtype).requires_grad_()
    dout = torch.randn(*shape_q, generator=g).to(device, dtype)
    cu = None
    if doc_spec is not None:
        cu = torch.from_numpy(boundaries(doc_spec.row(seq_len))).to(torch.int32)
    elif o.doc_len:
        cu = torch.tensor([*range(0, seq_len, o.doc_len), seq_len], dtype=torch.int32)
    kw = dict(mesh=mesh, causal=o.causal, backend=o.backend, cu_seqlens=cu)

    def fwd():
        with torch.no_grad():
            usp_attention(q, k, v, **kw)

    def fwd_bwd():
        usp_attention(q, k, v, **kw).backward(dout)

    with record_comm() as fwd_stats:
        fwd()
    with record_comm() as fb_stats:
        fwd_bwd()
    fwd_ms = _timed(fwd, o.iters, o.warmup, device)
    fwd_bwd_ms = _timed(fwd_bwd, o.iters, o.warmup, device)

    work = ring_work(seq_len, r, mesh.ring_layout, o.causal, cu)
    analytic = analytic_bytes_sent(
        batch=o.batch,
        seq_len=seq_len,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=o.head_dim,
        ulysses_degree=u,
        ring_degree=r,
        element_size=q.element_size(),
        ring_steps=work[0]["steps"],
    )
    fwd_bytes = _gather_ints(fwd_stats.bytes_sent, device)
    fb_bytes = _gather_ints(fb_stats.bytes_sent, device)
    pairs = _gather_ints(fwd_stats.attention_pairs, device)
    fwd_flops = _gather_ints(fwd_stats.attention_flops, device)
    flops = _gather_ints(fb_stats.attention_flops, device)
    rank_ms = rank_attention_ms(
        seq_len=seq_len,
        ring_degree=r,
        ulysses_degree=u,
        ring_rank=mesh.ring_rank,
        layout=mesh.ring_layout,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=o.head_dim,
        dtype=dtype,
        causal=o.causal,
        cu_seqlens=cu,
        backend=kw["backend"] if kw["backend"] != "auto" else resolve_backend("auto", device, dtype),
        device=device,
        iters=o.iters,
        warmup=o.warmup,
    )
    rank_ms_all = _gather_floats(rank_ms, device)
    n = r
    if not o.causal or n == 1:
        target = 1.0
    elif mesh.ring_layout in ("zigzag", "balanced"):
        target = (2 * n + 1) / (2 * n)
    else:
        target = n / ((n + 1) / 2)
    return {
        "ulysses": u,
        "ring": r,
        "dp": mesh.dp_degree,
        "layout": mesh.ring_layout,
        "causal": o.causal,
        "seq_len": seq_len,
        "num_heads": num_heads,
        "num_kv_heads": num_kv_heads,
        "head_dim": o.head_dim,
        "batch": o.batch,
        "dtype": o.dtype,
        "doc_len": o.doc_len,
        "doc_lengths": "" if doc_spec is None else doc_spec.text,
        "num_docs": 1 if cu is None else len(cu) - 1,
        "ring_steps": work[0]["steps"],
        "fwd_ms": fwd_ms,
        "fwd_bwd_ms": fwd_bwd_ms,
        "fwd_bytes_measured": max(fwd_bytes),
        "fwd_bytes_analytic": analytic["fwd"],
        "fwd_bytes_ratio": max(fwd_bytes) / analytic["fwd"] if analytic["fwd"] else 1.0,
        "fwd_bwd_bytes_measured": max(fb_bytes),
        "fwd_bwd_bytes_analytic": analytic["fwd_bwd"],
        "fwd_bwd_bytes_ratio": max(fb_bytes) / analytic["fwd_bwd"] if analytic["fwd_bwd"] else 1.0,
        "bytes_equal_on_all_ranks": len(set(fwd_bytes)) == 1 and len(set(fb_bytes)) == 1,
        "bytes_by_kind": fb_stats.bytes_by_kind,
        "pairs_per_rank": pairs,
        "fwd_attention_flops_per_rank": fwd_flops,
        "fwd_bwd_attention_flops_per_rank": flops,
        "pairs_max_over_mean": imbalance(pairs),
        "area_max_over_mean": imbalance([w["area"] for w in work]),
        "target_max_over_mean": target,
        "rank_attn_ms": rank_ms_all,
        "slowest_rank_attn_ms": max(rank_ms_all),
        "rank_attn_max_over_mean": imbalance(rank_ms_all),
    }


def run_grid(options: BenchOptions) -> dict:
    """Run the grid on the current process group (every rank calls this); returns the report."""
    o = options
    world = dist.get_world_size()
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if dist.get_backend() == "nccl"
        else torch.device("cpu")
    )
    kernel = resolve_backend(o.backend, device, getattr(torch, o.dtype))
    records, skipped, meshes = [], [], {}
    specs = [parse_doc_lengths(s) for s in o.doc_lengths] or [None]
    grid = itertools.product(o.ulysses, o.ring, o.layouts, o.seq, o.heads, o.kv_heads, specs)
    for u, r, layout, seq_len, hq, hkv, spec in grid:
        point = dict(ulysses=u, ring=r, layout=layout, seq_len=seq_len, num_heads=hq, num_kv_heads=hkv)
        if r == 1 and layout != o.layouts[0]:
            continue  # the layout only matters with a ring
        why = None
        if world % (u * r):
            why = f"ulysses x ring = {u * r} does not divide world {world}"
        elif seq_len % sequence_multiple(r, u, layout):
            why = f"seq {seq_len} not a multiple of {sequence_multiple(r, u, layout)}"
        elif hq % u or hq % hkv or (hkv % u and u % hkv):
            why = f"heads {hq}/{hkv} don't fit ulysses {u}"
        if why:
            skipped.append({**point, "reason": why})
            continue
        if (u, r, layout) not in meshes:  # building a mesh is collective: every rank walks the same grid
            meshes[u, r, layout] = init_sp_mesh(u, r, ring_layout=layout, device_type=device.type)
        mesh = meshes[u, r, layout]
        records.append(
            bench_point(
                mesh,
                seq_len=seq_len,
                num_heads=hq,
                num_kv_heads=hkv,
                options=options,
                device=device,
                doc_spec=spec,
            )
        )
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else f"cpu ({platform.processor() or platform.machine()})",
        "host_cpus": os.cpu_count(),
        "torch": torch.__version__,
        "world_size": world,
        "process_backend": dist.get_backend(),
        "kernel_backend": kernel,
        "results": records,
        "skipped": skipped,
    }


def format_table(report: dict) -> str:
    rows = [[title for _, title, _ in COLUMNS]]
    for rec in report["results"]:
        rows.append([fmt.format(rec[key]) for key, _, fmt in COLUMNS])
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in rows]
    head = (
        f"usp_attention benchmark  {report['date']}  device={report['device']}  world={report['world_size']}  "
        f"kernel={report['kernel_backend']}"
    )
    tail = [
        f"skipped U={s['ulysses']} R={s['ring']} {s['layout']} seq={s['seq_len']} "
        f"heads={s['num_heads']}/{s['num_kv_heads']}: {s['reason']}"
        for s in report["skipped"]
    ]
    return "\n".join([head, *lines, *tail])


def run_on_rank(options: BenchOptions) -> dict:
    """:func:`run_grid`, then rank 0 prints the table and writes ``options.out``; returns the report."""
    report = run_grid(options)
    if dist.get_rank() == 0:
        print(format_table(report), flush=True)
        if options.out:
            with open(options.out, "w") as f:
                json.dump(report, f, indent=2)
    return report


def _spawned(rank: int, world: int, port: int, options: BenchOptions) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        run_on_rank(options)
    finally:
        dist.destroy_process_group()


def check_options(options: BenchOptions) -> None:
    """``ValueError`` for settings that cannot run, before any rank starts."""
    if (options.doc_len or options.doc_lengths) and options.batch != 1:
        raise ValueError(
            f"--doc-len / --doc-lengths need --batch 1 (documents are packed into one sequence), got --batch "
            f"{options.batch}."
        )
    for spec in options.doc_lengths:
        parse_doc_lengths(spec)  # a bad spec fails here, before any rank starts


def run(options: BenchOptions, world: int = 4) -> dict | None:
    """Uses the existing process group if there is one, torchrun's if launched by it, else spawns ``world``
    gloo ranks on the CPU (then returns ``None``: the report is printed and written by rank 0)."""
    check_options(options)
    if dist.is_initialized():
        return run_on_rank(options)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # a launcher: join its group as usp-train does
        init_distributed(resolve_device("auto"))
        try:
            return run_on_rank(options)
        finally:
            dist.destroy_process_group()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.spawn(_spawned, args=(world, port, options), nprocs=world, join=True)
    return None


def main(argv: Sequence[str] | None = None) -> dict | None:
    """CLI entry: parse, then :func:`run`."""
    flags = vars(build_parser().parse_args(argv))
    world = flags.pop("world")
    return run(BenchOptions.from_flags(flags), world=world)


def cli(argv: Sequence[str] | None = None) -> int:
    """Console script ``usp-bench``: :func:`main`, its failures one ``usp-bench: error:`` line
    (:mod:`usp.errors`; the traceback with ``--verbose``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    verbose = pop_verbose(argv)
    return guarded("usp-bench", lambda: (main(argv), 0)[1], verbose=verbose)


if __name__ == "__main__":
    sys.exit(cli())
