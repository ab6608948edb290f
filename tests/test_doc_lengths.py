"""``--doc-lengths`` specs (one parser for usp-bench and usp-plan), the planner's document term, the trainer's
``attn_work_imbalance``."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from usp.data.doc_lengths import boundaries, parse_doc_lengths
from usp.parallel import ring_rank_pairs
from usp.plan.cli import main as plan_main
from usp.plan.compute import DocumentWork, compute_time
from usp.plan.hardware import get_device
from usp.plan.models import load_model_spec
from usp.train.flops import attention_work_imbalance


@pytest.mark.parametrize(
    "spec",
    ["lognormal:mean=8192", "lognormal:mean=300,sigma=2,seed=4", "fixed:2048", "lengths:2048,65536,2048x31"],
)
def test_rows_fill_the_sequence_deterministically(spec):
    dist = parse_doc_lengths(spec)
    for i in range(3):
        row = dist.row(131072, i)
        assert row.sum() == 131072 and row.min() >= 1
        assert np.array_equal(row, parse_doc_lengths(spec).row(131072, i))


def test_explicit_lengths_keep_their_order():
    assert parse_doc_lengths("lengths:3,10,3x2").row(20).tolist() == [3, 10, 3, 3, 1]
    assert parse_doc_lengths("fixed:7").row(20).tolist() == [7, 7, 6]


def test_file_of_lengths(tmp_path):
    text = tmp_path / "lengths.txt"
    text.write_text("100 200\n300,50\n")
    as_json = tmp_path / "lengths.json"
    as_json.write_text(json.dumps([100, 200, 300, 50]))
    for spec in (f"file:{text}", str(as_json)):
        row = parse_doc_lengths(spec).row(4096)
        assert row.sum() == 4096 and set(row[:-1].tolist()) <= {100, 200, 300, 50}


@pytest.mark.parametrize(
    "spec, needle",
    [
        ("lognormal:sigma=1", "mean="),
        ("lognormal:mean=abc", "not a number"),
        ("fixed:0", ">= 1"),
        ("lengths:12y", "not a length"),
        ("file:/no/such/file", "no file"),
        ("zipf:1.1", "not a document-length spec"),
    ],
)
def test_bad_specs_name_the_accepted_forms(spec, needle):
    with pytest.raises(ValueError, match=needle):
        parse_doc_lengths(spec)


def test_planner_costs_attention_over_documents():
    model = load_model_spec("llama-3.1-8b")
    device = get_device("h100-80g")
    kw = dict(seq_len=131072, ulysses_degree=1, ring_degree=8)
    whole = compute_time(model, device, ring_layout="zigzag", **kw)["attention_s"]
    docs = DocumentWork.from_spec("lognormal:mean=8192", 131072, num_rows=4)
    zigzag = compute_time(model, device, ring_layout="zigzag", documents=docs, **kw)["attention_s"]
    balanced = compute_time(model, device, ring_layout="balanced", documents=docs, **kw)["attention_s"]
    # the exact terms: in-document pairs of the rows, times the busiest ring rank's share
    fraction = np.mean([sum(d * (d + 1) / 2 for d in row) for row in docs.rows]) / (131072 * 131073 / 2)
    assert docs.pair_fraction == pytest.approx(fraction)
    assert zigzag == pytest.approx(whole * fraction * docs.imbalance(8, "zigzag"), rel=1e-9)
    assert balanced == pytest.approx(whole * fraction * docs.imbalance(8, "balanced"), rel=1e-9)
    assert docs.imbalance(8, "balanced") <= 1.05 < docs.imbalance(8, "zigzag")


def test_plan_cli_doc_lengths(capsys):
    argv = [
        "--model",
        "llama-3.1-8b",
        "--seq-len",
        "128K",
        "--nodes",
        "2",
        "--ring-degree",
        "8",
        "--top",
        "1",
    ]
    assert plan_main([*argv, "--ring-layout", "balanced", "--doc-lengths", "lengths:2048,65536,2048x31"]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("documents lengths:"))
    assert "busiest ring rank's work / mean at ring 8" in line
    shares = dict(re.findall(r"(zigzag|contiguous|balanced) ([\d.]+) \(", line))
    assert shares == {"zigzag": "2.26", "contiguous": "3.27", "balanced": "1.00"}
    seconds = dict(re.findall(r"(zigzag|contiguous|balanced) [\d.]+ \(([\d.e+-]+) s\)", line))
    assert float(seconds["balanced"]) > 0
    assert float(seconds["zigzag"]) == pytest.approx(2.26 * float(seconds["balanced"]), rel=0.01)
    assert plan_main([*argv, "--doc-lengths", "lognormal:nope"]) == 2


def test_attn_work_imbalance_from_exact_pairs():
    rows = [[2048, 65536] + [2048] * 31, [8192] * 16]
    for layout in ("zigzag", "contiguous", "balanced"):
        work = np.sum([ring_rank_pairs(131072, 8, layout, boundaries(np.array(r))) for r in rows], axis=0)
        assert attention_work_imbalance(rows, 8, layout) == pytest.approx(work.max() / work.mean())
    assert attention_work_imbalance(rows, 1, "zigzag") == 1.0
    assert attention_work_imbalance([[131072]], 8, "contiguous") == pytest.approx(1.875, abs=1e-3)
