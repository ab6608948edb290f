"""Per-rank attention compute of one ``usp_attention`` call, measured without communication.

On a CPU host shared by all ranks, the wall time of a distributed call shows the *total* work (idle ranks'
cores are lent to busy ones), not the slowest rank. :func:`rank_attention_ms` times only this rank's own
kernels: the blocks its ring rank computes (forward and backward, from the same block plans the ring runs),
on random tensors of the right shapes, serially and measured as thread CPU time (wall time after a device
sync on CUDA). ``max`` over ranks is the attention time of the slowest rank, what sets the step time once
communication is hidden; ``max / mean`` is the imbalance a layout leaves.
"""

from __future__ import annotations

import time

import torch

from usp.attention.blocks import plan_ring_blocks, ring_steps_needed
from usp.attention.kernels import attention_backward, attention_forward, default_scale
from usp.attention.ulysses import kv_replication


def rank_attention_ms(
    *,
    seq_len: int,
    ring_degree: int,
    ulysses_degree: int,
    ring_rank: int,
    layout: str,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    causal: bool,
    cu_seqlens: torch.Tensor | None,
    backend: str,
    device: torch.device,
    iters: int = 3,
    warmup: int = 1,
) -> float:
    """Milliseconds ring rank ``ring_rank`` spends in its attention kernels for one forward + backward.

    Shapes after the Ulysses all-to-all: ``q [1, S/R, Hq/U, D]``, ``k, v [1, S/R, Hk'/U, D]``. Mean over
    ``iters`` after ``warmup``.
    """
    part = seq_len // ring_degree
    hk = num_kv_heads * kv_replication(num_heads, num_kv_heads, ulysses_degree) // ulysses_degree
    hq = num_heads // ulysses_degree
    every = [plan_ring_blocks(seq_len, ring_degree, r, layout, causal, cu_seqlens) for r in range(ring_degree)]
    plans = every[ring_rank][: ring_steps_needed(every)]
    g = torch.Generator().manual_seed(ring_rank)
    q, dout = (torch.randn(1, part, hq, head_dim, generator=g).to(device, dtype) for _ in range(2))
    k, v = (torch.randn(1, part, hk, head_dim, generator=g).to(device, dtype) for _ in range(2))
    scale = default_scale(head_dim, None)
    lse_full = torch.zeros(1, hq, part, dtype=torch.float32, device=device)

    def once() -> None:
        for spec in plans:
            if spec is None:
                continue
            qs, ks = spec.q_slice, spec.k_slice
            kw = dict(causal=spec.causal, softmax_scale=scale, backend=backend, segments=spec.segments)
            out, lse = attention_forward(q[:, qs], k[:, ks], v[:, ks], **kw)
            lse_full[:, :, qs] = torch.nan_to_num(lse, neginf=0.0)  # rows with no key here: finite
            attention_backward(dout[:, qs], q[:, qs], k[:, ks], v[:, ks], out, lse_full[:, :, qs], **kw)

    clock = time.perf_counter if device.type == "cuda" else time.thread_time
    for _ in range(warmup):
        once()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = clock()
    for _ in range(iters):
        once()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (clock() - start) / iters * 1e3
