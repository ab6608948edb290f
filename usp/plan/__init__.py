"""The planner: a pure-Python cost model of memory, compute and communication per layout, and ``usp-plan``.

``auto_degrees`` answers ``parallel.ulysses_degree=auto parallel.ring_degree=auto`` for the trainer;
``max_seq_len`` finds the longest sequence a cluster trains (``usp-plan --max-seq-len``). Inside, what is
trained, the layout being costed and the layouts a search tries travel as :class:`Workload`,
:class:`Candidate` and :class:`SearchSpace` (:mod:`usp.plan.layout`); the functions here take keywords.
"""

from usp.plan.auto import auto_degrees
from usp.plan.calibrate import Calibration, calibrate, read_bench_json, read_training_run
from usp.plan.hardware import GPUS, DeviceSpec, get_device
from usp.plan.inference import InferenceEstimate, kv_cache_bytes_per_gpu, plan_inference
from usp.plan.layout import Candidate, SearchSpace, Workload
from usp.plan.lora import LoraPlan
from usp.plan.maxlen import MaxSeqLenEstimate, max_seq_len, max_seq_lens
from usp.plan.memory import MemoryBreakdown, held_activation_bytes, training_memory
from usp.plan.models import PRESETS, ModelSpec, load_model_spec
from usp.plan.offload import host_memory, offload_time
from usp.plan.search import LayoutEstimate, NoFeasibleLayoutError, evaluate_layout, plan_layouts

__all__ = [
    "GPUS",
    "PRESETS",
    "Calibration",
    "Candidate",
    "DeviceSpec",
    "InferenceEstimate",
    "LayoutEstimate",
    "LoraPlan",
    "MaxSeqLenEstimate",
    "MemoryBreakdown",
    "ModelSpec",
    "NoFeasibleLayoutError",
    "SearchSpace",
    "Workload",
    "auto_degrees",
    "calibrate",
    "evaluate_layout",
    "get_device",
    "held_activation_bytes",
    "host_memory",
    "kv_cache_bytes_per_gpu",
    "load_model_spec",
    "max_seq_len",
    "max_seq_lens",
    "offload_time",
    "plan_inference",
    "plan_layouts",
    "read_bench_json",
    "read_training_run",
    "training_memory",
]
