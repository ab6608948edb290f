"""The planner's LoRA (usp.plan.lora): the trainable count, the optimizer and gradient bytes, the saved
activations, the model FLOPs and the longest sequence, each against what torch and peft actually do on a tiny
Llama with ``usp.model.lora.apply_lora``."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from usp.model.lora import LoraSpec, apply_lora
from usp.plan import LoraPlan, get_device, load_model_spec, max_seq_len
from usp.plan.compute import model_flops_per_token, training_flops
from usp.plan.hardware import GPUS
from usp.plan.lora import (
    adapter_params,
    matmul_params,
    total_params,
    trainable_matmul_params,
    trainable_params,
)
from usp.plan.memory import activation_bytes_per_token_layer, device_states_bytes, training_memory

TINY = dict(
    hidden_size=64,
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_hidden_layers=2,
    vocab_size=100,
)
# (target_modules, train_embeddings_and_norms, tie_word_embeddings)
SETTINGS = [
    (None, False, False),
    (None, True, False),
    (("q_proj", "v_proj"), False, False),
    (("q_proj", "v_proj"), True, True),
    (None, True, True),
]
IDS = ["default", "default+emb", "qv", "qv+emb-tied", "default+emb-tied"]


def _tiny_lora(targets, train_embeddings_and_norms, tied, rank=4, attn="sdpa"):
    """A tiny random Llama with peft adapters as usp injects them, and its planner spec and plan."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = TINY | {"tie_word_embeddings": tied}
    cfg = LlamaConfig(**config)
    cfg._attn_implementation = attn
    model = LlamaForCausalLM(cfg)
    spec = LoraSpec(rank=rank, target_modules=targets, train_embeddings_and_norms=train_embeddings_and_norms)
    apply_lora(model, spec)
    plan = LoraPlan(rank, train_embeddings_and_norms, targets)
    return model, load_model_spec(config), plan


@pytest.mark.parametrize("targets,emb,tied", SETTINGS, ids=IDS)
def test_trainable_count_is_what_requires_grad(targets, emb, tied):
    """The planner's parameter counts are the model's after ``apply_lora``; the trainer's count of the plain
    model (usp.train.flops, what the step's MFU uses) agrees with the planner's."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from usp.train.flops import count_lora_matmul_params, count_matmul_params

    model, spec, plan = _tiny_lora(targets, emb, tied)
    params = list(model.parameters())  # each tensor once (a tied LM head is the embedding)
    assert sum(p.numel() for p in params if p.requires_grad) == trainable_params(spec, plan)
    assert sum(p.numel() for p in params) == total_params(spec, plan)
    adapters = sum(p.numel() for n, p in model.named_parameters() if ".lora_" in n)
    assert adapters == adapter_params(spec, plan) > 0
    # the trainer counts on the plain model, before the adapters are injected
    plain = LlamaForCausalLM(LlamaConfig(**TINY | {"tie_word_embeddings": tied}))
    lora = LoraSpec(rank=plan.rank, target_modules=targets, train_embeddings_and_norms=emb)
    assert count_matmul_params(plain) == spec.matmul_params
    assert count_lora_matmul_params(plain, lora) == (adapters, trainable_matmul_params(spec, plan))
    # and after injection every nn.Linear (base and adapters) is the N the FLOPs count
    assert count_matmul_params(model) == matmul_params(spec, plan)


@pytest.mark.parametrize("accumulating", [False, True])
@pytest.mark.parametrize("targets,emb,tied", SETTINGS[:3], ids=IDS[:3])
def test_states_are_what_adamw_allocates(targets, emb, tied, accumulating):
    """The sharded states of a world of one: the fp32 parameters (all of them, the frozen base too), the Adam
    moments torch's AdamW allocates for the trainable parameters (``exp_avg``, ``exp_avg_sq``, after one step on
    CPU) and, with gradient accumulation, their fp32 gradients."""
    model, spec, plan = _tiny_lora(targets, emb, tied)
    ids = torch.randint(0, TINY["vocab_size"], (1, 32))
    model(ids, labels=ids).loss.backward()
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-3)
    optimizer.step()
    params = sum(p.nbytes for p in model.parameters())
    grads = sum(p.grad.nbytes for p in model.parameters() if p.grad is not None)
    moments = sum(
        t.nbytes
        for state in optimizer.state.values()
        for k, t in state.items()
        if k in ("exp_avg", "exp_avg_sq")
    )
    assert len(optimizer.state) == len(trainable) and grads == 4 * trainable_params(spec, plan)
    # the states of full training are four times the parameters; with LoRA far less
    assert device_states_bytes(spec, 1, lora=plan) == params + grads + moments < 4 * params
    mem = training_memory(
        spec,
        replace(GPUS["cpu"], reserved_gib=0.0),
        seq_len=64,
        world_size=1,
        node_size=1,
        compute_bytes=4,
        overhead_frac=0.0,
        lora=plan,
        global_batch=2 if accumulating else None,
    )
    # before the backward (the loss's and the top layer's peaks) the gradients exist only when accumulating
    assert mem.sharded_states == params + moments + (grads if accumulating else 0)


def _saved_by_one_layer(model, dtype, tiled):
    """Bytes per token autograd keeps for the first decoder layer of ``model`` (its input requiring grad, as
    every layer's does below a trained one), weights and the rotary tables left out."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    model = model.to(dtype)
    layer = model.model.layers[0]
    if tiled:
        from usp.train.tiling import apply_sequence_tiling

        apply_sequence_tiling([layer], None, 4)
    T = 64
    x = torch.randn(1, T, TINY["hidden_size"], dtype=dtype, requires_grad=True)
    pos = torch.arange(T)[None]
    cos, sin = LlamaRotaryEmbedding(model.config)(x, pos)
    skip = {t.untyped_storage().data_ptr() for t in [*layer.parameters(), cos, sin]}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() not in skip:
            saved[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x, position_embeddings=(cos, sin), attention_mask=None, position_ids=pos)
    return sum(saved.values()) / T


@pytest.mark.parametrize("tiled", [False, True], ids=["plain", "tiled"])
@pytest.mark.parametrize("dtype,compute_bytes", [(torch.bfloat16, 2), (torch.float32, 4)])
@pytest.mark.parametrize(
    "targets,emb",
    [(None, False), (None, True), (("q_proj", "v_proj"), False), (("o_proj", "down_proj"), True)],
    ids=["default", "default+emb", "qv", "o,down+emb"],
)
def test_layer_activations_match_what_autograd_saves(targets, emb, dtype, compute_bytes, tiled):
    """A LoRA decoder layer keeps no input of a frozen layer, no normalized input of a frozen norm, and the
    adapters' ``r``-wide ``A`` outputs: the planner's per-token bytes are what autograd saves (Ulysses 1)."""
    model, spec, plan = _tiny_lora(targets, emb, False)
    measured = _saved_by_one_layer(model, dtype, tiled)
    assert measured == activation_bytes_per_token_layer(spec, 1, compute_bytes, tiled, lora=plan)
    # not the count of the same layer trained whole (its norms' normalized inputs, every projection's input)
    if not tiled:
        assert measured != activation_bytes_per_token_layer(spec, 1, compute_bytes, tiled)


HELD_SHAPE = dict(TINY, hidden_size=128, intermediate_size=512, num_attention_heads=8, num_hidden_layers=3)


def _held_after_forward(lora: bool, activation_checkpointing: str, S: int) -> int:
    """Bytes the allocator holds after the trainer's forward (checkpointing, the chunked loss) of a tiny Llama,
    fp32 on CPU, with rank-8 adapters or trained whole (as tests/test_plan_memory.py measures)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from usp.bench.track_memory import track_memory
    from usp.train.loss import ChunkedCausalLMLoss
    from usp.train.parallelize import apply_activation_checkpointing, decoder_layers

    torch.manual_seed(0)
    cfg = LlamaConfig(**HELD_SHAPE)
    cfg._attn_implementation = "sdpa"
    model = LlamaForCausalLM(cfg)
    if lora:
        apply_lora(model, LoraSpec(rank=8))
    apply_activation_checkpointing(decoder_layers(model), activation_checkpointing)
    loss_model = ChunkedCausalLMLoss(model, chunk_size=1024)
    ids, pos = torch.randint(0, 100, (1, S)), torch.arange(S)[None]
    with track_memory("cpu") as forward:
        loss = loss_model(ids, ids, position_ids=pos)
    loss.backward()
    return forward.held_bytes


@pytest.mark.parametrize("activation_checkpointing", ["none", "full"])
def test_held_bytes_of_a_lora_forward(activation_checkpointing):
    """What a whole LoRA model keeps after the trainer's forward is the planner's held bytes, and what it keeps
    less than full training is what the planner says it saves (frozen norms' normalized inputs, the final norm's
    too, the projections' inputs no adapter reads, less the adapters' own)."""
    from usp.plan.memory import held_activation_bytes

    S = 4096
    spec = load_model_spec(HELD_SHAPE)
    kw = dict(
        seq_len=S, activation_checkpointing=activation_checkpointing, compute_bytes=4, loss_chunk_size=1024
    )
    lora, full = held_activation_bytes(spec, lora=LoraPlan(8), **kw), held_activation_bytes(spec, **kw)
    if activation_checkpointing == "none":
        # the first layer's input norm keeps nothing (nothing below it trains): 4 h + 4 bytes per token less
        lora = lora | {"total": lora["total"] - (4 * 128 + 4) * S}
    else:  # the checkpoints keep RoPE's tables outside the allocator's count (tests/test_plan_memory.py)
        lora = lora | {"total": lora["total"] - lora["rotary"]}
        full = full | {"total": full["total"] - full["rotary"]}
    measured_lora = _held_after_forward(True, activation_checkpointing, S)
    measured_full = _held_after_forward(False, activation_checkpointing, S)
    assert measured_lora == pytest.approx(lora["total"], rel=0.05)
    assert measured_full - measured_lora == pytest.approx(full["total"] - lora["total"], rel=0.05)
    assert measured_lora < measured_full


def _matmul_flops(model, ids) -> int:
    """FLOPs torch's FlopCounterMode counts in the linear layers' matmuls (``mm``, ``addmm``) of one forward and
    backward of the plain cross-entropy (attention is ``bmm`` / SDPA, left out)."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        model(ids, labels=ids).loss.backward()
    counts = counter.get_flop_counts()["Global"]
    return sum(v for op, v in counts.items() if str(op).split(".")[1] in ("mm", "addmm"))


@pytest.mark.parametrize("targets,emb,tied", SETTINGS, ids=IDS)
def test_lora_flops_are_what_the_matmuls_count(targets, emb, tied):
    """``4 N + 2 N_t`` per token (N every matmul weight, adapters included; N_t the trainable ones) is torch's
    count of the matmuls of a forward and backward with a frozen base. Without trained embeddings the first
    layer's q/k/v (and their adapters' A) compute no input gradient, nothing below them needing one: the model
    FLOPs count it (``2 (in x out + r x in)`` per token each), a convention under 1/L of the attention's."""
    model, spec, plan = _tiny_lora(targets, emb, tied)
    T = 48
    ids = torch.randint(0, TINY["vocab_size"], (1, T))
    measured = _matmul_flops(model, ids)
    N, Nt = matmul_params(spec, plan), trainable_matmul_params(spec, plan)
    assert Nt is not None and Nt < N
    skipped = 0
    if not emb:
        h, d = spec.hidden_size, spec.head_dim
        for name, out in (
            ("q_proj", spec.num_heads * d),
            ("k_proj", spec.num_kv_heads * d),
            ("v_proj", spec.num_kv_heads * d),
        ):
            skipped += h * out + (plan.rank * h if targets is None or name in targets else 0)
    assert measured == (4 * N + 2 * Nt - 2 * skipped) * T
    # the model-FLOP count: these matmuls and the attention, per token
    dense = (
        model_flops_per_token(spec, T, lora=plan) * T
        - 12 * spec.num_heads * spec.head_dim * spec.num_layers * T * (T + 1) / 2
    )
    assert dense == pytest.approx((4 * N + 2 * Nt) * T, rel=1e-12)
    # full training of the same model: every weight's gradient, 6 N (unchanged by the LoRA argument)
    model.requires_grad_(True)
    assert _matmul_flops(model, ids) == 6 * N * T


def test_training_flops_default_is_six_n():
    """``trainable_matmul_params=None`` is full training's ``6 N`` exactly; all of them trainable is the same;
    none trainable (a frozen model) ``4 N``; the attention term never changes."""
    kw = dict(matmul_params=1000, num_layers=2, num_heads=4, head_dim=8, document_lengths=[[16, 8]])
    attention = 3 * 4 * 4 * 8 * 2 * (16 * 17 / 2 + 8 * 9 / 2)
    assert training_flops(**kw) == 6 * 1000 * 24 + attention
    assert training_flops(**kw, trainable_matmul_params=1000) == training_flops(**kw)
    assert training_flops(**kw, trainable_matmul_params=0) == 4 * 1000 * 24 + attention
    assert training_flops(**kw, trainable_matmul_params=10) == (4000 + 20) * 24 + attention
    with pytest.raises(ValueError, match="trainable_matmul_params"):
        training_flops(**kw, trainable_matmul_params=1001)
    spec = load_model_spec("llama-3-70b")
    full = model_flops_per_token(spec, 8192)
    assert model_flops_per_token(spec, 8192, lora=None) == full
    assert model_flops_per_token(spec, 8192, lora=LoraPlan(16)) < full * 0.7


def test_lora_trains_longer_sequences_than_full_training():
    """On the same cluster LoRA fits at least the length full training does (llama-3.1-8b, 8 x H100, states on
    the device): only the trainable parameters carry gradients and moments."""
    spec, h100 = load_model_spec("llama-3.1-8b"), get_device("h100-80g")
    kw = dict(world_size=8, node_size=8, states=("device",))
    full = max_seq_len(spec, h100, **kw)
    lora = max_seq_len(spec, h100, lora=LoraPlan(16, True), **kw)
    assert lora.max_seq_len >= full.max_seq_len
    assert lora.estimate.memory_gib["sharded_states"] < full.estimate.memory_gib["sharded_states"] / 3
    assert lora.estimate.lora == LoraPlan(16, True) and "model.lora.rank=16" in lora.overrides()


def test_cli_plans_llama3_70b_lora_on_one_node(capsys):
    """``usp-plan --max-seq-len --lora-rank 16`` answers for Llama-3-70B on one node of 8 H100s, longer than
    full training there (which needs its states on the host to fit at all)."""
    from usp.plan import cli

    base = [
        "--model",
        "llama-3-70b",
        "--max-seq-len",
        "--nodes",
        "1",
        "--gpus-per-node",
        "8",
        "--gpu",
        "h100-80g",
    ]
    assert cli.main([*base, "--json", "--top", "3"]) == 0
    full = json.loads(capsys.readouterr().out)
    assert (
        cli.main([*base, "--lora-rank", "16", "--lora-train-embeddings-and-norms", "--json", "--top", "3"])
        == 0
    )
    lora = json.loads(capsys.readouterr().out)
    assert lora[0]["max_seq_len"] > 2 * full[0]["max_seq_len"]
    assert full[0]["states"] == "cpu_offload"
    assert {"model.lora.rank=16", "model.lora.train_embeddings_and_norms=true"} <= set(lora[0]["overrides"])
    assert cli.main([*base, "--lora-rank", "16"]) == 0
    table = capsys.readouterr().out
    assert "LoRA rank 16: 0.207B of 70.76B parameters train" in table
    assert cli.main([*base, "--lora-train-embeddings-and-norms"]) != 0  # a LoRA flag needs a rank
    assert "--lora-rank" in capsys.readouterr().err


def test_fsdp_reduces_only_the_trainable_gradients():
    """All-gathers move every parameter (the adapters too), the reduce-scatter only the trainable gradients."""
    from usp.plan.comm import fsdp_comm

    spec, h100, plan = load_model_spec("llama-3-70b"), get_device("h100-80g"), LoraPlan(16, True)
    kw = dict(world_size=8, node_size=8, fsdp_mode="full_shard")
    full, lora = fsdp_comm(spec, h100, **kw), fsdp_comm(spec, h100, lora=plan, **kw)
    assert full["fsdp_bytes"] == spec.num_params * 7 / 8 * (2 * 2 + 4)
    assert lora["fsdp_bytes"] == pytest.approx(
        (total_params(spec, plan) * 2 * 2 + trainable_params(spec, plan) * 4) * 7 / 8, rel=1e-12
    )


def test_auto_degrees_plan_with_the_runs_lora():
    """``parallel.ulysses_degree=auto`` plans what the run trains: Llama-3-70B at 128K on one node fits with the
    recipe's adapters, and not as full training with the states on the device."""
    from usp.config.compose import compose_config
    from usp.plan.models import PRESETS
    from usp.plan.request import PlanRequest

    overrides = [
        "model.path=/ckpt/model",
        "data.prepared_path=/data/prepared",
        "parallel.ulysses_degree=auto",
    ]
    cfg = compose_config(["recipe=llama3_70b_lora_128k", *overrides, "parallel.ring_degree=auto"])
    request = PlanRequest.from_config(cfg)
    assert request.lora == LoraPlan(16, True)
    assert request.auto_constraints()["lora"] == LoraPlan(16, True)
    layout = request.plan_auto(PRESETS["llama-3-70b"], world_size=8, node_size=8, gpu="h100-80g")
    assert layout.ulysses_degree * layout.ring_degree * layout.dp_degree == 8
    assert "LoRA rank 16 + embeddings and norms" in layout.reason
    with pytest.raises(ValueError, match="no layout"):
        replace(request, lora_rank=0).plan_auto(
            PRESETS["llama-3-70b"], world_size=8, node_size=8, gpu="h100-80g"
        )
