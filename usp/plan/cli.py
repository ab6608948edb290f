"""``usp-plan``: rank the Ulysses x ring x dp layouts for a model, sequence length and cluster.

    usp-plan --model llama-3.1-8b --seq-len 1M --nodes 4 --gpus-per-node 8 --gpu h100-80g
    usp-plan --model llama-3-70b --seq-len 1M --nodes 4 --gpu a100-80g --inference --json
    usp-plan calibrate --gpu cpu --run runs/tiny-a --run runs/tiny-b --bench bench.json --out calib.json
    usp-plan --model ckpt/config.json --seq-len 128K --nodes 1 --gpu cpu --calibration calib.json
    usp-plan --model llama-3.1-8b --max-seq-len --nodes 1 --gpus-per-node 8 --gpu h100-80g --json
    usp-plan --model llama-3-70b --max-seq-len --lora-rank 16 --nodes 1 --gpus-per-node 8 --gpu h100-80g

Sequence lengths take binary suffixes: ``128K`` = 131072, ``1M`` = 1048576.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import asdict, replace

from usp.errors import pop_verbose, report
from usp.modes import RING_LAYOUTS
from usp.plan.calibrate import Calibration, calibrate, format_report, read_bench_json, read_training_run
from usp.plan.compute import DocumentWork
from usp.plan.hardware import GPUS, DeviceSpec, get_device
from usp.plan.inference import InferenceEstimate, plan_inference
from usp.plan.layout import STATE_PLACEMENTS
from usp.plan.lora import LoraPlan, total_params, trainable_params
from usp.plan.maxlen import (
    LOSS_CHUNK_CANDIDATES,
    SEQ_MULTIPLE,
    MaxSeqLenEstimate,
    max_seq_lens,
)
from usp.plan.models import PRESETS, ModelSpec, load_model_spec
from usp.plan.request import PlanRequest, compute_bytes
from usp.plan.search import TIE_TOLERANCE, LayoutEstimate, plan_layouts
from usp.units import parse_seq_len  # noqa: F401 - also usp.plan.cli.parse_seq_len, as before


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
        host_mem_gib=getattr(args, "host_mem_gib", None),
        host_link_gbps=getattr(args, "host_link_gbps", None),
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
        "--seq-len", type=parse_seq_len, default=None, help="tokens per sequence (131072, 128K, 1M)"
    )
    p.add_argument(
        "--max-seq-len",
        action="store_true",
        help="instead of --seq-len: find the longest sequence that fits, with its layout and settings",
    )
    p.add_argument("--nodes", type=int, default=1, help="nodes of the cluster (default 1)")
    p.add_argument(
        "--gpus-per-node",
        type=int,
        default=8,
        help="GPUs per node; Ulysses groups stay inside a node (default 8)",
    )
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
    p.add_argument(
        "--loss-chunk-size",
        type=int,
        default=None,
        help="trainer.loss_chunk_size (default 4096; --max-seq-len tries 4096, 2048, 1024 unless given)",
    )
    p.add_argument(
        "--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"], help="model.dtype"
    )
    p.add_argument(
        "--overhead-frac",
        type=float,
        default=0.05,
        help="allocator fragmentation allowance (fraction of the tensor peak)",
    )
    p.add_argument("--calibration", default=None, help="JSON written by 'usp-plan calibrate --out'")
    p.add_argument(
        "--host-mem-gib", type=float, default=None, help="host RAM per node, GiB (cluster.host_mem_gib)"
    )
    p.add_argument("--host-link-gbps", type=float, default=None, help="PCIe GB/s per GPU and direction")
    p.add_argument(
        "--headroom-gib",
        type=float,
        default=None,
        help="device memory a layout must leave free (default 7.5%%)",
    )
    p.add_argument(
        "--mlp-tiles", default="auto", help="parallel.mlp_tiles: an integer >= 1, or auto (tile when needed)"
    )
    p.add_argument(
        "--attn-head-chunks",
        default="auto",
        help="parallel.attn_head_chunks: an integer >= 1, or auto (chunk the ring's heads when needed)",
    )
    p.add_argument(
        "--states",
        default=None,
        choices=[*STATE_PLACEMENTS, "any"],
        help="where the sharded states live: device, or cpu_offload (optim.name=deepspeed_cpu_adam: states and "
        "step on the host), or any (default: device with --seq-len, any with --max-seq-len)",
    )
    p.add_argument(
        "--seq-multiple", type=int, default=SEQ_MULTIPLE, help="--max-seq-len answers multiples of this"
    )
    p.add_argument(
        "--lora-rank",
        type=int,
        default=0,
        help="model.lora.rank: cost LoRA adapters of this rank on a frozen base (default 0: full training)",
    )
    p.add_argument(
        "--lora-train-embeddings-and-norms",
        action="store_true",
        help="model.lora.train_embeddings_and_norms: the embeddings and norms train with the adapters",
    )
    p.add_argument(
        "--lora-target-modules",
        default=None,
        help="model.lora.target_modules, comma-separated (e.g. q_proj,v_proj; default every *proj* layer)",
    )
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


def paste_overrides(
    overrides: list[str],
    estimate: LayoutEstimate,
    *,
    model: ModelSpec,
    seq_len: int,
    nodes: int,
    gpus_per_node: int,
    gpu: str | None = None,
) -> list[str]:
    """The layout's overrides plus everything that makes them paste onto any recipe as they are: the length
    (with ``model.max_position_embeddings`` when it exceeds the model's own context), the batch settings
    (``trainer.micro_batch_size``, ``trainer.grad_accum_steps``: a recipe's own accumulation would otherwise
    multiply the step) and the cluster's size (``cluster.num_nodes``, ``cluster.gpus_per_node``: usp-launch
    sizes the job from them)."""
    out = list(overrides)
    if not any(o.startswith("trainer.seq_len=") for o in out):
        out.append(f"trainer.seq_len={seq_len}")
    if model.max_position_embeddings and seq_len > model.max_position_embeddings:
        out.append(f"model.max_position_embeddings={seq_len}")
    out += [
        "trainer.micro_batch_size=1",
        f"trainer.grad_accum_steps={estimate.grad_accum_steps}",
        f"cluster.num_nodes={nodes}",
        f"cluster.gpus_per_node={gpus_per_node}",
    ]
    if gpu in GPUS:
        out.append(f"cluster.gpu={gpu}")
    return out


def _params(model: ModelSpec) -> str:
    """``8.03B params``; a MoE's also its active parameters per token (with and without the embedding table:
    publishers count both ways), its experts, shared experts and MoE layers when not every layer is one."""
    out = f"{model.num_params / 1e9:.2f}B params"
    if model.moe is not None:
        m, active = model.moe, model.active_params / 1e9
        experts = f"{m.top_k} of {m.num_experts} experts"
        if m.shared_intermediate_size:
            experts += " + shared"
        if m.num_moe_layers < model.num_layers:
            experts += f" on {m.num_moe_layers} of {model.num_layers} layers"
        out += (
            f" ({active:.2f}B active per token, {active - model.embedding_params / 1e9:.2f}B without the "
            f"embedding: {experts})"
        )
    return out


def _lora_note(model: ModelSpec, lora: LoraPlan | None) -> str:
    """``; LoRA rank 16 + embeddings and norms: 1.07B of 70.6B parameters train`` (empty for full training)."""
    if lora is None:
        return ""
    trained, total = trainable_params(model, lora) / 1e9, total_params(model, lora) / 1e9
    return f"; {lora.describe()}: {trained:.3g}B of {total:.4g}B parameters train"


def _lora_plan(args: argparse.Namespace) -> LoraPlan | None:
    """The ``--lora-*`` flags as a :class:`LoraPlan` (``None`` for full training); ``ValueError`` for a LoRA flag
    without a rank."""
    targets = None
    if args.lora_target_modules is not None:
        targets = tuple(t for t in args.lora_target_modules.replace(" ", "").split(",") if t)
    if args.lora_rank < 0:
        raise ValueError(f"--lora-rank={args.lora_rank} must be >= 0 (0: full training).")
    if args.lora_rank == 0:
        if args.lora_train_embeddings_and_norms or targets is not None:
            raise ValueError(
                "--lora-train-embeddings-and-norms and --lora-target-modules need --lora-rank R > 0."
            )
        return None
    return LoraPlan(args.lora_rank, args.lora_train_embeddings_and_norms, targets)


def _batch_note(layouts: list[LayoutEstimate], global_batch: int | None) -> str:
    if global_batch is not None:
        return (
            f"global batch: {global_batch} sequences per optimizer step (--global-batch), trainer.grad_accum_steps "
            f"= {global_batch} / dp per row"
        )
    return (
        "global batch: one sequence per dp rank, so rows with different dp take steps of different sizes; compare "
        "tok/s/GPU, or fix the batch with --global-batch N (rows then differ in trainer.grad_accum_steps)"
    )


def format_table(
    model: ModelSpec,
    device: DeviceSpec,
    seq_len: int,
    world: int,
    layouts: list[LayoutEstimate],
    top: int,
    *,
    nodes: int | None = None,
    global_batch: int | None = None,
) -> str:
    nodes = nodes or 1
    head = (
        f"{model.name}: {_params(model)}{_lora_note(model, layouts[0].lora)}, seq_len={seq_len}, {world} x "
        f"{device.name} ({device.memory_gib:g} GiB, {device.peak_tflops:g} TFLOP/s peak); {len(layouts)} layouts fit"
    )
    cols = (
        f"{'#':>3} {'ulysses':>7} {'ring':>5} {'dp':>4} {'fsdp':<12} {'ckpt':<10} {'tiles':>5} {'heads':>5} {'states':<17} "
        f"{'batch':>7} {'mem GiB':>8} {'step s':>9} {'tok/s/GPU':>10} {'MFU':>6}"
    )
    rows = [head, _batch_note(layouts, global_batch), cols]
    for i, e in enumerate(layouts[:top], 1):
        ckpt = e.activation_checkpointing + (
            f"/{e.ac_every_k}" if e.activation_checkpointing == "every_k" else ""
        )
        batch = f"{e.global_batch}x{e.grad_accum_steps}" if e.grad_accum_steps > 1 else f"{e.global_batch}"
        rows.append(
            f"{i:>3} {e.ulysses_degree:>7} {e.ring_degree:>5} {e.dp_degree:>4} {e.fsdp_mode:<12} {ckpt:<10} "
            f"{e.mlp_tiles:>5} {e.attn_head_chunks:>5} {e.states:<17} {batch:>7} {e.mem_gib_per_gpu:>8.1f} "
            f"{e.step_time_s:>9.3g} {e.tokens_per_s_per_gpu:>10.4g} {e.mfu:>6.1%}"
        )
    rows.append(
        f"(ranked by tok/s/GPU; rows within {TIE_TOLERANCE:.0%} of each other count as a tie, and a tie goes to the "
        "layout with fewer memory-saving tricks (checkpoint offload, MLP tiles, states on the host, head chunks), "
        "then to the one with less memory; batch: sequences per optimizer step, x accumulation steps)"
    )
    best = layouts[0]
    rows.append("")
    rows.append(
        f"best layout, memory GiB/GPU (+ {best.headroom_gib:.1f} GiB headroom; host {best.host_mem_gib_per_node:.0f} "
        "GiB/node): " + ", ".join(f"{k} {v:.2f}" for k, v in best.memory_gib.items())
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
    rows.append("Hydra overrides for the best layout (they paste onto any recipe):")
    pasted = paste_overrides(
        best.overrides(),
        best,
        model=model,
        seq_len=seq_len,
        nodes=nodes,
        gpus_per_node=world // nodes,
        gpu=device.name,
    )
    rows.append("  " + " ".join(pasted))
    return "\n".join(rows)


def format_max_seq_len(
    model: ModelSpec,
    device: DeviceSpec,
    world: int,
    answers: list[MaxSeqLenEstimate],
    top: int,
    *,
    nodes: int | None = None,
) -> str:
    best = answers[0]
    head = (
        f"{model.name}: {_params(model)}{_lora_note(model, best.estimate.lora)} on {world} x {device.name} "
        f"({device.memory_gib:g} "
        f"GiB, host {device.host_mem_gib:g} GiB/node): longest sequence {best.max_seq_len} tokens "
        f"({best.max_seq_len / 2**20:.3g}M)"
    )
    cols = (
        f"{'#':>3} {'max seq':>10} {'ulysses':>7} {'ring':>5} {'dp':>4} {'fsdp':<12} {'ckpt':<8} {'tiles':>5} {'heads':>5} "
        f"{'states':<17} {'chunk':>5} {'mem GiB':>8} {'host GiB/node':>13} {'step s':>9} {'MFU':>6}"
    )
    rows = [head, cols]
    for i, a in enumerate(answers[:top], 1):
        e = a.estimate
        ckpt = e.activation_checkpointing + (
            f"/{e.ac_every_k}" if e.activation_checkpointing == "every_k" else ""
        )
        rows.append(
            f"{i:>3} {a.max_seq_len:>10} {e.ulysses_degree:>7} {e.ring_degree:>5} {e.dp_degree:>4} "
            f"{e.fsdp_mode:<12} {ckpt:<8} {e.mlp_tiles:>5} {e.attn_head_chunks:>5} {e.states:<17} {a.loss_chunk_size:>5} {e.mem_gib_per_gpu:>8.1f} "
            f"{e.host_mem_gib_per_node:>13.0f} {e.step_time_s:>9.4g} {e.mfu:>6.1%}"
        )
    e = best.estimate
    rows.append("")
    rows.append(
        f"longest layout, memory GiB/GPU (+ {e.headroom_gib:.1f} GiB headroom): "
        + ", ".join(f"{k} {v:.2f}" for k, v in e.memory_gib.items())
    )
    rows.append(
        "longest layout, seconds/step: "
        + ", ".join(f"{k.removesuffix('_s')} {v:.3g}" for k, v in e.time_s.items() if k.endswith("_s"))
    )
    rows.append("Overrides for the longest layout (they paste onto any recipe):")
    nodes = nodes or 1
    pasted = paste_overrides(
        best.overrides(),
        e,
        model=model,
        seq_len=best.max_seq_len,
        nodes=nodes,
        gpus_per_node=world // nodes,
        gpu=device.name,
    )
    rows.append("  " + " ".join(pasted))
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
    verbose = pop_verbose(argv)
    try:
        if argv and argv[0] == "calibrate":
            return _main_calibrate(argv[1:])
        args = build_plan_parser().parse_args(argv)
        if args.nodes < 1 or args.gpus_per_node < 1:
            raise ValueError(f"--nodes={args.nodes} and --gpus-per-node={args.gpus_per_node} must be >= 1.")
        model = load_model_spec(args.model)
        device = _device(args)
        world = args.nodes * args.gpus_per_node
        if args.seq_len is not None and args.max_seq_len:
            raise ValueError("give --seq-len N or --max-seq-len, not both.")
        if args.seq_len is None and (args.inference or not args.max_seq_len):
            raise ValueError(
                "give --seq-len N (rank the layouts at that length, e.g. --seq-len 128K; --inference needs it) or "
                "--max-seq-len (find the longest length that fits)."
            )
        if args.headroom_gib is not None and args.headroom_gib < 0:
            raise ValueError(
                f"--headroom-gib={args.headroom_gib} must be >= 0 (GiB of device memory left free)."
            )
        tiles = None if args.mlp_tiles == "auto" else int(args.mlp_tiles) if args.mlp_tiles.isdigit() else -1
        if tiles is not None and tiles < 1:
            raise ValueError(f"--mlp-tiles={args.mlp_tiles!r} is invalid: use an integer >= 1 or auto.")
        a = args.attn_head_chunks
        head_chunks = None if a == "auto" else int(a) if a.isdigit() else -1
        if head_chunks is not None and head_chunks < 1:
            raise ValueError(f"--attn-head-chunks={a!r} is invalid: use an integer >= 1 or auto.")
        lora = _lora_plan(args)
        if lora is not None and args.inference:
            raise ValueError(
                "--lora-rank costs training; --inference plans the model itself (adapters merged)."
            )
        default_states = "any" if args.max_seq_len else "device"
        states = STATE_PLACEMENTS if (args.states or default_states) == "any" else (args.states or "device",)
        dtype_bytes = compute_bytes(args.dtype)
        if args.max_seq_len:
            answers = max_seq_lens(
                model,
                device,
                world_size=world,
                node_size=args.gpus_per_node,
                ring_layout=args.ring_layout,
                ulysses_degree=args.ulysses_degree,
                ring_degree=args.ring_degree,
                states=states,
                mlp_tiles=tiles,
                loss_chunk_sizes=LOSS_CHUNK_CANDIDATES
                if args.loss_chunk_size is None
                else (args.loss_chunk_size,),
                overhead_frac=args.overhead_frac,
                compute_bytes=dtype_bytes,
                headroom_gib=args.headroom_gib,
                seq_multiple=args.seq_multiple,
                attn_head_chunks=head_chunks,
                lora=lora,
            )
            print(
                json.dumps([a.to_dict() for a in answers[: args.top]], indent=2)
                if args.json
                else format_max_seq_len(model, device, world, answers, args.top, nodes=args.nodes)
            )
            return 0
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
        documents = (
            None if args.doc_lengths is None else DocumentWork.from_spec(args.doc_lengths, args.seq_len)
        )
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
            loss_chunk_size=args.loss_chunk_size or PlanRequest.loss_chunk_size,  # the trainer's default
            overhead_frac=args.overhead_frac,
            compute_bytes=dtype_bytes,
            mlp_tiles=tiles,
            states=states,
            headroom_gib=args.headroom_gib,
            attn_head_chunks=head_chunks,
            lora=lora,
        )
        if args.json:
            print(json.dumps([e.to_dict() for e in layouts], indent=2))
        else:
            print(
                format_table(
                    model,
                    device,
                    args.seq_len,
                    world,
                    layouts,
                    args.top,
                    nodes=args.nodes,
                    global_batch=args.global_batch,
                )
            )
            if documents is not None:
                print(format_documents(documents, layouts[0], args.ring_layout))
        return 0
    except BrokenPipeError:  # `usp-plan ... | head`: the reader left; not an error
        sys.stdout = open(os.devnull, "w")  # keeps the interpreter's final flush quiet
        return 0
    except (Exception, KeyboardInterrupt) as e:  # noqa: BLE001 - the one report of a failure (usp.errors)
        return report("usp-plan", e, verbose=verbose)


if __name__ == "__main__":
    sys.exit(main())
