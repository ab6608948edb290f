"""``python -m usp.bench.maxlen``: the command line, the setup and the search driving one trainer run per
length (the tool is described in :mod:`usp.bench.maxlen`)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from usp.bench.maxlen.planner import Planner, choose_optim, cpu_adam_error, deepest_fitting
from usp.bench.maxlen.search import Attempt, attempt_from, fmt_cell, search, table
from usp.host import meminfo_bytes
from usp.longest import floor_multiple as round_down
from usp.plan.request import compute_bytes as dtype_bytes
from usp.units import GIB, parse_seq_len

OPTIM_CHOICES: tuple[str, ...] = ("auto", "deepspeed_cpu_adam", "adamw_cpu_offload", "adamw")
ROOT = Path(__file__).resolve().parents[3]
DESCRIPTION = "The longest sequence one device trains, measured: one trainer run per length."


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m usp.bench.maxlen", description=DESCRIPTION)
    p.add_argument("--model", default="llama-3.1-8b", help="a preset name or a config.json / checkpoint dir")
    p.add_argument("--tiny", action="store_true", help="the tiny Llama on the CPU, fp32, 256-token granules")
    p.add_argument(
        "--num-layers",
        default=None,
        help="a shallower model of the same width: N, or auto (deepest the host holds)",
    )
    p.add_argument("--out", default="bench_results/maxlen/maxlen.json", help="the JSON report")
    p.add_argument(
        "--work-dir", default=None, help="checkpoint, corpora, data cache (default: next to --out)"
    )
    p.add_argument(
        "--optim", choices=OPTIM_CHOICES, default="auto", help="optim.name (auto: see choose_optim)"
    )
    p.add_argument("--mlp-tiles", default="auto", help="parallel.mlp_tiles: auto or an integer")
    p.add_argument("--dtype", default=None, help="model.dtype (default bfloat16; --tiny: float32)")
    p.add_argument("--loss-chunk-size", type=int, default=4096, help="trainer.loss_chunk_size")
    p.add_argument(
        "--steps", type=int, default=2, help="trainer.max_steps per attempt (the last one is timed)"
    )
    p.add_argument("--start", type=parse_seq_len, default=None, help="first length (default: the planner's)")
    p.add_argument("--max-len", type=parse_seq_len, default=4 * 1024 * 1024, help="never try longer")
    p.add_argument(
        "--granularity", type=int, default=None, help="lengths are multiples (default 4096; tiny 256)"
    )
    p.add_argument("--factor", type=float, default=1.25, help="growth / shrink factor before bisection")
    p.add_argument(
        "--budget", type=float, default=480.0, help="wall-clock seconds for everything (setup included)"
    )
    p.add_argument("--attempt-timeout", type=float, default=240.0, help="seconds one attempt may take")
    p.add_argument("--min-attempt-s", type=float, default=30.0, help="start no attempt with less budget left")
    p.add_argument(
        "--build-timeout", type=float, default=300.0, help="seconds for DeepSpeed's CPU Adam build"
    )
    p.add_argument(
        "--gpu", default=None, help="the planner's device (default: recognised from the GPU's name)"
    )
    p.add_argument("--fail-above", type=int, default=None, help="tests: steps of more tokens fail as an OOM")
    return p


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from usp.bench.maxlen.attempt import attempt_overrides, launch
    from usp.bench.maxlen.setup import model_fields, write_corpus
    from usp.train.peak_flops import gpu_from_device_name

    args = build_parser().parse_args(argv)
    began = time.monotonic()
    deadline = began + args.budget
    model = "tiny" if args.tiny else args.model
    g = args.granularity or (256 if args.tiny else 4096)
    dtype = args.dtype or ("float32" if args.tiny else "bfloat16")
    if args.mlp_tiles != "auto" and not args.mlp_tiles.isdigit():
        raise ValueError(f"--mlp-tiles={args.mlp_tiles!r}: use auto or an integer >= 1.")
    out = Path(args.out)
    work = Path(args.work_dir) if args.work_dir else out.parent / "maxlen-work"
    host_gib = meminfo_bytes("MemTotal") / GIB
    compute_bytes = dtype_bytes(dtype)
    host_states = args.optim != "adamw"
    layers_note = "set by --num-layers" if args.num_layers not in (None, "auto") else "the model's"
    if args.num_layers not in (None, "auto") and not str(args.num_layers).isdigit():
        raise ValueError(f"--num-layers={args.num_layers!r}: use a whole number >= 1, or auto.")
    fields = model_fields(
        model, num_layers=None if args.num_layers in (None, "auto") else int(args.num_layers)
    )
    if args.num_layers == "auto" and host_states:
        deepest = deepest_fitting(fields, host_mem_gib=host_gib, seq_len=g, compute_bytes=compute_bytes)
        if deepest < fields["num_hidden_layers"]:
            layers_note = (
                f"auto: {deepest} of {fields['num_hidden_layers']} layers, the deepest whose offloaded "
                f"states this host ({host_gib:.0f} GiB) holds with room for pinned layer inputs"
            )
            fields["num_hidden_layers"] = deepest
    if (
        host_states
        and deepest_fitting(
            fields, host_mem_gib=host_gib, seq_len=g, compute_bytes=compute_bytes, keep_frac=0.0
        )
        < fields["num_hidden_layers"]
    ):
        raise ValueError(
            f"this host's memory ({host_gib:.0f} GiB, {0.85 * host_gib:.0f} usable) cannot hold the offloaded "
            f"optimizer states of {model} with {fields['num_hidden_layers']} layers (16 bytes per parameter): "
            f"measure a shallower model of the same width (--num-layers auto, or a number), or keep the states "
            f"on the device (--optim adamw)."
        )
    num_layers = None if layers_note == "the model's" else fields["num_hidden_layers"]
    model_dir = work / f"model-{Path(model).name}{'' if num_layers is None else f'-L{num_layers}'}-{dtype}"

    setup = subprocess.run(  # in a child: this process never holds a CUDA context
        [
            sys.executable,
            "-m",
            "usp.bench.maxlen.setup",
            "--model",
            model,
            "--out",
            str(model_dir),
            "--dtype",
            dtype,
        ]
        + ([] if num_layers is None else ["--num-layers", str(num_layers)]),
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
        timeout=args.budget,
    )
    info = json.loads(setup.stdout.strip().splitlines()[-1])
    dev = info["device"]
    gpu = args.gpu or (gpu_from_device_name(dev["name"]) if dev["cuda"] else "cpu")
    if gpu is None:
        raise ValueError(
            f"the planner does not know the GPU {dev['name']!r}: pass --gpu (h100-80g, h200, ...)."
        )
    config = json.loads((model_dir / "config.json").read_text())  # what the trainer trains
    planner = Planner(
        str(model_dir),
        gpu=gpu,
        memory_gib=dev["memory_gib"],
        host_mem_gib=host_gib,
        mlp_tiles=args.mlp_tiles,
        loss_chunk_size=args.loss_chunk_size,
        compute_bytes=compute_bytes,
    )
    optim, optim_reason = choose_optim(
        args.optim,
        cpu_adam_error=lambda: cpu_adam_error(max(1.0, min(args.build_timeout, deadline - time.monotonic()))),
    )
    planned = planner.max_seq_len(host_states, g, None)
    raw = planner.max_seq_len(host_states, g, 0.0)
    start = args.start
    if start is None:  # the planner's limit, shortened until its predicted steps take half an attempt's time
        start = round_down(min(raw or args.max_len, args.max_len), g)
        while (
            start > g
            and args.steps * planner.estimate(start, host_states).step_time_s > args.attempt_timeout / 2
        ):
            start = round_down(start / args.factor, g)
    print(
        f"maxlen: {model} ({planner.spec.num_params / 1e9:.2f}B params) on {dev['name']} (planner device {gpu}, "
        f"host {host_gib:.0f} GiB); optim.name={optim} ({optim_reason}); planner max {planned} (no headroom: "
        f"{raw}); start {start}; setup {time.monotonic() - began:.0f} s",
        flush=True,
    )

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    runs = out.parent / f"{out.stem}-attempts"

    def try_len(seq_len: int) -> Attempt:
        pred = planner.predict(seq_len, host_states)
        if not pred["host_fits"]:
            return Attempt(
                seq_len,
                "host_mem",
                error=f"planner: {pred['host_mem_gib_per_node']:.1f} GiB of host "
                f"memory needed, {0.85 * host_gib:.1f} usable: not run",
                planner=pred,
            )
        timeout = min(args.attempt_timeout, deadline - time.monotonic())
        corpus = work / "corpus" / f"seq{seq_len}.jsonl"
        if not corpus.is_file():
            write_corpus(corpus, tokenizer, min_tokens=seq_len + seq_len // 16 + 1024)
        overrides = attempt_overrides(
            seq_len,
            model_dir=model_dir.resolve(),
            corpus=corpus.resolve(),
            cache_dir=(work / "data_cache").resolve(),
            dtype=dtype,
            optim=optim,
            mlp_tiles=args.mlp_tiles,
            loss_chunk_size=args.loss_chunk_size,
            steps=args.steps,
            max_position=int(config.get("max_position_embeddings") or 0),
            cpu=not dev["cuda"],
        )
        run_dir = (runs / f"seq{seq_len}").resolve()
        if run_dir.exists():
            import shutil

            shutil.rmtree(run_dir)
        spec = {
            "seq_len": seq_len,
            "overrides": overrides,
            "run_dir": str(run_dir),
            "result": str(runs.resolve() / f"seq{seq_len}.result.json"),
            "fail_above": args.fail_above,
        }
        result = launch(spec, timeout_s=timeout, log_path=runs / f"seq{seq_len}.log")
        if result["status"] == "timeout" and timeout < args.attempt_timeout:
            result["status"] = "budget"  # cut by the search's budget, not by its own limit: no bound
        a = attempt_from(result, pred)
        print(
            f"  {seq_len}: {a.status} ({a.wall_s:.0f} s){'' if a.ok else ' ' + str(a.error or '')}",
            flush=True,
        )
        return a

    best, stopped, attempts = search(
        try_len,
        start=start,
        granularity=g,
        max_len=args.max_len,
        factor=args.factor,
        time_left=lambda: deadline - time.monotonic() >= args.min_attempt_s,
    )
    found = next((a for a in attempts if a.ok and a.seq_len == best), None)
    above = sorted(
        (a for a in attempts if not a.ok and (best is None or a.seq_len > best)), key=lambda a: a.seq_len
    )
    limited_by = (
        above[0].status if above else stopped
    )  # what stopped the next longer length (oom, timeout ...)
    report = {
        "max_seq_len": best,
        "stopped": stopped,
        "limited_by": limited_by,
        "best": None if found is None else asdict(found),
        "attempts": [asdict(a) for a in attempts],
        "planner": {
            "max_seq_len": planned,
            "max_seq_len_no_headroom": raw,
            "device": gpu,
            "at_max_seq_len": None if best is None else planner.predict(best, host_states),
        },
        "settings": {
            "model": model,
            "num_layers": config["num_hidden_layers"],
            "num_layers_note": layers_note,
            "params": planner.spec.num_params,
            "activation_checkpointing": "offload",
            "mlp_tiles": args.mlp_tiles,
            "optim": optim,
            "optim_reason": optim_reason,
            "dtype": dtype,
            "loss_chunk_size": args.loss_chunk_size,
            "steps": args.steps,
            "granularity": g,
            "factor": args.factor,
            "start": start,
            "budget_s": args.budget,
            "attempt_timeout_s": args.attempt_timeout,
            "fail_above": args.fail_above,
        },
        "machine": {
            "device": dev["name"],
            "memory_gib": dev["memory_gib"],
            "host_mem_gib": round(host_gib, 1),
        },
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "elapsed_s": round(time.monotonic() - began, 1),
        "command": "python -m usp.bench.maxlen " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1, default=str))
    print(table(attempts))
    summary = (
        "none trained"
        if found is None
        else (
            f"{best} tokens (step {found.step_time_s:.2f} s, {found.tokens_per_s:.0f} tokens/s, MFU {100 * found.mfu:.1f}%, "
            f"peak {fmt_cell(found.peak_mem_gib, '.2f')} GiB allocated, {fmt_cell(found.peak_mem_reserved_gib, '.2f')} reserved)"
        )
    )
    print(
        f"longest trained: {summary}; next longer: {limited_by}; planner: {planned} ({raw} without headroom); stopped: {stopped} after "
        f"{len(attempts)} attempt(s), {report['elapsed_s']:.0f} s; report {out}",
        flush=True,
    )
    return report
