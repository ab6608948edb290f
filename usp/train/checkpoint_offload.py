"""Checkpoint offload: full per-layer activation checkpointing whose saved layer inputs live in host memory.

``parallel.activation_checkpointing=offload``. Each decoder layer runs under the non-reentrant
``torch.utils.checkpoint`` (like ``full``); the one tensor the checkpoint keeps, the layer's input hidden states
``[B, S_local, h]`` in the compute dtype, goes through a :class:`HostCheckpointStore` instead of staying on the
device:

- forward: after the checkpoint has taken its input, it is copied into this layer's host slot (pinned memory
  on CUDA; the copy runs on a side stream, after the compute stream's pending work, so the next layer's
  forward overlaps it; the device tensor is kept from reuse until the copy is done with ``record_stream``);
- backward: when the checkpoint recomputes layer ``i`` it asks for the input back; the store copies it to the
  device (if the prefetch did not already) and then starts copying layer ``i - 1``'s input on the side stream,
  so it arrives while layer ``i`` recomputes and runs its backward.

The device therefore holds at most two layer inputs for backward (the one in use and the one prefetched)
instead of ``L``. Host memory: one slot per layer, ``L x B x S_local x h x bytes`` per rank, allocated at the
first step and reused: one arena of exactly those bytes, pinned on CUDA by registering its pages
(``cudaHostRegister``) rather than through torch's caching host allocator, which would round it up to a power
of two (:func:`offload_host_bytes`; checked before the run by :func:`check_host_memory`). On a
CPU device the same code runs with plain copies (no streams, no pinning): it is exact, and the slots are
allocated once, outside later steps' allocations, so measured step memory falls as on a GPU.

Other tensor arguments of a layer (RoPE ``cos``/``sin`` passed as keyword arguments, shared by all layers)
are not offloaded: the checkpoint holds keyword arguments by reference. ``retain_graph`` backward passes that
unpack a layer input twice are supported only without a forward in between (the slot is reused by the next
forward of that layer).
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks
from torch.utils.checkpoint import checkpoint

from usp.host import available_host_bytes
from usp.units import GIB


class _Packed:
    """A layer input parked in host memory (what the saved-tensor pack hook returns)."""

    __slots__ = (
        "__weakref__",
        "store",
        "layer",
        "index",
        "host",
        "slot_gen",
        "device_copy",
        "ready",
        "dtype",
    )

    def __init__(self, store: HostCheckpointStore, layer: int, index: int, host: torch.Tensor, slot_gen: int):
        self.store, self.layer, self.index, self.host, self.slot_gen = store, layer, index, host, slot_gen
        self.device_copy: torch.Tensor | None = None
        self.ready: Any = None  # CUDA event: the device copy is complete on the side stream

    def __del__(self) -> None:  # graph freed (backward done, or dropped unused): the slot may be reused
        store = self.store
        if store is not None and store._busy.get(self.layer) == self.index:
            del store._busy[self.layer]


class HostCheckpointStore:
    """Host slots for the checkpointed inputs of decoder layers, with asynchronous copies out and prefetch back.

    ``device``: the compute device. Use :meth:`hooks` around a layer's checkpointed forward. The slots are the
    rows of one host arena (``arena``, ``[num_layers, *layer input shape]``, pinned on CUDA at exactly its
    bytes), allocated at the first step and reused; ``host_bytes`` is its size, what
    :func:`offload_host_bytes` plans.
    """

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._slots: dict[int, torch.Tensor] = {}  # layer -> host buffer
        self._gens: dict[int, int] = {}  # layer -> times its slot was written
        self._busy: dict[int, int] = {}  # layer -> index of the live packed tensor using the slot
        self._live: dict[int, weakref.ref[_Packed]] = {}  # pack index -> packed tensor (for prefetch)
        self._counter = itertools.count()
        self.num_layers = 0  # set by apply_offload_checkpointing: the arena's slot count
        self.arena: torch.Tensor | None = None  # [num_layers, *layer input shape], the slots are its rows
        self.host_bytes = 0

    # --- host buffers -----------------------------------------------------------------------------------
    def _host_buffer(self, layer: int, t: torch.Tensor) -> tuple[torch.Tensor, int]:
        """The layer's slot (a slice of the arena), or a one-off buffer while the slot is in use."""
        if layer in self._busy:  # two forwards of this layer before its backward: do not overwrite
            return torch.empty(t.shape, dtype=t.dtype, pin_memory=self.cuda), -1
        slot = self._slots.get(layer)
        if slot is None or slot.shape != t.shape or slot.dtype != t.dtype:
            slot = self._arena_slot(layer, t)
        self._gens[layer] = self._gens.get(layer, 0) + 1
        return slot, self._gens[layer]

    def _arena_slot(self, layer: int, t: torch.Tensor) -> torch.Tensor:
        """Layer ``layer``'s slot in the arena: one host buffer of ``num_layers`` slots of ``t``'s shape,
        allocated once (again only when the layer input's shape or dtype changes) at exactly its bytes."""
        slots = max(self.num_layers, layer + 1)
        arena = self.arena
        if arena is None or arena.shape[1:] != t.shape or arena.dtype != t.dtype or arena.size(0) < slots:
            self._slots.clear()
            self.arena = arena = None  # the old arena goes before the new one comes
            arena = self._allocate_arena((slots, *t.shape), t.dtype)
            self.arena = arena
            self.host_bytes = arena.numel() * arena.element_size()
        self._slots[layer] = arena[layer]
        return arena[layer]

    def _allocate_arena(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A host tensor of exactly ``shape``: on CUDA pinned by registering its own pages
        (``cudaHostRegister``), not through torch's caching host allocator, which rounds every block up to a
        power of two (up to 2x the bytes); unregistered when the tensor is freed."""
        arena = torch.empty(shape, dtype=dtype)
        if self.cuda and torch.cuda.is_available():
            ptr, nbytes = arena.data_ptr(), arena.numel() * arena.element_size()
            cudart = torch.cuda.cudart()
            err = cudart.cudaHostRegister(ptr, nbytes, 0)
            if int(err) != 0:
                raise RuntimeError(
                    f"cudaHostRegister of the {nbytes / GIB:.2f} GiB offload arena failed ({err})"
                )
            weakref.finalize(arena, cudart.cudaHostUnregister, ptr)  # slots are views: they keep it alive
        return arena

    # --- hooks ------------------------------------------------------------------------------------------
    def _pack(self, layer: int, t: torch.Tensor) -> Any:
        if t.device != self.device or not t.is_floating_point():
            return t  # not a compute-device activation: keep as is
        host, gen = self._host_buffer(layer, t)
        index = next(self._counter)
        if gen > 0:
            self._busy[layer] = index
        if self.cuda:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))  # t is fully computed
            with torch.cuda.stream(self.stream):
                host.copy_(t, non_blocking=True)
            t.record_stream(self.stream)  # keep t's memory from reuse until the copy is done
        else:
            host.copy_(t)
        packed = _Packed(self, layer, index, host, gen)
        self._live[index] = weakref.ref(packed)
        return packed

    def _fetch(self, packed: _Packed) -> None:
        """Start copying ``packed`` back to the device (side stream on CUDA; at once on CPU)."""
        if packed.device_copy is not None:
            return
        if packed.slot_gen > 0 and self._gens.get(packed.layer) != packed.slot_gen:
            raise RuntimeError(
                f"offloaded input of decoder layer {packed.layer} was overwritten by a later forward before its "
                f"backward (activation_checkpointing=offload keeps one host slot per layer)"
            )
        if self.cuda:
            with torch.cuda.stream(self.stream):
                packed.device_copy = packed.host.to(self.device, non_blocking=True)
                packed.ready = torch.cuda.Event()
                packed.ready.record(self.stream)
        else:
            packed.device_copy = packed.host.clone()

    def _unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, _Packed):
            return packed
        self._fetch(packed)
        t = packed.device_copy
        packed.device_copy = None
        if self.cuda:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(packed.ready)
            t.record_stream(current)
        self._live.pop(packed.index, None)
        previous = self._live.get(
            packed.index - 1
        )  # backward walks the layers in reverse: fetch the next one
        previous = previous() if previous is not None else None
        if previous is not None:
            self._fetch(previous)
        return t

    def hooks(self, layer: int) -> saved_tensors_hooks:
        """Saved-tensor hooks that park what is saved under them (a checkpoint's inputs) in layer ``layer``'s slot."""
        return saved_tensors_hooks(lambda t: self._pack(layer, t), self._unpack)


def apply_offload_checkpointing(layers: Iterable[nn.Module], store: HostCheckpointStore) -> int:
    """Checkpoint every layer of ``layers`` with its input kept in ``store``; returns how many.

    Replaces each layer's ``forward`` on the instance (parameter names unchanged): the layer's original forward
    runs under the non-reentrant checkpoint, inside ``store.hooks(i)``. FSDP2's hooks (applied later, on
    ``__call__``) still gather the parameters before the forward and again before the backward's recompute.
    """
    n = 0
    layers = list(layers)
    store.num_layers = len(layers)
    for i, layer in enumerate(layers):
        inner = layer.forward

        def forward(*args: Any, _inner: Any = inner, _i: int = i, **kwargs: Any) -> Any:
            with store.hooks(_i):
                return checkpoint(_inner, *args, use_reentrant=False, **kwargs)

        layer.forward = forward
        n += 1
    return n


def offload_host_bytes(num_layers: int, local_tokens: int, hidden_size: int, compute_bytes: int) -> int:
    """Host bytes one rank's offload slots take: a ``[local_tokens, hidden_size]`` input per decoder layer.

    ``local_tokens`` = micro-batch size x sequence length / (ulysses x ring degree).
    """
    return num_layers * local_tokens * hidden_size * compute_bytes


def check_host_memory(
    *,
    num_layers: int,
    local_tokens: int,
    hidden_size: int,
    compute_bytes: int,
    ranks_per_node: int,
    available_bytes: int | None = None,
) -> int:
    """``ValueError`` when the node's offload slots (every rank on it) exceed its available host memory.

    Returns the bytes the node needs. Call before building the model (no tensors are allocated here).
    """
    per_rank = offload_host_bytes(num_layers, local_tokens, hidden_size, compute_bytes)
    need = per_rank * ranks_per_node
    available = available_host_bytes() if available_bytes is None else available_bytes
    if need > available:
        raise ValueError(
            f"parallel.activation_checkpointing=offload needs {need / GIB:.2f} GiB of host memory per node "
            f"({ranks_per_node} rank(s) x {num_layers} layers x {local_tokens} local tokens x hidden {hidden_size} "
            f"x {compute_bytes} bytes = {per_rank / GIB:.2f} GiB per rank), but only {available / GIB:.2f} GiB is "
            f"available. Use activation_checkpointing=full, a shorter trainer.seq_len, or more sequence-parallel "
            f"ranks (a larger ulysses/ring degree)."
        )
    return need
