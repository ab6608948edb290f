"""``usp.train.checkpoint_offload.HostCheckpointStore`` on plain modules (one process, CPU): exact gradients, the prefetch
order of backward, O(1) layer inputs back on the device, two forwards before one backward. float64, and the
gradients equal the plain stack's at ``tests.tolerance.EXACT_TOL``."""

from __future__ import annotations

import copy

import torch
from torch import nn

from tests.tolerance import EXACT_DTYPE, assert_exact
from usp.train.checkpoint_offload import HostCheckpointStore, apply_offload_checkpointing

LAYERS, TOKENS, HIDDEN = 4, 64, 16


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor, *, scale: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(x)) * scale  # scale: a shared keyword tensor, like RoPE's cos/sin


def make_stacks(
    dtype: torch.dtype = torch.float32,
) -> tuple[nn.ModuleList, nn.ModuleList, HostCheckpointStore]:
    torch.manual_seed(0)
    plain = nn.ModuleList(Block() for _ in range(LAYERS)).to(dtype)
    offloaded = copy.deepcopy(plain)
    store = HostCheckpointStore("cpu")
    assert apply_offload_checkpointing(offloaded, store) == LAYERS
    return plain, offloaded, store


def run(layers: nn.ModuleList, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    for layer in layers:
        x = layer(x, scale=scale)
    return x


def grads(layers: nn.ModuleList) -> list[torch.Tensor]:
    return [p.grad.clone() for p in layers.parameters()]


def test_gradients_exact_and_prefetch_walks_backward_one_layer_ahead():
    plain, offloaded, store = make_stacks(EXACT_DTYPE)
    scale = torch.full((TOKENS, 1), 0.5, dtype=EXACT_DTYPE)
    x0 = torch.randn(TOKENS, HIDDEN, dtype=EXACT_DTYPE)
    xa, xb = x0.clone().requires_grad_(), x0.clone().requires_grad_()
    run(plain, xa, scale).square().sum().backward()

    fetched, on_device = [], []
    original = store._fetch

    def spy(packed):
        original(packed)
        fetched.append(packed.layer)
        live = [ref() for ref in store._live.values()]
        on_device.append(sum(p is not None and p.device_copy is not None for p in live))

    store._fetch = spy
    out = run(offloaded, xb, scale)
    assert store.host_bytes == LAYERS * TOKENS * HIDDEN * EXACT_DTYPE.itemsize  # one slot per layer
    out.square().sum().backward()
    assert fetched == [3, 2, 2, 1, 1, 0, 0]  # each layer fetched when needed or one layer ahead, in reverse
    assert max(on_device) <= 2  # the layer in use and the prefetched one
    for i, (a, b) in enumerate(zip(grads(plain), grads(offloaded))):
        assert_exact(b, a, f"parameter {i}")
    assert_exact(xb.grad, xa.grad, "input")


def test_two_forwards_before_backward_use_fresh_host_buffers():
    """Gradient accumulation without a backward in between: the second forward must not overwrite the slots."""
    plain, offloaded, store = make_stacks(EXACT_DTYPE)
    scale = torch.full((TOKENS, 1), 0.5, dtype=EXACT_DTYPE)
    x1, x2 = torch.randn(TOKENS, HIDDEN, dtype=EXACT_DTYPE), torch.randn(TOKENS, HIDDEN, dtype=EXACT_DTYPE)
    (
        run(plain, x1.requires_grad_(), scale).sum() + run(plain, x2.requires_grad_(), scale).square().sum()
    ).backward()
    y1, y2 = x1.detach().clone().requires_grad_(), x2.detach().clone().requires_grad_()
    loss = run(offloaded, y1, scale).sum() + run(offloaded, y2, scale).square().sum()
    assert (
        store.host_bytes == LAYERS * TOKENS * HIDDEN * EXACT_DTYPE.itemsize
    )  # slots; 2nd forward: one-off buffers
    loss.backward()
    for i, (a, b) in enumerate(zip(grads(plain), grads(offloaded))):
        assert_exact(b, a, f"parameter {i}")
    assert not store._busy  # every slot released once its graph is gone


def test_slots_are_rows_of_one_arena_of_the_planned_size():
    """The host slots are one allocation of exactly ``offload_host_bytes`` (no per-slot allocations, no
    rounding): every slot is a row of ``store.arena``."""
    from usp.train.checkpoint_offload import offload_host_bytes

    _, offloaded, store = make_stacks()
    x = torch.randn(1, TOKENS, HIDDEN, requires_grad=True)
    run(offloaded, x, torch.tensor(0.5)).sum().backward()
    assert store.arena is not None and store.arena.shape == (LAYERS, 1, TOKENS, HIDDEN)
    assert store.host_bytes == offload_host_bytes(LAYERS, TOKENS, HIDDEN, 4)
    assert store.arena.untyped_storage().nbytes() == store.host_bytes
    base = store.arena.untyped_storage().data_ptr()
    assert sorted(s.untyped_storage().data_ptr() for s in store._slots.values()) == [base] * LAYERS
