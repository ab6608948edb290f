"""Memory per GPU for Llama-3.1-8B, derived term by term by hand, and the model's monotonic sanity."""

from __future__ import annotations

import pytest
import torch

from usp.plan.hardware import GIB, GPUS
from usp.plan.memory import activation_bytes_per_token_layer, training_memory
from usp.plan.models import load_model_spec
from usp.plan.search import enumerate_layouts

LLAMA8 = load_model_spec("llama-3.1-8b")
H100 = GPUS["h100-80g"]


def test_llama31_8b_parameter_count():
    embed = 128256 * 4096  # 525,336,576 (and as many again for the untied LM head)
    layer = 4096 * 4096 * 2 + 4096 * 1024 * 2 + 3 * 4096 * 14336 + 2 * 4096  # q,o + k,v + MLP + norms
    assert layer == 218_112_000
    assert LLAMA8.num_params == 2 * embed + 32 * layer + 4096 == 8_030_261_248


def test_llama31_8b_1m_tokens_32_gpus_ulysses8_ring4_full_checkpointing():
    S, W = 2**20, 32
    mem = training_memory(
        LLAMA8,
        H100,
        seq_len=S,
        ulysses_degree=8,
        ring_degree=4,
        world_size=W,
        node_size=8,
        fsdp_mode="full_shard",
        activation_checkpointing="full",
        loss_chunk_size=4096,
        overhead_frac=0.0,
    )
    s = S // W  # 32,768 local tokens
    # the peak of this step is the top layer's backward (usp.plan.memory: the larger of four peaks)
    # fp32 param + Adam m, v = 12 B/param sharded over all 32 ranks (the fp32 gradient shards come later)
    assert mem.sharded_states == 12 * 8_030_261_248 / 32 == 3_011_347_968
    # the root unit (embedding, final norm, LM head: 1.05B), which FSDP2 keeps gathered in bf16 from its forward
    # to the end of the backward; the LM head's bf16 gradient (525M), from the loss's backward on; the layer and
    # the prefetched one in bf16 and the layer's bf16 gradients (218M each); FSDP2's fp32 reduce-scatter input
    # of the layer above (one unsharded layer gradient)
    root = (2 * 525_336_576 + 4096) * 2 + 525_336_576 * 2
    assert mem.gathered_params == 218_112_000 * 2 * 3 + 218_112_000 * 4 + root == 5_333_147_648
    # one layer's saved activations per token, bytes: two RMSNorms x 4096 x (fp32 input copy 4 + normalized 2 +
    # output 2) = 65,536; q,k,v after the all-to-all with 8 KV heads (32 + 16) x 128 x 2 = 12,288; attention
    # output + the o_proj input after the all-to-all back 2 x 4096 x 2 = 16,384; fp32 lse 4 x 32 + two rsqrt 8
    # = 136; MLP gate, up, silu, product 4 x 14336 x 2 = 114,688
    per_token_layer = 65_536 + 12_288 + 16_384 + 136 + 114_688
    assert per_token_layer == 209_032
    one_layer = per_token_layer * s
    # full checkpointing: the 31 layer inputs below (4096 x 2 B per token), the top layer recomputed, the rotary
    # cos and sin every layer shares (2 x 128 x 2 B per token)
    assert mem.activations == 31 * 4096 * s * 2 + one_layer + 2 * 128 * 2 * s == 15_187_836_928
    # inside the top layer's backward, the larger of two phases (usp.plan.memory, usp.plan.attention_memory).
    # The MLP phase: the activations above, and at the product's backward the gradient of the down projection's
    # input replacing the saved product, the gradients of silu(gate) and of up on top: 2 x 14336 x 2 B
    mlp = 2 * 14336 * 2 * s
    # The attention phase: the 31 inputs below and the rotary tables; of the top layer, its checkpointed input
    # (8,192 B per token), the input norm's fp32 upcast, normalized input, rsqrt and output (4096 x 8 + 4), q, k,
    # v, out after the all-to-all and the fp32 lse (48 x 128 x 2 + 32 x 128 x 2 + 4 x 32), the gradients of the
    # output and of the residual stream (2 x 8,192)
    top_attention = 8192 + (4096 * 8 + 4) + (12_288 + 8192 + 128) + 2 * 8192
    attention_acts = (31 * 8192 + 512 + top_attention) * s
    # ... and the ring backward's peak, a later step (zigzag: all 262,144 queries of the part against half its
    # keys, 4 query heads and 1 KV head here): the fp32 dq accumulator, the fp32 dK/dV accumulators sent and
    # received (2 x 2 blocks), the K/V block in use and the next (2 x 128 MiB); flash's softmax_d, fp32
    # dq_accum and GQA-expanded dK/dV of half the keys, and the call's dq, dk, dv
    q_rows, k_rows = 262_144, 131_072
    block = 2 * q_rows * 1 * 128 * 2
    kernel = 4 * 4 * q_rows + q_rows * 4 * 128 * 4 + 2 * k_rows * 4 * 128 * 2
    call = kernel + (q_rows * 4 + 2 * k_rows * 1) * 128 * 2
    ring = q_rows * 4 * 128 * 4 + 2 * (2 * block) + 2 * block + call
    assert ring == 2_487_222_272
    assert attention_acts + ring < mem.activations + mlp  # the MLP phase is this step's peak
    assert mem.attention_workspace == mlp == 1_879_048_192
    assert mem.loss_buffer == 0  # the loss's own peak (7.4 GiB of chunk buffers) comes when less else is live
    # CUDA context + cuBLAS 0.6 GiB, NCCL 0.5 GiB for each of the FSDP, Ulysses and ring groups; no margin asked
    assert mem.overhead == pytest.approx(0.6 * GIB + 3 * 0.5 * GIB)
    assert mem.total == pytest.approx(3_011_347_968 + 5_333_147_648 + 15_187_836_928 + mlp + 2.1 * GIB)
    assert mem.total_gib == pytest.approx(25.77, abs=0.005)


def test_no_checkpointing_keeps_every_layer():
    S = 2**17
    kw = dict(seq_len=S, ulysses_degree=8, ring_degree=1, world_size=8, node_size=8, overhead_frac=0.0)
    none = training_memory(LLAMA8, H100, activation_checkpointing="none", **kw)
    every2 = training_memory(LLAMA8, H100, activation_checkpointing="every_k", ac_every_k=2, **kw)
    s = S // 8
    one_layer = 209_032 * s  # as above: Ulysses 8 keeps the o_proj input apart from the kernel's output
    rotary = 2 * 128 * 2 * s
    assert none.activations == 32 * one_layer + rotary
    # 16 layers keep everything, 16 keep their input; the top layer (31) is not checkpointed, so its backward
    # comes first with everything held and nothing recomputed
    assert every2.activations == 16 * one_layer + 16 * 4096 * s * 2 + rotary


def test_float32_run_activations_by_hand():
    kw = dict(seq_len=2**16, ulysses_degree=4, ring_degree=2, world_size=8, node_size=8, overhead_frac=0.0)
    bf16 = training_memory(LLAMA8, H100, **kw)
    fp32 = training_memory(LLAMA8, H100, compute_bytes=4, **kw)
    s = 2**16 // 8
    # fp32: norms 2 x 4096 x (4 + 4 + 4), q,k,v (32 + 16) x 128 x 4, out + o_proj input 2 x 4096 x 4, 136, MLP
    # 4 x 14336 x 4 -- the norms' fp32 input copy does not grow, everything else doubles
    assert fp32.activations == 32 * s * (98_304 + 24_576 + 32_768 + 136 + 229_376) + 2 * 128 * 4 * s
    assert bf16.activations == 32 * s * 209_032 + 2 * 128 * 2 * s
    assert fp32.sharded_states == bf16.sharded_states
    # gathered: the root unit's parameters and the LM head's gradient in the compute dtype; in bf16 the peak is
    # the top layer's backward (its 2 copies and its gradients, 3 x 2 B per parameter), in fp32 the loss's
    # backward (the prefetched top layer, 4 B per parameter), where the fp32 logits weigh relatively less
    root_params, head_grad = 2 * 525_336_576 + 4096, 525_336_576
    assert fp32.gathered_params == 218_112_000 * 4 + (root_params + head_grad) * 4
    assert bf16.gathered_params == 218_112_000 * 2 + (root_params + head_grad) * 2


@pytest.mark.parametrize("tiled", [False, True], ids=["plain", "tiled"])
@pytest.mark.parametrize("dtype,compute_bytes", [(torch.bfloat16, 2), (torch.float32, 4)])
def test_activation_bytes_match_what_autograd_saves(dtype, compute_bytes, tiled):
    """Count the bytes autograd keeps for one Hugging Face Llama decoder layer (SDPA keeps the flash set:
    q, k, v, out, lse) and compare with the planner's per-token formula (Ulysses 1). Tiled
    (:func:`usp.train.tiling.apply_sequence_tiling`, 4 tiles): the norms fused into q/k/v and the MLP, the
    layer keeps its input and the residual after attention, no norm output and nothing of the MLP."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    shape = dict(
        hidden_size=96, intermediate_size=160, num_attention_heads=4, num_key_value_heads=2, head_dim=16
    )
    cfg = LlamaConfig(num_hidden_layers=1, vocab_size=100, **shape)
    cfg._attn_implementation = "sdpa"
    layer = LlamaDecoderLayer(cfg, 0).to(dtype)
    if tiled:
        from usp.train.tiling import apply_sequence_tiling

        apply_sequence_tiling([layer], None, 4)
    T = 64
    x = torch.randn(1, T, 96, dtype=dtype, requires_grad=True)
    pos = torch.arange(T)[None]
    cos, sin = LlamaRotaryEmbedding(cfg)(x, pos)
    # weights, and the rotary tables (computed once per model, shared by every layer), are not activations
    skip = {t.untyped_storage().data_ptr() for t in [*layer.parameters(), cos, sin]}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() not in skip:
            saved[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x, position_embeddings=(cos, sin), attention_mask=None, position_ids=pos)
    spec = load_model_spec(shape | {"num_hidden_layers": 1, "vocab_size": 100})
    assert sum(saved.values()) == T * activation_bytes_per_token_layer(spec, 1, compute_bytes, tiled)


def test_more_gpus_never_predict_more_memory_per_gpu():
    S = 2**18
    by_world = {
        w: enumerate_layouts(LLAMA8, H100, seq_len=S, world_size=w, node_size=8)[0] for w in (8, 16, 32, 64)
    }
    mins = [min(e.mem_gib_per_gpu for e in by_world[w]) for w in sorted(by_world)]
    assert mins == sorted(mins, reverse=True) and mins[0] > mins[-1]
    # layout by layout: doubling the world through dp or through the ring never adds memory per GPU
    for w in (8, 16, 32):
        bigger = {
            (
                e.ulysses_degree,
                e.ring_degree,
                e.dp_degree,
                e.fsdp_mode,
                e.activation_checkpointing,
                e.mlp_tiles,
            ): e.mem_gib_per_gpu
            for e in by_world[2 * w]
        }
        for e in by_world[w]:
            for key in (
                (e.ulysses_degree, e.ring_degree, 2 * e.dp_degree, e.fsdp_mode, e.activation_checkpointing),
                (e.ulysses_degree, 2 * e.ring_degree, e.dp_degree, e.fsdp_mode, e.activation_checkpointing),
            ):
                if key in bigger:
                    assert bigger[key] <= e.mem_gib_per_gpu + 1e-9, (w, key)


def test_checkpointing_never_predicts_more_memory():
    layouts, _ = enumerate_layouts(LLAMA8, H100, seq_len=2**18, world_size=16, node_size=8)
    by_layout: dict[tuple, dict[str, float]] = {}
    for e in layouts:
        if e.mlp_tiles > 1:
            continue
        key = (e.ulysses_degree, e.ring_degree, e.fsdp_mode)
        by_layout.setdefault(key, {})[e.activation_checkpointing] = e.mem_gib_per_gpu
    assert len(by_layout) > 5
    for key, m in by_layout.items():
        assert m["full"] <= m["every_k"] <= m["none"], key
        assert m["full"] < m["none"], key


# --- the planner's terms against the memory a training step measurably takes (CPU, usp.bench.track_memory) ---------
MEASURED_SHAPE = dict(
    hidden_size=128,
    intermediate_size=512,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=16,
    num_hidden_layers=3,
    vocab_size=128,
)
MEASURED_TOKENS = (
    4096  # thousands of tokens on one rank: activations dominate the tiny model's 3 MB of gradients
)


def _measure_step(activation_checkpointing: str, mlp_tiles: int) -> tuple[int, int]:
    """Held bytes of a forward (first step) and peak bytes of forward + backward (second step) of the trainer's
    pieces (:mod:`usp.train.tiling`, :mod:`usp.train.checkpoint_offload`, checkpointing, the chunked loss), fp32 on CPU."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from usp.bench.track_memory import track_memory
    from usp.train.checkpoint_offload import HostCheckpointStore
    from usp.train.loss import ChunkedCausalLMLoss
    from usp.train.parallelize import apply_activation_checkpointing, decoder_layers
    from usp.train.tiling import apply_sequence_tiling

    torch.manual_seed(0)
    cfg = LlamaConfig(**MEASURED_SHAPE)
    cfg._attn_implementation = "sdpa"
    model = LlamaForCausalLM(cfg)
    layers = decoder_layers(model)
    apply_sequence_tiling(layers, model.model.norm, mlp_tiles)
    store = HostCheckpointStore("cpu") if activation_checkpointing == "offload" else None
    apply_activation_checkpointing(layers, activation_checkpointing, offload_store=store)
    loss_model = ChunkedCausalLMLoss(model, chunk_size=1024)
    S, V = MEASURED_TOKENS, MEASURED_SHAPE["vocab_size"]
    ids, labels, pos = torch.randint(0, V, (1, S)), torch.randint(0, V, (1, S)), torch.arange(S)[None]
    with track_memory("cpu") as first:
        loss = loss_model(ids, labels, position_ids=pos)
    loss.backward()  # first step: the offload store allocates its host slots (reused from then on)
    peaks = []
    for _ in range(2):  # the same step twice: the larger figure (see below)
        model.zero_grad(set_to_none=True)
        with track_memory("cpu") as second:
            loss_model(ids, labels, position_ids=pos).backward()
        peaks.append(second.peak_bytes)
    # Twice (a loaded run, one full-suite run) the CPU profiler returned a step's figure equal to its forward alone (the
    # backward's allocation events missing; not reproduced in isolation): a missing event can only lower the
    # running sum, so the larger of two identical steps is the measurement.
    return first.held_bytes, max(peaks)


@pytest.mark.parametrize("activation_checkpointing", ["none", "full", "offload"])
@pytest.mark.parametrize("mlp_tiles", [1, 4])
def test_planner_terms_match_the_measured_step(activation_checkpointing, mlp_tiles, request):
    """Held bytes (what autograd keeps after the forward) against :func:`held_activation_bytes`, and the peak
    of a step against the planner's activations + attention workspace + loss buffer + the fp32 gradients,
    within 15% for every checkpointing mode, with and without tiles."""
    from dataclasses import replace

    from usp.plan.memory import held_activation_bytes

    held, peak = _measure_step(activation_checkpointing, mlp_tiles)
    spec = load_model_spec(MEASURED_SHAPE)
    kw = dict(
        seq_len=MEASURED_TOKENS,
        ulysses_degree=1,
        ring_degree=1,
        activation_checkpointing=activation_checkpointing,
        mlp_tiles=mlp_tiles,
        compute_bytes=4,
        loss_chunk_size=1024,  # the step's (four chunks; the last one kept, not recomputed)
    )
    predicted = held_activation_bytes(spec, **kw)
    predicted_held = predicted["total"]
    if activation_checkpointing != "none":
        # the checkpoint keeps RoPE's cos/sin (keyword arguments of every layer) by reference, outside saved-tensor
        # hooks: on the device (the peak below sees them) but not in the held-bytes measurement
        predicted_held -= predicted["rotary"]
    assert held == pytest.approx(predicted_held, rel=0.15)
    mem = training_memory(
        spec,
        replace(GPUS["cpu"], reserved_gib=0.0),
        world_size=1,
        node_size=1,
        overhead_frac=0.0,
        **kw,
    )
    # the measured peak is above the step's start (the parameters exist; no optimizer here): the planner's tensor
    # terms less the fp32 parameters and Adam moments (12 B per parameter) it counts as states
    predicted_peak = mem.total - mem.overhead - 12 * spec.num_params
    assert peak == pytest.approx(predicted_peak, rel=0.15)


def test_planner_counts_the_layers_the_trainer_checkpoints() -> None:
    """``usp.plan.memory.checkpointed_layers`` is the count ``apply_activation_checkpointing`` marks (every_k:
    layers 0, k, 2k, ... so ceil(L / k), odd depths included)."""
    from torch import nn

    from usp.plan.memory import checkpointed_layers
    from usp.train.parallelize import apply_activation_checkpointing

    for layers in (1, 2, 3, 5, 32, 80):
        for mode, k in (("none", 2), ("full", 2), ("every_k", 1), ("every_k", 2), ("every_k", 3)):
            marked = apply_activation_checkpointing([nn.Linear(2, 2) for _ in range(layers)], mode, k)
            assert checkpointed_layers(layers, mode, k) == marked, (layers, mode, k)
