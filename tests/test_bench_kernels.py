"""The local-kernel check script on a tiny CPU shape: cpu_flash agrees with the math reference."""

from __future__ import annotations

import json

import pytest

from usp.attention import segmented
from usp.bench.kernels import document_segments, main

KEYS = ("out", "lse", "dq", "dk", "dv")


@pytest.mark.parametrize("per_segment", [False, True], ids=["dense_mask", "per_segment"])
def test_kernel_check_cpu(tmp_path, monkeypatch, per_segment):
    if per_segment:  # what a GPU-sized block does with documents
        monkeypatch.setattr(segmented, "DENSE_MASK_MAX_ELEMENTS", 0)
    out = tmp_path / "kernels.json"
    report = main(
        [
            "--seq",
            "64",
            "--heads",
            "4",
            "--kv-heads",
            "2",
            "--head-dim",
            "16",
            "--iters",
            "1",
            "--out",
            str(out),
        ]
    )
    assert json.loads(out.read_text()) == report
    (rec,) = report["results"]
    assert rec["backend"] == "cpu_flash" and rec["dtype"] == "float32" and rec["doc_len"] == 64 // 8 + 3
    for key in [f"max_err_{k}" for k in KEYS] + [f"max_err_doc_{k}" for k in KEYS]:
        assert rec[key] < 1e-5, (key, rec[key])
    assert rec["kernel_tflops"] > 0 and rec["sdpa_tflops"] > 0 and rec["kernel_over_sdpa"] > 0


def test_document_segments_cover_the_block():
    segs = document_segments(20, 8).tolist()
    assert segs == [
        [0, 8, 0, 8],
        [8, 9, 8, 9],
        [9, 10, 9, 10],
        [10, 18, 10, 18],
        [18, 19, 18, 19],
        [19, 20, 19, 20],
    ]
