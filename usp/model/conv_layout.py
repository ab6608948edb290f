"""The input layout the mixers hand to ``causal_conv1d_fn`` (causal-conv1d on CUDA, transformers' torch code
elsewhere).

The mixers build the convolution's input as a ``[B, C, L]`` view of ``[B, L, W]`` rows: channel-last
(``stride(1) == 1``), ``W >= C`` elements apart. causal-conv1d's CUDA kernel takes channel-last input only when
``C % 8 == 0`` and ``stride(0)``, ``stride(2)`` are multiples of 8 (16-byte vector loads), and raises
otherwise; a channel-first input (``stride(2) == 1``) it takes as it is. So the view goes through when it
meets that rule and is copied to channel-first otherwise (a Mamba2 rank's rows carry ``H / P`` dt values
after its ``x``, ``B``, ``C`` channels: ``W`` is a multiple of 8 only when ``H / P`` is). The torch path
takes either.
"""

from __future__ import annotations

import torch

VECTOR_ELEMENTS = 8
"""causal-conv1d's channel-last rule: channels and the batch and length strides in multiples of 8."""


def conv_input(x: torch.Tensor) -> torch.Tensor:
    """``x`` ``[B, C, L]`` as causal-conv1d's CUDA kernel takes it: the view when it is channel-first, or
    channel-last with ``C``, ``stride(0)`` and ``stride(2)`` multiples of 8; else a channel-first copy."""
    if x.stride(2) == 1:
        return x
    if x.stride(1) == 1 and all(n % VECTOR_ELEMENTS == 0 for n in (x.size(1), x.stride(0), x.stride(2))):
        return x
    return x.contiguous()
