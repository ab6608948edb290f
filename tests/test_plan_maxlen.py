"""``usp-plan --max-seq-len``: the longest trainable sequence, its validity, monotonicity, and the offload terms."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from usp.parallel import sequence_multiple
from usp.plan import evaluate_layout, get_device, load_model_spec, plan_layouts
from usp.plan.cli import main
from usp.plan.hardware import GB, GIB
from usp.plan.maxlen import max_seq_len, max_seq_lens
from usp.plan.offload import HOST_ADAM_BYTES_PER_PARAM, host_memory, offload_time
from usp.plan.search import head_chunk_candidates

LLAMA8 = load_model_spec("llama-3.1-8b")
H100 = get_device("h100-80g")
REQUIRED = {
    "max_seq_len",
    "ulysses_degree",
    "ring_degree",
    "activation_checkpointing",
    "mlp_tiles",
    "mem_gib_per_gpu",
    "host_mem_gib_per_node",
    "step_time_s",
    "mfu",
}


def _layout_kw(a) -> dict:
    e = a.estimate
    return dict(
        ulysses_degree=e.ulysses_degree,
        ring_degree=e.ring_degree,
        fsdp_mode=e.fsdp_mode,
        activation_checkpointing=e.activation_checkpointing,
        ac_every_k=e.ac_every_k,
        mlp_tiles=e.mlp_tiles,
        states_on_host=e.states == "cpu_offload",
        attn_head_chunks=e.attn_head_chunks,
    )


def test_cli_max_seq_len_json_fields_and_validity(capsys):
    argv = ["--model", "llama-3.1-8b", "--max-seq-len", "--nodes", "1", "--gpus-per-node", "8", "--json"]
    assert main(argv) == 0
    answers = json.loads(capsys.readouterr().out)
    assert answers and all(REQUIRED <= set(a) for a in answers)
    lengths = [a["max_seq_len"] for a in answers]
    assert lengths == sorted(lengths, reverse=True)
    for a in answers:
        U, R, T = a["ulysses_degree"], a["ring_degree"], a["mlp_tiles"]
        # the trainer's rules: zigzag's 2 x ring x ulysses, and the tiles split the local tokens
        assert a["max_seq_len"] % sequence_multiple(R, U, "zigzag") == 0
        assert (a["max_seq_len"] // (U * R)) % T == 0
        assert a["mem_gib_per_gpu"] + 0.075 * 80 <= 80 + 1e-6
        assert a["host_mem_gib_per_node"] <= 0.85 * 2048
        assert 0 < a["mfu"] < 1 and a["step_time_s"] > 0
        assert f"trainer.seq_len={a['max_seq_len']}" in a["overrides"]
    # the text form names the same answer and its overrides
    assert main(argv[:-1]) == 0
    out = capsys.readouterr().out
    assert f"longest sequence {answers[0]['max_seq_len']} tokens" in out
    assert "parallel.activation_checkpointing=" in out.splitlines()[-1]


def test_the_answer_is_the_longest_for_its_layout():
    """At the answer the layout fits; one granularity step longer it does not (with as many tiles as allowed)."""
    for a in max_seq_lens(LLAMA8, H100, world_size=8, node_size=8)[:4]:
        kw = _layout_kw(a) | dict(world_size=8, node_size=8)
        assert evaluate_layout(LLAMA8, H100, seq_len=a.max_seq_len, **kw).fits
        most_chunks = (
            head_chunk_candidates(LLAMA8, a.estimate.ulysses_degree)[-1] if a.estimate.ring_degree > 1 else 1
        )
        longer = kw | {"mlp_tiles": 64, "attn_head_chunks": most_chunks}
        assert not evaluate_layout(LLAMA8, H100, seq_len=a.max_seq_len + a.granularity, **longer).fits
        # auto tiles: the fewest that fit at that length
        if a.estimate.mlp_tiles > 1:
            fewer = kw | {"mlp_tiles": a.estimate.mlp_tiles // 2}
            assert not evaluate_layout(LLAMA8, H100, seq_len=a.max_seq_len, **fewer).fits
        # auto head chunks: likewise the fewest that fit
        if a.estimate.attn_head_chunks > 1:
            fewer = kw | {"attn_head_chunks": a.estimate.attn_head_chunks // 2}
            assert not evaluate_layout(LLAMA8, H100, seq_len=a.max_seq_len, **fewer).fits


def test_max_seq_len_is_monotone_in_gpus_memory_and_host_memory():
    by_world = [
        max_seq_len(LLAMA8, H100, world_size=w, node_size=min(w, 8)).max_seq_len for w in (1, 2, 4, 8, 16)
    ]
    assert by_world == sorted(by_world) and by_world[-1] > 4 * by_world[0]
    by_mem = [
        max_seq_len(LLAMA8, get_device("h100-80g", memory_gib=m), world_size=8, node_size=8).max_seq_len
        for m in (40, 60, 80, 141)
    ]
    assert by_mem == sorted(by_mem) and by_mem[-1] > by_mem[0]
    by_host = [
        max_seq_len(LLAMA8, get_device("h100-80g", host_mem_gib=g), world_size=8, node_size=8).max_seq_len
        for g in (64, 256, 2048)
    ]
    assert by_host == sorted(by_host) and by_host[-1] > by_host[0]


def test_restricting_the_tricks_never_lengthens():
    full = max_seq_len(LLAMA8, H100, world_size=8, node_size=8)
    plain = max_seq_len(
        LLAMA8,
        H100,
        world_size=8,
        node_size=8,
        states=("device",),
        mlp_tiles=1,
        ac_modes=("none", "every_k", "full"),
        attn_head_chunks=1,
    )
    assert plain.estimate.tricks == 0 and full.max_seq_len > plain.max_seq_len
    # without the tricks the answer is what --seq-len ranking allows: it fits there, not one step longer
    kw = dict(
        world_size=8,
        node_size=8,
        states=("device",),
        mlp_tiles=1,
        ac_modes=("none", "every_k", "full"),
        attn_head_chunks=1,
    )
    assert plan_layouts(LLAMA8, H100, seq_len=plain.max_seq_len, **kw)
    with pytest.raises(ValueError, match="no layout"):
        plan_layouts(LLAMA8, H100, seq_len=plain.max_seq_len + 2 * plain.granularity, **kw)


def test_headroom_keeps_the_best_layout_off_the_limit():
    # 8B at 144K on 2 x 8 H100 (Ulysses 8, ring 2: 9216 local tokens) keeping every activation: the peak is the
    # loss's backward, by hand
    S, s, V, h = 147_456, 9216, 128_256, 4096
    layer_params = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336 + 2 * 4096
    root_params = 2 * V * h + h
    states = 12 * LLAMA8.num_params / 16  # fp32 parameters, Adam m and v, over 16 ranks (no gradients yet)
    gathered = (
        2 * root_params + 2 * layer_params + 2 * V * h
    )  # bf16 root, the prefetched top layer, head grad
    # per layer and token: 2 norms 2 x 4096 x (4 + 2 x 2), q/k/v (32 + 16) x 128 x 2, the output and the
    # all-to-all's copy 2 x 32 x 128 x 2, lse and rsqrt 4 x 32 + 8, MLP 4 x 14336 x 2
    per_token_layer = 2 * 4096 * 8 + 48 * 128 * 2 + 2 * 32 * 128 * 2 + 136 + 4 * 14336 * 2
    assert per_token_layer == 209_032
    acts = 32 * per_token_layer * s + 2 * 128 * 2 * s  # + rotary cos, sin
    # one fp32 loss chunk x 3 buffers; what the final norm keeps; the gradient of the final hidden states
    loss = 4096 * V * 12 + h * (4 + 2 * 2) * s + h * 2 * s
    tensors = states + gathered + acts + loss
    # 5% fragmentation, CUDA context + cuBLAS 0.6 GiB, NCCL 0.5 GiB for each of FSDP's, Ulysses' and ring's groups
    expected = (1.05 * tensors + (0.6 + 3 * 0.5) * GIB) / GIB
    assert 76 < expected < 79  # within the 6 GiB headroom of the 80
    none = evaluate_layout(
        LLAMA8, H100, seq_len=S, ulysses_degree=8, ring_degree=2, world_size=16, node_size=8
    )
    assert none.mem_gib_per_gpu == pytest.approx(expected, rel=1e-9)
    assert not none.fits and none.headroom_gib == pytest.approx(6.0)
    assert evaluate_layout(
        LLAMA8, H100, seq_len=S, ulysses_degree=8, ring_degree=2, world_size=16, node_size=8, headroom_gib=0
    ).fits
    for e in plan_layouts(LLAMA8, H100, seq_len=S, world_size=16, node_size=8):
        assert e.mem_gib_per_gpu <= 80 - 6.0


def test_tricks_only_when_needed():
    # 8K on 8 GPUs: everything fits plainly, nothing is offloaded, tiled or chunked: the overrides name the
    # layout and the checkpointing only
    best = plan_layouts(LLAMA8, H100, seq_len=2**13, world_size=8, node_size=8)[0]
    assert best.tricks == 0 and best.activation_checkpointing != "offload"
    tricks = ("parallel.mlp_tiles", "parallel.attn_head_chunks", "optim.name")
    assert not [o for o in best.overrides() if o.startswith(tricks)]
    assert best.overrides()[4].startswith("parallel.activation_checkpointing")
    # 1M on 8 GPUs does not fit plainly; the planner offloads the checkpoints (free in time here) and tiles
    best = plan_layouts(LLAMA8, H100, seq_len=2**20, world_size=8, node_size=8)[0]
    assert best.activation_checkpointing == "offload" and best.tricks >= 1
    assert best.time_s["ckpt_offload_exposed_s"] == 0.0  # the copies hide behind each layer's compute


def test_host_memory_and_offload_time_by_hand():
    S, U = 2**22, 8
    s = S // U  # 524,288 local tokens
    host = host_memory(
        LLAMA8,
        seq_len=S,
        ulysses_degree=U,
        ring_degree=1,
        world_size=8,
        node_size=8,
        activation_checkpointing="offload",
        states_on_host=True,
    )
    # 32 layer inputs of 524,288 x 4096 x 2 B = 4 GiB each; fp32 parameter, gradient, Adam m, v: 16 B x 8.03B / 8
    assert host["checkpoints"] == 32 * s * 4096 * 2 == 128 * GIB
    # ... the fp32 parameter and gradient shards pinned one block each, rounded up to a power of two by torch's
    # caching host allocator (the MLP's 28 MiB shards take 32 MiB): more than the 16 B per parameter
    from usp.plan.offload import offloaded_state_bytes, pinned_block_bytes

    assert pinned_block_bytes(4096 * 14336 * 4 / 8) == 32 * 2**20
    assert host["states"] == pytest.approx(offloaded_state_bytes(LLAMA8, 8))
    assert host["states"] > 16 * LLAMA8.num_params / 8
    assert host["node"] == pytest.approx(8 * (128 * GIB + offloaded_state_bytes(LLAMA8, 8)))
    t = offload_time(
        LLAMA8,
        H100,
        seq_len=S,
        ulysses_degree=U,
        ring_degree=1,
        world_size=8,
        node_size=8,
        activation_checkpointing="offload",
        states_on_host=True,
        layer_fwd_s=0.05,
        layer_bwd_s=1.0,
    )
    # 8 GPUs share 300 GB/s of DRAM: 37.5 GB/s each (under the 50 GB/s PCIe link); 4 GiB take 0.115 s
    copy = s * 4096 * 2 / 37.5e9
    assert t["ckpt_copy_s"] == pytest.approx(copy)
    assert t["ckpt_offload_exposed_s"] == pytest.approx(32 * (copy - 0.05))  # the backward hides its copy
    # every micro step the fp32 parameter shard comes in twice (forward, backward) and the gradient goes out
    assert t["fsdp_offload_s"] == pytest.approx(LLAMA8.num_params / 8 * 12 / 37.5e9)
    # the optimizer step on the host: 28 B per parameter of the node over its DRAM bandwidth
    assert t["host_adam_s"] == pytest.approx(LLAMA8.num_params * HOST_ADAM_BYTES_PER_PARAM / (300 * GB))


def test_offload_terms_in_the_device_memory_by_hand():
    from usp.plan.memory import held_activation_bytes, training_memory

    S, U = 2**20, 8
    s = S // U  # 131,072 local tokens
    kw = dict(seq_len=S, ulysses_degree=U, ring_degree=1, world_size=8, node_size=8, overhead_frac=0.0)
    full = training_memory(LLAMA8, H100, activation_checkpointing="full", **kw)
    off = training_memory(LLAMA8, H100, activation_checkpointing="offload", **kw)
    tiled = training_memory(LLAMA8, H100, activation_checkpointing="offload", mlp_tiles=8, **kw)
    opt = training_memory(LLAMA8, H100, activation_checkpointing="offload", states_on_host=True, **kw)
    layer_input = s * 4096 * 2  # 1 GiB
    layer_params = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336 + 2 * 4096
    rotary = 2 * 128 * 2 * s
    # one layer's full activations per token, untiled: 2 norms 2 x 4096 x (4 + 2 x 2), q/k/v (32 + 16) x 128 x 2,
    # output + all-to-all copy 2 x 32 x 128 x 2, lse + rsqrt 4 x 32 + 8, MLP 4 x 14336 x 2
    untiled = 65_536 + 12_288 + 16_384 + 136 + 114_688
    assert untiled == 209_032
    # tiled: the layer input and the residual after attention (2 x 4096 x 2 B) instead of the norms, no rsqrt,
    # nothing of the MLP (one tile of its 4 x 14336 x 2 B in flight)
    tiled_layer = 16_384 + 12_288 + 16_384 + 128
    mlp = 4 * 14336 * 2 * s
    # full: the peak is the top layer's backward: 31 checkpoints below it, its recomputed activations (which
    # replace its own checkpoint), and the larger of its two phases. The MLP phase: two gradients of [s, 14336]
    # beside the one that replaces the product (2 x 14336 x 2 B x s = 7 GiB). The attention phase (smaller):
    # the top layer's input, input norm (4096 x 8 + 4), q/k/v/out/lse after the all-to-all (48 x 128 x 2 +
    # 32 x 128 x 2 + 4 x 32), the output's and the residual's gradients (2 x 8192) per token, and one kernel
    # call over the whole 1M-token sequence: its dq, dk, dv (131,072 x 48 x 128 x 2 B), flash's fp32 softmax_d
    # and dq_accum and the dK/dV expanded to the 4 query heads of the rank
    assert full.activations == 31 * layer_input + untiled * s + rotary
    assert full.attention_workspace == mlp / 2
    qkv = s * 48 * 128 * 2
    kernel = 4 * 4 * S + 4 * S * 4 * 128 + 2 * S * 4 * 128 * 2
    top_attention = (8192 + 4096 * 8 + 4 + 12_288 + 8192 + 128 + 2 * 8192) * s
    assert top_attention + qkv + kernel < untiled * s + mlp / 2
    assert full.sharded_states == 12 * LLAMA8.num_params / 8  # no gradient shard yet
    # offload: 2 inputs on the device (the one in flight, the one in use) instead of 31; the peak moves to the
    # bottom layer's backward, where the 31 layers above have left their fp32 gradient shards
    assert off.activations == 2 * layer_input + untiled * s + rotary
    assert full.activations - off.activations == 29 * layer_input
    assert off.sharded_states == 12 * LLAMA8.num_params / 8 + 4 * layer_params * 31 / 8
    # tiles: the bottom layer's backward; its peak is the attention phase, above the MLP tile's backward phase
    # (the tile's saved 4 x 14336 x 2 B and gradients 2 x 14336 x 2 B per tile token, the tiled MLP's
    # whole-sequence input gradient, and per tile token its normed input, output-gradient slice, input gradient
    # 3 x 4096 x 2 B and the norm's fp32 upcast 4 x 4096 B), which is over by then. The layer holds q/k/v/out/lse
    # and the output's and residual's gradients; its input is the offloaded one in use (one of the 2)
    mlp_phase = mlp / 8 + mlp / 16 + layer_input + (3 * 4096 * 2 + 4 * 4096) * s / 8
    attention_phase = 12_288 + 8192 + 128 + 2 * 8192  # q/k/v, out, lse; the gradients of out and the residual
    assert tiled.activations == 2 * layer_input + attention_phase * s + rotary
    assert tiled.attention_workspace == qkv + kernel
    assert tiled.activations + tiled.attention_workspace > mlp_phase + 2 * layer_input + tiled_layer * s
    # the loss keeps the pre-norm hidden (4096 x 2 B per token; the final norm runs inside its chunks) instead
    # of the final norm's 4096 x (4 + 2 + 2)
    held = {
        t: held_activation_bytes(
            LLAMA8,
            seq_len=S,
            ulysses_degree=U,
            ring_degree=1,
            activation_checkpointing="offload",
            mlp_tiles=t,
        )
        for t in (1, 8)
    }
    assert held[1]["final_norm"] - held[8]["final_norm"] == (8 - 2) * 4096 * s
    # states offloaded: none of the 16 B per parameter shard stays on the device, nor the gradient shards
    assert opt.sharded_states == 0 and opt.activations == off.activations
    with pytest.raises(ValueError, match="parallel.mlp_tiles=3 does not divide"):
        training_memory(LLAMA8, H100, activation_checkpointing="full", mlp_tiles=3, **kw)


def test_bad_input(capsys):
    assert main(["--model", "llama-3.1-8b", "--nodes", "1"]) == 2
    assert "--max-seq-len" in capsys.readouterr().err
    assert main(["--model", "llama-3.1-8b", "--seq-len", "1M", "--max-seq-len"]) == 2
    assert "not both" in capsys.readouterr().err
    assert main(["--model", "llama-3.1-8b", "--max-seq-len", "--mlp-tiles", "0"]) == 2
    assert "--mlp-tiles='0' is invalid" in capsys.readouterr().err
    assert main(["--model", "llama-3.1-8b", "--max-seq-len", "--host-mem-gib", "-1"]) == 2
    assert "--host-mem-gib=-1.0 must be > 0" in capsys.readouterr().err
    assert main(["--model", "llama-3.1-8b", "--max-seq-len", "--headroom-gib", "-2"]) == 2
    assert "--headroom-gib=-2.0 must be >= 0" in capsys.readouterr().err
    assert main(["--model", "llama-3.1-8b", "--max-seq-len", "--ulysses-degree", "3"]) == 2
    assert "--ulysses-degree=3 must divide the world size 8" in capsys.readouterr().err
    assert main(["--model", "llama-3.1-8b", "--max-seq-len", "--nodes", "2", "--ulysses-degree", "16"]) == 2
    assert "every (ulysses, ring) pair was rejected: ulysses=16 ring=1" in capsys.readouterr().err
    tiny = replace(H100, memory_gib=2.0)
    with pytest.raises(ValueError, match="no layout of llama-3.1-8b fits"):
        max_seq_len(LLAMA8, tiny, world_size=1, node_size=1)


def test_offload_copies_show_when_the_host_link_is_slow():
    kw = dict(
        seq_len=2**20,
        ulysses_degree=8,
        ring_degree=1,
        world_size=8,
        node_size=8,
        activation_checkpointing="offload",
    )
    fast = evaluate_layout(LLAMA8, H100, **kw)
    assert fast.time_s["ckpt_offload_exposed_s"] == 0.0  # 1 GiB in 29 ms behind seconds of compute per layer
    # at 0.1 GB/s a 1 GiB layer input takes 10.7 s, more than a layer's forward (~2.7 s here)
    copy = 2**17 * 4096 * 2 / 0.1e9
    slow = evaluate_layout(LLAMA8, get_device("h100-80g", host_link_gbps=0.1), **kw)
    slower = evaluate_layout(LLAMA8, get_device("h100-80g", host_link_gbps=0.05), **kw)
    exposed = slow.time_s["ckpt_offload_exposed_s"]
    assert 32 * (copy - 3.0) < exposed < 2 * 32 * copy
    assert slower.time_s["ckpt_offload_exposed_s"] > exposed + 32 * copy  # twice the copy time, out and back
    assert slow.step_time_s == pytest.approx(fast.step_time_s + exposed)
    assert slow.mem_gib_per_gpu == fast.mem_gib_per_gpu
