"""A training config -> the planner's input: the one adapter the trainer, ``usp-launch``, calibration and the
longest-sequence benchmark use.

A :class:`PlanRequest` holds the plain values of a run that the cost model reads (``trainer.seq_len``, the
compute dtype's bytes, ``parallel.ring_layout``, ``trainer.loss_chunk_size``, ``parallel.mlp_tiles``,
``parallel.attn_head_chunks``, where the states live, ``cluster.host_mem_gib``, the degrees and the
checkpointing, ``model.lora``'s rank, targets and trained embeddings and norms). :meth:`PlanRequest.from_config` reads them from a :class:`usp.config.TrainConfig`;
:meth:`PlanRequest.from_dict` from a run's saved config (calibration). Two questions use it, so both ask the
planner the same thing:

- the degrees are ``auto``: :meth:`PlanRequest.plan_auto` (:func:`usp.plan.auto_degrees` with what the user
  fixed, :meth:`PlanRequest.auto_constraints`): the trainer's start-up and ``usp-launch``'s preflight;
- the degrees are fixed: :meth:`PlanRequest.evaluate` (:func:`usp.plan.evaluate_layout` of that layout):
  ``usp-launch``'s memory check.

Before this module each caller built the keywords itself, and the copies drifted (``usp-launch`` never passed
``parallel.attn_head_chunks``, so it overestimated memory and refused layouts the trainer's planner accepted).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING, Any

from usp.config import ParallelConfig, TrainerConfig, states_on_host
from usp.parallel.layout import ParallelLayout
from usp.plan.auto import auto_degrees
from usp.plan.estimate import LayoutEstimate, estimate_layout
from usp.plan.hardware import DeviceSpec, get_device
from usp.plan.layout import Workload
from usp.plan.lora import LoraPlan
from usp.plan.models import ModelSpec

if TYPE_CHECKING:
    from usp.config import TrainConfig

_DTYPE_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "half": 2}


def compute_bytes(dtype: str) -> int:
    """Bytes per element of the compute dtype (``model.dtype``): 4 for float32, 2 for bfloat16 and float16.

    ``dtype``: a config name (``float32``, ``bfloat16``, ``float16``, or their short forms; ``torch.``
    prefixed names too). ``ValueError`` for anything else."""
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPE_BYTES:
        raise ValueError(
            f"model.dtype={dtype!r} is not a compute dtype the planner knows; use one of "
            f"{sorted(_DTYPE_BYTES)}."
        )
    return _DTYPE_BYTES[name]


_PARALLEL_DEFAULTS = ParallelConfig()
_TRAINER_DEFAULTS = TrainerConfig()


@dataclass(frozen=True)
class PlanRequest:
    """What a training run asks of the planner (plain values; see the module docstring)."""

    seq_len: int
    """``trainer.seq_len``."""
    compute_bytes: int = 2
    """:func:`compute_bytes` of ``model.dtype``."""
    ring_layout: str = _PARALLEL_DEFAULTS.ring_layout
    loss_chunk_size: int = _TRAINER_DEFAULTS.loss_chunk_size
    """``trainer.loss_chunk_size`` (``usp-plan --loss-chunk-size`` defaults to it too)."""
    grad_accum_steps: int = _TRAINER_DEFAULTS.grad_accum_steps
    """``trainer.grad_accum_steps``: with more than one, the fp32 gradients live across the micro steps."""
    micro_batch_size: int = _TRAINER_DEFAULTS.micro_batch_size
    """``trainer.micro_batch_size``: the planner's ``global_batch`` is dp x this x ``grad_accum_steps``
    (``usp-plan --global-batch``; the planner costs one sequence per micro step)."""
    mlp_tiles: int | str = 1
    """``parallel.mlp_tiles``: an integer, or ``auto``."""
    attn_head_chunks: int | str = 1
    """``parallel.attn_head_chunks``."""
    states_on_host: bool = False
    """:func:`usp.config.states_on_host` of ``optim.name`` and ``parallel.cpu_offload``."""
    host_mem_gib: float | None = None
    """``cluster.host_mem_gib`` (``None``: the device preset's)."""
    ulysses_degree: int | str = 1
    ring_degree: int | str = 1
    fsdp_mode: str = _PARALLEL_DEFAULTS.fsdp_mode
    activation_checkpointing: str = _PARALLEL_DEFAULTS.activation_checkpointing
    ac_every_k: int = _PARALLEL_DEFAULTS.ac_every_k
    lora_rank: int = 0
    """``model.lora.rank``: 0 = full training."""
    lora_train_embeddings_and_norms: bool = False
    """``model.lora.train_embeddings_and_norms``."""
    lora_target_modules: tuple[str, ...] | None = None
    """``model.lora.target_modules`` (``None``: every ``*proj*`` layer)."""

    @property
    def lora(self) -> LoraPlan | None:
        """The adapters the run trains, as the planner costs them (:mod:`usp.plan.lora`); ``None``: full
        training."""
        return LoraPlan.from_config(
            {
                "rank": self.lora_rank,
                "train_embeddings_and_norms": self.lora_train_embeddings_and_norms,
                "target_modules": self.lora_target_modules,
            }
        )

    @classmethod
    def from_config(cls, cfg: TrainConfig) -> PlanRequest:
        """The request of a composed training config: :meth:`from_dict` of its sections (one reading of the
        keys, so the two cannot drift)."""
        return cls.from_dict(asdict(cfg))

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], **overrides: Any) -> PlanRequest:
        """The request of a run's saved config (a plain dict, as ``config.yaml`` holds it); missing keys take the
        config's defaults; ``overrides`` (field names) win, e.g. the degrees a ``layout.json`` resolved."""
        model, par, trainer = (cfg.get(k) or {} for k in ("model", "parallel", "trainer"))
        values: dict[str, Any] = {
            "seq_len": int(trainer.get("seq_len", 0)),
            "compute_bytes": compute_bytes(str(model.get("dtype", "bfloat16"))),
            "loss_chunk_size": int(trainer.get("loss_chunk_size", _TRAINER_DEFAULTS.loss_chunk_size)),
            "grad_accum_steps": int(trainer.get("grad_accum_steps", _TRAINER_DEFAULTS.grad_accum_steps)),
            "micro_batch_size": int(trainer.get("micro_batch_size", _TRAINER_DEFAULTS.micro_batch_size)),
            "states_on_host": states_on_host(
                str((cfg.get("optim") or {}).get("name", "adamw")), bool(par.get("cpu_offload", False))
            ),
            "host_mem_gib": (cfg.get("cluster") or {}).get("host_mem_gib"),
        }
        lora = model.get("lora") or {}
        if int(lora.get("rank", 0) or 0):
            targets = lora.get("target_modules")
            values |= {
                "lora_rank": int(lora["rank"]),
                "lora_train_embeddings_and_norms": bool(lora.get("train_embeddings_and_norms", False)),
                "lora_target_modules": None if targets is None else tuple(targets),
            }
        for name in (
            "ring_layout",
            "mlp_tiles",
            "attn_head_chunks",
            "ulysses_degree",
            "ring_degree",
            "fsdp_mode",
            "activation_checkpointing",
            "ac_every_k",
        ):
            if name in par:
                values[name] = par[name]
        known = {f.name for f in fields(cls)}
        assert set(overrides) <= known, f"unknown PlanRequest fields {set(overrides) - known}"
        values.update(overrides)
        return cls(**values)

    def auto_constraints(self) -> dict[str, Any]:
        """The keywords of :func:`usp.plan.auto_degrees` besides the cluster: the run's description, and what the
        user fixed: a degree that is not ``auto``; ``fsdp_mode`` and ``activation_checkpointing`` when they
        differ from the config's defaults (``full_shard``, ``none``: at the default the planner chooses)."""
        out: dict[str, Any] = {
            "seq_len": self.seq_len,
            "compute_bytes": self.compute_bytes,
            "ring_layout": self.ring_layout,
            "loss_chunk_size": self.loss_chunk_size,
            "mlp_tiles": self.mlp_tiles,
            "attn_head_chunks": self.attn_head_chunks,
            "cpu_offload": self.states_on_host,
            "host_mem_gib": self.host_mem_gib,
            "lora": self.lora,
        }
        for name in ("ulysses_degree", "ring_degree"):
            value = getattr(self, name)
            if value != "auto":
                out[name] = int(value)
        if self.fsdp_mode != _PARALLEL_DEFAULTS.fsdp_mode:
            out["fsdp_mode"] = self.fsdp_mode
        if self.activation_checkpointing != _PARALLEL_DEFAULTS.activation_checkpointing:
            out["activation_checkpointing"] = self.activation_checkpointing
            out["ac_every_k"] = self.ac_every_k
        return out

    def plan_auto(
        self,
        model_config: dict[str, Any],
        *,
        world_size: int,
        node_size: int,
        gpu: str,
        memory_gib: float | None = None,
    ) -> ParallelLayout:
        """:func:`usp.plan.auto_degrees` for this request: the layout it chooses (``ValueError`` when none fits)."""
        return auto_degrees(
            model_config,
            world_size=world_size,
            node_size=node_size,
            gpu=gpu,
            memory_gib=memory_gib,
            **self.auto_constraints(),
        )

    def device(self, gpu: str, memory_gib: float | None = None) -> DeviceSpec:
        """``cluster.gpu``'s :class:`~usp.plan.hardware.DeviceSpec` with ``cluster.memory_gib`` and this request's
        host memory, as :meth:`plan_auto` sees it."""
        return get_device(gpu, memory_gib=memory_gib, host_mem_gib=self.host_mem_gib)

    def evaluate(
        self,
        model: ModelSpec,
        device: DeviceSpec,
        layout: ParallelLayout,
        *,
        global_batch: int | None = None,
    ) -> LayoutEstimate:
        """:func:`usp.plan.evaluate_layout` of the run's ``layout`` (:func:`usp.startup.plan_layout`, as start-up
        makes it) on ``device`` (:meth:`device`). ``global_batch`` (sequences per optimizer step) defaults to
        dp x ``micro_batch_size`` x ``grad_accum_steps``: the figure ``usp-plan --global-batch`` prints for the
        same run."""
        if global_batch is None:
            global_batch = layout.dp_degree * self.micro_batch_size * self.grad_accum_steps
        work = Workload(
            model,
            self.seq_len,
            global_batch=global_batch,
            compute_bytes=self.compute_bytes,
            loss_chunk_size=self.loss_chunk_size,
            ring_layout=self.ring_layout,
            lora=self.lora,
        )
        return estimate_layout(work, layout, device)


__all__ = ["PlanRequest", "compute_bytes"]
