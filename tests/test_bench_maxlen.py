"""usp.bench.maxlen (the longest sequence one device trains): the search against known limits, the optimizer
choice, the attempt's outcome classes, and one real search on the CPU with the tiny Llama and an injected
memory limit (``--fail-above``), whose answer must bracket that limit."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from usp.bench.maxlen import main as maxlen_main
from usp.bench.maxlen.attempt import classify
from usp.bench.maxlen.planner import choose_optim, deepest_fitting
from usp.bench.maxlen.search import Attempt, attempt_from, search, table
from usp.bench.maxlen.setup import model_fields
from usp.plan import load_model_spec

ROOT = Path(__file__).resolve().parents[1]


def _fake(limit: int, *, fail: str = "oom", errors: tuple[int, ...] = ()):
    """A ``try_len`` that trains up to ``limit`` tokens and fails with ``fail`` above it (``error`` at ``errors``)."""
    tried: list[int] = []

    def try_len(s: int) -> Attempt:
        tried.append(s)
        if s in errors:
            return Attempt(s, "error", error="boom")
        return Attempt(s, "ok" if s <= limit else fail)

    return try_len, tried


@pytest.mark.parametrize("start", [256, 1024, 4096, 9984, 65536])
@pytest.mark.parametrize("limit", [300, 2500, 10000])
@pytest.mark.parametrize("fail", ["oom", "timeout", "host_mem", "killed"])
def test_search_finds_the_longest_multiple_under_the_limit(start, limit, fail):
    g = 256
    try_len, tried = _fake(limit, fail=fail)
    best, stopped, attempts = search(try_len, start=start, granularity=g, max_len=1 << 20)
    assert best == limit // g * g
    assert stopped == "converged"
    assert [a.seq_len for a in attempts] == tried and len(set(tried)) == len(tried)  # nothing tried twice
    assert all(s % g == 0 for s in tried)
    assert best == max(a.seq_len for a in attempts if a.ok)  # the longest that trained, among those tried
    assert best + g in tried  # bracketed: one granule longer was tried and failed
    assert len(tried) <= math.ceil(abs(math.log(start / limit, 1.25))) + 8  # geometric walk, then bisection


def test_search_stops_at_the_limit_and_when_nothing_fits():
    try_len, tried = _fake(10**9)
    assert search(try_len, start=1024, granularity=256, max_len=3000)[:2] == (2816, "limit")
    assert max(tried) == 2816
    try_len, tried = _fake(100)
    best, stopped, _ = search(try_len, start=4096, granularity=256, max_len=1 << 20)
    assert (best, stopped) == (None, "nothing_fits") and tried[-1] == 256


def test_search_stops_on_an_error_and_on_the_budget():
    try_len, tried = _fake(5000, errors=(2560,))
    best, stopped, _ = search(try_len, start=2048, granularity=256, max_len=1 << 20)
    assert (best, stopped, tried) == (2048, "error", [2048, 2560])  # an error is not a memory limit
    calls = iter([True, True, False])
    try_len, tried = _fake(5000)
    best, stopped, _ = search(
        try_len, start=1024, granularity=256, max_len=1 << 20, time_left=lambda: next(calls)
    )
    assert (best, stopped, tried) == (1280, "budget", [1024, 1280])


def test_choose_optim():
    ok, broken = (lambda: None), (lambda: "gcc: not found")
    assert choose_optim("auto", cpu_adam_error=ok)[0] == "deepspeed_cpu_adam"
    assert choose_optim("auto", cpu_adam_error=broken)[0] == "adamw_cpu_offload"
    name, why = choose_optim("deepspeed_cpu_adam", cpu_adam_error=broken)
    assert name == "adamw_cpu_offload" and "gcc: not found" in why
    assert choose_optim("adamw", cpu_adam_error=broken)[0] == "adamw"


def test_host_memory_decides_the_depth(tmp_path):
    """Llama-3.1-8B's offloaded states (more than 16 B x 8.03e9 = 120 GiB once pinned) do not fit a 128 GiB host
    (85% usable): auto depth keeps a shallower model of the same width; a host too small for the asked model
    fails at once."""
    fields = model_fields("llama-3.1-8b")
    assert deepest_fitting(fields, host_mem_gib=2048, seq_len=4096, compute_bytes=2) == 32
    deepest = deepest_fitting(fields, host_mem_gib=128, seq_len=4096, compute_bytes=2)
    # by hand, world 1: the fp32 parameter and gradient of every tensor pinned as one block each, rounded up to
    # a power of two by torch's caching host allocator, Adam's m and v unpinned (8 B per parameter), and each
    # layer's pinned checkpoint (4096 tokens x 4096 x 2 B); the states and inputs may take 3/4 of 85% of 128 GiB
    MiB, KiB = 2**20, 2**10
    # q, o: 4096 x 4096 x 4 B = 64 MiB; k, v: 4096 x 1024 x 4 B = 16 MiB; gate, up, down: 224 MiB -> 256 MiB;
    # the two norms 16 KiB
    layer_params = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336 + 2 * 4096
    per_layer = 2 * (2 * 64 * MiB + 2 * 16 * MiB + 3 * 256 * MiB + 2 * 16 * KiB) + 8 * layer_params
    per_layer += 4096 * 4096 * 2
    # embedding and LM head: 128256 x 4096 x 4 B = 2004 MiB -> 2048 MiB each; the final norm 16 KiB
    root_params = 2 * 128256 * 4096 + 4096
    root = 2 * (2 * 2048 * MiB + 16 * KiB) + 8 * root_params
    usable = 0.85 * 0.75 * 128 * 2**30
    assert deepest == (usable - root) // per_layer
    assert 8 <= deepest < 32
    spec = load_model_spec({**fields, "num_hidden_layers": deepest})
    assert spec.num_params == deepest * layer_params + root_params  # the shape counted above
    if 0.85 * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") < 120 * 2**30:  # this machine
        with pytest.raises(ValueError, match="--num-layers auto"):
            maxlen_main(["--out", str(tmp_path / "m.json")])
        assert not (tmp_path / "maxlen-work").exists()  # failed before any setup


def test_classify_outcomes():
    assert classify(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")) == "oom"
    assert classify(RuntimeError("CUDA error: out of memory")) == "oom"
    assert (
        classify(ValueError("model.path='/m': could not read the weights (OutOfMemoryError: ...)")) == "oom"
    )
    assert classify(ValueError("offload needs 9.00 GiB of host memory per node ...")) == "host_mem"
    assert classify(ValueError("parallel.mlp_tiles=7 does not divide")) == "error"


def test_attempt_from_takes_the_last_step_and_the_peaks():
    recs = [
        {
            "step_time_s": 9.0,
            "tokens_per_s": 100.0,
            "mfu": 0.1,
            "peak_mem_gib": 50.0,
            "peak_mem_reserved_gib": 60.0,
        },
        {
            "step_time_s": 4.0,
            "tokens_per_s": 250.0,
            "mfu": 0.3,
            "peak_mem_gib": 48.0,
            "peak_mem_reserved_gib": 61.0,
        },
    ]
    a = attempt_from(
        {"seq_len": 1024, "status": "ok", "records": recs, "layout": {"mlp_tiles": 4}}, {"mfu": 0.31}
    )
    assert (a.step_time_s, a.tokens_per_s, a.mfu, a.mlp_tiles) == (4.0, 250.0, 0.3, 4)
    assert (a.peak_mem_gib, a.peak_mem_reserved_gib) == (50.0, 61.0)
    failed = attempt_from({"seq_len": 2048, "status": "oom", "error": "OutOfMemoryError: x"}, {})
    assert failed.step_time_s is None and not failed.ok
    lines = table([a, failed]).splitlines()
    assert lines[2].startswith("| 2048 | oom |") and lines[3].startswith(
        "| 1024 | ok | 4 | 4.00 | 250 | 30.0% |"
    )


@pytest.mark.slow
def test_cpu_search_brackets_an_injected_memory_limit(tmp_path):
    """The whole tool on the CPU: setup (random checkpoint, corpus), the trainer in a fresh process per
    length, the report. Attempts above 1100 tokens fail as an OOM would; from 1536 the search goes down
    (1024 trains) and bisects (1280 fails): the answer is 1024, bracketing the limit within one granule."""
    out = tmp_path / "maxlen.json"
    cmd = [
        sys.executable,
        "-m",
        "usp.bench.maxlen",
        "--tiny",
        "--start",
        "1536",
        "--granularity",
        "256",
        "--fail-above",
        "1100",
        "--optim",
        "adamw_cpu_offload",
        "--budget",
        "240",
        "--attempt-timeout",
        "120",
        "--min-attempt-s",
        "5",
        "--out",
        str(out),
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    attempts = report["attempts"]
    assert [(a["seq_len"], a["status"]) for a in attempts] == [(1536, "oom"), (1024, "ok"), (1280, "oom")]
    assert report["max_seq_len"] == 1024 == max(a["seq_len"] for a in attempts if a["status"] == "ok")
    assert report["max_seq_len"] <= 1100 < report["max_seq_len"] + report["settings"]["granularity"]
    assert (report["stopped"], report["limited_by"]) == ("converged", "oom")
    best = report["best"]
    assert best["seq_len"] == 1024 and best["mlp_tiles"] == 16  # auto: tiles of hidden_size (64) tokens
    for key in ("step_time_s", "tokens_per_s", "mfu", "peak_mem_gib"):
        assert best[key] > 0, key
    assert best["tokens_per_s"] == pytest.approx(1024 / best["step_time_s"], rel=1e-6)
    assert set(best["planner"]) >= {"mem_gib_per_gpu", "host_mem_gib_per_node", "step_time_s", "mfu", "fits"}
    assert report["planner"]["max_seq_len"] > 0 and report["planner"]["at_max_seq_len"]["fits"]
    s = report["settings"]
    assert (s["activation_checkpointing"], s["optim"], s["mlp_tiles"], s["steps"]) == (
        "offload",
        "adamw_cpu_offload",
        "auto",
        2,
    )
    assert "| 1024 | ok | 16 |" in proc.stdout and "longest trained: 1024 tokens" in proc.stdout


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")
def test_descendants_include_other_sessions():
    """A timed-out attempt is killed with all its descendants, also those in sessions of their own (the
    compilers of a JIT build did that and outlived the attempt)."""
    import signal

    from usp.bench.maxlen.attempt import _descendants

    proc = subprocess.Popen(["bash", "-c", "setsid sleep 60 & sleep 60"], start_new_session=True)

    def names(pids: list[int]) -> list[str]:
        return sorted(Path(f"/proc/{pid}/comm").read_text().strip() for pid in pids)

    try:
        deadline = time.monotonic() + 10
        found = _descendants(proc.pid)
        while names(found) != ["sleep", "sleep"] and time.monotonic() < deadline:  # until both have exec'd
            time.sleep(0.05)
            found = _descendants(proc.pid)
        assert names(found) == ["sleep", "sleep"]  # the plain child and the one in a session of its own
    finally:
        for pid in [*_descendants(proc.pid), proc.pid]:
            os.kill(pid, signal.SIGKILL)
        proc.wait()
