"""``usp.bench.track_memory.track_memory`` against allocations of known size (CPU; the CUDA path when available)."""

from __future__ import annotations

import gc

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from usp.bench.track_memory import track_memory

MIB = 1 << 20
SLACK = 64 << 10  # the profiler's own small allocations (scalars, shapes) inside the block


def test_cpu_peak_is_the_high_water_mark_of_known_allocations():
    with track_memory("cpu") as mem:
        a = torch.empty(4 * MIB, dtype=torch.uint8)
        b = torch.empty(2 * MIB, dtype=torch.uint8)
        del a  # live: 2 MiB after a 6 MiB high-water mark
        c = torch.empty(1 * MIB, dtype=torch.uint8)
    assert 6 * MIB <= mem.peak_bytes <= 6 * MIB + SLACK
    assert 3 * MIB <= mem.net_bytes <= 3 * MIB + SLACK  # b and c still allocated
    assert mem.peak_reserved_bytes is None
    del b, c


def test_cpu_peak_is_relative_to_the_start_of_the_block():
    before = torch.empty(16 * MIB, dtype=torch.uint8)  # allocated before: not part of the block's peak
    with track_memory("cpu") as mem:
        x = torch.empty(3 * MIB, dtype=torch.uint8)
    assert 3 * MIB <= mem.peak_bytes <= 3 * MIB + SLACK
    del before, x


def test_cpu_peak_ignores_garbage_from_before_the_block():
    # A tensor allocated under an earlier profiling window (its free is then reported in any later one) and
    # left in an unreachable reference cycle: Python's collector may free it at any allocation inside a later
    # block (when depends on object counts, so on the torch version). It must not lower that block's figures.
    with track_memory("cpu"):
        junk: list = [torch.empty(8 * MIB, dtype=torch.uint8)]
        junk.append(junk)  # a reference cycle: only the garbage collector frees it
    del junk
    with track_memory("cpu") as mem:
        a = torch.empty(4 * MIB, dtype=torch.uint8)
        gc.collect()  # what an allocation inside the block may trigger
        b = torch.empty(2 * MIB, dtype=torch.uint8)
    assert 6 * MIB <= mem.peak_bytes <= 6 * MIB + SLACK
    assert 6 * MIB <= mem.net_bytes <= 6 * MIB + SLACK
    del a, b


def test_cpu_net_leaves_out_the_blocks_own_garbage():
    with track_memory("cpu") as mem:
        tmp: list = [torch.empty(4 * MIB, dtype=torch.uint8)]
        tmp.append(tmp)  # unreachable after the del: garbage the block made, not memory it left allocated
        del tmp
        kept = torch.empty(1 * MIB, dtype=torch.uint8)
    assert 5 * MIB <= mem.peak_bytes <= 5 * MIB + SLACK
    assert 1 * MIB <= mem.net_bytes <= 1 * MIB + SLACK
    del kept


def test_cpu_backward_window_counts_the_frees_of_what_its_forward_saved():
    # the step's peak is forward.net_bytes + backward.peak_bytes: the backward's frees of tensors the forward
    # allocated (under its own track_memory window) must be reported in the backward's window
    x = torch.randn(256, 1024, requires_grad=True)
    one = x.numel() * x.element_size()  # 1 MiB
    with track_memory("cpu") as fwd:
        loss = torch.sigmoid(x * 2.0).sum()  # sigmoid saves its output (1 MiB); x * 2.0 is freed at once
    with track_memory("cpu") as bwd:
        loss.backward()  # frees the saved output, leaves x.grad (1 MiB)
    assert one <= fwd.net_bytes <= one + SLACK
    assert -SLACK <= bwd.net_bytes <= SLACK
    assert x.grad is not None


def test_held_bytes_counts_each_saved_storage_once_and_not_parameters():
    w = torch.nn.Parameter(torch.randn(64, 32))
    x = torch.randn(1024, 64, requires_grad=True)
    with track_memory("cpu") as mem:
        y = torch.sigmoid(x @ w)  # matmul saves x and w (leaves requiring grad: not counted); sigmoid saves y
        z = y * y  # saves y twice: the same storage, counted once
    assert mem.held_bytes == y.numel() * y.element_size()
    z.sum().backward()


def test_held_bytes_under_checkpoint_is_the_region_input_only():
    lin = torch.nn.Linear(64, 64)
    x = torch.randn(512, 64, requires_grad=True)
    with track_memory("cpu") as plain:
        h = x * 1.5  # no saved tensor (scalar multiply)
        y = torch.relu(lin(torch.relu(lin(h))))
    with track_memory("cpu") as ckpt:
        h2 = x * 1.5
        y2 = checkpoint(lambda t: torch.relu(lin(torch.relu(lin(t)))), h2, use_reentrant=False)
    one = h.numel() * h.element_size()
    assert ckpt.held_bytes == one  # the checkpoint keeps its input h2 only
    assert plain.held_bytes >= 3 * one  # h, relu outputs (and the inner linear's input)
    (y.sum() + y2.sum()).backward()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA path")
def test_cuda_peak_and_reserved():
    dev = torch.device("cuda")
    with track_memory(dev) as mem:
        a = torch.empty(8 * MIB, dtype=torch.uint8, device=dev)
        del a
    assert 8 * MIB <= mem.peak_bytes <= 8 * MIB + SLACK
    assert mem.peak_reserved_bytes is not None and mem.peak_reserved_bytes >= 8 * MIB


def test_metrics_record_peak_reserved_only_on_cuda(tmp_path, monkeypatch):
    from usp.config import WandbConfig
    from usp.train import metrics

    def log(run_dir):
        with metrics.MetricsLogger(
            run_dir,
            rank=0,
            world_size=1,
            peak_flops=1e12,
            wandb_cfg=WandbConfig(),
            config={},
            layout={},
            total_steps=1,
            progress_bar=False,
        ) as m:
            return m.log_step(1, loss=1.0, grad_norm=1.0, lr=1e-3, tokens=8, flops=1e9, step_time_s=0.1)

    if not torch.cuda.is_available():
        assert "peak_mem_reserved_gib" not in log(tmp_path / "cpu")
    monkeypatch.setattr(metrics, "peak_memory_reserved_gib", lambda: 3.5)  # what a CUDA rank reports
    assert log(tmp_path / "cuda")["peak_mem_reserved_gib"] == 3.5
