"""The pictures in ``docs/figures/``, drawn from the code they describe so they stay true.

    python -m usp.bench.figures --out docs/figures [--metrics outputs/demo/metrics.jsonl]

- ``rank_grid.png``: which global rank sits where on the dp x ring x ulysses mesh of 2 nodes x 8 GPUs
  (``usp.parallel.ParallelLayout``): Ulysses groups on adjacent ranks inside a node, rings strided across nodes.
- ``memory_breakdown.png``: the planner's memory terms per GPU as stacked bars, one bar per layout and
  activation-checkpointing choice, for the planner's 10 fastest layouts (``usp.plan.plan_layouts``), for Llama-3.1-8B at 128K on 2 x 8 H100.
- ``demo_loss.png``: the loss curve of a run's ``metrics.jsonl`` (the README's ``make demo``), if given.

matplotlib draws off-screen (Agg). Each figure is a function returning the saved path, so a test can draw
them into a temporary directory.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

from usp.parallel.layout import ParallelLayout


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def rank_grid_figure(
    out: Path, *, nodes: int = 2, gpus_per_node: int = 8, ulysses: int = 4, ring: int = 4
) -> Path:
    """Each GPU as a cell (a row per node), labelled with its rank and (dp, ring, ulysses) coordinates and
    coloured by its ring group; Ulysses groups are outlined."""
    from matplotlib.patches import Rectangle

    plt = _pyplot()
    world = nodes * gpus_per_node
    dims = ParallelLayout(world_size=world, ulysses_degree=ulysses, ring_degree=ring, node_size=gpus_per_node)
    cmap = plt.get_cmap("tab20")
    ring_of = {rank: i for i, group in enumerate(dims.groups("ring")) for rank in group}
    fig, ax = plt.subplots(figsize=(1.3 * gpus_per_node + 1.5, 1.4 * nodes + 1.2))
    for rank in range(world):
        node, gpu = divmod(rank, gpus_per_node)
        c = dims.coordinates(rank)
        ax.add_patch(Rectangle((gpu, -node), 0.94, 0.9, color=cmap(ring_of[rank] % 20), alpha=0.85))
        ax.text(gpu + 0.47, -node + 0.58, f"rank {rank}", ha="center", va="center", fontsize=9, weight="bold")
        ax.text(
            gpu + 0.47, -node + 0.25, f"dp{c['dp']} r{c['ring']} u{c['ulysses']}", ha="center", fontsize=8
        )
    for group in dims.groups("ulysses"):
        node, gpu = divmod(group[0], gpus_per_node)
        ax.add_patch(Rectangle((gpu - 0.03, -node - 0.04), len(group), 0.98, fill=False, lw=2.2, ec="black"))
    for node in range(nodes):
        ax.text(-0.15, -node + 0.45, f"node {node}", ha="right", va="center", fontsize=10)
    ax.set_xlim(-1.3, gpus_per_node + 0.1)
    ax.set_ylim(-nodes + 0.8, 1.05)
    ax.axis("off")
    ax.set_title(
        f"{nodes} nodes x {gpus_per_node} GPUs: ulysses {ulysses} (black boxes, inside a node) x ring {ring} "
        f"(same colour, across nodes) x dp {dims.dp_degree}",
        fontsize=10,
    )
    path = out / "rank_grid.png"
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def memory_rows(
    model: str, *, seq_len: int, nodes: int, gpus_per_node: int, gpu: str, top: int = 10
) -> tuple[list[tuple[str, dict[str, float]]], float]:
    """``([(layout label, {memory term: GiB})], device GiB)`` for the planner's ``top`` fastest feasible layouts."""
    from usp.plan.hardware import get_device
    from usp.plan.models import load_model_spec
    from usp.plan.search import plan_layouts

    device = get_device(gpu)
    estimates = plan_layouts(
        load_model_spec(model),
        device,
        seq_len=seq_len,
        world_size=nodes * gpus_per_node,
        node_size=gpus_per_node,
    )
    rows = []
    for e in estimates[:top]:
        ac = e.activation_checkpointing + (
            f"/{e.ac_every_k}" if e.activation_checkpointing == "every_k" else ""
        )
        label = f"u{e.ulysses_degree} r{e.ring_degree} dp{e.dp_degree} {e.fsdp_mode.split('_')[0]} {ac}"
        label += (f" t{e.mlp_tiles}" if e.mlp_tiles > 1 else "") + (" host" if e.states != "device" else "")
        rows.append((label, {k: v for k, v in e.memory_gib.items() if k != "total" and v > 0}))
    return rows, device.memory_gib


def memory_breakdown_figure(
    out: Path,
    *,
    model: str = "llama-3.1-8b",
    seq_len: int = 131072,
    nodes: int = 2,
    gpus_per_node: int = 8,
    gpu: str = "h100-80g",
) -> Path:
    """Stacked bars of the planner's memory terms per GPU for its fastest feasible layouts (fastest left)."""
    plt = _pyplot()
    rows, limit_gib = memory_rows(model, seq_len=seq_len, nodes=nodes, gpus_per_node=gpus_per_node, gpu=gpu)
    terms = sorted({t for _, parts in rows for t in parts}, key=lambda t: -max(p.get(t, 0) for _, p in rows))
    fig, ax = plt.subplots(figsize=(max(6.0, 0.55 * len(rows) + 3), 4.8))
    bottoms = [0.0] * len(rows)
    cmap = plt.get_cmap("tab10")
    for i, term in enumerate(terms):
        values = [parts.get(term, 0.0) for _, parts in rows]
        ax.bar(range(len(rows)), values, bottom=bottoms, label=term, color=cmap(i % 10))
        bottoms = [b + v for b, v in zip(bottoms, values)]
    ax.axhline(limit_gib, color="red", ls="--", lw=1)
    ax.text(len(rows) - 0.5, limit_gib, f" {gpu}: {limit_gib:.0f} GiB", color="red", va="bottom", ha="right")
    ax.set_xticks(range(len(rows)), [label for label, _ in rows], rotation=60, ha="right", fontsize=8)
    ax.set_ylabel("GiB per GPU")
    ax.set_title(
        f"{model} at {seq_len // 1024}K tokens on {nodes} x {gpus_per_node} {gpu}: planner memory terms, fastest left"
    )
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    path = out / "memory_breakdown.png"
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def loss_curve_figure(out: Path, metrics: Path) -> Path:
    """Training loss (and validation loss where logged) per step from a run's ``metrics.jsonl``."""
    plt = _pyplot()
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    steps = [r["step"] for r in records if r.get("loss") is not None]
    losses = [r["loss"] for r in records if r.get("loss") is not None]
    if not steps:
        raise ValueError(f"--metrics {metrics}: no record with a loss; point it at a run's metrics.jsonl.")
    fig, ax = plt.subplots(figsize=(6.0, 3.6))
    ax.plot(steps, losses, marker="o", ms=3, label="train loss")
    val = [(r["step"], r["val_loss"]) for r in records if r.get("val_loss") is not None]
    if val:
        ax.plot(*zip(*val), marker="s", ms=4, label="validation loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(f"{metrics.parent.name}: loss per step")
    ax.grid(alpha=0.3)
    ax.legend()
    path = out / "demo_loss.png"
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m usp.bench.figures", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="docs/figures", help="directory for the PNG files (default docs/figures)")
    p.add_argument(
        "--metrics", help="a run's metrics.jsonl for the loss curve (e.g. outputs/demo/metrics.jsonl)"
    )
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    paths = [rank_grid_figure(out), memory_breakdown_figure(out)]
    if args.metrics:
        paths.append(loss_curve_figure(out, Path(args.metrics)))
    for path in paths:
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
