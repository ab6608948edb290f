"""The parallelize recipe: USP attention, activation checkpointing, FSDP2 — applied from outside, in order.

``parallelize(model, mesh, ...)`` is a short ordered list of ``apply_*`` steps, each taking a mesh and plain
arguments:

0. :func:`usp.model.lora.apply_lora` - low-rank adapters on a frozen base (``lora``; else full training);
1. :func:`usp.model.apply_usp` - attention over the sequence-parallel mesh;
2. :func:`usp.train.tiling.apply_sequence_tiling` - MLPs and RMSNorms over the sequence in tiles
   (``mlp_tiles`` > 1);
3. :func:`apply_activation_checkpointing` - recompute decoder layers in backward (none / full / every k-th /
   offload: full with the saved layer inputs in host memory, :mod:`usp.train.checkpoint_offload`);
4. wrap in :class:`usp.train.loss.ChunkedCausalLMLoss` (decoder + chunked loss in one forward);
5. :func:`apply_fsdp` - FSDP2 ``fully_shard`` per decoder layer, then the root, over every rank
   (``full_shard``: the flattened dp x ring x ulysses axis; ``hybrid_shard``: shard inside a node, replicate
   across nodes). Parameters stay fp32 (the optimizer's master copy); compute runs in ``param_dtype``;
   gradients are reduced in ``reduce_dtype`` and *summed*, not averaged (see :mod:`usp.train.loss`).
   Skipped where FSDP2 would do nothing but copy (:func:`needs_fsdp`: one rank, compute and reduction in the
   weights' own dtype, nothing offloaded): the plain module trains, with the same numbers.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._composable import checkpoint as composable_checkpoint
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from transformers import PreTrainedModel

from usp.model import apply_usp, decoder_of
from usp.model.lora import LoraSpec, apply_lora
from usp.modes import AC_MODES, FSDP_MODES
from usp.parallel import SPMesh
from usp.train.checkpoint_offload import HostCheckpointStore, apply_offload_checkpointing
from usp.train.loss import ChunkedCausalLMLoss
from usp.train.router_loss import is_moe, router_aux_spec
from usp.train.tiling import apply_sequence_tiling


def decoder_layers(model: PreTrainedModel) -> nn.ModuleList:
    """The decoder blocks of a Llama-family causal LM (``model.model.layers``)."""
    layers = getattr(decoder_of(model), "layers", None)
    assert isinstance(layers, nn.ModuleList), f"{type(model).__name__} has no decoder .layers ModuleList"
    return layers


def apply_activation_checkpointing(
    layers: Iterable[nn.Module],
    mode: str,
    every_k: int = 2,
    *,
    offload_store: HostCheckpointStore | None = None,
) -> int:
    """Recompute the chosen decoder layers in backward; returns how many layers were marked.

    ``mode``: ``none``; ``full`` (every layer); ``every_k`` (layers 0, k, 2k, ...); ``offload`` (every layer,
    its saved input in ``offload_store``'s host slots: :func:`usp.train.checkpoint_offload.apply_offload_checkpointing`).
    ``full`` and ``every_k`` use the composable
    (non-reentrant) checkpoint, which keeps parameter names unchanged (checkpoints and exports see the same
    state-dict keys with or without it). Collectives inside attention run again during the recompute, in the
    same order on every rank.
    """
    # the settings were validated with the run (usp.config.validate_choices); these are the callers' contract
    assert mode in AC_MODES, f"activation checkpointing mode {mode!r} is not one of {AC_MODES}"
    assert mode != "every_k" or every_k >= 1, f"ac_every_k={every_k} must be >= 1"
    if mode == "offload":
        assert offload_store is not None, "activation_checkpointing=offload needs a HostCheckpointStore"
        return apply_offload_checkpointing(layers, offload_store)
    n = 0
    for i, layer in enumerate(layers):
        if mode == "full" or (mode == "every_k" and i % every_k == 0):
            composable_checkpoint(layer)
            n += 1
    return n


def build_hsdp_mesh(mesh: SPMesh, node_size: int) -> DeviceMesh:
    """A 2-D ``(replicate, shard)`` DeviceMesh over the same ranks: shard inside a node of ``node_size``.

    Collective: every rank must call it. ``node_size`` must divide the world size. See
    :meth:`usp.parallel.SPMesh.hsdp_mesh` (its groups carry the job's collective timeout).
    """
    return mesh.hsdp_mesh(node_size)


def needs_fsdp(
    world_size: int,
    *,
    weights_dtype: torch.dtype,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    cpu_offload: bool,
) -> bool:
    """Whether the model is wrapped in FSDP2 (the one rule; the trainer, its checkpoints and exports read the
    parameters they get, DTensor or plain). Not when one rank holds everything and FSDP2 would only copy: a
    world of one, compute (``param_dtype``) and gradient reduction (``reduce_dtype``) in the weights' own
    dtype (an fp32 run), no CPU offload. There FSDP2 all-gathers by copying every parameter into its
    unsharded buffer, and reduce-scatters by copying every gradient into a flat fp32 buffer, each step
    (docs/performance.md, issue 34). Each copy is exact, so the plain module computes the same losses,
    gradients and updates, bit for bit (``tests/test_train_run.py``)."""
    identity = param_dtype == weights_dtype and reduce_dtype == weights_dtype
    return world_size > 1 or cpu_offload or not identity


def apply_fsdp(
    root: nn.Module,
    layers: Iterable[nn.Module],
    device_mesh: DeviceMesh,
    *,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype = torch.float32,
    cpu_offload: bool = False,
) -> FSDPModule:
    """FSDP2 ``fully_shard`` on each of ``layers``, then on ``root``; gradients are summed across ranks.

    ``device_mesh``: 1-D (shard over it) or 2-D ``(replicate, shard)`` (HSDP). Each layer's parameters are
    all-gathered in ``param_dtype`` for its forward and freed after it (again for backward); gradients are
    reduce-scattered in ``reduce_dtype`` (all-reduced across replicas under HSDP). The gradient divide factor
    is 1 with sum-only collectives, because the loss is already normalized by the global token count.
    ``cpu_offload`` (CUDA only) keeps the sharded parameters, gradients and optimizer states in host memory;
    they are copied to the device for each all-gather and the optimizer step runs on the CPU.
    """
    assert not cpu_offload or device_mesh.device_type == "cuda", "FSDP CPU offload needs CUDA devices"
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    offload = CPUOffloadPolicy() if cpu_offload else OffloadPolicy()
    for layer in layers:
        fully_shard(layer, mesh=device_mesh, mp_policy=mp, offload_policy=offload, reshard_after_forward=True)
    fully_shard(root, mesh=device_mesh, mp_policy=mp, offload_policy=offload)
    for m in root.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)
    assert isinstance(root, FSDPModule)
    return root


def parallelize(
    model: PreTrainedModel,
    mesh: SPMesh,
    *,
    attention_backend: str = "auto",
    fsdp_mode: str = "full_shard",
    node_size: int | None = None,
    activation_checkpointing: str = "none",
    ac_every_k: int = 2,
    param_dtype: torch.dtype = torch.bfloat16,
    reduce_dtype: torch.dtype = torch.float32,
    loss_chunk_size: int = 4096,
    cpu_offload: bool = False,
    mlp_tiles: int = 1,
    attn_head_chunks: int = 1,
    router_aux_loss_coef: float | None = None,
    router_loss_scope: str = "micro_batch",
    lora: LoraSpec | None = None,
) -> ChunkedCausalLMLoss:
    """Apply the whole recipe to a loaded (fp32, CPU) model; returns the FSDP2-wrapped loss module.

    The returned module's ``.model`` is ``model`` itself (its parameters now DTensors on the mesh's device);
    pass ``model`` to checkpointing and export, and the returned module to the training step. Under
    ``activation_checkpointing=offload`` the returned module's ``offload_store`` is the
    :class:`~usp.train.checkpoint_offload.HostCheckpointStore` (``host_bytes``: what its host slots hold); else ``None``.
    ``mlp_tiles``: a resolved tile count (:func:`usp.mlp_tiles.resolve_mlp_tiles`), 1 = off.
    ``attn_head_chunks``: ``parallel.attn_head_chunks`` (:func:`usp.attention.usp_attention`), 1 = off.
    ``router_aux_loss_coef``: a mixture-of-experts model's router-loss coefficient (``None``: its config's
    ``router_aux_loss_coef``); the loss module adds the family's own router loss (:mod:`usp.train.router_loss`),
    from each micro-batch's routing or the whole step's (``router_loss_scope``: ``micro_batch`` | ``step``).
    Where :func:`needs_fsdp` says no (one rank, an fp32 run), the loss module is returned unwrapped.
    """
    assert fsdp_mode in FSDP_MODES, f"fsdp_mode={fsdp_mode!r} is not one of {FSDP_MODES} (validate_choices)"
    router_aux = router_aux_spec(model, router_aux_loss_coef)
    if is_moe(model) and mlp_tiles > 1:
        raise ValueError(
            f"parallel.mlp_tiles={mlp_tiles}: MLP tiles are not supported for mixture-of-experts layers (the "
            f"router's loss needs the routing graph that tiling drops); set parallel.mlp_tiles=1."
        )
    if lora is not None:
        apply_lora(model, lora)
    apply_usp(model, mesh, backend=attention_backend, attn_head_chunks=attn_head_chunks)
    layers = decoder_layers(model)
    apply_sequence_tiling(layers, getattr(decoder_of(model), "norm", None), mlp_tiles)
    store = None
    if activation_checkpointing == "offload":
        device_type = mesh.device_mesh.device_type
        index = torch.cuda.current_device() if device_type == "cuda" else None
        store = HostCheckpointStore(torch.device(device_type, index))
    apply_activation_checkpointing(layers, activation_checkpointing, ac_every_k, offload_store=store)
    loss_model = ChunkedCausalLMLoss(
        model,
        chunk_size=loss_chunk_size,
        router_aux=router_aux,
        aux_group=mesh.group("fsdp"),
        router_scope=router_loss_scope,
    )
    loss_model.offload_store = store
    weights_dtype = next(model.parameters()).dtype
    world = dist.get_world_size()
    if not needs_fsdp(
        world,
        weights_dtype=weights_dtype,
        param_dtype=param_dtype,
        reduce_dtype=reduce_dtype,
        cpu_offload=cpu_offload,
    ):
        return loss_model
    if fsdp_mode == "hybrid_shard":
        device_mesh = build_hsdp_mesh(mesh, node_size or world)
    else:
        device_mesh = mesh.fsdp_mesh
    apply_fsdp(
        loss_model,
        layers,
        device_mesh,
        param_dtype=param_dtype,
        reduce_dtype=reduce_dtype,
        cpu_offload=cpu_offload,
    )
    return loss_model
