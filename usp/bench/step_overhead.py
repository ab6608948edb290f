"""Host time a training step spends outside the model's math, and a world-1 step against plain Hugging Face.

``python -m usp.bench.step_overhead --model DIR [--layouts 1x1 2x2] [--seq-len 256] [--steps 6] --json out.json``

For each ``UxR`` layout (``ulysses x ring`` ranks on gloo, spawned here; ``balanced`` ring layout, one packed
row of two documents a step, FSDP2, fp32, AdamW) it runs the trainer's own step (:func:`usp.train.step.
train_step` on :func:`usp.data.batch.collate_rows`'s micro-batch) and reports per step, on rank 0:

- ``step_s``: the whole step, batch building included;
- ``collate_s``: building and sharding the micro-batch (labels, positions, boundaries, this rank's slice);
- ``attention_glue_s``: the forward time of every USP attention call minus its all-to-alls and ring (the
  kernel calls and collectives): validation, planning, head splits, backend resolution;
- ``overhead_s = collate_s + attention_glue_s``, the host time that is not forward/backward/optimizer math.

At ``1x1`` it then takes the timers off and runs ``--steps`` more usp steps interleaved step by step with
the same model as plain Hugging Face (its own SDPA attention, ``model(input_ids, labels)``, torch's fused
AdamW) on the same row (one document: plain HF has no document masking without flash-attn), and reports
``usp_untimed_step_s``, ``hf_step_s`` and ``usp_over_hf``, the median ratio of the two step times. Medians
of ``--steps`` steps after one warm-up step. Every figure is a wall-clock time on a shared machine: compare
ratios measured in one run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


@dataclass(frozen=True)
class Case:
    model_dir: str
    ulysses: int
    ring: int
    seq_len: int
    steps: int


class _Timer:
    """Wraps module-level functions and sums the wall time of their calls (forward only: the wrapped calls
    are those the forward makes; autograd runs backwards without calling them)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.wrapped: list[tuple[Any, str, Any]] = []

    def wrap(self, module: Any, name: str, label: str) -> None:
        inner = getattr(module, name)
        self.wrapped.append((module, name, inner))

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds[label] = self.seconds.get(label, 0.0) + time.perf_counter() - start
                self.calls[label] = self.calls.get(label, 0) + 1

        setattr(module, name, timed)

    def unwrap(self) -> None:
        """Put the wrapped functions back (the timing costs a few microseconds a call)."""
        for module, name, inner in reversed(self.wrapped):
            setattr(module, name, inner)
        self.wrapped = []

    def take(self) -> tuple[dict[str, float], dict[str, int]]:
        out = (self.seconds, self.calls)
        self.seconds, self.calls = {}, {}
        return out


def _instrument() -> _Timer:
    import usp.attention
    import usp.attention.usp as usp_module

    timer = _Timer()
    timer.wrap(usp.attention, "usp_attention", "attention")  # what the registered attention function calls
    for name in ("ring_attention_checked", "seq_to_head", "kv_seq_to_head", "head_to_seq"):
        timer.wrap(usp_module, name, "kernels_and_collectives")
    return timer


def _row(seq_len: int, vocab: int, documents: int) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (seq_len,), generator=generator)
    cut = [seq_len // documents] * (documents - 1)
    return {"input_ids": ids.numpy(), "document_lengths": [*cut, seq_len - sum(cut)], "first_position": 0}


def _usp_stepper(
    case: Case, mesh: Any, document_masking: bool
) -> tuple[Callable[[dict[str, Any]], dict[str, float]], _Timer]:
    from usp.config import OptimConfig
    from usp.data.batch import collate_rows
    from usp.model import load_causal_lm
    from usp.train.optim import build_optimizer
    from usp.train.parallelize import parallelize
    from usp.train.step import train_step

    model = load_causal_lm(case.model_dir, dtype=torch.float32)
    loss_model = parallelize(
        model,
        mesh,
        param_dtype=torch.float32,
        loss_chunk_size=case.seq_len,
        activation_checkpointing="none",
        node_size=case.ulysses * case.ring,
    )
    optim = OptimConfig(lr=1e-5, warmup_steps=1)
    optimizer, scheduler = build_optimizer(loss_model, optim, max_steps=10**6)
    timer = _instrument()

    def step(row: dict[str, Any]) -> dict[str, float]:
        timer.take()
        start = time.perf_counter()
        batch = collate_rows([row], mesh=mesh, document_masking=document_masking)
        collated = time.perf_counter()
        train_step(loss_model, optimizer, scheduler, [batch], mesh=mesh, grad_clip=1.0)
        end = time.perf_counter()
        seconds, calls = timer.take()
        glue = seconds.get("attention", 0.0) - seconds.get("kernels_and_collectives", 0.0)
        return {
            "step_s": end - start,
            "collate_s": collated - start,
            "attention_glue_s": glue,
            "attention_calls": calls.get("attention", 0),
            "overhead_s": collated - start + glue,
        }

    return step, timer


def _hf_stepper(case: Case) -> Callable[[dict[str, Any]], dict[str, float]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        case.model_dir, dtype=torch.float32, attn_implementation="sdpa"
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)

    def step(row: dict[str, Any]) -> dict[str, float]:
        start = time.perf_counter()
        ids = torch.as_tensor(row["input_ids"], dtype=torch.long)[None]
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return {"step_s": time.perf_counter() - start}

    return step


def _median(records: Sequence[dict[str, float]], key: str) -> float:
    return statistics.median(r[key] for r in records)


def run_case(case: Case) -> dict[str, Any]:
    """On every rank of an initialized world of ``ulysses x ring`` ranks; returns rank 0's figures."""
    from transformers import AutoConfig

    from usp.parallel import init_sp_mesh

    mesh = init_sp_mesh(case.ulysses, case.ring, dp_degree=1, ring_layout="balanced")
    vocab = AutoConfig.from_pretrained(case.model_dir).vocab_size
    world1 = case.ulysses * case.ring == 1
    usp_step, timer = _usp_stepper(case, mesh, document_masking=not world1)
    row = _row(case.seq_len, vocab, documents=1 if world1 else 2)
    try:
        usp_records = [usp_step(row) for _ in range(case.steps + 1)][1:]  # the first is a warm-up
    finally:
        timer.unwrap()
    hf_records, plain_records = [], []
    if world1:  # then the ratio: the timers off, usp and HF interleaved step by step on the same row
        hf_step = _hf_stepper(case)
        for i in range(case.steps + 1):
            got, ref = usp_step(row), hf_step(row)
            if i:
                plain_records.append(got)
                hf_records.append(ref)
    out: dict[str, Any] = {
        "model": os.path.basename(case.model_dir.rstrip("/")),
        "layout": f"u{case.ulysses}r{case.ring}",
        "seq_len": case.seq_len,
        "steps": case.steps,
        "attention_calls_per_step": usp_records[0]["attention_calls"],
    }
    for key in ("step_s", "collate_s", "attention_glue_s", "overhead_s"):
        out[key] = _median(usp_records, key)
    out["overhead_fraction"] = out["overhead_s"] / out["step_s"]
    if hf_records:
        out["usp_untimed_step_s"] = _median(plain_records, "step_s")
        out["hf_step_s"] = _median(hf_records, "step_s")
        out["usp_over_hf"] = statistics.median(
            u["step_s"] / h["step_s"] for u, h in zip(plain_records, hf_records, strict=True)
        )
    return out


def _spawned(rank: int, world: int, port: int, case: Case, queue: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        out = run_case(case)
        if rank == 0:
            queue.put(out)
    finally:
        dist.destroy_process_group()


def measure(case: Case, port: int = 29731) -> dict[str, Any]:
    """``case`` on ``ulysses x ring`` spawned gloo ranks; rank 0's figures."""
    world = case.ulysses * case.ring
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.start_processes(_spawned, args=(world, port, case, queue), nprocs=world, start_method="spawn")
    return queue.get()


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m usp.bench.step_overhead", description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="a Hugging Face checkpoint dir (e.g. the tiny Llama)")
    p.add_argument("--layouts", nargs="+", default=["1x1", "2x2"], help="ULYSSESxRING, e.g. 1x1 2x2")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--json", help="also write the figures here (a JSON list)")
    args = p.parse_args(argv)
    results = []
    for i, layout in enumerate(args.layouts):
        ulysses, ring = (int(x) for x in layout.split("x"))
        case = Case(args.model, ulysses, ring, args.seq_len, args.steps)
        results.append(measure(case, port=29731 + i))
        print(json.dumps(results[-1]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
