"""The settings of a longest-sequence search (``python -m usp.bench.maxlen``) seen by the planner and chosen
for this machine: :class:`Planner` (:mod:`usp.plan` for one rank with offload checkpointing, the tile
setting, where the states live), the optimizer (:func:`choose_optim`: DeepSpeed's CPU Adam if it builds), and
the depth a host can hold (:func:`deepest_fitting`, ``--num-layers auto``).
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from typing import Any

from usp.mlp_tiles import resolve_mlp_tiles
from usp.units import GIB


class Planner:
    """:mod:`usp.plan` for one rank of this machine with the search's settings (offload checkpointing, the
    given tile setting, states on the host or not, bf16 or fp32 compute)."""

    def __init__(
        self,
        model: str | dict[str, Any],
        *,
        gpu: str,
        memory_gib: float | None,
        host_mem_gib: float,
        mlp_tiles: str,
        loss_chunk_size: int,
        compute_bytes: int,
    ) -> None:
        from usp.plan import get_device, load_model_spec

        self.spec = load_model_spec(model)
        self.device = get_device(gpu, memory_gib=memory_gib, host_mem_gib=host_mem_gib)
        self.mlp_tiles, self.loss_chunk_size, self.compute_bytes = mlp_tiles, loss_chunk_size, compute_bytes

    def tiles(self, seq_len: int) -> int:
        """The tile count the trainer will use at ``seq_len`` (its own rule, :func:`usp.mlp_tiles.resolve_mlp_tiles`)."""
        return resolve_mlp_tiles(self.mlp_tiles, local_tokens=seq_len, hidden_size=self.spec.hidden_size)

    def estimate(self, seq_len: int, host_states: bool) -> Any:
        from usp.plan.estimate import estimate_layout
        from usp.plan.layout import Workload

        work = Workload(
            self.spec, seq_len=seq_len, loss_chunk_size=self.loss_chunk_size, compute_bytes=self.compute_bytes
        )
        return estimate_layout(work, one_gpu_offload(host_states, mlp_tiles=self.tiles(seq_len)), self.device)

    def predict(self, seq_len: int, host_states: bool) -> dict[str, Any]:
        e = self.estimate(seq_len, host_states)
        return {
            "mem_gib_per_gpu": round(e.mem_gib_per_gpu, 3),
            "host_mem_gib_per_node": round(e.host_mem_gib_per_node, 3),
            "step_time_s": round(e.step_time_s, 3),
            "mfu": round(e.mfu, 4),
            "fits": e.fits,
            "host_fits": e.host_fits,
        }

    def max_seq_len(self, host_states: bool, granularity: int, headroom_gib: float | None) -> int | None:
        """:func:`usp.plan.max_seq_len` for these settings (None when nothing fits)."""
        from usp.plan import max_seq_len

        tiles = None if self.mlp_tiles == "auto" else int(self.mlp_tiles)
        try:
            return max_seq_len(
                self.spec,
                self.device,
                world_size=1,
                node_size=1,
                ulysses_degree=1,
                ring_degree=1,
                ac_modes=("offload",),
                states=("cpu_offload" if host_states else "device",),
                mlp_tiles=tiles,
                loss_chunk_sizes=(self.loss_chunk_size,),
                compute_bytes=self.compute_bytes,
                headroom_gib=headroom_gib,
                seq_multiple=granularity,
                limit=1 << 26,
            ).max_seq_len
        except ValueError:
            return None


def one_gpu_offload(host_states: bool, *, mlp_tiles: int = 1) -> Any:
    """The layout every attempt runs: one GPU, checkpoint offload, the states on the host or the device."""
    from usp.plan.layout import Candidate

    return Candidate(
        ulysses_degree=1,
        ring_degree=1,
        world_size=1,
        node_size=1,
        activation_checkpointing="offload",
        mlp_tiles=mlp_tiles,
        states="cpu_offload" if host_states else "device",
    )


def choose_optim(setting: str, *, cpu_adam_error: Callable[[], str | None]) -> tuple[str, str]:
    """``(optim.name, why)``: ``auto`` and ``deepspeed_cpu_adam`` step on the host with DeepSpeed's CPU Adam,
    or with torch's fused AdamW there (``adamw_cpu_offload``) when DeepSpeed's op does not build."""
    if setting in ("auto", "deepspeed_cpu_adam"):
        err = cpu_adam_error()
        if err is None:
            return "deepspeed_cpu_adam", f"{setting}: DeepSpeed's CPU Adam builds"
        return (
            "adamw_cpu_offload",
            f"DeepSpeed's CPU Adam did not build ({err}): torch's fused AdamW on the host",
        )
    return setting, "set by --optim"


def deepest_fitting(
    fields: dict[str, Any], *, host_mem_gib: float, seq_len: int, compute_bytes: int, keep_frac: float = 0.25
) -> int:
    """The most decoder layers (at most the model's) whose offloaded states and pinned layer inputs at
    ``seq_len`` take at most ``1 - keep_frac`` of the usable host memory (the planner's terms,
    :func:`usp.plan.host_memory`), leaving ``keep_frac`` for the pinned inputs of longer sequences; 0 when
    not even one layer does. ``--num-layers auto``."""
    from usp.plan import load_model_spec
    from usp.plan.layout import Workload
    from usp.plan.offload import HOST_USABLE_FRAC, host_bytes

    usable = HOST_USABLE_FRAC * host_mem_gib * GIB * (1 - keep_frac)
    for layers in range(int(fields["num_hidden_layers"]), 0, -1):
        spec = load_model_spec({"vocab_size": 512, **fields, "num_hidden_layers": layers})
        need = host_bytes(
            Workload(spec, seq_len=seq_len, compute_bytes=compute_bytes), one_gpu_offload(host_states=True)
        )["node"]
        if need <= usable:
            return layers
    return 0


def cpu_adam_error(timeout_s: float) -> str | None:
    """Build (or load from usp's per-machine cache, :func:`usp.train.deepspeed_parts.load_cpu_adam_op`)
    DeepSpeed's CPU Adam op in a child process; None when it works."""
    code = "from usp.train.deepspeed_parts import load_cpu_adam_op; load_cpu_adam_op()"
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return f"no build within {timeout_s:.0f} s"
    if proc.returncode == 0:
        return None
    lines = [ln for ln in (proc.stderr or proc.stdout).strip().splitlines() if ln.strip()]
    return (lines[-1] if lines else f"exit status {proc.returncode}")[:300]
