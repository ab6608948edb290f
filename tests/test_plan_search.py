"""Layout search, ``auto_degrees``, the ``usp-plan`` command line and its answers to impossible requests."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest

from usp.config import OptimConfig, ParallelConfig
from usp.parallel import ParallelLayout, sequence_multiple
from usp.plan import (
    NoFeasibleLayoutError,
    auto_degrees,
    evaluate_layout,
    get_device,
    load_model_spec,
    plan_layouts,
)
from usp.plan.cli import main, parse_seq_len
from usp.plan.maxlen import max_seq_len


def test_parse_seq_len():
    assert parse_seq_len("1M") == 1_048_576
    assert parse_seq_len("128K") == 131_072 == parse_seq_len("131072") == parse_seq_len("128k")
    with pytest.raises(Exception, match="seq-len"):
        parse_seq_len("lots")


def test_ranked_layouts_are_valid_and_fit():
    model, device = load_model_spec("llama-3.1-8b"), get_device("h100-80g")
    layouts = plan_layouts(model, device, seq_len=2**20, world_size=32, node_size=8)
    assert layouts
    for e in layouts:
        assert e.fits and e.mem_gib_per_gpu <= 80
        dims = ParallelLayout(32, e.ulysses_degree, e.ring_degree, e.dp_degree, node_size=8)
        assert e.layout is not None and e.layout.replace(ring_layout="zigzag") == e.layout
        assert e.ulysses_degree <= 8 and dims.sp_degree * e.dp_degree == 32
        assert 2**20 % sequence_multiple(e.ring_degree, e.ulysses_degree, "zigzag") == 0
        assert 32 % e.ulysses_degree == 0 and e.mfu < 1
        # tokens/s/GPU and step time agree: one sequence of 2^20 tokens per dp rank per step
        assert e.tokens_per_s_per_gpu * e.step_time_s * 32 == pytest.approx(e.dp_degree * 2**20)
    # the first is within 2% of the fastest, and no fitting layout beats it by more
    fastest = max(e.tokens_per_s_per_gpu for e in layouts)
    assert layouts[0].tokens_per_s_per_gpu >= 0.98 * fastest


def test_overrides_name_real_config_fields():
    layouts = plan_layouts(
        load_model_spec("llama-3.1-8b"), get_device("h100-80g"), seq_len=2**17, world_size=8, node_size=8
    )
    fields = {
        "parallel": {f.name for f in dataclasses.fields(ParallelConfig)},
        "optim": {f.name for f in dataclasses.fields(OptimConfig)},
    }
    tiled = [e for e in layouts if e.mlp_tiles > 1]
    assert tiled and any(e.activation_checkpointing == "offload" for e in layouts)
    optim = plan_layouts(
        load_model_spec("llama-3.1-8b"),
        get_device("h100-80g"),
        seq_len=2**17,
        world_size=8,
        node_size=8,
        states=("cpu_offload",),
    )
    for e in layouts + optim:
        for item in e.overrides():
            key, value = item.split("=")
            section, name = key.split(".")
            assert name in fields[section], item
            assert value != ""


def test_auto_degrees_tiny_cpu_model(tiny_config):
    out = auto_degrees(tiny_config, seq_len=256, world_size=4, node_size=4, gpu="cpu")
    assert isinstance(out, ParallelLayout)  # the run's own layout type, validated
    assert out.world_size == 4 and out.node_size == 4 and out.sp_degree * out.dp_degree == 4
    assert 256 % sequence_multiple(out.ring_degree, out.ulysses_degree, "zigzag") == 0
    assert out.fsdp_mode in ("full_shard", "hybrid_shard")
    assert out.activation_checkpointing in ("none", "full", "every_k")
    assert "fastest" in out.reason


def test_auto_degrees_memory_limit_forces_checkpointing():
    # Llama-3.1-8B on 8 GPUs: 32K tokens leave room to keep every activation (none is fastest); at 256K with
    # 40 GiB only full checkpointing fits (every other layer would need far more); with 36 GiB it needs MLP
    # tiles or checkpoint offload, and offload costs no compute, tiles do
    cfg = {
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "intermediate_size": 14336,
        "vocab_size": 128256,
    }
    roomy = auto_degrees(cfg, seq_len=2**15, world_size=8, node_size=8, gpu="h100-80g")
    tight = auto_degrees(cfg, seq_len=2**18, world_size=8, node_size=8, gpu="h100-80g", memory_gib=40)
    tighter = auto_degrees(cfg, seq_len=2**18, world_size=8, node_size=8, gpu="h100-80g", memory_gib=36)
    assert roomy.activation_checkpointing == "none" and roomy.mlp_tiles == 1  # a fixed count stays
    assert tight.activation_checkpointing == "full"
    assert tighter.activation_checkpointing == "offload"
    # with mlp_tiles=auto the planner may tile: here full checkpointing fits with 2 tiles
    tiled = auto_degrees(
        cfg,
        seq_len=2**18,
        world_size=8,
        node_size=8,
        gpu="h100-80g",
        memory_gib=36,
        activation_checkpointing="full",
        mlp_tiles="auto",
    )
    assert (tiled.activation_checkpointing, tiled.mlp_tiles) == ("full", 2)
    with pytest.raises(ValueError, match="offload"):
        auto_degrees(cfg, seq_len=2**18, world_size=8, node_size=8, gpu="h100-80g", memory_gib=26)


def test_no_layout_fits_says_why_and_what_would():
    with pytest.raises(NoFeasibleLayoutError) as err:
        plan_layouts(
            load_model_spec("llama-3.1-8b"), get_device("h100-80g"), seq_len=2**23, world_size=8, node_size=8
        )
    msg = str(err.value)
    assert isinstance(err.value, ValueError)
    assert "Smallest need" in msg and "more GPUs" in msg and "trainer.seq_len=" in msg
    assert "checkpointing" in msg
    # the shorter sequence it names fits, on multiples of lcm(1024, 2 x 8), and is near the longest that
    # --max-seq-len finds with the states on the device (whose search also tries more tiles and loss chunks, on
    # multiples of its own granularity: the advice's finer steps may land up to one of them beyond it)
    shorter = int(re.search(r"a shorter sequence: trainer.seq_len=(\d+) fits", msg).group(1))
    best = max_seq_len(
        load_model_spec("llama-3.1-8b"), get_device("h100-80g"), world_size=8, node_size=8, states=("device",)
    )
    longest = best.max_seq_len
    assert shorter % 1024 == 0 and longest * 15 / 16 <= shorter < longest + best.granularity
    # 70B on one node of 40 GB cards: sharded states alone overflow; offload (with a shorter sequence) fits
    with pytest.raises(NoFeasibleLayoutError, match="offload"):
        plan_layouts(
            load_model_spec("llama-3-70b"), get_device("a100-40g"), seq_len=2**20, world_size=8, node_size=8
        )


def test_checkpointing_suggested_when_the_user_ruled_it_out():
    with pytest.raises(NoFeasibleLayoutError, match="activation_checkpointing=full"):
        plan_layouts(
            load_model_spec("llama-3.1-8b"),
            get_device("h100-80g"),
            seq_len=2**21,
            world_size=32,
            node_size=8,
            ac_modes=("none",),
            attn_head_chunks=1,
        )


def test_heads_that_cannot_split(tmp_path, capsys, tiny_config):
    cfg = tmp_path / "config.json"
    cfg.write_text(
        json.dumps(tiny_config | {"num_attention_heads": 12, "num_key_value_heads": 4, "hidden_size": 768})
    )
    args = ["--model", str(cfg), "--seq-len", "64K", "--nodes", "1", "--gpus-per-node", "16"]
    rc = main(args + ["--ulysses-degree", "16"])
    err = capsys.readouterr().err
    assert rc == 2
    assert "num_attention_heads=12 leaves a Ulysses rank without a query head at ulysses_degree=16" in err
    assert "1..12" in err  # the degrees that would split
    spec = load_model_spec(str(cfg))
    assert spec.ulysses_split_error(8) is None  # uneven: 2 / 1 query heads per rank
    assert spec.ulysses_split_error(6) is None and spec.ulysses_split_error(12) is None
    assert (spec.q_heads_per_rank(8), spec.ulysses_head_imbalance(8)) == (2, 16 / 12)


def test_cli_done_when_command(capsys):
    rc = main(
        [
            "--model",
            "llama-3.1-8b",
            "--seq-len",
            "1M",
            "--nodes",
            "4",
            "--gpus-per-node",
            "8",
            "--gpu",
            "h100-80g",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0
    assert "ulysses" in out and "tok/s/GPU" in out
    overrides = out.strip().splitlines()[-1].split()
    keys = [o.split("=")[0] for o in overrides]
    assert keys[:5] == [
        "parallel.ulysses_degree",
        "parallel.ring_degree",
        "parallel.dp_degree",
        "parallel.fsdp_mode",
        "parallel.activation_checkpointing",
    ]
    u, r, d = (int(o.split("=")[1]) for o in overrides[:3])
    assert u * r * d == 32


def test_cli_json_and_inference(capsys):
    assert (
        main(["--model", "llama-3.1-8b", "--seq-len", "128K", "--nodes", "2", "--gpu", "h200", "--json"]) == 0
    )
    layouts = json.loads(capsys.readouterr().out)
    required = {
        "ulysses_degree",
        "ring_degree",
        "dp_degree",
        "mem_gib_per_gpu",
        "step_time_s",
        "tokens_per_s_per_gpu",
        "mfu",
    }
    assert layouts and all(required <= set(x) for x in layouts)
    assert all(x["mem_gib_per_gpu"] <= 141 for x in layouts)
    # each row hands over the run's layout type: the record start-up builds the mesh from
    for x in layouts:
        layout = ParallelLayout.from_dict(x["layout"])
        assert (layout.ulysses_degree, layout.ring_degree, layout.dp_degree) == (
            x["ulysses_degree"],
            x["ring_degree"],
            x["dp_degree"],
        )
        assert layout.world_size == 16 and layout.node_size == 8 and layout.to_dict() == x["layout"]
    argv = [
        "--model",
        "llama-3-70b",
        "--seq-len",
        "1000000",
        "--nodes",
        "1",
        "--gpu",
        "a100-80g",
        "--inference",
        "--json",
    ]
    assert main(argv) == 0
    plans = json.loads(capsys.readouterr().out)
    assert plans and all((required | {"kv_cache_gb_per_gpu"}) <= set(x) for x in plans)
    assert {x["kv_cache_gb_per_gpu"] for x in plans} == {40.96}


def test_cli_explicit_device_and_bad_values(capsys):
    argv = [
        "--model",
        "llama-2-7b",
        "--seq-len",
        "32K",
        "--gpu-mem-gib",
        "48",
        "--peak-tflops",
        "180",
        "--intra-node-gbps",
        "64",
        "--inter-node-gbps",
        "12.5",
        "--json",
    ]
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)
    assert main(["--model", "llama-2-7b", "--seq-len", "32K", "--gpu", "tpu-v9"]) == 2
    assert "--gpu='tpu-v9' is unknown" in capsys.readouterr().err
    assert main(["--model", "no-such-model", "--seq-len", "32K"]) == 2
    assert "preset" in capsys.readouterr().err
    # a global batch of 3 sequences on 8 GPUs: only dp=1 splits it, as 3 accumulation steps
    assert main(["--model", "llama-2-7b", "--seq-len", "32K", "--global-batch", "3", "--json"]) == 0
    layouts = json.loads(capsys.readouterr().out)
    assert layouts and all(x["dp_degree"] == 1 and x["grad_accum_steps"] == 3 for x in layouts)


def test_evaluate_layout_refuses_invalid_layouts(tiny_config):
    model, device = load_model_spec("llama-3.1-8b"), get_device("h100-80g")
    kw = dict(seq_len=2**17, world_size=16, node_size=8)
    with pytest.raises(ValueError, match="span nodes"):  # Ulysses 16 over nodes of 8
        evaluate_layout(model, device, ulysses_degree=16, ring_degree=1, **kw)
    with pytest.raises(ValueError, match="does not divide the world size"):
        evaluate_layout(model, device, ulysses_degree=8, ring_degree=3, **kw)
    twelve = load_model_spec(
        tiny_config | {"num_attention_heads": 12, "num_key_value_heads": 4, "hidden_size": 768}
    )
    with pytest.raises(ValueError, match="num_attention_heads=12 leaves a Ulysses rank without a query head"):
        evaluate_layout(
            twelve, device, ulysses_degree=16, ring_degree=1, seq_len=2**12, world_size=16, node_size=16
        )
    with pytest.raises(ValueError, match="multiple of 2"):
        evaluate_layout(model, device, ulysses_degree=4, ring_degree=2, global_batch=3, **kw)


def test_cli_float32_costs_more_memory(capsys):
    base = [
        "--model",
        "llama-3.1-8b",
        "--seq-len",
        "32K",
        "--json",
        "--ulysses-degree",
        "8",
        "--ring-degree",
        "1",
    ]
    assert main(base) == 0
    bf16 = {
        (x["fsdp_mode"], x["activation_checkpointing"], x["mlp_tiles"]): x
        for x in json.loads(capsys.readouterr().out)
    }
    assert main(base + ["--dtype", "float32"]) == 0
    fp32 = {
        (x["fsdp_mode"], x["activation_checkpointing"], x["mlp_tiles"]): x
        for x in json.loads(capsys.readouterr().out)
    }
    assert len(fp32.keys() & bf16.keys()) >= 2
    for key in fp32.keys() & bf16.keys():
        # the activations, gathered copies and buffers double (the two may peak in different phases of the
        # step, so compare the sums); the fp32 master states do not, and the peak is higher
        tensors = [
            sum(
                v for k, v in x[key]["memory_gib"].items() if k not in ("total", "overhead", "sharded_states")
            )
            for x in (fp32, bf16)
        ]
        assert tensors[1] < tensors[0] <= 2 * tensors[1] + 1e-9
        assert fp32[key]["mem_gib_per_gpu"] > bf16[key]["mem_gib_per_gpu"]


def test_cli_efficiency_flags_scale_the_compute(capsys):
    base = [
        "--model",
        "llama-3.1-8b",
        "--seq-len",
        "64K",
        "--json",
        "--ulysses-degree",
        "8",
        "--ring-degree",
        "1",
    ]
    assert main(base + ["--attention-efficiency", "0.5", "--dense-efficiency", "0.6"]) == 0
    ref = json.loads(capsys.readouterr().out)[0]
    assert main(base + ["--attention-efficiency", "0.25", "--dense-efficiency", "0.3"]) == 0
    half = {(x["fsdp_mode"], x["activation_checkpointing"]): x for x in json.loads(capsys.readouterr().out)}
    same = half[(ref["fsdp_mode"], ref["activation_checkpointing"])]
    assert same["time_s"]["attention_s"] == pytest.approx(2 * ref["time_s"]["attention_s"])
    assert same["time_s"]["dense_s"] == pytest.approx(2 * ref["time_s"]["dense_s"])
    assert main(base + ["--attention-efficiency", "1.5"]) == 2
    assert "--attention-efficiency=1.5 must be in (0, 1]" in capsys.readouterr().err


def test_cli_overrides_carry_gradient_accumulation(capsys):
    assert main(["--model", "llama-3.1-8b", "--seq-len", "128K", "--nodes", "2", "--global-batch", "8"]) == 0
    overrides = capsys.readouterr().out.strip().splitlines()[-1].split()
    values = dict(o.split("=") for o in overrides)
    dp = int(values["parallel.dp_degree"])
    assert int(values.get("trainer.grad_accum_steps", "1")) * dp == 8
    assert values["trainer.seq_len"] == "131072"


def test_inference_that_does_not_fit(capsys):
    # 405B in bf16 is 812 GB: 8 x 40 GB cannot hold even the weights
    argv = [
        "--model",
        "llama-3.1-405b",
        "--seq-len",
        "1M",
        "--nodes",
        "1",
        "--gpu",
        "a100-40g",
        "--inference",
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "does not fit 8 x a100-40g" in err and "more GPUs" in err


def test_auto_degrees_keeps_what_the_user_fixed(tiny_config):
    free = auto_degrees(tiny_config, seq_len=256, world_size=4, node_size=2, gpu="cpu")
    other_u = 1 if free.ulysses_degree != 1 else 2
    for fixed in ({"ulysses_degree": other_u}, {"ring_degree": 4 // other_u}):
        out = auto_degrees(tiny_config, seq_len=256, world_size=4, node_size=2, gpu="cpu", **fixed)
        assert all(getattr(out, k) == v for k, v in fixed.items()), (fixed, out)
        assert out.ulysses_degree * out.ring_degree * out.dp_degree == 4
        assert "fixed" in out.reason
    modes = auto_degrees(
        tiny_config,
        seq_len=256,
        world_size=4,
        node_size=2,
        gpu="cpu",
        fsdp_mode="hybrid_shard",
        activation_checkpointing="every_k",
        ac_every_k=1,
    )
    assert (modes.fsdp_mode, modes.activation_checkpointing, modes.ac_every_k) == (
        "hybrid_shard",
        "every_k",
        1,
    )
    f32 = auto_degrees(
        tiny_config,
        seq_len=256,
        world_size=4,
        node_size=2,
        gpu="cpu",
        compute_bytes=4,
        ring_layout="contiguous",
        ulysses_degree=1,
    )
    assert f32.ulysses_degree == 1 and f32.ring_degree * f32.dp_degree == 4


def test_auto_degrees_with_states_on_the_host_and_little_host_memory():
    cfg = load_model_spec("llama-3.1-8b")
    hf = {
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "intermediate_size": 14336,
        "vocab_size": 128256,
    }
    assert cfg.num_params == load_model_spec(hf).num_params
    # one H100, 256K tokens: 128 GB of fp32 states do not fit on the device; on the host (optim.name=
    # deepspeed_cpu_adam) they do, with the layer inputs offloaded and the MLPs/norms tiled when asked
    with pytest.raises(ValueError, match="no layout"):
        auto_degrees(hf, seq_len=2**18, world_size=1, node_size=1, gpu="h100-80g", mlp_tiles="auto")
    out = auto_degrees(
        hf, seq_len=2**18, world_size=1, node_size=1, gpu="h100-80g", mlp_tiles="auto", cpu_offload=True
    )
    assert out.activation_checkpointing == "offload" and out.mlp_tiles > 1
    # with 32 GiB of host RAM the 128 GB of states do not fit on the host either
    with pytest.raises(ValueError, match="no layout"):
        auto_degrees(
            hf,
            seq_len=2**18,
            world_size=1,
            node_size=1,
            gpu="h100-80g",
            mlp_tiles="auto",
            cpu_offload=True,
            host_mem_gib=32,
        )
