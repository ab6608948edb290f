"""Per-rank attention compute of one ``usp_attention`` call, measured without communication.

On a CPU host shared by all ranks, the wall time of a distributed call shows the *total* work (idle ranks'
cores are lent to busy ones), not the slowest rank. :func:`rank_attention_ms` times only this rank's own
kernels: the blocks its ring rank computes (forward and backward, from the same block plans the ring runs),
on random tensors of the right shapes, serially and measured as thread CPU time (wall time after a device
sync on CUDA). ``max`` over ranks is the attention time of the slowest rank, what sets the step time once
communication is hidden; ``max / mean`` is the imbalance a layout leaves.

``python -m usp.bench.balance --seq 16384 --ring 4,8 --doc-lengths lognormal:mean=2048`` runs every ring
rank of each layout one after another in this process (one thread) and prints the slowest rank's time.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence

import torch

from usp.attention.blocks import plan_ring_blocks, ring_steps_needed
from usp.attention.heads import ulysses_heads
from usp.attention.kernels import attention_backward, attention_forward, default_scale, resolve_backend
from usp.bench.flags import comma_ints, comma_ring_layouts
from usp.data.doc_lengths import DocLengths, boundaries, parse_doc_lengths
from usp.parallel import ring_rank_pairs
from usp.parallel.balance import balanced_placement, pieces_to_positions


def rank_attention_ms(
    *,
    seq_len: int,
    ring_degree: int,
    ulysses_degree: int,
    ring_rank: int,
    layout: str,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    causal: bool,
    cu_seqlens: torch.Tensor | None,
    backend: str,
    device: torch.device,
    iters: int = 3,
    warmup: int = 1,
) -> float:
    """Milliseconds ring rank ``ring_rank`` spends in its attention kernels for one forward + backward.

    Shapes after the Ulysses all-to-all: ``q [1, S/R, Hq/U, D]``, ``k, v [1, S/R, Hk'/U, D]``. Mean over
    ``iters`` after ``warmup``.
    """
    part = seq_len // ring_degree
    split = ulysses_heads(num_heads, num_kv_heads, ulysses_degree)
    busiest = split.busiest_rank()  # uneven heads: the rank with the most heads sets the pace
    hq, hk = split.q_counts[busiest], split.local_kv_heads(busiest)
    every = [
        plan_ring_blocks(seq_len, ring_degree, r, layout, causal, cu_seqlens) for r in range(ring_degree)
    ]
    plans = every[ring_rank][: ring_steps_needed(every)]
    g = torch.Generator().manual_seed(ring_rank)
    q, dout = (torch.randn(1, part, hq, head_dim, generator=g).to(device, dtype) for _ in range(2))
    k, v = (torch.randn(1, part, hk, head_dim, generator=g).to(device, dtype) for _ in range(2))
    scale = default_scale(head_dim, None)
    lse_full = torch.zeros(1, hq, part, dtype=torch.float32, device=device)

    def once() -> None:
        for spec in plans:
            if spec is None:
                continue
            qs, ks = spec.q_slice, spec.k_slice
            kw = dict(causal=spec.causal, softmax_scale=scale, backend=backend, segments=spec.segments)
            out, lse = attention_forward(q[:, qs], k[:, ks], v[:, ks], **kw)
            lse_full[:, :, qs] = torch.nan_to_num(lse, neginf=0.0)  # rows with no key here: finite
            attention_backward(dout[:, qs], q[:, qs], k[:, ks], v[:, ks], out, lse_full[:, :, qs], **kw)

    clock = time.perf_counter if device.type == "cuda" else time.thread_time
    for _ in range(warmup):
        once()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = clock()
    for _ in range(iters):
        once()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (clock() - start) / iters * 1e3


def measure_layouts(
    *,
    seq_len: int,
    ring_degree: int,
    ulysses_degree: int,
    layouts: list[str],
    spec: DocLengths,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    iters: int,
    row: int = 0,
) -> list[dict]:
    """Every ring rank's attention kernel time, one after another in this process, for each layout.

    Returns one record per layout: exact pairs per rank (max / mean), each rank's ms, the slowest rank's ms.
    """
    lengths = spec.row(seq_len, row)
    cu = torch.from_numpy(boundaries(lengths))
    device = torch.device("cpu")
    backend = resolve_backend("auto", device, torch.float32)
    records = []
    for layout in layouts:
        pairs = ring_rank_pairs(seq_len, ring_degree, layout, cu)
        ms = [
            rank_attention_ms(
                seq_len=seq_len,
                ring_degree=ring_degree,
                ulysses_degree=ulysses_degree,
                ring_rank=r,
                layout=layout,
                num_heads=num_heads,
                num_kv_heads=num_kv_heads,
                head_dim=head_dim,
                dtype=torch.float32,
                causal=True,
                cu_seqlens=cu,
                backend=backend,
                device=device,
                iters=iters,
            )
            for r in range(ring_degree)
        ]
        records.append(
            {
                "doc_lengths": spec.text,
                "num_docs": len(lengths),
                "seq_len": seq_len,
                "ring": ring_degree,
                "ulysses": ulysses_degree,
                "layout": layout,
                "pairs_per_rank": pairs,
                "pairs_max_over_mean": max(pairs) / (sum(pairs) / len(pairs)),
                "rank_attn_ms": ms,
                "slowest_rank_attn_ms": max(ms),
                "rank_attn_max_over_mean": max(ms) / (sum(ms) / len(ms)),
            }
        )
    return records


def placement_cost(seq_len: int, ring_degree: int, spec: DocLengths, repeats: int = 200) -> dict:
    """Host time of the balanced placement of one row (no cache): the cut points and every rank's pieces, and
    the positions of one rank's part (what ``shard_sequence`` indexes with). Min and median over ``repeats``."""
    cu = boundaries(spec.row(seq_len))

    def timed(fn) -> tuple[float, float]:
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        times.sort()
        return times[0], times[len(times) // 2]

    place = timed(lambda: balanced_placement(seq_len, ring_degree, cu))
    pieces = balanced_placement(seq_len, ring_degree, cu)
    index = timed(lambda: pieces_to_positions(pieces[0]))
    return {
        "doc_lengths": spec.text,
        "seq_len": seq_len,
        "ring": ring_degree,
        "num_docs": len(cu) - 1,
        "placement_ms_min": place[0],
        "placement_ms_median": place[1],
        "rank_positions_ms_min": index[0],
        "rank_positions_ms_median": index[1],
    }


def main(argv: Sequence[str] | None = None) -> list[dict]:
    """``python -m usp.bench.balance``: per-rank attention time of each layout on document mixtures (CPU)."""
    p = argparse.ArgumentParser(prog="python -m usp.bench.balance", description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, default=16384)
    p.add_argument("--ring", type=comma_ints, default="4,8", help="ring degrees, comma-separated")
    p.add_argument(
        "--ulysses", type=comma_ints, default="1", help="ulysses degrees, comma-separated (heads are divided)"
    )
    p.add_argument("--layouts", type=comma_ring_layouts, default="zigzag,contiguous,balanced")
    p.add_argument("--doc-lengths", action="append", required=True, metavar="SPEC")
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--kv-heads", type=int, default=1)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--iters", type=int, default=2)
    p.add_argument("--placement", action="store_true", help="only time the host-side balanced placement")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    specs = [parse_doc_lengths(s) for s in args.doc_lengths]
    records = []
    if args.placement:
        for spec in specs:
            for r in args.ring:
                rec = placement_cost(args.seq, r, spec)
                print(
                    f"{spec.text:<40} S={args.seq} R={r} docs={rec['num_docs']}: placement "
                    f"{rec['placement_ms_min']:.3f} ms min / {rec['placement_ms_median']:.3f} median, one rank's "
                    f"positions {rec['rank_positions_ms_min']:.3f} ms min",
                    flush=True,
                )
                records.append(rec)
        return records
    for spec in specs:
        for r in args.ring:
            for u in args.ulysses:
                found = measure_layouts(
                    seq_len=args.seq,
                    ring_degree=r,
                    ulysses_degree=u,
                    layouts=args.layouts,
                    spec=spec,
                    num_heads=args.heads,
                    num_kv_heads=args.kv_heads,
                    head_dim=args.head_dim,
                    iters=args.iters,
                )
                for rec in found:
                    print(
                        f"{rec['doc_lengths']:<40} docs={rec['num_docs']:<4} R={r} U={u} {rec['layout']:<10} "
                        f"pairs max/mean {rec['pairs_max_over_mean']:.3f}  slowest rank {rec['slowest_rank_attn_ms']:.1f} ms"
                        f"  ms max/mean {rec['rank_attn_max_over_mean']:.3f}",
                        flush=True,
                    )
                records += found
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                {"device": "cpu", "threads": 1, "torch": torch.__version__, "results": records}, f, indent=2
            )
    return records


if __name__ == "__main__":
    main()
