"""The attention benchmark on a tiny grid (world 4, gloo): JSON fields, measured bytes == analytic, balance."""

from __future__ import annotations

import json

import pytest

from usp.attention.cost import analytic_bytes_sent, imbalance, ring_work


def run_bench(out_path: str) -> None:
    from usp.bench.attention import main

    argv = [
        "--ulysses",
        "1,2,4",
        "--ring",
        "1,2,4",
        "--seq",
        "64",
        "--heads",
        "4",
        "--kv-heads",
        "1,4",
        "--head-dim",
        "8",
        "--iters",
        "1",
        "--warmup",
        "0",
        "--out",
        out_path,
    ]
    main(argv)


def test_bench_tiny_grid_json(dist_pools, tmp_path):
    out = tmp_path / "bench.json"
    dist_pools(4).run(run_bench, str(out))
    report = json.loads(out.read_text())
    for key in ("date", "device", "torch", "world_size", "kernel_backend", "results", "skipped"):
        assert key in report
    assert report["world_size"] == 4 and report["kernel_backend"] == "cpu_flash"
    points = {(r["ulysses"], r["ring"], r["layout"], r["num_kv_heads"]) for r in report["results"]}
    assert (
        (2, 2, "zigzag", 1) in points and (1, 4, "contiguous", 4) in points and (4, 1, "zigzag", 1) in points
    )
    assert all(s["ulysses"] * s["ring"] > 4 for s in report["skipped"])
    for rec in report["results"]:
        assert rec["fwd_ms"] > 0 and rec["fwd_bwd_ms"] > 0
        assert rec["fwd_bytes_ratio"] == 1.0 and rec["fwd_bwd_bytes_ratio"] == 1.0, rec
        assert rec["bytes_equal_on_all_ranks"]
        n = rec["ring"]
        if rec["layout"] == "zigzag":
            assert rec["pairs_max_over_mean"] <= (2 * n + 1) / (2 * n) + 1e-9
            assert rec["area_max_over_mean"] <= (2 * n + 1) / (2 * n) + 1e-9
        else:
            assert rec["area_max_over_mean"] == pytest.approx(n / ((n + 1) / 2))
        for f, fb in zip(rec["fwd_attention_flops_per_rank"], rec["fwd_bwd_attention_flops_per_rank"]):
            assert fb == f * 14 // 4  # fwd 4 D per pair, bwd 10 D per pair
    hybrid = next(r for r in report["results"] if (r["ulysses"], r["ring"], r["num_kv_heads"]) == (2, 2, 1))
    assert hybrid["fwd_bytes_measured"] > 0 and hybrid["bytes_by_kind"]["ring_dkv"] > 0
    # the planner's calibration reads this file (usp.plan.measurements)
    from usp.plan.measurements import read_bench_json

    assert {r.kind for r in read_bench_json(out)} == {"fwd", "fwd_bwd"}


def test_analytic_bytes_formula_by_hand():
    # U=2, R=2, B=1, S=64, Hq=4, Hkv=1 (replicated to 2), D=8, fp32: L=16
    got = analytic_bytes_sent(
        batch=1,
        seq_len=64,
        num_heads=4,
        num_kv_heads=1,
        head_dim=8,
        ulysses_degree=2,
        ring_degree=2,
        element_size=4,
    )
    a2a_q = 16 * 4 * 8 * 4 // 2  # half of the local q leaves the rank
    a2a_kv = 16 * 2 * 8 * 4 // 2  # 2 replicated KV heads
    part = 32 * 1 * 8  # one K (or V) part on the ring: S/R tokens x 1 head
    fwd = 2 * a2a_q + 2 * a2a_kv + 1 * 2 * part * 4
    bwd = 2 * a2a_q + 2 * a2a_kv + 1 * 2 * part * 4 + 2 * 2 * part * 4
    assert got == {"fwd": fwd, "bwd": bwd, "fwd_bwd": fwd + bwd}


def test_layout_balance():
    for n in (2, 4, 8):
        zig = ring_work(64 * n, n, "zigzag", True)
        con = ring_work(64 * n, n, "contiguous", True)
        assert imbalance([w["pairs"] for w in zig]) == pytest.approx(1.0)
        assert imbalance([w["area"] for w in con]) == pytest.approx(n / ((n + 1) / 2))


def run_bench_documents(out_path: str) -> None:
    from usp.bench.attention import main

    main(
        [
            "--ulysses",
            "1",
            "--ring",
            "4",
            "--seq",
            "64",
            "--heads",
            "2",
            "--kv-heads",
            "2",
            "--head-dim",
            "8",
            "--iters",
            "1",
            "--warmup",
            "0",
            "--doc-len",
            "10",
            "--out",
            out_path,
        ]
    )


def test_bench_documents_trim_the_ring(dist_pools, tmp_path):
    """10-token documents, ring 4 over 64 tokens: contiguous needs 2 ring steps, zigzag all 4; bytes exact."""
    out = tmp_path / "bench_docs.json"
    dist_pools(4).run(run_bench_documents, str(out))
    recs = {r["layout"]: r for r in json.loads(out.read_text())["results"]}
    assert recs["contiguous"]["ring_steps"] == 2 and recs["zigzag"]["ring_steps"] == 4
    for rec in recs.values():
        assert rec["doc_len"] == 10
        assert rec["fwd_bytes_ratio"] == 1.0 and rec["fwd_bwd_bytes_ratio"] == 1.0
    assert recs["contiguous"]["fwd_bwd_bytes_measured"] < recs["zigzag"]["fwd_bwd_bytes_measured"]
