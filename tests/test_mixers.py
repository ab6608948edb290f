"""Hybrid models' mixers under sequence parallelism, one module at a time (:mod:`usp.model.mixers`).

The family matrix (``tests/test_model_families.py``) checks whole hybrid models; here each scheme is pushed
where it breaks first, in float64 on 4 gloo ranks:

- ``halo``: a short convolution whose window (7 tokens) is longer than a rank's runs of consecutive positions
  (4 tokens under u1r4 zigzag), so halos span several runs and ranks; documents of 1 token and documents
  crossing ranks;
- ``heads``: Qwen3-Next's gated DeltaNet with 6 key heads over 4 ranks (an uneven split) and Bamba's Mamba2
  and Falcon-H1's (2 groups of 2 heads: each group's B and C go to two ranks; Falcon-H1's muP multipliers);
  ``gather``: Jamba's Mamba; the same layouts and documents;
- the bytes each scheme sends, counted by ``record_comm`` like attention's, against the formula;
- refusals: a hybrid mixer usp does not implement (``check_model_dir``, before any weight is read) and sharded
  KV-cache decoding of a model with a recurrent state.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch

from tests.exact_model import KeepFloat64
from tests.family_models import REFUSED, family_config
from tests.mesh_cache import cached_sp_mesh
from tests.tolerance import assert_exact
from usp.model.gated_deltanet import head_counts
from usp.model.mixers import HALO, apply_sequence_mixers, mixer_modules
from usp.parallel import gather_sequence, shard_sequence

SEQ_LEN = 32
HIDDEN = 64
LAYOUTS = [  # (ulysses, ring, layout, documents)
    (1, 4, "zigzag", None),
    (1, 4, "zigzag", [0, 5, 6, 19, 32]),
    (2, 2, "zigzag", [0, 1, 2, 30, 32]),
    (4, 1, "contiguous", [0, 16, 17, 32]),
    (1, 4, "balanced", [0, 3, 20, 21, 32]),
    (1, 4, "contiguous", [0, 9, 32]),
]


def _mixer(family: str) -> torch.nn.Module:
    """The first mixer of the family's tiny model (float64, seeded); ``falcon_h1_silu``: Falcon-H1 without its
    gated norm (``mamba_rms_norm=False``, the config's default: ``silu(gate)`` instead)."""
    from transformers import AutoModelForCausalLM

    from tests.family_models import build_family

    if family == "falcon_h1_silu":
        torch.manual_seed(0)
        config = family_config("falcon_h1")
        config.mamba_rms_norm = False
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float64)
    else:
        model = build_family(family)
    return mixer_modules(model)[0][1]


def _long_conv() -> torch.nn.Module:
    """LFM2's short convolution with a 7-token window (longer than a u1r4 zigzag run)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = family_config("lfm2")
    config.conv_L_cache = 7
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float64)
    return mixer_modules(model)[0][1]


def _reference(mixer: torch.nn.Module, x: torch.Tensor, bounds: list[int]) -> torch.Tensor:
    """The unsharded mixer on each document alone."""
    return torch.cat([mixer(x[:, a:b]) for a, b in zip(bounds[:-1], bounds[1:])], dim=1)


def _grads(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


def run_mixer(name: str) -> list[dict] | None:
    """Worker: the reference and every layout's sharded run of one mixer; rank 0 returns them."""
    from usp.attention import record_comm

    with KeepFloat64():
        reference = _long_conv() if name == "long_conv" else _mixer(name)
        g = torch.Generator().manual_seed(5)
        x = torch.randn(1, SEQ_LEN, HIDDEN, generator=g, dtype=torch.float64)
        w = torch.randn(1, SEQ_LEN, HIDDEN, generator=g, dtype=torch.float64)
        results = []
        for u, r, layout, docs in LAYOUTS:
            bounds = docs or [0, SEQ_LEN]
            cu = torch.tensor(bounds, dtype=torch.int32) if docs else None
            ref = copy.deepcopy(reference)
            xr = x.clone().requires_grad_(True)
            (_reference(ref, xr, bounds) * w).sum().backward()
            mesh = cached_sp_mesh(u, r, layout, 1)
            mixer = copy.deepcopy(reference)
            wrapper = torch.nn.Module()
            wrapper.mixer = mixer  # apply_sequence_mixers hooks the mixer's parent (the decoder layer)
            apply_sequence_mixers(wrapper, mesh)
            local = shard_sequence(x, mesh, cu_seqlens=cu).requires_grad_(True)
            with record_comm() as stats:
                out = mixer(local, cu_seq_lens_q=cu)
                (out * shard_sequence(w, mesh, cu_seqlens=cu)).sum().backward()
            grads = _grads(mixer)
            for t in grads.values():
                torch.distributed.all_reduce(t, group=mesh.sp_group)
            results.append(
                {
                    "case": (u, r, layout, docs),
                    "out": gather_sequence(out.detach(), mesh, cu_seqlens=cu),
                    "x_grad": gather_sequence(local.grad, mesh, cu_seqlens=cu),
                    "grads": grads,
                    "ref_out": _reference(ref, x, bounds).detach(),
                    "ref_x_grad": xr.grad,
                    "ref_grads": _grads(ref),
                    "bytes": dict(stats.bytes_by_kind),
                    "scheme": mixer.usp_mixer_state.scheme,
                    "field": mixer.usp_mixer_state.receptive_field,
                }
            )
        return results if torch.distributed.get_rank() == 0 else None


SCHEMES = {
    "long_conv": "halo",
    "qwen3_next": "heads",
    "bamba": "heads",
    "falcon_h1": "heads",
    "jamba": "gather",
}


@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_mixer_is_exact_under_every_layout(dist_pools, name):
    """Outputs, input gradients and parameter gradients equal the unsharded mixer run per document."""
    for case in dist_pools(4).run(run_mixer, name)[0]:
        label = f"{name} {case['case']}"
        assert case["scheme"] == SCHEMES[name], label
        assert_exact(case["out"], case["ref_out"], f"output {label}")
        assert_exact(case["x_grad"], case["ref_x_grad"], f"input grad {label}")
        assert set(case["grads"]) == set(case["ref_grads"]), label
        for param, g in case["ref_grads"].items():
            assert_exact(case["grads"][param], g, f"grad {param} {label}")


def _halo_bytes(u: int, r: int, layout: str, docs: list[int] | None, field: int) -> int:
    """What the halo all-gather sends per rank: ``P - 1`` copies of the widest rank's tails."""
    from usp.model.mixers import _plan

    bounds = tuple(docs or [0, SEQ_LEN])
    plan = _plan(SEQ_LEN, r, u, 0, layout, bounds, field - 1)
    return (u * r - 1) * plan["tail_width"] * HIDDEN * 8


def test_mixer_bytes_are_counted(dist_pools):
    """``record_comm`` counts each scheme's traffic: the gather sends ``(P - 1)`` copies of the rank's
    ``[1, S/P, hidden]`` slice forward, and ``(P - 1) / P`` of the gathered gradient back; the head all-to-all
    sends the other ranks' key head groups of its tokens and gets its own groups' outputs back (and the
    reverse in backward); the halo sends ``P - 1`` copies of the widest rank's tails (at most ``K - 1`` per
    run), and the same back."""
    gathered = dist_pools(4).run(run_mixer, "jamba")[0]
    for case in gathered:
        slice_bytes = SEQ_LEN // 4 * HIDDEN * 8
        assert case["scheme"] == "gather"
        assert case["bytes"] == {"mixer_gather": 3 * slice_bytes, "mixer_gather_grad": 3 * slice_bytes}
    by_heads = dist_pools(4).run(run_mixer, "qwen3_next")[0]
    config = family_config("qwen3_next")
    hk, hv = config.linear_num_key_heads, config.linear_num_value_heads
    dk, dv = config.linear_key_head_dim, config.linear_value_head_dim
    r = hv // hk
    width = 2 * dk + 2 * r * dv + 2 * r  # one key head group's [q | k | v | z | b | a]
    counts = head_counts(hk, 4)  # rank 0 reports: it holds counts[0] key head groups
    token = SEQ_LEN // 4 * 8  # float64 bytes per element of one rank's tokens
    groups_out, groups_back = hk - counts[0], 3 * counts[0]  # all-to-all: sent away / gathered back
    for case in by_heads:
        assert case["scheme"] == "heads"
        assert case["bytes"] == {
            "mixer_heads": token * (groups_out * width + groups_back * r * dv),
            "mixer_heads_grad": token * (groups_back * width + groups_out * r * dv),
        }, case["case"]
    # the planner's formula (usp.plan.mixers) is the busiest rank's: rank 0 holds the most key heads
    from dataclasses import replace

    from usp.plan import load_model_spec

    planned = load_model_spec(config.to_dict()).mixer
    assert planned.comm_bytes(SEQ_LEN // 4, 4, HIDDEN, 8) == sum(by_heads[0]["bytes"].values())
    gather = replace(planned, key_heads=3)  # fewer key heads than ranks: the gather's formula
    assert gather.comm_bytes(SEQ_LEN // 4, 4, HIDDEN, 8) == sum(gathered[0]["bytes"].values())
    mamba = dist_pools(4).run(run_mixer, "bamba")[0]
    planned = load_model_spec(family_config("bamba").to_dict()).mixer
    for case in mamba:  # 4 heads in 2 groups over 4 ranks: each group's B and C to two ranks
        assert case["scheme"] == "heads"
        assert sum(case["bytes"].values()) == planned.comm_bytes(SEQ_LEN // 4, 4, HIDDEN, 8), case["case"]
    planned = load_model_spec(family_config("lfm2").to_dict()).mixer  # width 3: 2-token tails of 4-token runs
    whole = [c for c in dist_pools(4).run(run_mixer, "lfm2")[0] if c["case"][2:] == ("zigzag", None)]
    assert whole  # zigzag without documents: 2 runs a rank, no document start cuts a tail
    for case in whole:
        assert case["scheme"] == HALO
        assert sum(case["bytes"].values()) == planned.comm_bytes(SEQ_LEN // 4, 4, HIDDEN, 8)
    haloed = dist_pools(4).run(run_mixer, "long_conv")[0]
    for case in haloed:
        assert case["scheme"] == HALO and case["field"] == 7
        expected = _halo_bytes(*case["case"], case["field"])
        assert expected > 0
        assert case["bytes"] == {"mixer_halo": expected, "mixer_halo_grad": expected}, case["case"]
        assert expected <= 3 * SEQ_LEN // 4 * HIDDEN * 8, "the halo sends at most what the gather sends"


def test_unimplemented_hybrid_is_refused_before_weights(tmp_path):
    """``check_model_dir`` refuses a hybrid whose mixer usp does not implement from its config alone (there
    are no weight files here), naming the class and the family."""
    from usp.model import check_model_dir

    overrides, field = REFUSED["zamba2"]
    family_config("zamba2", overrides).save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "zamba2"
    with pytest.raises(ValueError, match=field) as err:
        check_model_dir(tmp_path)
    assert "zamba2" in str(err.value) and "Nothing was loaded" in str(err.value)


def run_decode_refusal() -> str:
    from tests.family_models import build_family
    from usp.eval.decode import decode
    from usp.model import apply_usp

    mesh = cached_sp_mesh(2, 2, "zigzag", 1)
    model = apply_usp(build_family("lfm2", dtype=torch.float32).eval(), mesh)
    try:
        decode(model, torch.randint(3, 100, (1, 16)), mesh, 2)
    except ValueError as e:
        return str(e)
    return "no error"


def test_sharded_decoding_refuses_a_recurrent_state(dist_pools):
    """usp's sharded KV cache keeps attention's K/V only: a model with mixers is refused, naming them."""
    messages = dist_pools(4).run(run_decode_refusal)
    assert all("Lfm2ShortConv" in m and "eval=ppl" in m for m in messages), messages


def test_a_mixer_the_gate_does_not_recognise_is_refused_by_its_convolution(monkeypatch):
    """A hybrid whose mixer class no name rule matches (here Falcon-H1's, with the rule narrowed) and whose
    config has no ``layer_types`` telling so: its causal convolution outside every known mixer is refused,
    naming the class, so no future mixer is sharded blindly."""
    import re

    from usp.model import capabilities

    config = family_config("falcon_h1")
    assert not capabilities.model_capabilities(config).refusals
    monkeypatch.setattr(capabilities, "_MIXER_CLASSES", re.compile(r"DeltaNet"))
    refusals = capabilities.model_capabilities(config).refusals
    assert any(r.field == "modules FalconH1Mixer" and "convolution" in r.reason for r in refusals), refusals


def test_mixer_bench_counts_a_quarter_of_the_work_per_rank_on_the_head_exchange():
    """``python -m usp.bench.mixers``' FLOP counts (docs/attention.md's table): at P = 4 the head all-to-all
    does exactly a quarter of the unsharded layer's FLOPs per rank, the gather all of them."""
    from usp.bench.mixers import build_parser, run

    flags = vars(build_parser().parse_args(["--seq", "512", "--docs", "2", "--iters", "1", "--hidden", "64"]))
    world = flags.pop("world")
    flags.pop("out")
    rows = {r["scheme"]: r for r in run(flags, world)["results"]}
    full = rows["unsharded"]["flops_per_rank_max"]
    assert rows["gather"]["flops_per_rank_max"] == full
    assert rows["heads"]["flops_per_rank_max"] * 4 == full
    assert rows["heads"]["bytes_sent_per_rank_max"] > 0 and rows["unsharded"]["bytes_sent_per_rank_max"] == 0
