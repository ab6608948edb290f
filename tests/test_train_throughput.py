"""The throughput tool runs the trainer's step on random weights and reports sane figures."""

from __future__ import annotations

import math

import pytest

from usp.tiny import build_tiny_llama


def _throughput(argv: list[str]) -> list[dict]:
    from usp.bench.throughput import main

    return main(argv)


@pytest.mark.slow
def test_throughput_tool_world1(dist_pools, tmp_path):
    model_dir = str(build_tiny_llama(tmp_path / "llama"))
    argv = [
        "--model",
        model_dir,
        "--seq-len",
        "64",
        "128",
        "--steps",
        "1",
        "--warmup",
        "0",
        "--dtype",
        "float32",
        "--device",
        "cpu",
        "--find-max",
        "--max-seq-len",
        "512",
        "--granularity",
        "64",
    ]
    records = dist_pools(1).run(_throughput, argv)[0]
    assert [r["seq_len"] for r in records[:2]] == [64, 128]
    for r in records[:2]:
        assert r["tokens_per_s"] > 0 and 0 < r["mfu"] < 1 and math.isfinite(r["loss"])
        assert abs(r["loss"] - math.log(384)) < 0.5  # random init: near-uniform predictions
    assert records[2] == {"longest_fitting_seq_len": 512}  # no OOM on CPU: capped by --max-seq-len
