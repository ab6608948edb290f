"""The local-kernel check script on a tiny CPU shape: cpu_flash agrees with the math reference."""

from __future__ import annotations

import json

from usp.bench.kernels import main


def test_kernel_check_cpu(tmp_path):
    out = tmp_path / "kernels.json"
    report = main(["--seq", "64", "--heads", "4", "--kv-heads", "2", "--head-dim", "16", "--iters", "1",
                   "--out", str(out)])  # fmt: skip
    assert json.loads(out.read_text()) == report
    (rec,) = report["results"]
    assert rec["backend"] == "cpu_flash" and rec["dtype"] == "float32"
    for key in ("max_err_out", "max_err_lse", "max_err_dq", "max_err_dk", "max_err_dv"):
        assert rec[key] < 1e-5, (key, rec[key])
    assert rec["kernel_tflops"] > 0 and rec["sdpa_tflops"] > 0 and rec["kernel_over_sdpa"] > 0
