"""The test models in float64, for the exactness tests (:data:`tests.tolerance.EXACT_TOL`).

Hugging Face's ``LlamaRMSNorm`` computes in fp32 whatever its input (an upcast for bf16, a *downcast* for
float64), so a float64 model would still round every norm to fp32 and two exact computations of it would differ
at 1e-7. :func:`load_float64` loads the checkpoint in float64 and gives each RMSNorm instance a forward that
computes in ``promote_types(input, fp32)``: float64 stays float64, and fp32/bf16 inputs compute exactly as
before. Applied per instance before :func:`usp.train.parallelize.parallelize` (tiling wraps the forward it
finds), never to the class, so other tests in the same worker process see the library's norm.
"""

from __future__ import annotations

import types
from pathlib import Path

import torch
from torch import nn

from tests.tolerance import EXACT_DTYPE
from usp.model import load_causal_lm


def whole(t: torch.Tensor) -> torch.Tensor:
    """A parameter or gradient as one whole tensor: an FSDP2 ``DTensor`` gathered, a plain one as it is (a
    world of one in the weights' own dtype trains without FSDP2: :func:`usp.train.parallelize.needs_fsdp`)."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def float64_loss_model(
    model_dir: str | Path, mesh, loss_chunk_size: int, **parallel
) -> tuple[nn.Module, nn.Module]:
    """``(model, loss_model)``: the checkpoint in float64 (:func:`load_float64`) through the trainer's
    :func:`usp.train.parallelize.parallelize` on ``mesh``, computing and reducing in float64 on the ``math``
    kernel (``cpu_flash`` returns an fp32 lse); ``parallel``: more of its keywords (``lora``, ...)."""
    from usp.train.parallelize import parallelize

    model = load_float64(model_dir)
    loss_model = parallelize(
        model,
        mesh,
        param_dtype=torch.float64,
        reduce_dtype=torch.float64,
        loss_chunk_size=loss_chunk_size,
        attention_backend="math",
        **parallel,
    )
    return model, loss_model


class CaptureGrads(torch.optim.Optimizer):
    """An 'optimizer' whose step records the whole gradients (collective under FSDP2: every rank calls step)."""

    def __init__(self, named: list[tuple[str, nn.Parameter]]):
        super().__init__([p for _, p in named], {"lr": 0.0})
        self.names = [n for n, _ in named]
        self.grads: dict[str, torch.Tensor] = {}

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ARG002 - the Optimizer signature
        params = self.param_groups[0]["params"]
        self.grads = {n: whole(p.grad).clone() for n, p in zip(self.names, params)}


def _rmsnorm_forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """``LlamaRMSNorm.forward`` computed in ``promote_types(input dtype, fp32)`` instead of fp32."""
    input_dtype = hidden_states.dtype
    h = hidden_states.to(torch.promote_types(input_dtype, torch.float32))
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
    return self.weight * h.to(input_dtype)


def norms_in_input_dtype(model: nn.Module) -> int:
    """Give every RMSNorm of ``model`` the float64-keeping forward; returns how many."""
    n = 0
    for module in model.modules():
        if type(module).__name__.endswith("RMSNorm"):
            assert hasattr(module, "variance_epsilon"), (
                f"{type(module).__name__} is not a Llama-style RMSNorm"
            )
            module.forward = types.MethodType(_rmsnorm_forward, module)
            n += 1
    return n


def load_float64(path: str | Path, **kwargs) -> nn.Module:
    """:func:`usp.model.load_causal_lm` in float64 with every RMSNorm computing in float64."""
    model = load_causal_lm(path, dtype=EXACT_DTYPE, **kwargs)
    assert norms_in_input_dtype(model) > 0
    return model


class KeepFloat64(torch.overrides.TorchFunctionMode):
    """Inside it, a float64 tensor is never cast down to fp32: ``x.float()``, ``x.to(torch.float32)`` and
    ``dtype=torch.float32`` arguments keep float64 when an input is float64.

    Many families compute norms, routers or rotary terms in fp32 whatever the input (``x.float()``); in a
    float64 model that is a rounding to fp32 on both sides of an exactness comparison, which then differ at
    1e-7. Under this mode both run in float64 end to end (fp32 and bf16 tensors are untouched). Autograd sees
    the same graph minus the casts.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        f64 = any(isinstance(a, torch.Tensor) and a.dtype == torch.float64 for a in args)
        if f64:
            if func is torch.Tensor.float:
                return args[0]
            if func is torch.Tensor.to:
                args = tuple(torch.float64 if a is torch.float32 else a for a in args)
            if kwargs.get("dtype") is torch.float32:
                kwargs["dtype"] = torch.float64
        return func(*args, **kwargs)
