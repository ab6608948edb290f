"""Benchmark of hybrid models' mixers under sequence parallelism (:mod:`usp.model.mixers`), scheme by scheme.

One mixer layer of a transformers family (random weights, ``--hidden`` wide, its other sizes from
``--heads``), one row of ``--seq`` tokens in ``--docs`` equal packed documents, on ``--world`` ranks
(``--ulysses`` x ``--ring``, ``--layout``). For each scheme the mixer's class supports (``heads`` for gated
DeltaNet; ``gather`` for every recurrent mixer; ``halo`` for short convolutions), and the unsharded layer on
one rank, it reports per rank: forward+backward FLOPs (``torch.utils.flop_counter``, a depthwise convolution's
backward taken as twice its forward: counts that do not drift), bytes sent by kind (``usp.attention.record_comm``, as ``usp-bench`` counts attention's), and the
median wall time of ``--iters`` runs (slowest rank, one thread per rank; noisy on shared CPUs, read it as a
ratio within one run).

Run::

    python -m usp.bench.mixers --world 4 --ulysses 2 --ring 2 --family qwen3_5_text --seq 4096 --out m.json
    python -m usp.bench.mixers --world 4 --ulysses 1 --ring 4 --family bamba --seq 4096
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import socket
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from usp.attention import record_comm
from usp.errors import guarded, pop_verbose


def _deltanet(h: int, n: int) -> dict[str, Any]:
    return dict(
        layer_types=["linear_attention"],
        linear_num_key_heads=n,
        linear_num_value_heads=2 * n,
        linear_key_head_dim=h // n,
        linear_value_head_dim=h // n,
    )


_MOE = dict(num_experts=2, num_experts_per_tok=1, moe_intermediate_size=8, shared_expert_intermediate_size=8)

_FAMILY_SIZES: dict[str, Callable[[int, int], dict[str, Any]]] = {  # --hidden H, --heads N -> mixer sizes
    "qwen3_5_text": _deltanet,
    "qwen3_next": lambda h, n: _deltanet(h, n) | _MOE,
    "bamba": lambda h, n: dict(
        mamba_n_heads=n, mamba_d_head=2 * h // n, mamba_n_groups=1, mamba_d_state=64, mamba_chunk_size=256
    ),
    "lfm2": lambda h, n: dict(layer_types=["conv"], conv_L_cache=3),
}


def _mixer(family: str, hidden: int, heads: int) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    from usp.model.mixers import mixer_modules

    torch.manual_seed(0)
    config = AutoConfig.for_model(
        family,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=1,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        head_dim=hidden // heads,
        vocab_size=64,
        **_FAMILY_SIZES[family](hidden, heads),
    )
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return mixer_modules(model)[0][1]


def _flops(counter: Any) -> int:
    """The counter's FLOPs, with a depthwise convolution's backward taken as twice its forward: torch's
    ``convolution_backward`` formula ignores ``groups`` and counts the layer as a dense convolution (17 GFLOP
    instead of 0.03 for Qwen3.5's 1024-channel, 4-tap convolution over 2048 tokens)."""
    counts = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    backward = counts.pop("aten.convolution_backward", 0)
    return sum(counts.values()) + (2 * counts.get("aten.convolution", 0) if backward else 0)


def _measure(fn, iters: int, *, together: bool = True) -> tuple[float, int, dict[str, int]]:
    """(median ms, FLOPs of one call, bytes by kind of one call) of ``fn`` (forward + backward); ``together``:
    every rank runs it (a barrier before each timed call), else this rank alone."""
    from torch.utils.flop_counter import FlopCounterMode

    with record_comm() as stats, FlopCounterMode(display=False) as flops:
        fn()
    times = []
    for _ in range(iters):
        if together:
            dist.barrier()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), _flops(flops), dict(stats.bytes_by_kind)


def run_on_rank(options: dict[str, Any]) -> list[dict[str, Any]]:
    from usp.model.mixers import GATHER, HEADS, apply_sequence_mixers
    from usp.parallel import init_sp_mesh, shard_sequence

    mesh = init_sp_mesh(options["ulysses"], options["ring"], dp_degree=1, ring_layout=options["layout"])
    seq, docs = options["seq"], options["docs"]
    cu = torch.arange(0, seq + 1, seq // docs, dtype=torch.int32) if docs > 1 else None
    reference = _mixer(options["family"], options["hidden"], options["heads"])
    x = torch.randn(1, seq, options["hidden"], generator=torch.Generator().manual_seed(1))
    rows = []
    holder = torch.nn.Module()
    holder.mixer = copy.deepcopy(reference)
    native = apply_sequence_mixers(holder, mesh)["mixer"]
    schemes = [native] + ([GATHER] if native == HEADS else [])
    local = shard_sequence(x, mesh, cu_seqlens=cu).requires_grad_(True)
    for scheme in schemes:
        mixer = holder.mixer
        mixer.usp_mixer_state = dataclasses.replace(mixer.usp_mixer_state, scheme=scheme)

        def step(mixer=mixer) -> None:
            mixer(local, cu_seq_lens_q=cu).sum().backward()

        ms, flops, sent = _measure(step, options["iters"])
        rows.append({"scheme": scheme, "ms": ms, "flops": flops, "bytes": sent})
    if mesh.sp_rank == 0:  # the unsharded layer, each document alone, on one rank
        bounds = [0, seq] if cu is None else cu.tolist()
        xr = x.clone().requires_grad_(True)

        def whole() -> None:
            torch.cat([reference(xr[:, a:b]) for a, b in zip(bounds[:-1], bounds[1:])], 1).sum().backward()

        ms, flops, _ = _measure(whole, options["iters"], together=False)
        rows.append({"scheme": "unsharded", "ms": ms, "flops": flops, "bytes": {}})
    return rows


def _spawned(rank: int, world: int, port: int, options: dict[str, Any], out: Any) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.set_num_threads(1)  # one thread per rank, as torchrun's OMP_NUM_THREADS=1 (ranks share the cores)
    try:
        rows = run_on_rank(options)
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, rows)
        if rank == 0:
            out.put(gathered)
    finally:
        dist.destroy_process_group()


def run(options: dict[str, Any], world: int) -> dict[str, Any]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = torch.multiprocessing.get_context("spawn")
    out = ctx.SimpleQueue()
    torch.multiprocessing.spawn(_spawned, args=(world, port, options, out), nprocs=world, join=True)
    per_rank = out.get()
    schemes = [r["scheme"] for r in per_rank[0]]
    summary = []
    for i, scheme in enumerate(schemes):
        ranks = [rows[i] for rows in per_rank if i < len(rows)]
        summary.append(
            {
                "scheme": scheme,
                "slowest_rank_ms": max(r["ms"] for r in ranks),
                "flops_per_rank_max": max(r["flops"] for r in ranks),
                "bytes_sent_per_rank_max": max(sum(r["bytes"].values()) for r in ranks),
                "bytes_by_kind_rank0": ranks[0]["bytes"],
            }
        )
    return {"options": options, "world": world, "results": summary}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m usp.bench.mixers", description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--ulysses", type=int, default=2)
    p.add_argument("--ring", type=int, default=2)
    p.add_argument("--layout", default="zigzag", choices=["zigzag", "contiguous", "balanced"])
    p.add_argument("--family", default="qwen3_5_text", choices=sorted(_FAMILY_SIZES))
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--docs", type=int, default=1, help="equal packed documents in the row")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--out", default=None, help="write the JSON here")
    return p


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    flags = vars(build_parser().parse_args(argv))
    world, out = flags.pop("world"), flags.pop("out")
    if flags["ulysses"] * flags["ring"] != world:
        raise ValueError(f"--ulysses {flags['ulysses']} x --ring {flags['ring']} must equal --world {world}")
    report = run(flags, world)
    for row in report["results"]:
        print(
            f"{row['scheme']:>10}: {row['slowest_rank_ms']:9.1f} ms  {row['flops_per_rank_max'] / 1e9:8.3f} GFLOP/rank"
            f"  {row['bytes_sent_per_rank_max'] / 2**20:8.2f} MiB sent/rank"
        )
    if out:
        with open(out, "w") as f:
            json.dump(report, f, indent=2)
    return report


def cli(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    verbose = pop_verbose(argv)
    return guarded("usp.bench.mixers", lambda: (main(argv), 0)[1], verbose=verbose)


if __name__ == "__main__":
    sys.exit(cli())
