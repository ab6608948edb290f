"""The longest sequence one device trains, measured: ``python -m usp.bench.maxlen``.

Each tried length is one run of the trainer (:mod:`usp.bench.maxlen_attempt`, a fresh process with its own
timeout) of ``--steps`` steps of a model with random weights (``--model``: a preset of
:data:`usp.plan.models.PRESETS`, default Llama-3.1-8B; ``--tiny``: the tiny Llama on the CPU) on one rank,
with ``parallel.activation_checkpointing=offload``, ``parallel.mlp_tiles`` (``auto``: the trainer's rule)
and the optimizer step on the host (``optim.name=deepspeed_cpu_adam``; ``adamw_cpu_offload`` when DeepSpeed's
CPU Adam does not build). For every length it reports the outcome (``ok``, ``oom``, ``host_mem``, ``timeout``,
``killed``, ``error``), the last step's time, tokens/s and MFU (the trainer's own figures, FLOPs from
:func:`usp.train.flops.training_flops`), peak allocated and reserved GiB over the steps, and the planner's
prediction for the same settings (:func:`usp.plan.evaluate_layout`).

Search (:func:`search`): from the planner's longest length for these settings without its headroom
(:func:`usp.plan.max_seq_len`, rounded down to ``--granularity``; capped so one attempt's predicted time
fits ``--attempt-timeout``), up by ``x --factor`` while attempts succeed, or down by ``/ --factor`` until one
does, then bisection to one granule. An attempt that fails for memory or time bounds the answer from above;
the answer is the longest length that trained. The whole search stops at ``--budget`` seconds of wall clock
(setup included) and writes what it has. Host memory is checked before each attempt with the planner's host
terms (offloaded states, pinned layer inputs) against this machine's RAM: an attempt that would not fit is
recorded as ``host_mem`` and not run (a host out-of-memory kill could take the whole machine down).

    python -m usp.bench.maxlen --out bench_results/maxlen/maxlen.json           # on a GPU, ~8 minutes
    python -m usp.bench.maxlen --tiny --start 2048 --granularity 256 --out /tmp/maxlen.json   # CPU, < 1 min
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from usp.bench.maxlen_plan import Planner, choose_optim, cpu_adam_error, deepest_fitting, memory_gib
from usp.plan.request import compute_bytes as dtype_bytes
from usp.units import parse_seq_len

BOUND_STATUSES: tuple[str, ...] = ("oom", "host_mem", "timeout", "killed")
"""Outcomes that bound the answer from above (a longer sequence would fail too); ``error`` and ``budget`` stop
the search instead."""
OPTIM_CHOICES: tuple[str, ...] = ("auto", "deepspeed_cpu_adam", "adamw_cpu_offload", "adamw")
ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Attempt:
    """One tried length and what it measured (``None`` where it did not get that far)."""

    seq_len: int
    status: str
    mlp_tiles: int | None = None
    wall_s: float = 0.0
    step_time_s: float | None = None
    tokens_per_s: float | None = None
    mfu: float | None = None
    peak_mem_gib: float | None = None
    peak_mem_reserved_gib: float | None = None
    error: str | None = None
    planner: dict[str, Any] = field(default_factory=dict)
    """:func:`usp.plan.evaluate_layout` at this length: ``mem_gib_per_gpu``, ``host_mem_gib_per_node``,
    ``step_time_s``, ``mfu``, ``fits`` (with the planner's default headroom)."""

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def round_down(x: float, g: int) -> int:
    return max(g, int(x) // g * g)


def round_up(x: float, g: int) -> int:
    return -(-int(math.ceil(x)) // g) * g


def search(try_len: Callable[[int], Attempt], *, start: int, granularity: int, max_len: int, factor: float = 1.25,
           time_left: Callable[[], bool] = lambda: True) -> tuple[int | None, str, list[Attempt]]:  # fmt: skip
    """The longest length (a multiple of ``granularity``, at most ``max_len``) for which ``try_len`` succeeds,
    assuming success is monotone (shorter fits when longer does).

    Returns ``(longest ok or None, why it stopped, attempts in order)``; why: ``converged`` (the longest ok and
    the shortest failure are one granule apart), ``limit`` (``max_len`` trained), ``nothing_fits`` (the
    smallest length failed), ``budget`` (``time_left()`` said stop, or an attempt was cut by the budget),
    ``error`` (an attempt failed for another reason than memory or time).
    """
    g = granularity
    top = round_down(max_len, g)
    attempts: list[Attempt] = []
    lo: int | None = None  # longest ok
    hi: int | None = None  # shortest failure

    def run(s: int) -> str:
        if not time_left():
            return "budget"
        a = try_len(s)
        attempts.append(a)
        return "ok" if a.ok else "bound" if a.status in BOUND_STATUSES else a.status

    s = min(round_down(start, g), top)
    outcome = run(s)
    if outcome == "ok":
        lo = s
        while hi is None:
            if lo >= top:
                return lo, "limit", attempts
            nxt = min(round_up(lo * factor, g), top)
            outcome = run(nxt)
            if outcome == "ok":
                lo = nxt
            elif outcome == "bound":
                hi = nxt
            else:
                return lo, outcome, attempts
    elif outcome == "bound":
        hi = s
        while lo is None:
            if hi <= g:
                return None, "nothing_fits", attempts
            nxt = min(round_down(hi / factor, g), hi - g)
            outcome = run(nxt)
            if outcome == "ok":
                lo = nxt
            elif outcome == "bound":
                hi = nxt
            else:
                return None, outcome, attempts
    else:
        return None, outcome, attempts
    while hi - lo > g:
        mid = round_down((lo + hi) // 2, g)
        outcome = run(mid)
        if outcome == "ok":
            lo = mid
        elif outcome == "bound":
            hi = mid
        else:
            return lo, outcome, attempts
    return lo, "converged", attempts


# --- the measurement --------------------------------------------------------------------------------------
def attempt_overrides(seq_len: int, *, model_dir: Path, corpus: Path, cache_dir: Path, dtype: str, optim: str,
                      mlp_tiles: str, loss_chunk_size: int, steps: int, max_position: int, cpu: bool) -> list[str]:  # fmt: skip
    """The trainer's Hydra overrides for one attempt: one rank, offload checkpointing, the tile setting, the
    optimizer; one document-unmasked row of ``seq_len`` tokens (dense causal attention, as the planner
    assumes); no evaluation, export, resume or watchdog."""
    return [
        f"model.path={model_dir}", f"model.dtype={dtype}", f"model.max_position_embeddings={max(seq_len, max_position)}",
        "data=jsonl", f"data.inputs=['{corpus}']", "data.document_masking=false", f"data.cache_dir={cache_dir}",
        "data.num_proc=1", "parallel=single", "parallel.activation_checkpointing=offload",
        f"parallel.mlp_tiles={mlp_tiles}", "optim=adamw", f"optim.name={optim}", "optim.warmup_steps=0",
        "trainer=long_context", f"trainer.seq_len={seq_len}", f"trainer.max_steps={steps}",
        f"trainer.loss_chunk_size={loss_chunk_size}", "trainer.checkpoint_every=0", "trainer.export_hf=false",
        "trainer.resume=null", f"trainer.device={'cpu' if cpu else 'cuda'}", "trainer.watchdog_factor=0",
        "trainer.watchdog_minutes=0", "logging.progress_bar=false",
    ]  # fmt: skip


def attempt_from(result: dict[str, Any], planner: dict[str, Any]) -> Attempt:
    """An :class:`Attempt` from :func:`usp.bench.maxlen_attempt.launch`'s result: the last step's time,
    tokens/s and MFU (the first may include warm-up), the peaks over all steps."""
    recs = result.get("records") or []
    last = recs[-1] if recs else {}

    def peak(key: str) -> float | None:
        values = [r[key] for r in recs if r.get(key) is not None]
        return max(values) if values else None

    return Attempt(
        seq_len=int(result["seq_len"]), status=result["status"], mlp_tiles=(result.get("layout") or {}).get("mlp_tiles"),
        wall_s=round(float(result.get("wall_s", 0.0)), 1), step_time_s=last.get("step_time_s"),
        tokens_per_s=last.get("tokens_per_s"), mfu=last.get("mfu"), peak_mem_gib=peak("peak_mem_gib"),
        peak_mem_reserved_gib=peak("peak_mem_reserved_gib"), error=result.get("error"), planner=planner,
    )  # fmt: skip


def _fmt(x: Any, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def table(attempts: Sequence[Attempt]) -> str:
    """The attempts, longest first, as a Markdown table (measured, then the planner's figures)."""
    head = ("| seq_len | status | tiles | step s | tokens/s | MFU | peak alloc GiB | peak reserved GiB | planner GiB "
            "| planner step s | planner MFU | wall s |")  # fmt: skip
    rows = [head, "|" + " --- |" * (head.count("|") - 1)]
    for a in sorted(attempts, key=lambda a: -a.seq_len):
        p = a.planner
        rows.append(
            f"| {a.seq_len} | {a.status} | {_fmt(a.mlp_tiles, 'd')} | {_fmt(a.step_time_s, '.2f')} | "
            f"{_fmt(a.tokens_per_s, '.0f')} | {_fmt(None if a.mfu is None else 100 * a.mfu, '.1f')}"
            f"{'%' if a.mfu is not None else ''} | {_fmt(a.peak_mem_gib, '.2f')} | {_fmt(a.peak_mem_reserved_gib, '.2f')} | "
            f"{_fmt(p.get('mem_gib_per_gpu'), '.2f')} | {_fmt(p.get('step_time_s'), '.2f')} | "
            f"{_fmt(None if p.get('mfu') is None else 100 * p['mfu'], '.1f')} | {a.wall_s:.0f} |"
        )  # fmt: skip
    return "\n".join(rows)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m usp.bench.maxlen", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama-3.1-8b", help="a preset name or a config.json / checkpoint dir")
    p.add_argument("--tiny", action="store_true", help="the tiny Llama on the CPU, fp32, 256-token granules")
    p.add_argument(
        "--num-layers", default=None, help="a shallower model of the same width: N, or auto (deepest the host holds)"
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

    from usp.bench.maxlen_attempt import launch
    from usp.bench.maxlen_setup import model_fields, write_corpus
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
    host_gib = memory_gib("MemTotal")
    compute_bytes = dtype_bytes(dtype)
    host_states = args.optim != "adamw"
    layers_note = "set by --num-layers" if args.num_layers not in (None, "auto") else "the model's"
    if args.num_layers not in (None, "auto") and not str(args.num_layers).isdigit():
        raise ValueError(f"--num-layers={args.num_layers!r}: use a whole number >= 1, or auto.")
    fields = model_fields(model, num_layers=None if args.num_layers in (None, "auto") else int(args.num_layers))
    if args.num_layers == "auto" and host_states:
        deepest = deepest_fitting(fields, host_mem_gib=host_gib, seq_len=g, compute_bytes=compute_bytes)
        if deepest < fields["num_hidden_layers"]:
            layers_note = (f"auto: {deepest} of {fields['num_hidden_layers']} layers, the deepest whose offloaded "
                           f"states this host ({host_gib:.0f} GiB) holds with room for pinned layer inputs")  # fmt: skip
            fields["num_hidden_layers"] = deepest
    if host_states and deepest_fitting(fields, host_mem_gib=host_gib, seq_len=g, compute_bytes=compute_bytes,
                                       keep_frac=0.0) < fields["num_hidden_layers"]:  # fmt: skip
        raise ValueError(
            f"this host's memory ({host_gib:.0f} GiB, {0.85 * host_gib:.0f} usable) cannot hold the offloaded "
            f"optimizer states of {model} with {fields['num_hidden_layers']} layers (16 bytes per parameter): "
            f"measure a shallower model of the same width (--num-layers auto, or a number), or keep the states "
            f"on the device (--optim adamw)."
        )
    num_layers = None if layers_note == "the model's" else fields["num_hidden_layers"]
    model_dir = (
        work / f"model-{Path(model).name}{'' if num_layers is None else f'-L{num_layers}'}-{dtype}"
    )

    setup = subprocess.run(  # in a child: this process never holds a CUDA context
        [sys.executable, "-m", "usp.bench.maxlen_setup", "--model", model, "--out", str(model_dir), "--dtype", dtype]
        + ([] if num_layers is None else ["--num-layers", str(num_layers)]),
        capture_output=True, text=True, check=True, cwd=ROOT, timeout=args.budget,
    )  # fmt: skip
    info = json.loads(setup.stdout.strip().splitlines()[-1])
    dev = info["device"]
    gpu = args.gpu or (gpu_from_device_name(dev["name"]) if dev["cuda"] else "cpu")
    if gpu is None:
        raise ValueError(
            f"the planner does not know the GPU {dev['name']!r}: pass --gpu (h100-80g, h200, ...)."
        )
    config = json.loads((model_dir / "config.json").read_text())  # what the trainer trains
    planner = Planner(str(model_dir), gpu=gpu, memory_gib=dev["memory_gib"], host_mem_gib=host_gib, mlp_tiles=args.mlp_tiles,
                      loss_chunk_size=args.loss_chunk_size, compute_bytes=compute_bytes)  # fmt: skip
    optim, optim_reason = choose_optim(
        args.optim,
        cpu_adam_error=lambda: cpu_adam_error(max(1.0, min(args.build_timeout, deadline - time.monotonic()))),
    )
    planned = planner.max_seq_len(host_states, g, None)
    raw = planner.max_seq_len(host_states, g, 0.0)
    start = args.start
    if start is None:  # the planner's limit, shortened until its predicted steps take half an attempt's time
        start = round_down(min(raw or args.max_len, args.max_len), g)
        while start > g and args.steps * planner.estimate(start, host_states).step_time_s > args.attempt_timeout / 2:
            start = round_down(start / args.factor, g)
    print(f"maxlen: {model} ({planner.spec.num_params / 1e9:.2f}B params) on {dev['name']} (planner device {gpu}, "
          f"host {host_gib:.0f} GiB); optim.name={optim} ({optim_reason}); planner max {planned} (no headroom: "
          f"{raw}); start {start}; setup {time.monotonic() - began:.0f} s", flush=True)  # fmt: skip

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    runs = out.parent / f"{out.stem}-attempts"

    def try_len(seq_len: int) -> Attempt:
        pred = planner.predict(seq_len, host_states)
        if not pred["host_fits"]:
            return Attempt(seq_len, "host_mem", error=f"planner: {pred['host_mem_gib_per_node']:.1f} GiB of host "
                           f"memory needed, {0.85 * host_gib:.1f} usable: not run", planner=pred)  # fmt: skip
        timeout = min(args.attempt_timeout, deadline - time.monotonic())
        corpus = work / "corpus" / f"seq{seq_len}.jsonl"
        if not corpus.is_file():
            write_corpus(corpus, tokenizer, min_tokens=seq_len + seq_len // 16 + 1024)
        overrides = attempt_overrides(
            seq_len, model_dir=model_dir.resolve(), corpus=corpus.resolve(), cache_dir=(work / "data_cache").resolve(),
            dtype=dtype, optim=optim, mlp_tiles=args.mlp_tiles, loss_chunk_size=args.loss_chunk_size,
            steps=args.steps, max_position=int(config.get("max_position_embeddings") or 0), cpu=not dev["cuda"],
        )  # fmt: skip
        run_dir = (runs / f"seq{seq_len}").resolve()
        if run_dir.exists():
            import shutil

            shutil.rmtree(run_dir)
        spec = {"seq_len": seq_len, "overrides": overrides, "run_dir": str(run_dir),
                "result": str(runs.resolve() / f"seq{seq_len}.result.json"), "fail_above": args.fail_above}  # fmt: skip
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
        try_len, start=start, granularity=g, max_len=args.max_len, factor=args.factor,
        time_left=lambda: deadline - time.monotonic() >= args.min_attempt_s,
    )  # fmt: skip
    found = next((a for a in attempts if a.ok and a.seq_len == best), None)
    above = sorted((a for a in attempts if not a.ok and (best is None or a.seq_len > best)), key=lambda a: a.seq_len)
    limited_by = above[0].status if above else stopped  # what stopped the next longer length (oom, timeout ...)
    report = {
        "max_seq_len": best, "stopped": stopped, "limited_by": limited_by, "best": None if found is None else asdict(found),
        "attempts": [asdict(a) for a in attempts],
        "planner": {"max_seq_len": planned, "max_seq_len_no_headroom": raw, "device": gpu,
                    "at_max_seq_len": None if best is None else planner.predict(best, host_states)},
        "settings": {"model": model, "num_layers": config["num_hidden_layers"], "num_layers_note": layers_note, "params": planner.spec.num_params,
                     "activation_checkpointing": "offload", "mlp_tiles": args.mlp_tiles, "optim": optim,
                     "optim_reason": optim_reason, "dtype": dtype, "loss_chunk_size": args.loss_chunk_size,
                     "steps": args.steps, "granularity": g, "factor": args.factor, "start": start,
                     "budget_s": args.budget, "attempt_timeout_s": args.attempt_timeout, "fail_above": args.fail_above},
        "machine": {"device": dev["name"], "memory_gib": dev["memory_gib"], "host_mem_gib": round(host_gib, 1)},
        "date": time.strftime("%Y-%m-%d", time.gmtime()), "elapsed_s": round(time.monotonic() - began, 1),
        "command": "python -m usp.bench.maxlen " + " ".join(argv if argv is not None else sys.argv[1:]),
    }  # fmt: skip
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1, default=str))
    print(table(attempts))
    summary = "none trained" if found is None else (
        f"{best} tokens (step {found.step_time_s:.2f} s, {found.tokens_per_s:.0f} tokens/s, MFU {100 * found.mfu:.1f}%, "
        f"peak {_fmt(found.peak_mem_gib, '.2f')} GiB allocated, {_fmt(found.peak_mem_reserved_gib, '.2f')} reserved)")  # fmt: skip
    print(f"longest trained: {summary}; next longer: {limited_by}; planner: {planned} ({raw} without headroom); stopped: {stopped} after "
          f"{len(attempts)} attempt(s), {report['elapsed_s']:.0f} s; report {out}", flush=True)  # fmt: skip
    return report


if __name__ == "__main__":
    main()
