"""Peak memory of one rank during a training step, item by item.

Precision assumed (FSDP2 mixed precision, what ``usp.train`` runs): fp32 sharded parameters, fp32 sharded
gradients and two fp32 Adam moments (16 bytes per parameter, divided by the shard degree); bf16 parameters
all-gathered for compute; bf16 activations; fp32 gradient reduction.

Saved activations of one Llama decoder layer, per local token, in bytes (``B`` the compute dtype's size, ``h``
hidden, ``H`` query heads, ``d`` head dim, ``I`` MLP width, ``kv = max(KV heads, ulysses_degree)`` after GQA
replication), as autograd keeps them for the Hugging Face layer (measured in ``tests/test_plan_memory.py``)::

    2 h (4 + 2B)     each RMSNorm: its input upcast to fp32, the normalized input, the output (= next matmul input)
    (H + 2kv) d B    q, k, v after the all-to-all (kept by the attention kernel)
    H d B (x2 if U>1) attention output (kept by the kernel); the o_proj input is a view of it, or with
                     Ulysses the separate result of the all-to-all back
    4 H + 8          log-sum-exp and the two norms' rsqrt, fp32
    4 I B            gate, up, silu(gate), silu(gate) * up

Outside the layers a forward keeps the rotary tables (cos and sin, ``2 d B`` per token, shared by every layer)
and the final RMSNorm's ``h (4 + 2B)`` (as a layer's norm; its output is what the chunked loss keeps).

With ``full`` checkpointing a layer keeps only its input (``h``) and one layer is recomputed at a time.
With ``offload`` those inputs live in host memory: the device holds :data:`OFFLOAD_DEVICE_CHECKPOINTS` of them
(the one being copied out or prefetched back, and the one in use) instead of ``L``.

With ``mlp_tiles = T > 1`` (:mod:`usp.train.tiling`) every RMSNorm is fused into its consumers, which run
over the sequence in ``T`` tiles and recompute each tile in backward: the post-attention norm and the MLP in
one tile (keeping the residual stream, ``B h``), the input norm inside each of the q/k/v projections (keeping
the layer input, ``B h``), the final norm inside the loss chunks (keeping the pre-norm hidden, ``B h``). A
layer keeps ``2 B h + (H + 2kv) d B + H d B (x2 if U>1) + 4 H`` per token: no norm output, nothing of the
MLP, no rsqrt; one MLP tile's ``4 I B s / T`` exists at a time. Of those ``2 B h``, the layer input is the
checkpoint's own when the layer is checkpointed: the recomputed layer adds ``B h`` less (measured in
``tests/test_plan_memory.py``).

Gathered parameters (FSDP2, more than one rank or states on the host): through every layer's backward, the
current layer and the prefetched one in ``B`` bytes plus one fp32 unsharded layer gradient, and the root unit
(embedding, final norm, LM head), which FSDP2 does not reshard after forward and reduce-scatters only after the
whole backward: its parameters in ``B`` bytes and the LM head's ``[V, h]`` gradient.

Sharded states: 16 B per parameter on the device; with them offloaded (``offload``: FSDP2 CPU offload, what
``parallel.cpu_offload=true`` and an ``optim.name`` that steps on the host both select) nothing stays on the
device between uses.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from usp.modes import AC_MODES
from usp.plan.comm import ACT_BYTES, kv_block_bytes
from usp.plan.hardware import GIB, DeviceSpec
from usp.plan.layout import Candidate, Workload
from usp.plan.models import ModelSpec

STATE_BYTES_PER_PARAM = 16  # fp32 master param + fp32 grad + Adam m and v
OFFLOAD_DEVICE_CHECKPOINTS = 2  # checkpoint offload: the layer input in flight + the one in use


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes per rank at the peak of a training step."""

    sharded_states: float
    gathered_params: float
    activations: float
    attention_workspace: float
    loss_buffer: float
    overhead: float

    def items(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) for f in fields(self)}  # (asdict deep-copies: slow in a search)

    @property
    def total(self) -> float:
        return sum(self.items().values())

    @property
    def total_gib(self) -> float:
        return self.total / GIB

    def as_gib(self) -> dict[str, float]:
        return {k: v / GIB for k, v in self.items().items()} | {"total": self.total_gib}


def activation_bytes_per_token_layer(
    model: ModelSpec, ulysses_degree: int, compute_bytes: int = ACT_BYTES, tiled: bool = False
) -> int:
    """Saved activations of one decoder layer per local token, in bytes (module docstring).

    ``tiled`` (``mlp_tiles > 1``, :mod:`usp.train.tiling`): the RMSNorms are recomputed per tile by their
    consumers, so the layer keeps its input (``B h``, for the q/k/v tiles) and the residual after attention
    (``B h``, for the norm + MLP tiles) instead of ``2 h (4 + 2B)``, two rsqrt and the MLP's ``4 I B``."""
    h, d, H, B = model.hidden_size, model.head_dim, model.num_heads, compute_bytes
    kv = model.kv_heads_per_rank(ulysses_degree) * ulysses_degree  # max(Hkv, U) when even
    attention = (H + 2 * kv) * d * B + H * d * B * (2 if ulysses_degree > 1 else 1)
    if tiled:
        return 2 * h * B + attention + 4 * H
    norms = 2 * h * (4 + 2 * B)
    return norms + attention + 4 * H + 8 + mlp_bytes_per_token(model, compute_bytes)


def mlp_bytes_per_token(model: ModelSpec, compute_bytes: int = ACT_BYTES) -> int:
    """What the MLP keeps per token for backward: gate, up, silu(gate), silu(gate) * up (``4 I B``)."""
    return 4 * model.intermediate_size * compute_bytes


def check_mlp_tiles(mlp_tiles: int, local_tokens: float) -> None:
    """``parallel.mlp_tiles`` must be an integer >= 1 that splits the local tokens evenly."""
    if isinstance(mlp_tiles, bool) or not isinstance(mlp_tiles, int) or mlp_tiles < 1:
        raise ValueError(f"parallel.mlp_tiles={mlp_tiles!r} is invalid: use an integer >= 1 (1 = off) or auto.")
    if mlp_tiles > 1 and local_tokens % mlp_tiles:
        raise ValueError(
            f"parallel.mlp_tiles={mlp_tiles} does not divide the {local_tokens:g} local tokens per rank; use a "
            "divisor of seq_len / (ulysses_degree x ring_degree)."
        )


def device_states_bytes(model: ModelSpec, shard: int, *, offload: bool = False) -> float:
    """Sharded parameters, gradients and optimizer states left on one device (module docstring)."""
    if offload:
        return 0.0
    return model.num_params * STATE_BYTES_PER_PARAM / shard


# Keyword forms: the public API. The planner itself passes a Workload and a Candidate to the functions below.


def held_activation_bytes(
    model: ModelSpec,
    *,
    seq_len: int,
    ulysses_degree: int,
    ring_degree: int,
    activation_checkpointing: str = "none",
    ac_every_k: int = 2,
    mlp_tiles: int = 1,
    micro_batch_size: int = 1,
    compute_bytes: int = ACT_BYTES,
) -> dict[str, float]:
    """:func:`held_bytes` of this workload and layout (no sharding enters the held bytes)."""
    work = Workload(model, seq_len, micro_batch_size=micro_batch_size, compute_bytes=compute_bytes)
    ranks = ulysses_degree * ring_degree
    cand = Candidate(
        ulysses_degree, ring_degree, world_size=ranks, node_size=ranks,
        activation_checkpointing=activation_checkpointing, ac_every_k=ac_every_k, mlp_tiles=mlp_tiles,
    )  # fmt: skip
    return held_bytes(work, cand)


def training_memory(
    model: ModelSpec,
    device: DeviceSpec,
    *,
    seq_len: int,
    ulysses_degree: int,
    ring_degree: int,
    world_size: int,
    node_size: int,
    fsdp_mode: str = "full_shard",
    activation_checkpointing: str = "none",
    ac_every_k: int = 2,
    micro_batch_size: int = 1,
    loss_chunk_size: int = 4096,
    overhead_frac: float = 0.08,
    offload: bool = False,
    compute_bytes: int = ACT_BYTES,
    mlp_tiles: int = 1,
    attn_head_chunks: int = 1,
) -> MemoryBreakdown:
    """:func:`peak_memory` of this workload and layout; ``offload`` puts the sharded states on the host."""
    work = Workload(
        model, seq_len, micro_batch_size=micro_batch_size, compute_bytes=compute_bytes,
        loss_chunk_size=loss_chunk_size, overhead_frac=overhead_frac,
    )  # fmt: skip
    cand = Candidate(
        ulysses_degree, ring_degree, world_size=world_size, node_size=node_size, fsdp_mode=fsdp_mode,
        activation_checkpointing=activation_checkpointing, ac_every_k=ac_every_k, mlp_tiles=mlp_tiles,
        attn_head_chunks=attn_head_chunks, states="cpu_offload" if offload else "device",
    )  # fmt: skip
    return peak_memory(work, cand, device)


def held_bytes(work: Workload, cand: Candidate) -> dict[str, float]:
    """Bytes autograd keeps on the device at the end of a training forward, per rank (what
    :func:`usp.train.memory.track_memory` measures as held bytes): ``layers`` (every saved activation of the
    layers that are not checkpointed, the input of those that are, nothing of the inputs ``offload`` moved to
    the host), ``rotary`` (cos and sin) and ``final_norm`` (what the final norm and the loss keep: with tiles
    only the pre-norm hidden, ``B h`` per token); ``total`` their sum."""
    model, seq_len, micro_batch_size, compute_bytes = work.model, work.seq_len, work.micro_batch_size, work.compute_bytes
    ulysses_degree, ring_degree = cand.ulysses_degree, cand.ring_degree
    activation_checkpointing, ac_every_k, mlp_tiles = cand.activation_checkpointing, cand.ac_every_k, cand.mlp_tiles
    B, h = compute_bytes, model.hidden_size
    s = seq_len / (ulysses_degree * ring_degree) * micro_batch_size
    check_mlp_tiles(mlp_tiles, s)
    tiled = mlp_tiles > 1
    per_layer = activation_bytes_per_token_layer(model, ulysses_degree, B, tiled)
    n_ckpt = checkpointed_layers(model.num_layers, activation_checkpointing, ac_every_k)
    inputs = 0 if activation_checkpointing == "offload" else n_ckpt
    out = {
        "layers": ((model.num_layers - n_ckpt) * per_layer + inputs * h * B) * s,
        "rotary": 2 * model.head_dim * B * s,
        "final_norm": (h * B if tiled else h * (4 + 2 * B)) * s,
    }
    return out | {"total": sum(out.values())}


def checkpointed_layers(num_layers: int, activation_checkpointing: str, ac_every_k: int = 2) -> int:
    """How many decoder layers keep only their input (and recompute their forward in backward)."""
    if activation_checkpointing == "none":
        return 0
    if activation_checkpointing in ("full", "offload"):
        return num_layers
    if activation_checkpointing == "every_k":
        if ac_every_k < 1:
            raise ValueError(f"parallel.ac_every_k={ac_every_k} must be >= 1.")
        return num_layers // ac_every_k
    raise ValueError(
        f"parallel.activation_checkpointing={activation_checkpointing!r} is invalid; use {AC_MODES}."
    )


def shard_degree(world_size: int, node_size: int, fsdp_mode: str) -> int:
    """Ranks a parameter is sharded over: all of them (full_shard) or the node (hybrid_shard)."""
    if fsdp_mode == "full_shard":
        return world_size
    if fsdp_mode == "hybrid_shard":
        return min(node_size, world_size)
    raise ValueError(f"parallel.fsdp_mode={fsdp_mode!r} is invalid; choose full_shard or hybrid_shard.")


def peak_memory(work: Workload, cand: Candidate, device: DeviceSpec) -> MemoryBreakdown:
    """Peak bytes per rank on the device. ``offload`` moves the sharded states to host memory (FSDP2 CPU
    offload); ``activation_checkpointing=offload`` keeps the layer inputs there; ``mlp_tiles`` runs the MLPs
    and norms in tiles (module docstring); ``attn_head_chunks`` runs the ring over that many groups of heads
    in turn, dividing its K/V, dK/dV and fp32 accumulator buffers by it; ``compute_bytes`` is 2 for bf16 compute, 4 for an fp32 run. Host
    bytes: :func:`usp.plan.offload.host_memory`."""
    model, seq_len, micro_batch_size, compute_bytes = work.model, work.seq_len, work.micro_batch_size, work.compute_bytes
    loss_chunk_size, overhead_frac = work.loss_chunk_size, work.overhead_frac
    world_size, node_size, fsdp_mode, offload = cand.world_size, cand.node_size, cand.fsdp_mode, cand.states_on_host
    activation_checkpointing, ac_every_k = cand.activation_checkpointing, cand.ac_every_k
    mlp_tiles, attn_head_chunks = cand.mlp_tiles, cand.attn_head_chunks
    ulysses_degree, ring_degree = cand.ulysses_degree, cand.ring_degree
    B = compute_bytes
    U, R = ulysses_degree, ring_degree
    s = seq_len / (U * R) * micro_batch_size  # local tokens
    h, d, H = model.hidden_size, model.head_dim, model.num_heads
    kv = model.kv_heads_per_rank(U) * U  # max(Hkv, U) when even
    check_mlp_tiles(mlp_tiles, s)

    shard = shard_degree(world_size, node_size, fsdp_mode)
    states = device_states_bytes(model, shard, offload=offload)
    # Through every layer's backward (on one rank without offload the parameters are used where they live:
    # nothing is gathered): the current layer and the prefetched one in bf16, plus one fp32 unsharded gradient
    # waiting for reduction; and the root unit (embedding, final norm, LM head), which FSDP2 does not reshard
    # after forward and reduce-scatters only after the whole backward: its bf16 parameters and the LM head's
    # gradient (the loss's backward runs first; tied or not, a [vocab, h] gradient). The root's own reduction
    # at the end (its fp32 gradient copy) comes when the layers' activations are gone.
    root = (model.embedding_params + model.head_params + h) * B + model.vocab_size * h * B
    gathered = 0.0 if world_size == 1 and not offload else root + model.layer_params * (2 * B + 4)

    mlp = mlp_bytes_per_token(model, B) * s
    per_layer = activation_bytes_per_token_layer(model, U, B, tiled=mlp_tiles > 1) * s
    n_ckpt = checkpointed_layers(model.num_layers, activation_checkpointing, ac_every_k)
    held = held_activation_bytes(
        model, seq_len=seq_len, ulysses_degree=U, ring_degree=R, activation_checkpointing=activation_checkpointing,
        ac_every_k=ac_every_k, mlp_tiles=mlp_tiles, micro_batch_size=micro_batch_size, compute_bytes=B,
    )  # fmt: skip
    # checkpoint offload: the input being copied out (forward) or prefetched (backward) and the one in use
    in_flight = min(n_ckpt, OFFLOAD_DEVICE_CHECKPOINTS) * h * s * B if activation_checkpointing == "offload" else 0
    # the recomputed layer's saved tensors; under tiles its input (kept by the q/k/v tiles) is the checkpoint's,
    # already counted among the held or in-flight inputs
    recompute = (per_layer - (h * B * s if mlp_tiles > 1 else 0.0)) if n_ckpt else 0.0
    tile = mlp / mlp_tiles if mlp_tiles > 1 else 0.0  # one MLP tile in flight (forward, or its recompute)
    activations = held["layers"] + held["rotary"] + in_flight + recompute + tile

    qkv = s * (H + 2 * kv) * d * B
    workspace = qkv  # dq, dk, dv of the layer in backward
    if U > 1:
        workspace += qkv  # all-to-all send and receive buffers live together
    if R > 1:
        block = kv_block_bytes(model, seq_len, U, R, B) * micro_batch_size
        block_fp32 = kv_block_bytes(model, seq_len, U, R, 4) * micro_batch_size
        # K/V current + next (compute dtype), dK/dV current + next (fp32), fp32 output / dq accumulator; with
        # parallel.attn_head_chunks they exist for one group of heads at a time.
        workspace += (2 * block + 2 * block_fp32 + s * H * d * 4) / attn_head_chunks

    chunk = min(loss_chunk_size, s)
    # One checkpointed chunk of the cross-entropy at its peak (log-softmax backward): the fp32 log-probabilities it
    # saved, their gradient and the gradient it returns, 3 x 4 B per logit; plus what the final norm and the loss
    # keep (with tiles the final norm runs inside the chunks: the pre-norm hidden only).
    loss = chunk * model.vocab_size * 12 + held["final_norm"]

    subtotal = states + gathered + activations + workspace + loss
    overhead = overhead_frac * subtotal + device.reserved_gib * GIB
    return MemoryBreakdown(states, gathered, activations, workspace, loss, overhead)
