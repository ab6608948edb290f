"""The docs' figures are drawn from the code (usp.bench.figures): each draws, and bad input is refused."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("matplotlib")

from usp.bench.figures import loss_curve_figure, main, memory_rows  # noqa: E402


def test_every_figure_draws(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps({"step": s, "loss": 6.0 - s / 10}) + "\n" for s in range(1, 6)))
    assert main(["--out", str(tmp_path / "figs"), "--metrics", str(metrics)]) == 0
    for name in ("rank_grid.png", "memory_breakdown.png", "demo_loss.png"):
        data = (tmp_path / "figs" / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, name


def test_memory_rows_are_the_planners_fastest_layouts():
    rows, limit = memory_rows("llama-3.1-8b", seq_len=131072, nodes=2, gpus_per_node=8, gpu="h100-80g", top=4)
    assert len(rows) == 4 and limit == pytest.approx(80.0, abs=5)
    assert all(0 < sum(parts.values()) <= limit for _, parts in rows)


def test_loss_curve_needs_losses(tmp_path):
    empty = tmp_path / "metrics.jsonl"
    empty.write_text("")
    with pytest.raises(ValueError, match="no record with a loss"):
        loss_curve_figure(tmp_path, empty)
