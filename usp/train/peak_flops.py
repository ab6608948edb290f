"""The MFU denominator: dense peak FLOP/s per device (:data:`PEAK_TFLOPS`, or ``cluster.peak_tflops``).

MFU itself, achieved model FLOP/s per device over that peak, is :func:`usp.plan.compute.mfu` (the planner's
too); the model FLOPs are :func:`usp.plan.compute.training_flops` (recomputation under activation
checkpointing is not counted: model FLOPs, not hardware FLOPs).
"""

from __future__ import annotations

from usp.config import ClusterConfig
from usp.plan.hardware import GPUS

PEAK_TFLOPS: dict[str, float] = {name: spec.peak_tflops for name, spec in GPUS.items()}
"""Dense bf16 peak TFLOP/s per device (no sparsity), from the planner's device table
(:data:`usp.plan.hardware.GPUS`), so MFU and the planner use one set of figures. The ``cpu`` entry is nominal
(a few cores of fp32 eager PyTorch): CPU MFU is only a relative figure."""


def gpu_from_device_name(name: str) -> str | None:
    """Map a CUDA device name (``NVIDIA H100 80GB HBM3``) to a :data:`PEAK_TFLOPS` key, if recognisable."""
    n = name.lower()
    for key, marker in (("b200", "b200"), ("h200", "h200"), ("h100-80g", "h100")):
        if marker in n:
            return key
    if "a100" in n:
        return "a100-40g" if "40gb" in n else "a100-80g"
    return None


def peak_flops_per_device(cluster: ClusterConfig, device_type: str) -> float:
    """Dense peak FLOP/s of one device, the MFU denominator.

    ``cluster.peak_tflops`` wins when set. On CPU (``device_type == "cpu"``) the nominal ``cpu`` entry is used.
    On CUDA, ``cluster.gpu`` is looked up; if it is ``cpu`` (a CPU cluster group on a GPU run) the GPU is
    recognised from ``torch.cuda.get_device_name()`` when possible.
    """
    if cluster.peak_tflops is not None:
        if cluster.peak_tflops <= 0:
            raise ValueError(f"cluster.peak_tflops={cluster.peak_tflops} must be > 0 (dense bf16 TFLOP/s).")
        return float(cluster.peak_tflops) * 1e12
    if device_type == "cpu":
        return PEAK_TFLOPS["cpu"] * 1e12
    key = cluster.gpu.lower().replace("_", "-")
    if key == "cpu" and device_type == "cuda":
        import torch

        detected = gpu_from_device_name(torch.cuda.get_device_name())
        if detected is None:
            raise ValueError(
                f"cluster.gpu=cpu on a CUDA run with an unrecognised GPU ({torch.cuda.get_device_name()}): "
                f"choose cluster=<one of {sorted(PEAK_TFLOPS)}> or set cluster.peak_tflops=<dense bf16 TFLOP/s>."
            )
        key = detected
    if key not in PEAK_TFLOPS:
        raise ValueError(
            f"cluster.gpu={cluster.gpu!r} has no peak FLOP/s entry; choose one of {sorted(PEAK_TFLOPS)} or set "
            "cluster.peak_tflops=<dense bf16 TFLOP/s per device>."
        )
    return PEAK_TFLOPS[key] * 1e12
