"""A training run's start-up: everything before the first step, as one :class:`Job` the loop reads.

Order: the tiny model built if asked; the settings checked and resolved
(:func:`usp.train.checks.check_training_run`: no weights or data are touched before they pass, and an error
on any rank is raised on every rank); the resume choice (verified); the mesh, tokenizer and data loaders;
the model built empty (meta device), sharded by :func:`usp.train.parallelize.parallelize` and filled from
``model.path`` (rank 0 reads, broadcasts); the optimizer and schedule; the checkpoint loaded when resuming.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from transformers import AutoTokenizer

from usp.checkpoint import load_checkpoint
from usp.config import TrainConfig
from usp.data import build_dataloaders
from usp.model import build_empty_causal_lm, load_sharded_weights, parse_dtype, weight_devices
from usp.model.lora import LoraSpec, init_adapter_weights, resolve_lora
from usp.parallel import ParallelLayout, SPMesh
from usp.parallel.agree import on_every_rank
from usp.plan.models import head_dim_of, layer_attention_of
from usp.startup import build_mesh
from usp.train.checks import (
    build_tiny_if_asked,
    check_training_run,
    dpo_spec,
    keeps_states_on_host,
    lora_spec,
    start_up_warnings,
)
from usp.train.dpo import DpoSpec
from usp.train.flops import count_lora_matmul_params, count_matmul_params
from usp.train.optim import build_optimizer, reapply_schedule
from usp.train.parallelize import decoder_layers, parallelize
from usp.train.peak_flops import peak_flops_per_device
from usp.train.reference import ReferenceLogps, reference_logps
from usp.train.resume import choose_resume
from usp.train.rng import seed_everything, set_rng_state
from usp.train.rundir import checkpoint_root

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """What a step's model FLOPs depend on (:func:`usp.plan.compute.training_flops`)."""

    matmul_params: int
    """Every matmul weight a token goes through (:func:`usp.train.flops.count_matmul_params`), with LoRA the
    adapters too (:func:`usp.train.flops.count_lora_matmul_params`)."""
    num_layers: int
    num_heads: int
    head_dim: int
    layer_attention: tuple[tuple[int | None, int | None], ...] = ()
    """Each layer's ``(sliding window, chunk)``; empty when all are full causal."""
    trainable_matmul_params: int | None = None
    """Of ``matmul_params``, those with a weight gradient (LoRA: the adapters, and a tied LM head when the
    embeddings train); ``None``: all of them (full training, ``6 N``)."""


@dataclasses.dataclass
class Job:
    """What start-up resolved and built, read by the loop and the end of the run."""

    cfg: TrainConfig
    device: torch.device
    rank: int
    world: int
    layout: ParallelLayout
    mesh: SPMesh
    tokenizer: Any
    train_loader: Any
    val_loader: Any
    model: torch.nn.Module  # the Hugging Face model, FSDP2-sharded in place
    loss_model: torch.nn.Module  # the model with the chunked loss on top (what a step calls)
    optimizer: torch.optim.Optimizer
    scheduler: Any
    ckpt_root: Path
    start_step: int
    resumed_from: Path | None
    model_shape: ModelShape
    peak_flops: float | None
    lora: LoraSpec | None = None
    """The adapters trained (target modules resolved), or ``None`` for full training."""
    dpo: DpoSpec | None = None
    """``trainer.objective=dpo``: the preference loss; ``None`` for the language-model loss."""
    reference: ReferenceLogps | None = None
    """DPO's cached reference log-probabilities (:mod:`usp.train.reference`; ``None`` for ``simpo``)."""

    @property
    def run_dir(self) -> Path:
        return Path(self.cfg.run_dir)

    @property
    def layout_info(self) -> dict[str, Any]:
        """The ``layout`` of the result and of ``metrics.jsonl``: the run's layout (the mesh's)."""
        return self.mesh.layout.to_dict()


def start_job(cfg: TrainConfig, device: torch.device) -> Job:
    """Everything before the first step, in order: the settings checked and resolved (no weights or data
    touched before they pass), the mesh, tokenizer and data, the sharded model and its weights, the optimizer,
    and the resume."""
    rank, world = dist.get_rank(), dist.get_world_size()
    on_every_rank(lambda: build_tiny_if_asked(cfg, rank), "building the tiny model (model.build_tiny)")
    model_config, layout = on_every_rank(lambda: check_training_run(cfg, world, device), "config validation")
    if rank == 0:
        for warning in start_up_warnings(cfg):
            logger.warning(warning)
    peak_flops = on_every_rank(lambda: peak_flops_per_device(cfg.cluster, device.type), "cluster settings")
    ckpt_root = checkpoint_root(cfg)
    resume_from = choose_resume(cfg, ckpt_root)  # verified; never another run's checkpoints
    seed_everything(cfg.trainer.seed)

    mesh = build_mesh(cfg, layout, device)
    tokenizer = on_every_rank(
        lambda: AutoTokenizer.from_pretrained(cfg.model.path, local_files_only=True), "loading the tokenizer"
    )
    train_loader, val_loader = on_every_rank(
        lambda: build_dataloaders(
            cfg.data,
            tokenizer=tokenizer,
            seq_len=cfg.trainer.seq_len,
            mesh=mesh,
            micro_batch_size=cfg.trainer.micro_batch_size,
            seed=cfg.trainer.seed,
            cache_dir=cfg.data.cache_dir or str(Path(cfg.run_dir) / "data_cache"),
            shared_prompt=cfg.trainer.objective == "dpo" and cfg.trainer.dpo.shared_prompt,
        ),
        "building the data loaders",
    )
    model, loss_model, model_shape, lora = build_model(cfg, model_config, layout, mesh, device)
    optimizer, scheduler = build_optimizer(loss_model, cfg.optim, max_steps=cfg.trainer.max_steps)
    job = Job(
        cfg=cfg,
        device=device,
        rank=rank,
        world=world,
        layout=layout,
        mesh=mesh,
        tokenizer=tokenizer,
        train_loader=train_loader,
        val_loader=val_loader,
        model=model,
        loss_model=loss_model,
        optimizer=optimizer,
        scheduler=scheduler,
        ckpt_root=ckpt_root,
        start_step=0,
        resumed_from=None,
        model_shape=model_shape,
        peak_flops=peak_flops,
        lora=lora,
        dpo=dpo_spec(cfg),
    )
    if job.dpo is not None and job.dpo.needs_reference:  # before resuming: the model holds the start weights
        job.reference = build_reference(job)
    if resume_from is not None:
        resume_job(job, Path(resume_from))
    return job


def build_model(
    cfg: TrainConfig, model_config: Any, layout: ParallelLayout, mesh: SPMesh, device: torch.device
) -> tuple[torch.nn.Module, torch.nn.Module, ModelShape, LoraSpec | None]:
    """fp32 master weights, never whole on any rank: an empty (meta) model is sharded by
    :func:`usp.train.parallelize.parallelize`, then each rank's shards are filled from ``model.path`` (the RoPE
    overrides were applied to ``model_config`` by the checks). With ``model.lora``, adapters on the frozen base,
    initialized once the base is loaded. Returns the HF model, the loss model, what the step's FLOPs depend on
    (counted before sharding) and the adapters (target modules resolved) or ``None``."""
    host_states = keeps_states_on_host(cfg, device)  # FSDP2 shards and optimizer states in host memory
    model = build_empty_causal_lm(model_config)
    lora = lora_spec(cfg)
    lora = None if lora is None else resolve_lora(lora, model)
    matmul_params, trainable_matmul_params = count_matmul_params(model), None
    if lora is not None:  # counted on the plain model: the adapters run with it, only they (mostly) train
        adapter_params, trainable_matmul_params = count_lora_matmul_params(model, lora)
        matmul_params += adapter_params
    shape = ModelShape(
        matmul_params,
        len(decoder_layers(model)),
        model_config.num_attention_heads,
        head_dim_of(model_config),
        layer_attention_of(model_config),
        trainable_matmul_params,
    )
    loss_model = parallelize(
        model,
        mesh,
        attention_backend=cfg.model.attention_backend,
        fsdp_mode=layout.fsdp_mode,
        node_size=layout.node_size,
        activation_checkpointing=layout.activation_checkpointing,
        ac_every_k=layout.ac_every_k,
        param_dtype=parse_dtype(cfg.model.dtype),
        reduce_dtype=parse_dtype(cfg.parallel.reduce_dtype, "parallel.reduce_dtype"),
        loss_chunk_size=cfg.trainer.loss_chunk_size,
        cpu_offload=host_states,
        mlp_tiles=layout.mlp_tiles,
        attn_head_chunks=layout.attn_head_chunks,
        router_aux_loss_coef=cfg.model.router_aux_loss_coef,
        router_loss_scope=cfg.model.router_loss_scope,
        lora=lora,
    )
    param_device, _ = weight_devices(device, cpu_offload=host_states)  # offload: shards on the CPU
    load_sharded_weights(model, cfg.model.path, device=device, param_device=param_device)
    if lora is not None:
        init_adapter_weights(model, cfg.trainer.seed)
    return model, loss_model, shape, lora


def build_reference(job: Job) -> ReferenceLogps:
    """DPO's reference log-probabilities of every row (cached; :func:`usp.train.reference.reference_logps`).
    Called before the checkpoint of a resumed run is loaded, so the model holds ``model.path`` (the starting
    policy; with LoRA, adapters that add zero); ``trainer.dpo.reference_path`` is loaded for the pass and
    ``model.path`` again after it. Collective."""
    cfg = job.cfg
    reference_path = cfg.trainer.dpo.reference_path or cfg.model.path
    other = Path(reference_path).resolve() != Path(cfg.model.path).resolve()

    def load(path: str) -> None:  # into the weights in place, wherever they live
        load_sharded_weights(job.model, path, device=job.device, materialize=False)

    def restore() -> None:
        load(cfg.model.path)
        if job.lora is not None:
            init_adapter_weights(job.model, cfg.trainer.seed)

    return reference_logps(
        job.loss_model,
        job.train_loader.dataset,
        mesh=job.mesh,
        device=job.device,
        reference_path=reference_path,
        dtype=cfg.model.dtype,
        run_dir=job.run_dir,
        load_reference=(lambda: load(reference_path)) if other else None,
        restore_policy=restore if other else None,
        document_masking=cfg.data.document_masking,
    )


def resume_job(job: Job, resume_from: Path) -> None:
    """Load the checkpoint into the model, optimizer and schedule (this run's schedule from its first step),
    the data loader's position and this rank's RNG states."""
    state = load_checkpoint(
        resume_from, model=job.model, optimizer=job.optimizer, scheduler=job.scheduler, verify=False
    )
    reapply_schedule(job.optimizer, job.scheduler, job.cfg.optim.lr)
    extra = state["extra"]
    job.train_loader.load_state_dict(extra["data"])
    if state.get("extra_rank", job.rank) == job.rank:
        set_rng_state(extra["rng"], job.device)
    job.start_step, job.resumed_from = state["step"], resume_from
    if job.rank == 0:
        logger.info("resumed from %s at step %d", state.get("path", resume_from), job.start_step)
