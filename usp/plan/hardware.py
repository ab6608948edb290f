"""Devices the planner knows: memory, dense bf16 peak FLOP/s, link bandwidths and achievable efficiency.

Bandwidths are per GPU and per direction, in GB/s (1e9 bytes/s): ``intra_node_gbps`` is NVLink (what one GPU
can push to its peers), ``inter_node_gbps`` is the network share of one GPU (one NIC per GPU: 200 Gb/s HDR is
25 GB/s, 400 Gb/s NDR is 50 GB/s). Efficiencies are the fractions of peak that large matmuls
(``dense_efficiency``) and a fused attention kernel on large blocks (``attention_efficiency``) reach; the
calibration (:mod:`usp.plan.calibrate`) replaces them with fitted values.

Host side (checkpoint and optimizer offload, :mod:`usp.plan.offload`): ``host_link_gbps`` is one GPU's PCIe link
to host memory per direction (Gen4 x16: 32 GB/s raw, ~25 achieved; Gen5 x16: 64 GB/s raw, ~50 achieved),
``host_mem_gib`` the RAM of one node and ``host_mem_gbps`` the node's DRAM bandwidth a bandwidth-bound host
kernel (the CPU Adam step) sustains. Defaults are the vendor's 8-GPU server: DGX A100 (2 x EPYC 7742, 1 TiB,
16 channels of DDR4-3200 = 410 GB/s peak), DGX H100 / H200 (2 x Xeon 8480C, 1.9 TB, 16 channels of DDR5-4800 =
614 GB/s peak), DGX B200 (2 x Xeon 8570, 2 TiB (4 TiB option), DDR5-5600 = 717 GB/s peak); the sustained figure
assumed is half the peak. A job on some GPUs of such a server has the whole server's RAM; give
``cluster.host_mem_gib`` (``--host-mem-gib``) for a smaller machine.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from usp.units import GIB  # noqa: F401 - also usp.plan.hardware.GIB, as before

GB = 1e9
HEADROOM_FRAC = 0.075
"""Default memory headroom: the best layout keeps this fraction of device memory free on top of the estimate's
own 8% margin (6 GiB of an 80 GiB card): allocator fragmentation at long sequences and communicator buffers
grow with the job, and a plan within a few GiB of the limit fails in practice."""


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator type (or the CPU) as the cost model sees it."""

    name: str
    memory_gib: float
    """Device memory usable by the job, GiB."""
    peak_tflops: float
    """Dense bf16 peak, TFLOP/s (the MFU denominator)."""
    intra_node_gbps: float
    """Per-GPU, per-direction bandwidth to GPUs of the same node, GB/s."""
    inter_node_gbps: float
    """Per-GPU, per-direction bandwidth to other nodes, GB/s."""
    hbm_tbps: float
    """Device memory bandwidth, TB/s (decode is bound by it)."""
    dense_efficiency: float = 0.6
    """Fraction of peak reached by the linear layers of a training step."""
    attention_efficiency: float = 0.5
    """Fraction of peak reached by the attention kernel on large blocks (fwd + bwd)."""
    attention_half_s: float = 5e-4
    """A kernel call worth this many seconds of peak work runs at half the large-block efficiency: small ring
    blocks and few heads per rank leave streaming multiprocessors idle (and each ring step pays a launch and
    an output merge)."""
    layer_overhead_s: float = 0.0
    """Fixed time per decoder layer per micro step (kernel launches, Python); matters on CPU only."""
    reserved_gib: float = 0.6
    """Memory the job cannot use and no tensor tracker sees, besides NCCL (:func:`usp.plan.memory.untracked_bytes`):
    the CUDA context (about 0.5 GiB with CUDA 12's lazy module loading) and the cuBLAS / cuBLASLt workspaces
    (32 MiB each on Hopper, torch's defaults)."""
    host_link_gbps: float = 25.0
    """Per-GPU, per-direction bandwidth to host memory (PCIe), GB/s: checkpoint and optimizer offload."""
    host_mem_gib: float = 1024.0
    """Host RAM of one node, GiB (``cluster.host_mem_gib`` overrides)."""
    host_mem_gbps: float = 200.0
    """Host DRAM bandwidth of one node that a bandwidth-bound host kernel (CPU Adam) sustains, GB/s."""

    @property
    def peak_flops(self) -> float:
        return self.peak_tflops * 1e12

    @property
    def memory_bytes(self) -> float:
        return self.memory_gib * GIB

    @property
    def default_headroom_gib(self) -> float:
        """Free memory a layout must leave on the device by default (:data:`HEADROOM_FRAC`)."""
        return HEADROOM_FRAC * self.memory_gib


NODE_HOST_BYTES_2TB = 1.9e12
"""Host RAM of an 8-GPU server sold with 2 TB (DGX H100 / H200, and DGX B200 in its base configuration): 2 TB
nominal, about 1.9 TB usable by the OS: 1.9e12 bytes, not 2 TiB. The B200 figure assumes the same OS share as
the H100's (not checked on a B200). ``cluster.host_mem_gib`` (``--host-mem-gib``) sets another per cluster
(a B200 node with the 4 TB option, say)."""
_GEN5_NODE = dict(host_link_gbps=50.0, host_mem_gib=NODE_HOST_BYTES_2TB / GIB, host_mem_gbps=300.0)
GPUS: dict[str, DeviceSpec] = {
    "a100-40g": DeviceSpec("a100-40g", 40.0, 312.0, 300.0, 25.0, 1.555),
    "a100-80g": DeviceSpec("a100-80g", 80.0, 312.0, 300.0, 25.0, 2.039),
    "h100-80g": DeviceSpec("h100-80g", 80.0, 989.0, 450.0, 50.0, 3.35, **_GEN5_NODE),
    "h200": DeviceSpec("h200", 141.0, 989.0, 450.0, 50.0, 4.8, **_GEN5_NODE),
    "b200": DeviceSpec(
        "b200",
        180.0,
        2250.0,
        900.0,
        50.0,
        8.0,
        host_link_gbps=50.0,
        host_mem_gib=NODE_HOST_BYTES_2TB / GIB,
        host_mem_gbps=350.0,
    ),
    # A few CPU cores running the gloo backend: modest FLOP/s, slow "links" (shared-memory copies), a fixed
    # cost per layer (eager PyTorch on small tensors) and ~0.45 GiB of Python/torch runtime per rank. The
    # efficiencies and overhead are the fit to four tiny-recipe runs on a shared 2-core machine (docs/planning.md).
    "cpu": DeviceSpec(
        "cpu",
        16.0,
        0.1,
        2.0,
        2.0,
        0.02,
        dense_efficiency=0.3,
        attention_efficiency=0.06,
        layer_overhead_s=0.009,
        reserved_gib=0.45,
        host_link_gbps=2.0,
        host_mem_gib=16.0,
        host_mem_gbps=5.0,
    ),
}


def get_device(
    name: str | None,
    *,
    memory_gib: float | None = None,
    peak_tflops: float | None = None,
    intra_node_gbps: float | None = None,
    inter_node_gbps: float | None = None,
    host_mem_gib: float | None = None,
    host_link_gbps: float | None = None,
) -> DeviceSpec:
    """Look up ``name`` in :data:`GPUS` and apply explicit overrides.

    ``name=None`` builds a custom device from the overrides, which must then all be given (the host figures
    are optional: the class defaults, an A100-class server, stand in).
    """
    host = {"host_mem_gib": host_mem_gib, "host_link_gbps": host_link_gbps}
    for key, value in host.items():
        if value is not None and value <= 0:
            raise ValueError(f"--{key.replace('_', '-')}={value} must be > 0.")
    host_given = {k: v for k, v in host.items() if v is not None}
    overrides = {
        "memory_gib": memory_gib,
        "peak_tflops": peak_tflops,
        "intra_node_gbps": intra_node_gbps,
        "inter_node_gbps": inter_node_gbps,
    }
    for key, value in overrides.items():
        if value is not None and value <= 0:
            raise ValueError(f"--{key.replace('_', '-')}={value} must be > 0.")
    given = {k: v for k, v in overrides.items() if v is not None}
    if name is None:
        missing = [k for k, v in overrides.items() if v is None]
        if missing:
            raise ValueError(
                "no --gpu given: name one of "
                f"{sorted(GPUS)} or give every one of --gpu-mem-gib, --peak-tflops, --intra-node-gbps, "
                f"--inter-node-gbps (missing: {', '.join(missing)})."
            )
        return DeviceSpec("custom", hbm_tbps=2.0, **given, **host_given)  # type: ignore[arg-type]
    key = name.lower().replace("_", "-")
    if key not in GPUS:
        raise ValueError(f"--gpu={name!r} is unknown; choose one of {sorted(GPUS)} or give explicit figures.")
    return replace(GPUS[key], **given, **host_given)
