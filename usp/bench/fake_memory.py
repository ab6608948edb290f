"""One optimizer step of the real training code on a fake CUDA device, its memory tracked by torch's own tracker.

``python -m usp.bench.fake_memory --model llama-3.1-8b --gpu h100-80g --nodes N --gpus-per-node G
--seq-len S [parallel.* / optim.* / trainer.* overrides]`` runs, as rank ``--rank`` (default 0) of the full
world of ``N x G`` ranks, what ``usp-train`` runs for one step: the Hugging Face Llama built from the preset's
config (``--layers`` cuts it), :func:`usp.train.parallelize.parallelize` (USP attention, tiles, activation
checkpointing and checkpoint offload, the chunked loss, FSDP2 with CPU offload where the optimizer asks for it),
the optimizer, a forward, a backward and the optimizer step; all on ``FakeTensorMode`` CUDA tensors
(:mod:`usp.bench.fake_cuda`, no memory is touched) with torch's fake process group
(``torch.testing._internal.distributed.fake_pg``, ``torch.distributed._tools.fake_collectives``). The attention
kernels allocate what the CUDA kernels allocate (:mod:`usp.bench.fake_kernels`). The optimizer states exist
before the measured step (as in every step after the first). The peak is
``torch.distributed._tools.fsdp2_mem_tracker.FSDPMemTracker``'s, by category and by module (torch's plain
``MemTracker`` where the trainer skips FSDP2, :func:`usp.train.parallelize.needs_fsdp`: a world of one in the
weights' own dtype; its parameters, gradients and optimizer states reported as the sharded ones).

It prints the measured peak per category next to the planner's terms (:func:`usp.plan.memory.peak_memory` for
the same settings); ``--json`` prints one object with the stable fields ``peak_gib`` (the fake-CUDA peak of the
step, tensors only), ``planner_gib`` (the planner's figure, everything it counts: tensors plus the CUDA context,
NCCL, workspaces and the fragmentation allowance no tracker sees), ``planner_tensor_gib`` (the planner's tensor
terms alone, what ``peak_gib`` is compared with), ``categories`` (``measured``: GiB per tracker category at the
peak; ``planned``: GiB per planner term) and ``host_gib`` (host bytes of the rank: pinned checkpoints and
offloaded states). Not emulated: document masking (``data.document_masking=false`` is what is measured) and
DeepSpeed's CPU Adam (its host states are torch AdamW's: the same ``m, v``).

The first run compiles a small C++ library (``g++``, a few seconds, cached). Each run needs a fresh process
(:func:`usp.bench.fake_cuda.preload`); :func:`run_in_subprocess` starts one.

    python -m usp.bench.fake_memory --model llama-3.1-8b --gpu h100-80g --nodes 1 --gpus-per-node 1 \
        --seq-len 512K parallel.activation_checkpointing=offload parallel.mlp_tiles=auto --json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any, TextIO

from usp.units import GIB

MIN_PROBE_DEPTH = 3
"""The shallowest default probe of ``--depth-method extrapolate``. A step's peak sits in some decoder layer's
backward, and what is alive there depends on the layer's neighbours: the reduce-scatter input of the layer
above (FSDP2 keeps one until the next layer's post-backward), the prefetched gather of the layer below. Only a
layer with both is like the layers of a deep model; a 2-layer step has none (its top layer has no layer above,
its bottom none below), so extending 2 and 3 layers counted one fp32 layer gradient per layer
(docs/memory.md, "Longest trainable context"). From 3 layers on, the
peak is in such an interior layer at every probe."""
PLAN_TERMS = ("sharded_states", "gathered_params", "activations", "attention_workspace", "loss_buffer")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m usp.bench.fake_memory", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama-3.1-8b", help="a preset of usp.plan.models.PRESETS")
    p.add_argument("--gpu", default="h100-80g", help="the planner's device (usp.plan.hardware.GPUS)")
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--seq-len", default=None, help="tokens per sequence (512K, 4M, 65536); or --from-plan")
    p.add_argument(
        "--from-plan",
        action="store_true",
        help="run the planner's longest trainable length for this model and cluster, with its layout and "
        "overrides (what `usp-plan --max-seq-len` prints first); overrides given here come after them",
    )
    p.add_argument("--rank", type=int, default=0, help="the rank of the world this process plays")
    p.add_argument("--layers", type=int, default=None, help="cut the model to this many decoder layers")
    p.add_argument(
        "--depth-method",
        choices=("auto", "direct", "extrapolate"),
        default="auto",
        help="direct: trace every layer; extrapolate: trace --probe-depths layers and extend each category "
        "affinely to the full depth (every decoder layer is the same); auto (default): extrapolate when the "
        "depth is above the deeper probe",
    )
    p.add_argument(
        "--probe-depths",
        default=None,
        help="the two depths traced by --depth-method extrapolate (default 3,4: each has a layer with layers "
        "above and below it, as every deep model does; under every_k two depths ac_every_k apart with the "
        "full depth's residue)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument(
        "--cases",
        default=None,
        help="a JSON file: a list of argument lists, each run in this process "
        "(one JSON line each); the other arguments are then ignored",
    )
    p.add_argument("overrides", nargs="*", help="parallel.* / optim.* / trainer.* overrides (key=value)")
    return p


def build_config(
    *, model: str, seq_len: str | int, gpu: str, nodes: int, gpus_per_node: int, overrides: Sequence[str] = ()
) -> Any:
    """The run's :class:`usp.config.TrainConfig` from the overrides (``key=value``); degrees default to Ulysses
    over the node and the ring across nodes. ``seq_len``: tokens, or a length such as ``512K``."""
    from omegaconf import OmegaConf

    from usp.config import TrainConfig
    from usp.units import parse_seq_len

    bad = [
        o
        for o in overrides
        if "=" not in o or o.split(".")[0] not in ("parallel", "optim", "trainer", "model", "data")
    ]
    if bad:
        raise ValueError(f"overrides {bad} are not parallel.*, optim.*, trainer.* or model.* key=value pairs")
    base = OmegaConf.structured(TrainConfig)
    world = nodes * gpus_per_node
    keys = {o.split("=", 1)[0] for o in overrides}
    defaults = [
        f"model.path={model}",
        f"trainer.seq_len={parse_seq_len(seq_len)}",
        "data.document_masking=false",
        f"cluster.gpu={gpu}",
        f"cluster.gpus_per_node={gpus_per_node}",
        f"cluster.num_nodes={nodes}",
    ]
    if "parallel.ulysses_degree" not in keys:
        defaults.append(f"parallel.ulysses_degree={min(gpus_per_node, world)}")
    if "parallel.ring_degree" not in keys:
        defaults.append(f"parallel.ring_degree={max(1, world // gpus_per_node)}")
    merged = OmegaConf.merge(base, OmegaConf.from_dotlist(defaults + list(overrides)))
    return OmegaConf.to_object(merged)


def _hf_config(model: str, layers: int | None, seq_len: int) -> Any:
    from transformers import LlamaConfig

    from usp.plan.models import PRESETS

    if model not in PRESETS:
        raise ValueError(f"--model={model!r} is not a preset; choose one of {sorted(PRESETS)}")
    cfg = dict(PRESETS[model])
    if layers is not None:
        cfg["num_hidden_layers"] = layers
    cfg["max_position_embeddings"] = seq_len  # (the presets carry the checkpoint's own)
    return LlamaConfig(**cfg, rope_theta=500000.0, attn_implementation="sdpa")


def _fake_model(config: Any, *, param_device: str) -> Any:
    """The HF model from its config with fp32 parameters on fake ``param_device`` (built on meta, then every
    parameter and buffer replaced by an empty fake tensor: no initialisation runs)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    made: dict[int, torch.nn.Parameter] = {}
    for m in model.modules():
        for name, p in list(m._parameters.items()):
            if p is not None:
                if id(p) not in made:
                    t = torch.empty(p.shape, dtype=p.dtype, device=param_device)
                    made[id(p)] = torch.nn.Parameter(t, requires_grad=p.requires_grad)
                m._parameters[name] = made[id(p)]
        for name, b in list(m._buffers.items()):
            if b is not None:
                m._buffers[name] = torch.empty(b.shape, dtype=b.dtype, device="cuda")
    return model


def _local(t: Any) -> Any:
    return getattr(t, "_local_tensor", t)


PLAIN_CATEGORIES = {"Parameter": "Sharded Param", "Gradient": "Sharded Grad", "Optstate": "OptState"}
"""A plain module's categories (torch's ``MemTracker``, where FSDP2 is skipped) under ``FSDPMemTracker``'s
names: one rank's whole parameters and gradients are its shards."""


def _category(key: Any) -> str:
    name = getattr(key, "value", str(key))
    return PLAIN_CATEGORIES.get(name, name)


def planned(cfg: Any, world: int, node_size: int, layers: int | None) -> Any:
    """The planner's :class:`usp.plan.memory.MemoryBreakdown` for this run."""
    from dataclasses import replace

    from usp.config import states_on_host
    from usp.plan.hardware import get_device
    from usp.plan.memory import training_memory
    from usp.plan.models import load_model_spec

    spec = load_model_spec(cfg.model.path)
    if layers is not None:
        spec = replace(spec, num_layers=layers)
    p = cfg.parallel
    tiles = p.mlp_tiles
    if tiles == "auto":
        from usp.mlp_tiles import resolve_mlp_tiles

        tiles = resolve_mlp_tiles(
            "auto",
            local_tokens=cfg.trainer.seq_len // (p.ulysses_degree * p.ring_degree),
            hidden_size=spec.hidden_size,
        )
    return training_memory(
        spec,
        get_device(cfg.cluster.gpu),
        seq_len=cfg.trainer.seq_len,
        ulysses_degree=p.ulysses_degree,
        ring_degree=p.ring_degree,
        world_size=world,
        node_size=node_size,
        fsdp_mode=p.fsdp_mode,
        activation_checkpointing=p.activation_checkpointing,
        ac_every_k=p.ac_every_k,
        micro_batch_size=cfg.trainer.micro_batch_size,
        loss_chunk_size=cfg.trainer.loss_chunk_size,
        states_on_host=states_on_host(cfg.optim.name, p.cpu_offload),
        mlp_tiles=int(tiles),
        attn_head_chunks=p.attn_head_chunks,
        attention_backend=cfg.model.attention_backend,
    )


def fake_step(
    cfg: Any, *, world: int, node_size: int, rank: int = 0, layers: int | None = None
) -> dict[str, Any]:
    """Run one step of ``cfg`` as ``rank`` of ``world`` on fake CUDA (module docstring); returns the record
    :func:`main` prints. Needs :func:`usp.bench.fake_cuda.preload` to have run in this process."""
    import torch
    import torch.distributed as dist
    import torch.distributed._tools.fake_collectives  # noqa: F401  (fake collectives under FakeTensorMode)
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker, _FSDPRefType
    from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType
    from torch.distributed.fsdp import FSDPModule
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from usp.bench.fake_cuda import fake_cuda_runtime, unsupported_reason
    from usp.bench.fake_kernels import fake_attention_kernels
    from usp.config import states_on_host
    from usp.mlp_tiles import resolve_mlp_tiles
    from usp.model import parse_dtype
    from usp.parallel import init_sp_mesh
    from usp.train.optim import build_optimizer
    from usp.train.parallelize import parallelize

    why = unsupported_reason()
    if why:
        raise RuntimeError(why)
    p, t = cfg.parallel, cfg.trainer
    U, R = int(p.ulysses_degree), int(p.ring_degree)
    seq = t.seq_len
    local = seq // (U * R)
    hf = _hf_config(cfg.model.path, layers, seq)
    tiles = resolve_mlp_tiles(p.mlp_tiles, local_tokens=local, hidden_size=hf.hidden_size)
    on_host = states_on_host(cfg.optim.name, p.cpu_offload)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        mesh = init_sp_mesh(U, R, node_size=node_size, ring_layout=p.ring_layout, device_type="cuda")
        with FakeTensorMode(allow_non_fake_inputs=True), fake_cuda_runtime(), fake_attention_kernels():
            model = _fake_model(hf, param_device="cuda")
            loss_model = parallelize(
                model,
                mesh,
                attention_backend=cfg.model.attention_backend,
                fsdp_mode=p.fsdp_mode,
                node_size=node_size,
                activation_checkpointing=p.activation_checkpointing,
                ac_every_k=p.ac_every_k,
                param_dtype=parse_dtype(cfg.model.dtype),
                reduce_dtype=parse_dtype(p.reduce_dtype, "parallel.reduce_dtype"),
                loss_chunk_size=t.loss_chunk_size,
                cpu_offload=on_host,
                mlp_tiles=tiles,
                attn_head_chunks=p.attn_head_chunks,
            )
            optim_cfg = cfg.optim
            if optim_cfg.name == "deepspeed_cpu_adam":  # its host m, v are torch AdamW's bytes (docstring)
                from dataclasses import replace

                optim_cfg = replace(optim_cfg, name="adamw_cpu_offload")
            optimizer, _ = build_optimizer(loss_model, optim_cfg, max_steps=t.max_steps)
            for q in loss_model.parameters():  # states as after the first step
                q.grad = torch.zeros_like(q)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            B = t.micro_batch_size
            ids = torch.zeros(B, local, dtype=torch.long, device="cuda")
            pos = torch.arange(local, device="cuda").expand(B, local)
            if isinstance(loss_model, FSDPModule):
                tracker, opt_ref = FSDPMemTracker(loss_model), _FSDPRefType.OPT
                tracker.track_inputs((ids, pos))
            else:  # no FSDP2 (usp.train.parallelize.needs_fsdp: a world of one in the weights' dtype)
                tracker, opt_ref = MemTracker(), _MemRefType.OPT
                tracker.track_external(loss_model)
            with tracker:
                for st in optimizer.state.values():
                    for v in st.values():
                        if isinstance(v, torch.Tensor) and _local(v).numel() > 1:
                            tracker._update_and_maybe_create_winfos(_local(v), opt_ref)
                loss = loss_model(ids, ids, position_ids=pos, num_targets=B * seq)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            peak = tracker.get_tracker_snapshot("peak")
            host = _host_bytes(loss_model, optimizer)
        cuda = next((v for d, v in peak.items() if d.type == "cuda"), {})
        modules = _module_peaks(tracker)
    finally:
        dist.destroy_process_group()
    measured = {_category(k): v / GIB for k, v in cuda.items() if k != "Total"}
    return {
        "seq_len": seq,
        "world_size": world,
        "rank": rank,
        "ulysses_degree": U,
        "ring_degree": R,
        "activation_checkpointing": p.activation_checkpointing,
        "mlp_tiles": tiles,
        "attn_head_chunks": p.attn_head_chunks,
        "states_on_host": on_host,
        "layers": hf.num_hidden_layers,
        "attention_backend": cfg.model.attention_backend,
        "peak_gib": cuda.get("Total", 0) / GIB,
        "measured": measured,
        "host_gib": host / GIB,
        "modules": modules,
    }


def planned_longest(model: str, gpu: str, nodes: int, gpus_per_node: int) -> list[str]:
    """The overrides of the planner's first answer to ``usp-plan --model M --gpu D --nodes N --gpus-per-node G
    --max-seq-len`` (its defaults: any state placement, the loss chunks it tries), ``trainer.seq_len`` included."""
    from usp.plan.hardware import get_device
    from usp.plan.layout import STATE_PLACEMENTS
    from usp.plan.maxlen import LOSS_CHUNK_CANDIDATES, max_seq_lens
    from usp.plan.models import load_model_spec

    best = max_seq_lens(
        load_model_spec(model),
        get_device(gpu),
        world_size=nodes * gpus_per_node,
        node_size=gpus_per_node,
        states=STATE_PLACEMENTS,
        loss_chunk_sizes=LOSS_CHUNK_CANDIDATES,
    )[0]
    return [o for o in best.overrides() if o.split(".")[0] in ("parallel", "optim", "trainer")]


def _probe_depths(text: str) -> tuple[int, int]:
    try:
        a, b = (int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"--probe-depths={text!r}: give two depths, e.g. 3,4") from None
    if not 1 <= a < b:
        raise ValueError(f"--probe-depths={text!r}: two increasing depths of at least 1, e.g. 3,4")
    return a, b


def _model_depth(model: str) -> int:
    from usp.plan.models import PRESETS

    if model not in PRESETS:
        raise ValueError(f"--model={model!r} is not a preset; choose one of {sorted(PRESETS)}")
    return int(PRESETS[model]["num_hidden_layers"])


def extrapolate_depth(probes: Sequence[dict[str, Any]], depth: int) -> dict[str, Any]:
    """The record of a ``depth``-layer step from two :func:`fake_step` records at smaller depths: every decoder
    layer is the same module with the same inputs, so each tracked category at the peak (and the peak, and the
    host bytes) is affine in the depth; extend the line through the two probes. ``tests/test_fake_memory.py``
    checks that affinity against traced steps (depths 3, 4 extended to 5)."""
    lo, hi = probes
    d0, d1 = lo["layers"], hi["layers"]
    assert d0 < d1 and {k: v for k, v in lo.items() if k not in _DEPTH_KEYS} == {
        k: v for k, v in hi.items() if k not in _DEPTH_KEYS
    }, "the probes differ in more than their depth"

    def line(a: float, b: float) -> float:
        return a + (b - a) * (depth - d0) / (d1 - d0)

    cats = set(lo["measured"]) | set(hi["measured"])
    return lo | {
        "layers": depth,
        "peak_gib": line(lo["peak_gib"], hi["peak_gib"]),
        "measured": {c: line(lo["measured"].get(c, 0.0), hi["measured"].get(c, 0.0)) for c in sorted(cats)},
        "host_gib": line(lo["host_gib"], hi["host_gib"]),
        "modules": hi["modules"],
        "depth_method": "extrapolate",
        "probe_depths": [d0, d1],
        "probe_peak_gib": [lo["peak_gib"], hi["peak_gib"]],
    }


_DEPTH_KEYS = ("layers", "peak_gib", "measured", "host_gib", "modules")


def _host_bytes(loss_model: Any, optimizer: Any) -> int:
    """Host bytes this rank holds: offload slots, and with states on the host the fp32 shards and Adam
    moments (FSDP2's pinned parameter shards, their gradients' host copies)."""
    store = getattr(loss_model, "offload_store", None)
    n = 0 if store is None else store.host_bytes
    for q in loss_model.parameters():
        loc = _local(q)
        if loc.device.type == "cpu":
            n += 2 * loc.numel() * loc.element_size()  # the shard and its gradient's host copy
    for st in optimizer.state.values():
        for v in st.values():
            loc = _local(v)
            if hasattr(loc, "device") and loc.device.type == "cpu" and loc.numel() > 1:
                n += loc.numel() * loc.element_size()
    return n


def _module_peaks(tracker: Any, depth: int = 4) -> dict[str, float]:
    """GiB at each tracked module's forward and backward peaks (modules up to ``depth`` dots deep)."""
    out: dict[str, float] = {}
    for stats in tracker.memory_tracking.values():
        fqn = stats.mod_fqn
        if fqn.count(".") > depth:
            continue
        best = 0
        for snaps in stats.snapshots.values():
            for snap in snaps:
                for dev, per in snap.items():
                    if dev.type == "cuda":
                        best = max(best, per.get("Total", 0))
        out[fqn] = round(best / GIB, 3)
    return out


def compare(record: dict[str, Any], plan: Any) -> dict[str, Any]:
    """Add the planner's figures to a :func:`fake_step` record (the stable ``--json`` fields)."""
    terms = plan.as_gib()
    tensor = sum(terms[k] for k in PLAN_TERMS)
    return record | {
        "planner_gib": terms["total"],
        "planner_tensor_gib": tensor,
        "categories": {
            "measured": record["measured"],
            "planned": {k: v for k, v in terms.items() if k != "total"},
        },
    }


def main(
    argv: Sequence[str] | None = None, out: TextIO | None = None
) -> dict[str, Any] | list[dict[str, Any]]:
    """Run one case (or ``--cases``) and print its record to ``out`` (default ``sys.stdout``)."""
    out = out or sys.stdout
    args = build_parser().parse_args(argv)
    if args.cases:
        with open(args.cases) as f:
            return [main([*case, "--json"], out) for case in json.load(f)]
    seq_len, overrides = args.seq_len, list(args.overrides)
    if args.from_plan:
        if seq_len is not None:
            raise ValueError("give --seq-len N or --from-plan, not both")
        plan_overrides = planned_longest(args.model, args.gpu, args.nodes, args.gpus_per_node)
        seq_len = next(o.split("=")[1] for o in plan_overrides if o.startswith("trainer.seq_len="))
        overrides = [o for o in plan_overrides if not o.startswith("trainer.seq_len=")] + overrides
    elif seq_len is None:
        raise ValueError("give --seq-len N (e.g. --seq-len 512K) or --from-plan")
    cfg = build_config(
        model=args.model,
        seq_len=seq_len,
        gpu=args.gpu,
        nodes=args.nodes,
        gpus_per_node=args.gpus_per_node,
        overrides=overrides,
    )
    rec = measure_case(
        cfg,
        world=args.nodes * args.gpus_per_node,
        node_size=args.gpus_per_node,
        rank=args.rank,
        layers=args.layers,
        depth_method=args.depth_method,
        probe_depths=args.probe_depths,
    )
    if args.json:
        print(json.dumps(rec), file=out, flush=True)
    else:
        print(format_report(rec), file=out, flush=True)
    return rec


def measure_case(
    cfg: Any,
    *,
    world: int,
    node_size: int,
    rank: int = 0,
    layers: int | None = None,
    depth_method: str = "auto",
    probe_depths: str | None = None,
) -> dict[str, Any]:
    """The record of one case (what ``--json`` prints): :func:`fake_step` of ``cfg`` as ``rank`` of ``world``
    at ``layers`` decoder layers (default: the model's), traced at every layer or extrapolated from two probe
    depths (``depth_method``, ``probe_depths`` as ``"3,4"``: the ``--depth-method`` / ``--probe-depths``
    flags), with the planner's figures (:func:`compare`). Runs :func:`usp.bench.fake_cuda.preload`."""
    if not 0 <= rank < world:
        raise ValueError(f"--rank={rank} is outside the world of {world} ranks")
    probes = _probe_depths(probe_depths or f"{MIN_PROBE_DEPTH},{MIN_PROBE_DEPTH + 1}")
    depth = layers if layers is not None else _model_depth(cfg.model.path)
    p = cfg.parallel
    period = (
        p.ac_every_k if p.activation_checkpointing == "every_k" else 1
    )  # layers 0, k, 2k, ... checkpointed
    if period > 1 and probe_depths is None:  # the default: two probes a period apart, on depth's residue
        lo = MIN_PROBE_DEPTH + (depth - MIN_PROBE_DEPTH) % period
        probes = (lo, lo + period)
    method = depth_method
    if method == "auto":
        method = "extrapolate" if depth > probes[1] else "direct"
    if method == "extrapolate":
        if depth < probes[0]:
            raise ValueError(
                f"--depth-method extrapolate: the depth {depth} is below --probe-depths {probes}"
            )
        if (probes[1] - probes[0]) % period or (depth - probes[0]) % period:
            raise ValueError(
                f"--probe-depths {probes}: with parallel.ac_every_k={period} the probes and the depth {depth} "
                f"must differ by multiples of {period} (the checkpointed layers repeat every {period})"
            )
    from usp.bench.fake_cuda import preload

    preload()
    t0, c0 = time.perf_counter(), time.process_time()
    step = dict(world=world, node_size=node_size, rank=rank)
    if method == "direct":
        rec = fake_step(cfg, layers=depth, **step) | {"depth_method": "direct"}
    else:
        rec = extrapolate_depth([fake_step(cfg, layers=d, **step) for d in probes], depth)
    rec["wall_s"] = round(time.perf_counter() - t0, 1)
    rec["cpu_s"] = round(time.process_time() - c0, 1)
    rec = compare(rec, planned(cfg, world, node_size, depth))
    rec.pop("measured")
    return rec


def format_report(rec: dict[str, Any]) -> str:
    lines = [
        f"fake-CUDA step: seq_len={rec['seq_len']} rank {rec['rank']} of {rec['world_size']} "
        f"(ulysses {rec['ulysses_degree']}, ring {rec['ring_degree']}), {rec['layers']} layers, "
        f"checkpointing={rec['activation_checkpointing']}, mlp_tiles={rec['mlp_tiles']}",
        "  depth: "
        + (
            f"every layer traced ({rec['wall_s']} s)"
            if rec["depth_method"] == "direct"
            else f"traced at {rec['probe_depths'][0]} and {rec['probe_depths'][1]} layers "
            f"(peaks {rec['probe_peak_gib'][0]:.2f}, {rec['probe_peak_gib'][1]:.2f} GiB), each category "
            f"extended affinely to {rec['layers']} ({rec['wall_s']} s)"
        ),
        "  measured at the peak (GiB)            planner (GiB)",
    ]
    meas = sorted(rec["categories"]["measured"].items(), key=lambda kv: -kv[1])
    plan = list(rec["categories"]["planned"].items())
    for i in range(max(len(meas), len(plan))):
        left = f"{meas[i][0]:<22} {meas[i][1]:8.2f}" if i < len(meas) else " " * 31
        right = f"{plan[i][0]:<22} {plan[i][1]:8.2f}" if i < len(plan) else ""
        lines.append(f"  {left}        {right}")
    lines.append(
        f"  {'peak (tensors)':<22} {rec['peak_gib']:8.2f}        {'tensor terms':<22} "
        f"{rec['planner_tensor_gib']:8.2f}"
    )
    lines.append(
        f"  {'host':<22} {rec['host_gib']:8.2f}        {'planner total':<22} {rec['planner_gib']:8.2f}"
    )
    return "\n".join(lines)


def run_in_subprocess(cases: Sequence[Sequence[str]], timeout: float = 1800) -> list[dict[str, Any]]:
    """Each argument list of ``cases`` as :func:`main` with ``--json``, all in one fresh Python (the fake device
    must load before torch); their records, in order."""
    import tempfile

    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        json.dump([list(c) for c in cases], f)
        f.flush()
        cmd = [sys.executable, "-m", "usp.bench.fake_memory", "--cases", f.name]
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    lines = [line for line in out.stdout.splitlines() if line.strip()]
    records = [json.loads(line) for line in lines if line.startswith("{")]
    if out.returncode:
        raise RuntimeError(
            f"{' '.join(cmd)} failed ({out.returncode}) after {len(records)} of {len(cases)} records:\n"
            f"{out.stderr[-4000:]}"
        )
    stray = [line for line in lines if not line.startswith("{")]
    if stray:  # stdout carries the records alone (library banners go to stderr)
        raise RuntimeError(f"{' '.join(cmd)} printed lines that are not records on stdout: {stray[:5]}")
    return records


if __name__ == "__main__":
    from usp.bench.fake_cuda import preload as _preload

    _preload()  # before torch is imported (usp.bench.fake_cuda imports only the standard library)
    # stdout carries the report or the JSON records alone, so that `--json | jq` works: what libraries print
    # there while they load (DeepSpeed's accelerator banner) goes to stderr.
    _records = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    main(out=_records)
    _records.flush()
    # Every record is printed and flushed: leave without the interpreter's teardown. With the fake CUDA device
    # registered, the autograd engine holds a worker thread for it, and tearing the process down under that
    # thread sometimes aborts ("terminate called without an active exception", exit -6) after the work is done.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
