"""The planner: a pure-Python cost model of memory, compute and communication per layout, and ``usp-plan``.

``auto_degrees`` answers ``parallel.ulysses_degree=auto parallel.ring_degree=auto`` for the trainer.
"""

from usp.plan.calibrate import Calibration, calibrate, read_bench_json, read_training_run
from usp.plan.hardware import GPUS, DeviceSpec, get_device
from usp.plan.inference import InferenceEstimate, kv_cache_bytes_per_gpu, plan_inference
from usp.plan.memory import MemoryBreakdown, training_memory
from usp.plan.models import PRESETS, ModelSpec, load_model_spec
from usp.plan.search import LayoutEstimate, NoFeasibleLayoutError, auto_degrees, evaluate_layout, plan_layouts

__all__ = [
    "GPUS",
    "PRESETS",
    "Calibration",
    "DeviceSpec",
    "InferenceEstimate",
    "LayoutEstimate",
    "MemoryBreakdown",
    "ModelSpec",
    "NoFeasibleLayoutError",
    "auto_degrees",
    "calibrate",
    "evaluate_layout",
    "get_device",
    "kv_cache_bytes_per_gpu",
    "load_model_spec",
    "plan_inference",
    "plan_layouts",
    "read_bench_json",
    "read_training_run",
    "training_memory",
]
