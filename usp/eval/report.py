"""What people look at after ``usp-eval``: ``eval.json``, one PNG per task, wandb, a short summary.

Rank 0 only. ``<run dir>/eval.json`` holds one entry per task (``{"ppl": {...}, "passkey": {...}}``); running
another task in the same run dir adds its entry and keeps the others. Plots use matplotlib's Agg backend (no
display needed): ``ppl_by_position.png`` (perplexity vs position, one line per evaluated length, the original
context length as a dashed vertical line) and ``passkey.png`` (accuracy heatmap, depth x length).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

from usp.atomic import write_text
from usp.config import WandbConfig

logger = logging.getLogger(__name__)
EVAL_JSON = "eval.json"
PLOTS = {"ppl": "ppl_by_position.png", "passkey": "passkey.png"}


def write_json(run_dir: Path, task: str, entry: dict[str, Any]) -> Path:
    """Add/replace ``task``'s entry of ``<run_dir>/eval.json`` (written aside, then renamed).

    An ``eval.json`` that does not parse (a truncated copy, an edit) is never silently replaced: it is kept
    as ``eval.json.damaged-<time>`` next to it, and a warning names both files."""
    path = run_dir / EVAL_JSON
    data: dict[str, Any] = {}
    if path.is_file():
        try:
            data = json.loads(path.read_text())
            if not isinstance(data, dict):
                raise ValueError("not a JSON object")
        except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
            aside = path.with_name(f"{EVAL_JSON}.damaged-{time.strftime('%Y%m%d-%H%M%S')}")
            os.replace(path, aside)
            warning = (
                f"usp-eval: warning: {path} did not parse ({e}); kept it as {aside} and started a new "
                f"{EVAL_JSON} (the earlier entries are in the kept file)"
            )
            logger.warning(warning)
            print(warning, file=sys.stderr, flush=True)
            data = {}
    data[task] = entry
    write_text(path, json.dumps(data, indent=2, default=str) + "\n")
    return path


def save_figure(fig: Any, path: Path) -> Path:
    """Write an evaluation figure to ``path`` the one way every plot here does (tight layout, 110 dpi) and free
    it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_ppl(result: dict[str, Any], path: Path, *, original_context: int | None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for length, entry in result["lengths"].items():
        xs = [(b["start"] + b["end"]) / 2 for b in entry["buckets"]]
        ax.plot(xs, [b["ppl"] for b in entry["buckets"]], marker="o", markersize=3, label=f"length {length}")
    longest = max(int(length) for length in result["lengths"])
    if original_context and original_context <= longest:
        ax.axvline(
            original_context, color="gray", linestyle="--", label=f"original context {original_context}"
        )
    elif original_context:  # beyond every evaluated position: say so rather than stretch the axis
        ax.plot(
            [],
            [],
            color="gray",
            linestyle="--",
            label=f"original context {original_context} (beyond the plot)",
        )
    ax.set_xlabel("position (tokens)")
    ax.set_ylabel("perplexity")
    ax.set_title("Perplexity by position")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return save_figure(fig, path)


def plot_passkey(result: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    lengths = list(dict.fromkeys(c["length"] for c in result["cells"]))
    depths = list(dict.fromkeys(c["depth"] for c in result["cells"]))
    grid = np.zeros((len(depths), len(lengths)))
    for c in result["cells"]:
        grid[depths.index(c["depth"]), lengths.index(c["length"])] = c["accuracy"]
    fig, ax = plt.subplots(figsize=(1.2 * len(lengths) + 3, 0.5 * len(depths) + 2.5))
    im = ax.imshow(grid, vmin=0.0, vmax=1.0, cmap="RdYlGn", aspect="auto")
    for i in range(len(depths)):
        for j in range(len(lengths)):
            ax.text(j, i, f"{grid[i, j]:.2f}", ha="center", va="center", fontsize=8)
    ax.set_xticks(range(len(lengths)), [str(x) for x in lengths])
    ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths])
    ax.set_xlabel("length (tokens)")
    ax.set_ylabel("depth")
    ax.set_title(f"Passkey retrieval accuracy ({result['accuracy']:.2f} overall)")
    fig.colorbar(im, ax=ax, label="accuracy")
    return save_figure(fig, path)


def start_wandb_run(cfg: WandbConfig, run_dir: Path, task: str, config: dict) -> tuple[Any, Any] | None:
    """``(wandb, run)`` for one evaluation ``task`` (tags ``eval``, ``task``; job type ``eval-<task>``), or
    ``None`` when ``logging.wandb.mode=disabled``. ``ImportError`` naming the fix without the package."""
    if cfg.mode == "disabled":
        return None
    try:
        import wandb
    except ImportError as err:
        raise ImportError(
            f"logging.wandb.mode={cfg.mode} needs the wandb package: pip install 'usp[wandb]', or set "
            "logging.wandb.mode=disabled."
        ) from err
    run = wandb.init(
        project=cfg.project,
        entity=cfg.entity,
        name=cfg.name,
        tags=[*cfg.tags, "eval", task],
        mode=cfg.mode,
        dir=str(run_dir),
        job_type=f"eval-{task}",
        config=config,
    )
    return wandb, run


def log_wandb(
    cfg: WandbConfig, run_dir: Path, task: str, entry: dict[str, Any], image: Path, config: dict
) -> None:
    """One wandb run per evaluation: a table of buckets (ppl) or cells (passkey), the plot, the summary."""
    started = start_wandb_run(cfg, run_dir, task, config)
    if started is None:
        return
    wandb, run = started
    result = entry["result"]
    if task == "ppl":
        table = wandb.Table(columns=["length", "start", "end", "tokens", "loss", "ppl"])
        for length, e in result["lengths"].items():
            for b in e["buckets"]:
                table.add_data(int(length), b["start"], b["end"], b["tokens"], b["loss"], b["ppl"])
        summary = {f"ppl/{length}": e["ppl"] for length, e in result["lengths"].items()}
    else:
        table = wandb.Table(columns=["length", "depth", "trials", "correct", "accuracy"])
        for c in result["cells"]:
            table.add_data(c["length"], c["depth"], c["trials"], c["correct"], c["accuracy"])
        summary = {"passkey/accuracy": result["accuracy"]}
    run.log(
        {
            f"eval/{task}": table,
            f"eval/{task}_plot": wandb.Image(str(image)),
            **summary,
            **{f"timing/{k}": v for k, v in entry["timing"].items() if v is not None},
        }
    )
    run.finish()


def summary_lines(task: str, entry: dict[str, Any]) -> list[str]:
    """A few lines for stdout."""
    result, timing = entry["result"], entry["timing"]
    lines = []
    if task == "ppl":
        for length, e in result["lengths"].items():
            first, last = e["buckets"][0], e["buckets"][-1]
            lines.append(
                f"ppl length {length}: {e['ppl']:.3f} over {e['documents']} document(s); positions "
                f"{first['start']}-{first['end']}: {first['ppl']:.3f}, {last['start']}-{last['end']}: {last['ppl']:.3f}"
            )
        if timing.get("forward_tokens_per_s"):
            lines.append(f"forward: {timing['forward_tokens_per_s']:.0f} tokens/s")
    else:
        for length in dict.fromkeys(c["length"] for c in result["cells"]):
            row = [c for c in result["cells"] if c["length"] == length]
            acc = sum(c["correct"] for c in row) / max(1, sum(c["trials"] for c in row))
            cells = " ".join(f"{c['depth']:g}:{c['accuracy']:.2f}" for c in row)
            lines.append(f"passkey length {length}: accuracy {acc:.2f} (depth:accuracy {cells})")
        lines.append(f"passkey overall accuracy {result['accuracy']:.3f}")
        pre, dec = timing.get("prefill_tokens_per_s"), timing.get("decode_tokens_per_s")
        lines.append(
            f"prefill: {pre:.0f} tokens/s; decode: {dec:.1f} tokens/s" if pre and dec else "timing: n/a"
        )
    return lines
