"""``usp.bench.step_overhead`` runs and reports every figure it documents (a world of one, a tiny Llama, one
step each): the timed entry points it wraps exist, the figures are positive step times, and the timers are
taken off again. No speed is asserted (docs/performance.md reports the measured ratios)."""

from __future__ import annotations

import math


def run_bench(model_dir: str) -> dict:
    """Worker (world 1): one case of the bench; also whether usp attention's entry points are unwrapped."""
    import usp.attention
    import usp.attention.usp as usp_module
    from usp.bench.step_overhead import Case, run_case

    entries = {
        "usp_attention": usp.attention.usp_attention,
        **{n: getattr(usp_module, n) for n in ("ring_attention_checked", "seq_to_head", "head_to_seq")},
    }
    out = run_case(Case(model_dir, 1, 1, 32, 1))
    restored = entries == {
        "usp_attention": usp.attention.usp_attention,
        **{n: getattr(usp_module, n) for n in ("ring_attention_checked", "seq_to_head", "head_to_seq")},
    }
    return out | {"restored": restored}


def test_step_overhead_bench_reports_its_figures(dist_pools, tiny_llama):
    got = dist_pools(1).run(run_bench, tiny_llama)[0]
    assert got["restored"], "the bench left usp attention's functions wrapped"
    assert got["layout"] == "u1r1" and got["steps"] == 1
    assert got["attention_calls_per_step"] == 2  # the tiny Llama's two layers
    for key in ("step_s", "usp_untimed_step_s", "hf_step_s", "usp_over_hf"):
        assert math.isfinite(got[key]) and got[key] > 0, (key, got)
    assert 0 <= got["collate_s"] < got["step_s"] and 0 <= got["overhead_s"] < got["step_s"], got
