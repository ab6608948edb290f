"""The fake-CUDA training step (:mod:`usp.bench.fake_memory`) on an 8B-shaped model cut to 3 layers at 64K tokens
(the fewest with a layer between two others, as the peak layer of a deep model is: ``MIN_PROBE_DEPTH``).

All cases run in one fresh process (the fake CUDA device loads before torch): world 1 and rank 0 of a ring-8
world, under several checkpointing modes, with and without tiles, and two Ulysses worlds (u8 r1, u4 r2 at 512K)
whose peak is the attention backward. Checked: the sharded states the tracker
sees are exactly the model's fp32 parameter and Adam bytes over the shard degree; checkpointing and tiles
lower the measured activations; and the planner's tensor terms are never more than 3% below the fake-CUDA
peak and at most 10% above it.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from usp.bench.fake_kernels import kernel_workspace_bytes
from usp.plan.models import load_model_spec

GIB = 1024**3


def _fake_cuda_reason() -> str | None:
    from usp.bench.fake_cuda import unsupported_reason

    return unsupported_reason()


pytestmark = pytest.mark.skipif(_fake_cuda_reason() is not None, reason=str(_fake_cuda_reason()))
CASES = [  # (nodes, gpus per node, checkpointing, tiles)
    (1, 1, "none", 1),
    (1, 1, "full", 8),
    (8, 1, "none", 1),
    (8, 1, "every_k", 1),
    (8, 1, "full", 1),
    (8, 1, "offload", 8),
    (1, 1, "offload", 2),  # few tiles: the MLP tile's backward, not the attention's, is the layer's peak
    (8, 1, "offload", 2),
]
ULYSSES_CASES = {  # (nodes, gpus per node, checkpointing, tiles) -> (ulysses, ring): 512K tokens, 64K per rank
    (1, 8, "offload", 8): (8, 1),  # the attention backward's phase is the peak: one kernel call per layer
    (2, 4, "full", 8): (4, 2),  # ... and on a ring: its fp32 accumulators and travelling K/V
}
LAYERS = 3
PLANNER_BAND = 1.10  # planner tensor terms / fake-CUDA peak: within 10% above, never more than 3% below


@pytest.fixture(scope="module")
def records():
    from usp.bench.fake_memory import run_in_subprocess

    def case_argv(n, g, ac, t, seq="64K", ulysses=1, ring=None):
        return [
            "--nodes",
            str(n),
            "--gpus-per-node",
            str(g),
            "--seq-len",
            seq,
            "--layers",
            str(LAYERS),
            f"parallel.activation_checkpointing={ac}",
            f"parallel.mlp_tiles={t}",
            "model.attention_backend=sdpa_flash",
            f"parallel.ulysses_degree={ulysses}",
            f"parallel.ring_degree={n * g // ulysses if ring is None else ring}",
        ]

    argv = [case_argv(*case) for case in CASES]
    argv += [case_argv(*case, "512K", u, r) for case, (u, r) in ULYSSES_CASES.items()]
    recs = run_in_subprocess(argv, timeout=1200)
    cases = [*CASES, *ULYSSES_CASES]
    assert len(recs) == len(cases)
    return {case: rec for case, rec in zip(cases, recs)}


def _spec():
    return replace(load_model_spec("llama-3.1-8b"), num_layers=LAYERS)


@pytest.mark.slow
def test_sharded_states_are_the_parameter_and_adam_bytes(records):
    spec = _spec()
    for (n, g, _, _), rec in records.items():
        world = n * g
        meas = rec["categories"]["measured"]
        assert meas["Sharded Param"] == pytest.approx(4 * spec.num_params / world / GIB, rel=1e-3)
        assert meas["OptState"] == pytest.approx(8 * spec.num_params / world / GIB, rel=1e-3)


@pytest.mark.slow
def test_checkpointing_and_tiles_lower_the_measured_activations(records):
    act = {case: rec["categories"]["measured"]["Activation"] for case, rec in records.items()}
    assert act[(8, 1, "every_k", 1)] < act[(8, 1, "none", 1)]
    assert act[(8, 1, "full", 1)] < act[(8, 1, "every_k", 1)]
    assert act[(8, 1, "offload", 8)] < act[(8, 1, "full", 1)]
    assert act[(1, 1, "full", 8)] < act[(1, 1, "none", 1)]
    # every layer's input (8192 local tokens x hidden 4096, bf16) on the host
    assert records[(8, 1, "offload", 8)]["host_gib"] == pytest.approx(
        LAYERS * 8192 * 4096 * 2 / GIB, rel=1e-6
    )


@pytest.mark.slow
def test_planner_is_never_below_the_fake_cuda_peak(records):
    for case, rec in records.items():
        ratio = rec["planner_tensor_gib"] / rec["peak_gib"]
        assert 0.97 <= ratio <= PLANNER_BAND, (
            f"{case}: planner {rec['planner_tensor_gib']:.2f} GiB vs fake-CUDA {rec['peak_gib']:.2f}"
        )
        assert rec["planner_gib"] > rec["planner_tensor_gib"]  # context, NCCL, fragmentation on top


@pytest.mark.slow
def test_ulysses_cases_peak_in_the_attention_backward(records):
    """The Ulysses cases exercise the planner's attention phase (usp.plan.attention_memory): it is the term the
    planner reports at their peak, so the band above checks it against the fake-CUDA step."""
    from usp.plan.attention_memory import attention_backward_bytes
    from usp.plan.layout import Candidate, from_keywords

    for (n, g, ac, t), (u, r) in ULYSSES_CASES.items():
        work, cand = from_keywords(
            _spec(),
            Candidate,
            seq_len=512 * 1024,
            ulysses_degree=u,
            ring_degree=r,
            world_size=n * g,
            node_size=g,
            activation_checkpointing=ac,
            mlp_tiles=t,
            attention_backend="sdpa_flash",
        )
        planned = records[(n, g, ac, t)]["categories"]["planned"]["attention_workspace"]
        assert planned == pytest.approx(attention_backward_bytes(work, cand) / GIB, rel=1e-9), (n, g, ac, t)


def test_flash_backward_workspace_follows_mha_bwd():
    # Llama-3.1-8B under Ulysses 8: 4 query heads, 1 KV head per rank, head dim 128, 100 rows (rounded to 128)
    got = kernel_workspace_bytes("sdpa_flash", batch=1, sq=100, sk=100, hq=4, hkv=1, d=128, elem=2)
    softmax_d, dq_accum, dkv_expanded = 4 * 128 * 4, 128 * 4 * 128 * 4, 2 * 100 * 4 * 128 * 2
    assert got == softmax_d + dq_accum + dkv_expanded
    assert kernel_workspace_bytes("flash_attn", batch=1, sq=128, sk=128, hq=4, hkv=4, d=96, elem=2) == (
        4 * 128 * 4 + 128 * 4 * 96 * 4
    )  # no GQA: no expanded dK/dV; head dim 96 is already a multiple of 32
    assert kernel_workspace_bytes("sdpa_efficient", batch=2, sq=64, sk=64, hq=8, hkv=8, d=64, elem=2) == (
        2 * 8 * 64 * 4 + 2 * 64 * 8 * 64 * 4
    )
    assert kernel_workspace_bytes("cpu_flash", batch=1, sq=64, sk=64, hq=8, hkv=8, d=64, elem=4) == 0


DEPTH_CASES = [  # (nodes, checkpointing, tiles, optimizer): 8B-shaped, 16K tokens, 5 layers
    (1, "none", 1, "adamw"),
    (1, "full", 4, "adamw"),
    (8, "offload", 4, "adamw_cpu_offload"),
]


@pytest.mark.slow
def test_depth_extrapolation_equals_the_traced_step():
    """Each category's peak is affine in the depth (every decoder layer is the same): the step extended from 3
    and 4 traced layers to 5 (``--depth-method extrapolate``) equals the step traced at 5 layers."""
    from usp.bench.fake_memory import run_in_subprocess

    argv = [
        [
            "--nodes",
            str(n),
            "--gpus-per-node",
            "1",
            "--seq-len",
            "16K",
            "--layers",
            "5",
            "--depth-method",
            method,
            f"parallel.activation_checkpointing={ac}",
            f"parallel.mlp_tiles={t}",
            f"optim.name={opt}",
            "model.attention_backend=sdpa_flash",
        ]
        for n, ac, t, opt in DEPTH_CASES
        for method in ("extrapolate", "direct")
    ]
    recs = run_in_subprocess(argv, timeout=1200)
    assert len(recs) == 2 * len(DEPTH_CASES)
    for case, ext, direct in zip(DEPTH_CASES, recs[::2], recs[1::2]):
        assert ext["depth_method"] == "extrapolate" and ext["probe_depths"] == [3, 4], case
        assert direct["depth_method"] == "direct" and ext["layers"] == direct["layers"] == 5, case
        assert ext["peak_gib"] == pytest.approx(direct["peak_gib"], rel=1e-9, abs=1e-9), case
        assert ext["host_gib"] == pytest.approx(direct["host_gib"], rel=1e-9, abs=1e-9), case
        meas = direct["categories"]["measured"]
        assert ext["categories"]["measured"] == pytest.approx(meas, rel=1e-9, abs=1e-9), case
        assert ext["planner_gib"] == direct["planner_gib"], case
    assert recs[0]["categories"]["measured"]["Activation"] > recs[2]["categories"]["measured"]["Activation"]


def test_depth_method_refuses_probes_off_the_checkpointing_period():
    from usp.bench.fake_memory import main

    with pytest.raises(ValueError, match="ac_every_k=2"):
        main(
            [
                "--seq-len",
                "16K",
                "--layers",
                "5",
                "--depth-method",
                "extrapolate",
                "--probe-depths",
                "2,3",
                "parallel.activation_checkpointing=every_k",
                "parallel.ac_every_k=2",
            ]
        )
    with pytest.raises(ValueError, match="--probe-depths"):
        main(["--seq-len", "16K", "--probe-depths", "3,2"])
    with pytest.raises(ValueError, match="--from-plan"):
        main(["--seq-len", "16K", "--from-plan"])


def test_json_stdout_is_the_record_alone():
    """``--json | jq`` works: with MLP tiles (whose DeepSpeed part prints an accelerator banner to stdout when
    DeepSpeed loads) the command's stdout is exactly one JSON object; the banner goes to stderr."""
    import json
    import os
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "usp.bench.fake_memory", "--nodes", "1", "--gpus-per-node", "1"]
    cmd += ["--seq-len", "4K", "--layers", "1", "parallel.mlp_tiles=2", "--json"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    record = json.loads(out.stdout)  # the whole of stdout, not its JSON-looking lines
    assert record["seq_len"] == 4096 and record["layers"] == 1
