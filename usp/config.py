"""Typed run configuration: the composed Hydra config becomes these dataclasses once, at the entry point.

The same names are used in the YAML groups under ``conf/`` (``model``, ``data``, ``parallel``, ``optim``,
``trainer``, ``logging``, ``cluster``), on the command line (``parallel.ulysses_degree=4``) and in code.
Stable public override keys: ``recipe=NAME``, ``parallel.ulysses_degree``, ``parallel.ring_degree``,
``trainer.max_steps``, ``trainer.seq_len``, ``logging.wandb.mode``, ``hydra.run.dir``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class ModelConfig:
    path: str = "???"
    """Local Hugging Face checkpoint dir (config.json + safetensors + tokenizer). For the ``tiny`` recipe a
    tiny random Llama is built there on first use when ``build_tiny`` is set."""
    dtype: str = "bfloat16"
    """Parameter dtype for compute: ``bfloat16`` | ``float32`` | ``float16``."""
    attention_backend: str = "auto"
    """Local attention kernel: ``auto`` | ``flash_attn`` | ``sdpa_flash`` | ``sdpa_efficient`` | ``sdpa_cudnn``
    | ``cpu_flash`` | ``math``."""
    rope_theta: float | None = None
    """Override ``rope_theta`` for context extension (e.g. 500000 -> 8000000)."""
    rope_scaling: dict[str, Any] | None = None
    """Override ``rope_scaling`` (e.g. ``{rope_type: llama3, factor: 8.0, ...}``)."""
    max_position_embeddings: int | None = None
    """Override ``max_position_embeddings`` (set to at least ``trainer.seq_len``)."""
    build_tiny: bool = False
    """Create a tiny random Llama checkpoint at ``path`` if it does not exist (demo/tests only)."""
    tiny_size: dict[str, Any] = field(default_factory=dict)
    """LlamaConfig fields for the tiny checkpoint (hidden_size, num_hidden_layers, heads, kv heads, vocab)."""


@dataclass
class DataConfig:
    inputs: list[str] = field(default_factory=list)
    """Local files (jsonl, parquet, text, arrow) or hub dataset names; or one ``usp-prepare-data`` output."""
    prepared_path: str | None = None
    """A dir written by ``usp-prepare-data`` (loads with ``datasets.load_from_disk``); preferred for big runs."""
    text_field: str = "text"
    weights: list[float] | None = None
    """Mixing weights for several ``inputs`` (same length), or None for concatenation."""
    streaming: bool = False
    num_proc: int = 1
    cache_dir: str | None = None
    document_masking: bool = True
    """Attention never crosses packed document boundaries; position ids restart at each document."""
    validation_fraction: float = 0.0
    build_tiny_corpus: bool = False
    """Generate a small synthetic corpus (demo/tests only) when ``inputs`` is empty."""
    seed: int = 1234


@dataclass
class ParallelConfig:
    ulysses_degree: Any = 1
    """Ulysses (all-to-all) degree inside a node, or ``auto`` (ask the planner)."""
    ring_degree: Any = 1
    """Ring degree across nodes, or ``auto`` (ask the planner)."""
    dp_degree: int = -1
    """Data-parallel degree; -1 = the remaining ranks."""
    ring_layout: str = "zigzag"
    """``zigzag`` (balanced causal work) or ``contiguous``."""
    node_size: int | None = None
    """Ranks per node; default: the launcher's LOCAL_WORLD_SIZE."""
    allow_cross_node_ulysses: bool = False
    fsdp_mode: str = "full_shard"
    """``full_shard`` (shard over dp x ring x ulysses) | ``hybrid_shard`` (shard in a node, replicate across)."""
    activation_checkpointing: str = "none"
    """``none`` | ``full`` (every decoder layer) | ``every_k`` (every ``ac_every_k``-th layer)."""
    ac_every_k: int = 2
    reduce_dtype: str = "float32"
    """Gradient reduce-scatter dtype under FSDP2."""
    backend: str | None = None
    """Process-group backend; default nccl on CUDA, gloo on CPU."""


@dataclass
class OptimConfig:
    lr: float = 2e-5
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    warmup_steps: int = 100
    min_lr_ratio: float = 0.1
    """Cosine decays to ``lr * min_lr_ratio`` at ``trainer.max_steps``."""
    grad_clip: float = 1.0
    """Max global grad norm; 0 disables clipping."""


@dataclass
class TrainerConfig:
    max_steps: int = 1000
    seq_len: int = 131072
    micro_batch_size: int = 1
    """Sequences per data-parallel rank per micro step (1 for long context)."""
    grad_accum_steps: int = 1
    loss_chunk_size: int = 4096
    """Tokens per chunk of the chunked cross-entropy (full logits never materialized)."""
    checkpoint_every: int = 500
    keep_last: int = 2
    checkpoint_dir: str | None = None
    """Default: ``<run dir>/checkpoints``."""
    resume: str | None = "auto"
    """``auto`` (latest in checkpoint_dir, if any) | a checkpoint path | None."""
    export_hf: bool = True
    """Write a Hugging Face checkpoint (safetensors + config + tokenizer) at the end, in ``<run dir>/hf``."""
    eval_every: int = 0
    seed: int = 0
    device: str = "auto"
    """``auto`` | ``cuda`` | ``cpu``."""


@dataclass
class WandbConfig:
    mode: str = "disabled"
    """``online`` | ``offline`` | ``disabled``."""
    project: str = "usp"
    entity: str | None = None
    name: str | None = None
    tags: list[str] = field(default_factory=list)


@dataclass
class LoggingConfig:
    log_every: int = 1
    progress_bar: bool = True
    wandb: WandbConfig = field(default_factory=WandbConfig)


@dataclass
class ClusterConfig:
    gpu: str = "h100-80g"
    """Device name for the peak FLOP/s table (``a100-40g``, ``a100-80g``, ``h100-80g``, ``h200``, ``b200``,
    ``cpu``)."""
    gpus_per_node: int = 8
    peak_tflops: float | None = None
    """Override the dense bf16 peak TFLOP/s per device used for MFU."""
    intra_node_gbps: float | None = None
    """NVLink bandwidth per GPU, GB/s (planner)."""
    inter_node_gbps: float | None = None
    """Network bandwidth per GPU, GB/s (planner)."""
    memory_gib: float | None = None


@dataclass
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    run_dir: str = "."
    """Filled in by the entry point from ``hydra.run.dir``; every rank agrees on it."""
