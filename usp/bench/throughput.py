"""Training-step throughput of a model shape, with random weights: ``python -m usp.bench.throughput``.

Runs the trainer's own step (``parallelize`` -> USP attention, activation checkpointing, FSDP2; chunked loss;
AdamW) on random tokens, so it needs no checkpoint and no data: the weights come from a config (a preset name
such as ``llama-3.1-8b`` from :data:`usp.plan.models.PRESETS`, or a ``config.json`` / checkpoint dir),
initialised randomly on the device after sharding. Prints one JSON line per sequence length::

    {"seq_len", "layout", "tokens_per_s", "tokens_per_s_per_gpu", "tflops_per_gpu", "mfu", "peak_mem_gib",
     "step_time_s", "loss"}

``--find-max`` then grows the sequence (doubling, then bisecting in steps of ``--granularity``:
:func:`usp.longest.longest_passing`) until a step runs out of device memory, and reports the longest that
fit (``usp.bench.maxlen`` searches the same way with a whole trainer run per length). Only on one rank (an OOM on one of several ranks
would leave the others in a collective).

    python -m usp.bench.throughput --model llama-3.1-8b --seq-len 32768 131072 --ac full --find-max
    torchrun --nproc-per-node 8 -m usp.bench.throughput --model llama-3.1-8b --ulysses 8 --seq-len 131072
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from usp.config import ClusterConfig, OptimConfig, states_on_host
from usp.longest import longest_passing
from usp.model import apply_rope_overrides, build_empty_causal_lm, parse_dtype
from usp.model.load import materialize_empty
from usp.modes import AC_MODES, OPTIMIZERS
from usp.parallel import init_sp_mesh, shard_sequence
from usp.parallel.process_group import init_distributed, resolve_device
from usp.plan.compute import mfu, training_flops
from usp.plan.models import head_dim_of
from usp.train.flops import count_matmul_params
from usp.train.optim import build_optimizer
from usp.train.parallelize import parallelize
from usp.train.peak_flops import peak_flops_per_device
from usp.train.step import train_step
from usp.units import GIB, parse_seq_len


def hf_config(
    model: str, *, rope_theta: float | None = None, max_position_embeddings: int | None = None
) -> Any:
    """A transformers ``LlamaConfig`` for a preset name, or the ``AutoConfig`` of a path."""
    from transformers import AutoConfig, LlamaConfig

    from usp.plan.models import PRESETS

    if model in PRESETS:
        fields = dict(PRESETS[model])
        config = LlamaConfig(**fields, tie_word_embeddings=False)
    else:
        config = AutoConfig.from_pretrained(model, local_files_only=True)
    return apply_rope_overrides(
        config, rope_theta=rope_theta, max_position_embeddings=max_position_embeddings
    )


@torch.no_grad()
def random_init_(
    model: torch.nn.Module,
    device: torch.device,
    *,
    param_device: torch.device | None = None,
    std: float = 0.02,
) -> None:
    """Materialize a meta-device (possibly FSDP2-sharded) model with random weights.

    Parameters go to ``param_device`` (default ``device``; the CPU under FSDP CPU offload), buffers to ``device``.
    """
    materialize_empty(model, device=device, param_device=param_device)
    for name, p in model.named_parameters():
        if p.ndim == 1:
            p.fill_(1.0 if "norm" in name else 0.0)
        else:
            p.normal_(0.0, std)


def random_batch(vocab: int, seq_len: int, mesh: Any, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """One packed row of random tokens (no document boundaries), this rank's slice."""
    ids = torch.randint(0, vocab, (1, seq_len), generator=generator)
    labels = torch.roll(ids, -1, dims=1)
    labels[:, -1] = -100
    pos = torch.arange(seq_len)[None]
    batch = {
        k: shard_sequence(v, mesh)
        for k, v in {"input_ids": ids, "labels": labels, "position_ids": pos}.items()
    }
    batch["document_lengths"] = [[seq_len]]
    return batch


def measure(
    loss_model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    mesh: Any,
    *,
    seq_len: int,
    steps: int,
    warmup: int,
    vocab: int,
    flops_per_token_args: dict[str, int],
    peak_flops: float,
    device: torch.device,
) -> dict[str, Any]:
    """Time ``steps`` optimizer steps at ``seq_len`` (after ``warmup`` untimed ones)."""
    g = torch.Generator().manual_seed(seq_len)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times, loss = [], float("nan")
    for i in range(warmup + steps):
        batch = random_batch(vocab, seq_len, mesh, g)
        res = train_step(loss_model, optimizer, None, [batch], mesh=mesh, grad_clip=1.0, device=device)
        if i >= warmup:
            times.append(res.step_time_s)
        loss = res.loss
    step_time = sorted(times)[len(times) // 2]  # median
    world = dist.get_world_size()
    tokens = seq_len * mesh.dp_degree
    flops = training_flops(**flops_per_token_args, document_lengths=[[seq_len]] * mesh.dp_degree)
    peak_mem = torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else float("nan")
    reserved = torch.cuda.max_memory_reserved(device) / GIB if device.type == "cuda" else None
    flops_per_gpu_s, step_mfu = mfu(flops, step_time, world, peak_flops)
    return {
        "seq_len": seq_len,
        "layout": mesh.describe(),
        "tokens_per_s": tokens / step_time,
        "tokens_per_s_per_gpu": tokens / step_time / world,
        "tflops_per_gpu": flops_per_gpu_s / 1e12,
        "mfu": step_mfu,
        "peak_mem_gib": peak_mem,
        "peak_mem_reserved_gib": reserved,
        "step_time_s": step_time,
        "loss": loss,
    }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m usp.bench.throughput", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama-3.1-8b", help="preset name or config.json / checkpoint dir")
    p.add_argument("--seq-len", type=parse_seq_len, nargs="+", default=[32768, 131072])
    p.add_argument("--ulysses", type=int, default=1)
    p.add_argument("--ring", type=int, default=1)
    p.add_argument("--ac", choices=AC_MODES, default="full", help="parallel.activation_checkpointing")
    p.add_argument("--mlp-tiles", type=int, default=1, help="sequence tiles of the MLPs and norms (1 = off)")
    p.add_argument(
        "--optim", choices=OPTIMIZERS, default="adamw", help="optim.name (host-side states: offload)"
    )
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--loss-chunk-size", type=int, default=4096)
    p.add_argument("--backend", default="auto", help="attention kernel (model.attention_backend)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--device", default="auto")
    p.add_argument(
        "--gpu", default="cpu", help="cluster.gpu for the peak FLOP/s (cpu: detect the CUDA device)"
    )
    p.add_argument("--cpu-offload", action="store_true", help="FSDP2 CPU offload of params, grads, optimizer")
    p.add_argument("--rope-theta", type=float, default=None)
    p.add_argument("--find-max", action="store_true", help="grow the sequence until out of memory (one rank)")
    p.add_argument("--granularity", type=int, default=16384)
    p.add_argument("--max-seq-len", type=parse_seq_len, default=4 * 1024 * 1024)
    return p


@dataclass(frozen=True)
class ThroughputOptions:
    """What :func:`run_throughput` measures (the flags of ``python -m usp.bench.throughput``, same names)."""

    model: str = "llama-3.1-8b"
    seq_len: tuple[int, ...] = (32768, 131072)
    ulysses: int = 1
    ring: int = 1
    ac: str = "full"
    mlp_tiles: int = 1
    optim: str = "adamw"
    dtype: str = "bfloat16"
    loss_chunk_size: int = 4096
    backend: str = "auto"
    steps: int = 3
    warmup: int = 1
    gpu: str = "cpu"
    cpu_offload: bool = False
    """FSDP2 CPU offload of params, grads and optimizer states, as resolved for the device (:func:`main`)."""
    rope_theta: float | None = None
    find_max: bool = False
    granularity: int = 16384
    max_seq_len: int = 4 * 1024 * 1024


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    args = build_parser().parse_args(argv)
    device = resolve_device(args.device)
    flags = {k: v for k, v in vars(args).items() if k != "device"}
    flags["seq_len"] = tuple(args.seq_len)
    flags["cpu_offload"] = device.type == "cuda" and states_on_host(args.optim, args.cpu_offload)
    options = ThroughputOptions(**flags)
    created = init_distributed(device, cpu_offload=options.cpu_offload)
    try:
        return run_throughput(options, device)
    finally:
        if created:
            dist.destroy_process_group()


def run_throughput(options: ThroughputOptions, device: torch.device) -> list[dict[str, Any]]:
    """Build the model and its optimizer as the trainer does, then :func:`measure` each of
    ``options.seq_len`` (and, with ``find_max``, the longest that fits); prints each record on rank 0 and
    returns them all. Needs the process group (:func:`main` starts one when there is none)."""
    o = options
    mesh = init_sp_mesh(o.ulysses, o.ring, device_type=device.type)
    config = hf_config(o.model, rope_theta=o.rope_theta, max_position_embeddings=max(o.seq_len))
    model = build_empty_causal_lm(config)
    flop_args = {
        "matmul_params": count_matmul_params(model),
        "num_layers": config.num_hidden_layers,
        "num_heads": config.num_attention_heads,
        "head_dim": head_dim_of(config),
    }
    loss_model = parallelize(
        model,
        mesh,
        attention_backend=o.backend,
        activation_checkpointing=o.ac,
        param_dtype=parse_dtype(o.dtype, "--dtype"),
        loss_chunk_size=o.loss_chunk_size,
        cpu_offload=o.cpu_offload,
        mlp_tiles=o.mlp_tiles,
    )
    random_init_(model, device, param_device=torch.device("cpu") if o.cpu_offload else None)
    optimizer, _ = build_optimizer(
        loss_model, OptimConfig(name=o.optim, lr=1e-5, warmup_steps=0), max_steps=1_000_000
    )
    peak = peak_flops_per_device(ClusterConfig(gpu=o.gpu), device.type)
    kw = dict(
        steps=o.steps,
        warmup=o.warmup,
        vocab=config.vocab_size,
        flops_per_token_args=flop_args,
        peak_flops=peak,
        device=device,
    )
    results = []

    def emit(record: dict[str, Any]) -> None:
        results.append(record)
        if dist.get_rank() == 0:
            print(json.dumps(record), flush=True)

    for seq_len in o.seq_len:
        emit(measure(loss_model, optimizer, mesh, seq_len=seq_len, **kw))
    if o.find_max:
        if dist.get_world_size() != 1:
            raise ValueError("--find-max runs on one rank only (an OOM on one rank would hang the others).")
        longest = _find_max(
            loss_model,
            optimizer,
            mesh,
            measured=max(o.seq_len),
            granularity=o.granularity,
            max_seq_len=o.max_seq_len,
            kw=kw,
        )
        emit({"longest_fitting_seq_len": longest})
    return results


def _fits(loss_model: Any, optimizer: Any, mesh: Any, seq_len: int, kw: dict[str, Any]) -> bool:
    try:
        measure(loss_model, optimizer, mesh, seq_len=seq_len, **{**kw, "steps": 1, "warmup": 0})
        return True
    except torch.OutOfMemoryError:
        optimizer.zero_grad(set_to_none=True)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return False


def _find_max(
    loss_model: Any,
    optimizer: Any,
    mesh: Any,
    *,
    measured: int,
    granularity: int,
    max_seq_len: int,
    kw: dict[str, Any],
) -> int:
    """The longest multiple of ``granularity`` (``--granularity``; and of the layout's sequence multiple) up to
    ``max_seq_len`` (``--max-seq-len``) whose step fits (:func:`usp.longest.longest_passing`: doubling from
    ``measured``, the longest ``--seq-len``, which already ran, then bisection)."""
    unit = math.lcm(granularity, mesh.sequence_multiple())

    def fits(seq_len: int) -> bool:  # shorter than a length that ran: fits (memory grows with the sequence)
        return seq_len <= measured or _fits(loss_model, optimizer, mesh, seq_len, kw)

    return longest_passing(fits, start=max(unit, measured // unit * unit), unit=unit, limit=max_seq_len)


if __name__ == "__main__":
    from torch.distributed.elastic.multiprocessing.errors import record

    record(main)(sys.argv[1:])  # under torchrun, a failing rank's traceback lands in torchrun's summary
