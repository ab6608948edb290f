"""What ``eval=ruler`` shows (rank 0): two PNGs, wandb tables and the stdout table.

- ``ruler.png``: the score heatmap, task x length, with the per-length mean as its last row;
- ``ruler_by_length.png``: the mean score per length (log2 axis), the effective-length threshold dashed, the
  original context length as a dotted vertical line;
- wandb (``logging.wandb.mode`` not ``disabled``): one run (job type ``eval-ruler``) with a ``task, length,
  score`` table, a trials table (everything but the prompt text, which stays in ``eval.json``), both images
  and the per-length means;
- stdout: the task x length table, the means, the effective length.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from usp.config import WandbConfig
from usp.eval.report import save_figure, start_wandb_run

PLOTS = ("ruler.png", "ruler_by_length.png")


def plot_heatmap(result: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    tasks = list(result["tasks"])
    lengths = list(result["mean"])
    grid = np.array(
        [[result["tasks"][t][n] for n in lengths] for t in tasks] + [[result["mean"][n] for n in lengths]]
    )
    fig, ax = plt.subplots(figsize=(1.1 * len(lengths) + 3.5, 0.42 * len(grid) + 2))
    im = ax.imshow(grid, vmin=0.0, vmax=1.0, cmap="RdYlGn", aspect="auto")
    for i in range(grid.shape[0]):
        for j in range(grid.shape[1]):
            ax.text(j, i, f"{grid[i, j]:.2f}", ha="center", va="center", fontsize=8)
    ax.axhline(len(tasks) - 0.5, color="black", linewidth=1)
    ax.set_xticks(range(len(lengths)), lengths)
    ax.set_yticks(range(len(grid)), [*tasks, "mean"])
    ax.set_xlabel("length (tokens)")
    ax.set_title("RULER score by task and length")
    fig.colorbar(im, ax=ax, label="score")
    return save_figure(fig, path)


def plot_by_length(result: dict[str, Any], path: Path, *, original_context: int | None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [int(n) for n in result["mean"]]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.plot(xs, list(result["mean"].values()), marker="o", label="mean over tasks")
    ax.axhline(
        result["threshold_score"],
        color="gray",
        linestyle="--",
        label=f"threshold {result['threshold']:g} x shortest = {result['threshold_score']:.2f}",
    )
    if original_context:
        inside = min(xs) <= original_context <= max(xs)
        ax.axvline(
            original_context,
            color="black",
            linestyle=":",
            label=f"original context {original_context}" + ("" if inside else " (outside the lengths)"),
        )
    if len(set(xs)) > 1:
        ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("length (tokens)")
    ax.set_ylabel("score")
    eff = result["effective_length"]
    ax.set_title(f"RULER mean score by length (effective length {eff if eff is not None else 'none'})")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return save_figure(fig, path)


def table_lines(result: dict[str, Any]) -> list[str]:
    """The task x length table, the means and the effective length, for stdout."""
    lengths = list(result["mean"])
    width = max(len("mean"), *(len(t) for t in result["tasks"]))
    lines = [f"{'ruler task':<{width}} " + " ".join(f"{n:>8}" for n in lengths)]
    for task, row in result["tasks"].items():
        lines.append(f"{task:<{width}} " + " ".join(f"{row[n]:>8.3f}" for n in lengths))
    lines.append(f"{'mean':<{width}} " + " ".join(f"{result['mean'][n]:>8.3f}" for n in lengths))
    eff = result["effective_length"]
    lines.append(
        f"ruler effective length: {eff if eff is not None else 'none'} (mean score >= {result['threshold']:g} x "
        f"the shortest length's = {result['threshold_score']:.3f})"
    )
    return lines


def log_wandb(
    cfg: WandbConfig, run_dir: Path, entry: dict[str, Any], images: list[Path], config: dict
) -> None:
    started = start_wandb_run(cfg, run_dir, "ruler", config)
    if started is None:
        return
    wandb, run = started
    result = entry["result"]
    scores = wandb.Table(columns=["task", "length", "score"])
    for task, row in result["tasks"].items():
        for length, value in row.items():
            scores.add_data(task, int(length), value)
    trials = wandb.Table(
        columns=["task", "length", "index", "references", "prediction", "score", "prompt_tokens"]
    )
    for t in result["trials"]:
        trials.add_data(
            t["task"],
            t["length"],
            t["index"],
            ", ".join(t["references"]),
            t["prediction"],
            t["score"],
            t["prompt_tokens"],
        )
    summary = {f"ruler/mean/{n}": v for n, v in result["mean"].items()}
    if result["effective_length"] is not None:
        summary["ruler/effective_length"] = result["effective_length"]
    run.log(
        {
            "eval/ruler": scores,
            "eval/ruler_trials": trials,
            **{f"eval/{p.stem}": wandb.Image(str(p)) for p in images},
            **summary,
            **{f"timing/{k}": v for k, v in entry["timing"].items() if v is not None},
        }
    )
    run.finish()
