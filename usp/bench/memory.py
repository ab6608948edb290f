"""Measured memory of one training forward + backward under each activation-memory setting, on one rank.

For each ``(activation_checkpointing, mlp_tiles)`` variant: a random Llama (``--hidden``, ``--intermediate``,
``--layers``, GQA 4 query / 2 KV heads) runs a warm-up step, then one forward and one backward of one
``--seq-len`` sequence under :func:`usp.bench.track_memory.track_memory`. Prints and writes (``--out``) one JSON
object per variant: ``held_mib`` (bytes saved for backward on the device), ``peak_mib`` (the step's peak
allocated above its start: max of the forward's peak and the forward's net plus the backward's peak),
``host_mib`` (offload slots), ``fwd_bwd_s`` (wall time with the profiler on: relative figures only), and what
the planner predicts for the same model and setting (:mod:`usp.plan.memory`): ``planned_held_mib``
(:func:`~usp.plan.memory.held_activation_bytes`) and ``planned_peak_mib`` (activations + attention workspace +
loss buffer + 4 bytes of gradient per parameter). With ``mlp_tiles > 1`` every RMSNorm is fused into its
consumers (:mod:`usp.train.tiling`): no norm output is kept.

Run (CPU, fp32, a few seconds per variant)::

    python -m usp.bench.memory --seq-len 4096 --out memory.json
    python -m usp.bench.memory --device cuda --dtype bfloat16 --seq-len 65536 --hidden 4096 \
        --intermediate 14336 --layers 4     # a GPU: CUDA allocator figures, peak reserved too
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from usp.parallel.process_group import init_distributed

VARIANTS = (("none", 1), ("full", 1), ("offload", 1), ("none", 8), ("full", 8), ("offload", 8))
MIB = 1 << 20
LOSS_CHUNK = 1024  # trainer.loss_chunk_size of every variant


def measure(
    model_dir: str, *, seq_len: int, ac: str, tiles: int, device: torch.device, dtype: torch.dtype
) -> dict[str, Any]:
    from usp.bench.track_memory import track_memory
    from usp.model import load_causal_lm
    from usp.parallel import init_sp_mesh
    from usp.train.parallelize import parallelize

    mesh = init_sp_mesh(1, 1, device_type=device.type)
    model = load_causal_lm(model_dir, dtype=torch.float32)
    loss_model = parallelize(
        model,
        mesh,
        param_dtype=dtype,
        loss_chunk_size=LOSS_CHUNK,
        activation_checkpointing=ac,
        mlp_tiles=tiles,
        attention_backend="auto",
    )
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, model.config.vocab_size, (1, seq_len), generator=g).to(device)
    labels, pos = torch.roll(ids, -1, 1), torch.arange(seq_len, device=device)[None]

    def forward() -> torch.Tensor:
        return loss_model(ids, labels, position_ids=pos, num_targets=seq_len)

    forward().backward()  # warm-up: offload slots, allocator caches
    for p in loss_model.parameters():
        p.grad = None
    start = time.perf_counter()
    with track_memory(device) as fwd:
        loss = forward()
    with track_memory(device) as bwd:
        loss.backward()
    elapsed = time.perf_counter() - start
    store = loss_model.offload_store
    planned_held, planned_peak = planned_bytes(
        model_dir, seq_len=seq_len, ac=ac, tiles=tiles, compute_bytes=torch.finfo(dtype).bits // 8
    )
    return {
        "activation_checkpointing": ac,
        "mlp_tiles": tiles,
        "seq_len": seq_len,
        "held_mib": fwd.held_bytes / MIB,
        "peak_mib": max(fwd.peak_bytes, fwd.net_bytes + bwd.peak_bytes) / MIB,
        "peak_reserved_mib": None if bwd.peak_reserved_bytes is None else bwd.peak_reserved_bytes / MIB,
        "host_mib": 0.0 if store is None else store.host_bytes / MIB,
        "fwd_bwd_s": elapsed,
        "planned_held_mib": planned_held / MIB,
        "planned_peak_mib": planned_peak / MIB,
    }


def planned_bytes(
    model_dir: str, *, seq_len: int, ac: str, tiles: int, compute_bytes: int
) -> tuple[float, float]:
    """The planner's held bytes and step peak (without CUDA context or margin) for one rank of this run."""
    from dataclasses import replace

    from usp.plan.hardware import GPUS
    from usp.plan.memory import held_activation_bytes, training_memory
    from usp.plan.models import load_model_spec

    spec = load_model_spec(model_dir)
    kw = dict(
        seq_len=seq_len,
        ulysses_degree=1,
        ring_degree=1,
        activation_checkpointing=ac,
        mlp_tiles=tiles,
        compute_bytes=compute_bytes,
    )
    held = held_activation_bytes(spec, **kw)["total"]
    mem = training_memory(
        spec,
        replace(GPUS["cpu"], reserved_gib=0.0),
        world_size=1,
        node_size=1,
        loss_chunk_size=LOSS_CHUNK,
        overhead_frac=0.0,
        **kw,
    )
    return held, mem.activations + mem.attention_workspace + mem.loss_buffer + 4 * spec.num_params


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m usp.bench.memory", description=__doc__.split("\n\n")[0])
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--intermediate", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--out", default=None, help="write the records as a JSON list here")
    return p


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    from usp.model import parse_dtype
    from usp.tiny import build_tiny_llama

    args = build_parser().parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    created = init_distributed(device)  # one process, no launcher: a world of 1
    os.environ.setdefault("LOCAL_WORLD_SIZE", "1")
    records = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            model_dir = str(
                build_tiny_llama(
                    f"{tmp}/llama",
                    hidden_size=args.hidden,
                    intermediate_size=args.intermediate,
                    num_hidden_layers=args.layers,
                    num_attention_heads=4,
                    num_key_value_heads=2,
                    head_dim=args.hidden // 4,
                    max_position_embeddings=args.seq_len,
                )
            )
            for ac, tiles in VARIANTS:
                rec = measure(
                    model_dir,
                    seq_len=args.seq_len,
                    ac=ac,
                    tiles=tiles,
                    device=device,
                    dtype=parse_dtype(args.dtype, "--dtype"),
                )
                records.append(rec)
                print(json.dumps(rec), flush=True)
    finally:
        if created:
            dist.destroy_process_group()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(records, f, indent=2)
    return records


if __name__ == "__main__":
    main()
