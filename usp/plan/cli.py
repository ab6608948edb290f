"""``usp-plan``: rank the Ulysses x ring x dp layouts for a model, sequence length and cluster.

    usp-plan --model llama-3.1-8b --seq-len 1M --nodes 4 --gpus-per-node 8 --gpu h100-80g
    usp-plan --model llama-3-70b --seq-len 1M --nodes 4 --gpu a100-80g --inference --json
    usp-plan calibrate --gpu cpu --run runs/tiny-a --run runs/tiny-b --bench bench.json --out calib.json
    usp-plan --model ckpt/config.json --seq-len 128K --nodes 1 --gpu cpu --calibration calib.json

Sequence lengths take binary suffixes: ``128K`` = 131072, ``1M`` = 1048576.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Sequence
from dataclasses import asdict, replace

from usp.modes import RING_LAYOUTS
from usp.plan.calibrate import Calibration, calibrate, format_report, read_bench_json, read_training_run
from usp.plan.compute import DocumentWork
from usp.plan.hardware import GPUS, DeviceSpec, get_device
from usp.plan.inference import InferenceEstimate, plan_inference
from usp.plan.models import PRESETS, ModelSpec, load_model_spec
from usp.plan.search import LayoutEstimate, plan_layouts

_SUFFIX = {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3}


def parse_seq_len(text: str) -> int:
    """``131072``, ``128K``, ``1M`` (binary multiples) -> tokens."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgG]?)\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"--seq-len={text!r}: use a token count like 131072, 128K or 1M.")
    value = float(m.group(1)) * _SUFFIX[m.group(2).lower()]
    if value != int(value) or value < 1:
        raise argparse.ArgumentTypeError(f"--seq-len={text!r} is not a whole positive number of tokens.")
    return int(value)


def _device_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gpu", default=None, help=f"device type: {', '.join(GPUS)} (default h100-80g)")
    p.add_argument("--gpu-mem-gib", type=float, default=None, help="device memory, GiB")
    p.add_argument("--peak-tflops", type=float, default=None, help="dense bf16 peak, TFLOP/s")
    p.add_argument("--intra-node-gbps", type=float, default=None, help="NVLink GB/s per GPU and direction")
    p.add_argument("--inter-node-gbps", type=float, default=None, help="network GB/s per GPU and direction")
    p.add_argument("--dense-efficiency", type=float, default=None, help="fraction of peak for linear layers")
    p.add_argument("--attention-efficiency", type=float, default=None, help="fraction of peak for attention")


def _device(args: argparse.Namespace) -> DeviceSpec:
    explicit = [args.gpu_mem_gib, args.peak_tflops, args.intra_node_gbps, args.inter_node_gbps]
    name = args.gpu if args.gpu is not None or all(x is not None for x in explicit) else "h100-80g"
    device = get_device(
        name,
        memory_gib=args.gpu_mem_gib,
        peak_tflops=args.peak_tflops,
        intra_node_gbps=args.intra_node_gbps,
        inter_node_gbps=args.inter_node_gbps,
    )
    calibration = getattr(args, "calibration", None)
    if calibration:
        device = Calibration.load(calibration).apply(device)
    for field in ("dense_efficiency", "attention_efficiency"):  # explicit figures win over a calibration
        value = getattr(args, field)
        if value is not None:
            if not 0 < value <= 1:
                raise ValueError(f"--{field.replace('_', '-')}={value} must be in (0, 1].")
            device = replace(device, **{field: value})
    return device


def build_plan_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="usp-plan",
        description="Predict memory and step time of every Ulysses x ring x dp layout and rank those that fit. "
        "Subcommand: 'usp-plan calibrate ...' fits the efficiencies to measured runs.",
    )
    p.add_argument(
        "--model", required=True, help=f"HF config.json / checkpoint dir, or a preset: {', '.join(PRESETS)}"
    )
    p.add_argument(
        "--seq-len", required=True, type=parse_seq_len, help="tokens per sequence (131072, 128K, 1M)"
    )
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--gpus-per-node", type=int, default=8)
    _device_args(p)
    p.add_argument(
        "--global-batch", type=int, default=None, help="sequences per optimizer step (default: dp)"
    )
    p.add_argument("--ulysses-degree", type=int, default=None, help="fix the Ulysses degree")
    p.add_argument("--ring-degree", type=int, default=None, help="fix the ring degree")
    p.add_argument("--ring-layout", default="balanced", choices=list(RING_LAYOUTS))
    p.add_argument(
        "--doc-lengths",
        default=None,
        metavar="SPEC",
        help="packed documents of this length distribution (as usp-bench: lognormal:mean=8192, fixed:2048, "
        "lengths:2048,65536,2048x31, file:PATH): attention is costed over them and the layout's busiest ring "
        "rank, not one causal sequence",
    )
    p.add_argument("--loss-chunk-size", type=int, default=4096)
    p.add_argument(
        "--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"], help="model.dtype"
    )
    p.add_argument(
        "--overhead-frac", type=float, default=0.08, help="allocator margin on top of the estimate"
    )
    p.add_argument("--calibration", default=None, help="JSON written by 'usp-plan calibrate --out'")
    p.add_argument("--inference", action="store_true", help="KV cache, batch capacity, prefill and decode")
    p.add_argument("--top", type=int, default=10, help="rows of the table")
    p.add_argument("--json", action="store_true", help="print the ranked layouts as a JSON list")
    return p


def build_calibrate_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="usp-plan calibrate",
        description="Fit the device efficiencies to usp-bench results and training runs; print predicted vs "
        "measured (ratio = measured / predicted).",
    )
    _device_args(p)
    p.add_argument(
        "--run", action="append", default=[], help="training run dir or its metrics.jsonl (repeat)"
    )
    p.add_argument("--bench", action="append", default=[], help="usp-bench JSON output (repeat)")
    p.add_argument("--model", default=None, help="model override when the run config does not locate it")
    p.add_argument("--world-size", type=int, default=None, help="ranks of the runs, when dp_degree=-1")
    p.add_argument("--node-size", type=int, default=None)
    p.add_argument("--out", default=None, help="write the calibration JSON here (for --calibration)")
    p.add_argument("--json", action="store_true")
    return p


def format_table(
    model: ModelSpec, device: DeviceSpec, seq_len: int, world: int, layouts: list[LayoutEstimate], top: int
) -> str:
    head = (
        f"{model.name}: {model.num_params / 1e9:.2f}B params, seq_len={seq_len}, {world} x {device.name} "
        f"({device.memory_gib:g} GiB, {device.peak_tflops:g} TFLOP/s peak); {len(layouts)} layouts fit"
    )
    cols = (
        f"{'#':>3} {'ulysses':>7} {'ring':>5} {'dp':>4} {'fsdp':<12} {'ckpt':<10} {'mem GiB':>8} {'step s':>9} "
        f"{'tok/s/GPU':>10} {'MFU':>6}"
    )
    rows = [head, cols]
    for i, e in enumerate(layouts[:top], 1):
        ckpt = e.activation_checkpointing + (
            f"/{e.ac_every_k}" if e.activation_checkpointing == "every_k" else ""
        )
        rows.append(
            f"{i:>3} {e.ulysses_degree:>7} {e.ring_degree:>5} {e.dp_degree:>4} {e.fsdp_mode:<12} {ckpt:<10} "
            f"{e.mem_gib_per_gpu:>8.1f} {e.step_time_s:>9.3g} {e.tokens_per_s_per_gpu:>10.4g} {e.mfu:>6.1%}"
        )
    best = layouts[0]
    rows.append("")
    rows.append(
        "best layout, memory GiB/GPU: " + ", ".join(f"{k} {v:.2f}" for k, v in best.memory_gib.items())
    )
    t = best.time_s
    rows.append(
        "best layout, seconds/step: "
        + ", ".join(
            f"{k.removesuffix('_s')} {v:.3g}"
            for k, v in t.items()
            if k.endswith("_s") and k != "ring_step_comm_s"
        )
    )
    rows.append("Hydra overrides for the best layout:")
    extra = [f"trainer.seq_len={seq_len}"]
    if best.grad_accum_steps > 1:
        extra.append(f"trainer.grad_accum_steps={best.grad_accum_steps}")
    rows.append("  " + " ".join(best.overrides() + extra))
    return "\n".join(rows)


def format_inference(
    model: ModelSpec, device: DeviceSpec, seq_len: int, plans: list[InferenceEstimate]
) -> str:
    rows = [
        f"{model.name} inference, one {seq_len}-token request over {plans[0].ulysses_degree * plans[0].ring_degree} "
        f"x {device.name}",
        f"{'ulysses':>7} {'ring':>5} {'KV GB/GPU':>10} {'weights GB':>10} {'batch cap':>9} {'prefill s':>10} "
        f"{'decode ms/tok (HBM)':>19} {'+ all-gather ms':>15}",
    ]
    for e in plans:
        rows.append(
            f"{e.ulysses_degree:>7} {e.ring_degree:>5} {e.kv_cache_gb_per_gpu:>10.2f} {e.weights_gb_per_gpu:>10.2f} "
            f"{e.batch_capacity:>9} {e.prefill_s:>10.4g} {e.decode_hbm_s_per_token * 1e3:>19.3g} "
            f"{e.decode_allgather_s_per_token * 1e3:>15.4g}"
        )
    return "\n".join(rows)


def format_documents(documents: DocumentWork, best: LayoutEstimate, ring_layout: str) -> str:
    """The packed-document attention terms: pairs vs one sequence, and per ring layout the busiest ring rank's
    share and the attention seconds per step it predicts for the best layout (which layout to choose)."""
    r = best.ring_degree
    attention = best.time_s["attention_s"] / documents.imbalance(r, ring_layout)  # per unit of share
    per_layout = ", ".join(
        f"{lay} {documents.imbalance(r, lay):.2f} ({attention * documents.imbalance(r, lay):.3g} s)"
        for lay in RING_LAYOUTS
    )
    return (
        f"documents {documents.spec}: attention pairs {documents.pair_fraction:.3f} x one causal sequence "
        f"(mean of {len(documents.rows)} rows); busiest ring rank's work / mean at ring {r} (attention s/step "
        f"of the best layout): {per_layout}"
    )


def _main_calibrate(argv: Sequence[str]) -> int:
    args = build_calibrate_parser().parse_args(argv)
    device = _device(args)
    spec = load_model_spec(args.model) if args.model else None
    runs = []
    for r in args.run:
        run = read_training_run(r, world_size=args.world_size, node_size=args.node_size, model_spec=spec)
        runs.append(run)
    bench = [rec for b in args.bench for rec in read_bench_json(b)]
    cal, before = calibrate(device, runs, bench)
    if args.out:
        cal.save(args.out)
    if args.json:
        print(json.dumps({"calibration": asdict(cal), "before_fit": before}, indent=2, default=str))
    else:
        print(format_report(before, cal))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv and argv[0] == "calibrate":
            return _main_calibrate(argv[1:])
        args = build_plan_parser().parse_args(argv)
        if args.nodes < 1 or args.gpus_per_node < 1:
            raise ValueError(f"--nodes={args.nodes} and --gpus-per-node={args.gpus_per_node} must be >= 1.")
        model = load_model_spec(args.model)
        device = _device(args)
        world = args.nodes * args.gpus_per_node
        if args.inference:
            plans = plan_inference(
                model,
                device,
                seq_len=args.seq_len,
                world_size=world,
                node_size=args.gpus_per_node,
                ring_layout=args.ring_layout,
            )
            print(
                json.dumps([p.to_dict() for p in plans], indent=2)
                if args.json
                else format_inference(model, device, args.seq_len, plans)
            )
            return 0
        documents = None if args.doc_lengths is None else DocumentWork.from_spec(args.doc_lengths, args.seq_len)
        layouts = plan_layouts(
            model,
            device,
            documents=documents,
            seq_len=args.seq_len,
            world_size=world,
            node_size=args.gpus_per_node,
            global_batch=args.global_batch,
            ring_layout=args.ring_layout,
            ulysses_degree=args.ulysses_degree,
            ring_degree=args.ring_degree,
            loss_chunk_size=args.loss_chunk_size,
            overhead_frac=args.overhead_frac,
            compute_bytes=4 if args.dtype == "float32" else 2,
        )
        if args.json:
            print(json.dumps([e.to_dict() for e in layouts], indent=2))
        else:
            print(format_table(model, device, args.seq_len, world, layouts, args.top))
            if documents is not None:
                print(format_documents(documents, layouts[0], args.ring_layout))
        return 0
    except ValueError as e:
        print(f"usp-plan: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `usp-plan ... | head`: the reader left; not an error
        sys.stdout = open(os.devnull, "w")  # keeps the interpreter's final flush quiet
        return 0


if __name__ == "__main__":
    sys.exit(main())
