"""``parallel.ulysses_degree=auto`` / ``parallel.ring_degree=auto``: the trainer asks the planner at start-up.

:func:`auto_degrees` takes the run's HF model config and what the user fixed, describes the run as a
:class:`usp.plan.layout.Workload` and the choices left as a :class:`usp.plan.layout.SearchSpace`, runs
:func:`usp.plan.search.search_layouts` and returns the fastest layout that fits, with a one-line reason for the run log.
"""

from __future__ import annotations

from typing import Any

from usp.parallel.layout import ParallelLayout
from usp.plan.hardware import get_device
from usp.plan.layout import SearchSpace, Workload
from usp.plan.lora import LoraPlan
from usp.plan.models import load_model_spec
from usp.plan.search import search_layouts


def auto_degrees(
    model_config: dict[str, Any],
    *,
    seq_len: int,
    world_size: int,
    node_size: int,
    gpu: str | None = None,
    memory_gib: float | None = None,
    ulysses_degree: int | None = None,
    ring_degree: int | None = None,
    fsdp_mode: str | None = None,
    activation_checkpointing: str | None = None,
    ac_every_k: int | None = None,
    compute_bytes: int = 2,
    ring_layout: str = "zigzag",
    loss_chunk_size: int = 4096,
    mlp_tiles: int | str = 1,
    attn_head_chunks: int | str = 1,
    cpu_offload: bool = False,
    host_mem_gib: float | None = None,
    headroom_gib: float | None = None,
    lora: LoraPlan | None = None,
) -> ParallelLayout:
    """The planner's choice for ``parallel.ulysses_degree=auto`` and/or ``parallel.ring_degree=auto``.

        ``model_config`` is an HF config dict; ``gpu`` a name from :data:`usp.plan.hardware.GPUS` (default
        ``h100-80g``; ``cpu`` for CPU runs); ``memory_gib`` overrides the device memory. The optional keywords are
        constraints the user fixed: a degree (``ulysses_degree=4`` with ``ring_degree`` left to the planner), the
        FSDP mode, the checkpointing mode (and its ``ac_every_k``); ``None`` lets the planner choose.
        ``compute_bytes`` (2 for bf16/fp16 ``model.dtype``, 4 for float32), ``ring_layout`` and ``loss_chunk_size``
        describe the run for the cost model. ``mlp_tiles`` (``parallel.mlp_tiles``: an integer, or ``"auto"`` to
        let the planner tile when needed), ``attn_head_chunks`` (``parallel.attn_head_chunks``: a fixed count,
        which rules out the layouts whose heads it does not split, or ``"auto"``), ``cpu_offload`` (:func:`usp.config.states_on_host`: the states and
        the optimizer step on the host), ``host_mem_gib`` (``cluster.host_mem_gib``) and ``headroom_gib`` complete the
        run's description, and ``lora`` (:meth:`usp.plan.lora.LoraPlan.from_config` of ``model.lora``; ``None``: full
    training) what trains. Returns the chosen :class:`usp.parallel.ParallelLayout` (the type start-up builds the
        mesh from; its ``reason`` the one-line why, its ``node_size`` the planner's, at most ``world_size``; a fixed
        ``mlp_tiles`` / ``attn_head_chunks`` stays as given). Raises ``ValueError`` when nothing fits.
    """
    model = load_model_spec(model_config)
    device = get_device(gpu or "h100-80g", memory_gib=memory_gib, host_mem_gib=host_mem_gib)
    node = min(node_size, world_size)
    work = Workload(
        model,
        seq_len,
        compute_bytes=compute_bytes,
        loss_chunk_size=loss_chunk_size,
        ring_layout=ring_layout,
        headroom_gib=headroom_gib,
        lora=lora,
    )
    space = SearchSpace(
        world_size,
        node,
        ulysses_degree=ulysses_degree,
        ring_degree=ring_degree,
        fsdp_modes=None if fsdp_mode is None else (fsdp_mode,),
        ac_modes=None if activation_checkpointing is None else (activation_checkpointing,),
        ac_every_k=ac_every_k,
        mlp_tiles=None if mlp_tiles == "auto" else int(mlp_tiles),
        attn_head_chunks=None if attn_head_chunks == "auto" else int(attn_head_chunks),
        states=("cpu_offload" if cpu_offload else "device",),
    )
    layouts = search_layouts(work, space, device)
    best = layouts[0]
    fixed = {
        k: v
        for k, v in (
            ("ulysses_degree", ulysses_degree),
            ("ring_degree", ring_degree),
            ("fsdp_mode", fsdp_mode),
            ("activation_checkpointing", activation_checkpointing),
        )
        if v is not None
    }
    reason = (
        f"fastest of {len(layouts)} layouts that fit {device.name} ({device.memory_gib:g} GiB) at seq_len={seq_len} "
        f"on {world_size} ranks ({node} per node)"
        + (f" training {lora.describe()}" if lora is not None else "")
        + (f" with {', '.join(f'{k}={v}' for k, v in fixed.items())} fixed" if fixed else "")
        + f": predicted {best.mem_gib_per_gpu:.2f} GiB/rank, "
        f"{best.step_time_s:.3g} s/step, {best.tokens_per_s_per_gpu:.4g} tokens/s/rank"
    )
    assert best.layout is not None
    return best.layout.replace(reason=reason)


__all__ = ["auto_degrees"]
