"""The typed run configuration: the composed Hydra config becomes these dataclasses once, at the entry point
(:mod:`usp.config.compose`); code below the entry points reads only them.

The same names are used in the YAML groups under ``conf/`` (``model``, ``data``, ``parallel``, ``optim``,
``trainer``, ``logging``, ``cluster``), on the command line (``parallel.ulysses_degree=4``) and in code.
Stable public override keys: ``recipe=NAME``, ``parallel.ulysses_degree``, ``parallel.ring_degree``,
``trainer.max_steps``, ``trainer.seq_len``, ``logging.wandb.mode``, ``hydra.run.dir``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class LoraConfig:
    """Low-rank adapters (``peft`` LoRA) on a frozen base model (:mod:`usp.model.lora`, docs/training.md)."""

    rank: int = 0
    """The adapters' rank ``r``; 0 = off (full training)."""
    alpha: float = 16.0
    """The adapters' scale numerator: each adapted layer adds ``(alpha / rank) * B @ A``."""
    dropout: float = 0.0
    """Dropout on each adapted layer's input to its adapter (training only)."""
    target_modules: list[str] | None = None
    """Names (last component, e.g. ``q_proj``) of the linear layers that get adapters; default: every linear
    layer of the decoder blocks whose name ends in ``proj`` (the attention and MLP projections, not a
    mixture-of-experts router)."""
    train_embeddings_and_norms: bool = False
    """Also train the input embeddings and every normalization layer (LongLoRA's finding for context
    extension); they are saved with the adapters (PEFT ``modules_to_save``)."""
    export_merged: bool = False
    """At the end of the run, also write the base model with the adapters merged into its weights (a plain
    Hugging Face checkpoint in ``<run dir>/hf``); the adapter directory ``<run dir>/adapter`` is always
    written (with ``trainer.export_hf``)."""


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
    rope_scaling: Any = None
    """Override ``rope_scaling`` (e.g. ``{rope_type: llama3, factor: 8.0, ...}``)."""
    max_position_embeddings: int | None = None
    """Override ``max_position_embeddings`` (set to at least ``trainer.seq_len``)."""
    router_aux_loss_coef: float | None = None
    """Mixture-of-experts models: the router load-balancing loss coefficient; ``None`` keeps the checkpoint's
    ``router_aux_loss_coef`` (0 turns the router loss off). Ignored by dense models."""
    router_loss_scope: str = "micro_batch"
    """Mixture-of-experts models: the routing statistics the router loss uses. ``micro_batch``: each forward's
    (every rank's tokens of one micro-batch, as transformers computes it per forward; the step's loss is the mean
    over micro-batches). ``step``: the whole step's (every micro-batch too), from a routing pass without
    gradients before the step (one more forward per micro-batch; the same as ``micro_batch`` when
    ``trainer.grad_accum_steps`` is 1)."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """Low-rank adapters on a frozen base (``model.lora.rank`` > 0): :class:`LoraConfig`."""
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
    text_field: Any = "text"
    """Column holding the document text: one name for every input, or a list with one name per input."""
    weights: list[float] | None = None
    """Mixing weights for several ``inputs`` (same length), or None for concatenation."""
    streaming: bool = False
    num_proc: int = 1
    cache_dir: str | None = None
    document_masking: bool = True
    """Attention never crosses packed document boundaries; position ids restart at each document."""
    validation_fraction: float = 0.0
    min_doc_tokens: int = 0
    """Drop documents shorter than this many tokens (after BOS/EOS) before packing; 0 keeps all."""
    long_doc_threshold: int | None = None
    """Documents of at least this many tokens count as long (for upsampling); None disables upsampling."""
    long_doc_factor: float = 1.0
    """Repeat long documents this many times on average (e.g. 2.0 doubles their share of the corpus)."""
    build_tiny_corpus: bool = False
    """Generate a small synthetic corpus (demo/tests only) when ``inputs`` is empty (``format=chat``: chats)."""
    seed: int = 1234
    format: str = "text"
    """``text`` (documents, every token trained) | ``chat`` (conversations rendered with the chat template,
    a ``loss_mask`` per token, best-fit packed; docs/data.md, "Chat data") | ``preference`` (DPO pairs
    ``{prompt, chosen, rejected}`` in columns of those names, two documents per pair with ``document_roles``;
    docs/data.md, "Preference data")."""
    messages_field: str = "messages"
    """Chat: the column holding the ``[{role, content}]`` list (ShareGPT ``conversations`` and ``prompt`` /
    ``completion`` rows are recognised too)."""
    chat_template: str | None = None
    """Chat: a Jinja template file, or a shipped one (``chatml``, ``tiny_chatml``); default the tokenizer's."""
    loss_on: str | None = None
    """Targets: ``assistant`` (each assistant message's content + its end-of-turn marker; the default for chat)
    | ``last_assistant`` | ``all`` (every token; the only choice, and the default, for text)."""
    long_conversations: str = "truncate"
    """Chat: a conversation longer than ``trainer.seq_len`` is ``truncate``d (first tokens kept) or ``drop``ped."""
    split_long_conversations: bool = False
    """Chat: cut conversations longer than ``trainer.seq_len`` across rows instead (never shorter ones)."""


@dataclass
class ParallelConfig:
    ulysses_degree: Any = 1
    """Ulysses (all-to-all) degree inside a node, or ``auto`` (ask the planner)."""
    ring_degree: Any = 1
    """Ring degree across nodes, or ``auto`` (ask the planner)."""
    dp_degree: int = -1
    """Data-parallel degree; -1 = the remaining ranks."""
    ring_layout: str = "balanced"
    """``balanced`` (default: placed from each packed row's document boundaries so every ring rank does the
    same attention work; exactly ``zigzag`` without document masking), ``zigzag`` (balanced causal work over
    one sequence) or ``contiguous``. See docs/attention.md, "Balanced layout"."""
    node_size: int | None = None
    """Ranks per node; default: the launcher's LOCAL_WORLD_SIZE."""
    allow_cross_node_ulysses: bool = False
    fsdp_mode: str = "full_shard"
    """``full_shard`` (shard over dp x ring x ulysses) | ``hybrid_shard`` (shard in a node, replicate across)."""
    activation_checkpointing: str = "none"
    """``none`` | ``full`` (every decoder layer) | ``every_k`` (every ``ac_every_k``-th layer) | ``offload``
    (every layer, the saved layer inputs in host memory: pinned, copied asynchronously; docs/memory.md)."""
    ac_every_k: int = 2
    mlp_tiles: Any = 1
    """Sequence tiles for each decoder layer's MLP and the RMSNorms (DeepSpeed ``TiledMLP``): 1 = off, an
    integer dividing ``trainer.seq_len / (ulysses x ring)``, or ``auto``: the planner's count (the fewest tiles
    that fit) when it chooses the degrees (``auto``), else tiles of about ``hidden_size`` tokens. Exact; costs
    one more MLP forward per step."""
    attn_head_chunks: int = 1
    """Groups of heads the ring attention runs over one after another (after the Ulysses all-to-all): 1 = all
    at once; else a divisor of both ``Hq / ulysses`` and ``max(Hkv, ulysses) / ulysses`` (whole GQA groups).
    Exact; the ring's fp32 accumulators and K/V/dK/dV buffers shrink by this factor (docs/memory.md)."""
    reduce_dtype: str = "float32"
    """Gradient reduce-scatter dtype under FSDP2."""
    backend: str | None = None
    """Process-group backend; default nccl on CUDA, gloo on CPU."""
    cpu_offload: bool = False
    """FSDP2 CPU offload of parameters, gradients and optimizer states (CUDA only; for one-GPU long runs)."""
    timeout_minutes: int = 60
    """Process-group timeout: how long a rank waits in a collective for the others (NCCL's default, 10 min,
    is too short while rank 0 prepares the data at start-up or a large checkpoint is saved)."""


@dataclass
class OptimConfig:
    name: str = "adamw"
    """``adamw`` (torch AdamW where the parameters live) | ``adamw_cpu_offload`` (optimizer states, fp32
    parameters and gradients in host memory, torch AdamW step on the host: FSDP2 CPU offload) |
    ``deepspeed_cpu_adam`` (the same placement, DeepSpeed's vectorized ``DeepSpeedCPUAdam`` step).
    ``parallel.cpu_offload=true`` with ``adamw`` means ``adamw_cpu_offload`` (docs/memory.md)."""
    lr: float = 2e-5
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    warmup_steps: int = 100
    min_lr_ratio: float = 0.1
    """Cosine decays to ``lr * min_lr_ratio`` at ``trainer.max_steps``."""
    grad_clip: float = 1.0
    """Max global grad norm; 0 disables clipping."""

    def __post_init__(self) -> None:
        self.betas = tuple(self.betas)  # YAML gives a list


@dataclass
class DpoConfig:
    """Preference optimization (``trainer.objective=dpo``; :mod:`usp.train.dpo`, docs/training.md "DPO")."""

    beta: float = 0.1
    """The DPO temperature: rewards are ``beta x (log pi - log ref)`` of each completion (``simpo``:
    ``beta x`` its mean token log-probability)."""
    loss_type: str = "sigmoid"
    """``sigmoid`` (DPO: ``-log sigmoid(beta ((pi_c - ref_c) - (pi_r - ref_r)))``), ``ipo``
    (``((pi_c - ref_c) - (pi_r - ref_r) - 1 / (2 beta))^2``) or ``simpo`` (reference-free:
    ``-log sigmoid(beta (pi_c / n_c - pi_r / n_r) - simpo_gamma)``, ``n`` the completion's tokens)."""
    simpo_gamma: float = 0.5
    """``loss_type=simpo``: the target reward margin gamma."""
    reference_path: str | None = None
    """The reference model (a Hugging Face checkpoint of the same architecture); default ``model.path``, the
    starting policy (with LoRA: the base, adapters off). Its log-probabilities of every row are computed once,
    on the training mesh, and cached beside the prepared data."""
    shared_prompt: bool = False
    """Lay each pair out with its prompt once, ``[prompt + chosen | rejected]``, the rejected completion
    attending to the prompt and to itself with its positions continuing from the prompt's end: the same loss
    and gradients as two sequences, with the prompt's tokens computed once (docs/training.md "DPO"). The
    prepared pairs must hold that layout (``usp-prepare-data --format preference --shared-prompt``; prepared so
    on the fly); not for models with recurrent or convolution mixers, sliding windows or chunked attention."""


@dataclass
class TrainerConfig:
    max_steps: int = 1000
    seq_len: int = 131072
    micro_batch_size: int = 1
    """Sequences per data-parallel rank per micro step (1 for long context)."""
    grad_accum_steps: int = 1
    loss_chunk_size: int = 4096
    """Tokens per chunk of the chunked cross-entropy (full logits never materialized)."""
    max_bad_steps: int = 3
    """Consecutive steps with a non-finite loss or gradient norm (each one skipped: no optimizer step) after
    which the run stops with an error; non-finite weights are never checkpointed or exported."""
    loss_spike_factor: float = 3.0
    """Log a warning when a step's loss exceeds this many times the median of the last 100 losses; 0 = off."""
    checkpoint_every: int = 500
    keep_last: int = 2
    checkpoint_dir: str | None = None
    """Default: ``<run dir>/checkpoints``."""
    resume: str | None = "auto"
    """``auto`` (latest in checkpoint_dir, if any) | a checkpoint path | None."""
    export_hf: bool = True
    """Write a Hugging Face checkpoint (safetensors + config + tokenizer) at the end, in ``<run dir>/hf``."""
    eval_every: int = 0
    """Validate every N steps (0: never): ``val_loss`` and, with ``eval_ppl_by_position``, perplexity by
    position on the validation split (needs ``data.validation_fraction > 0``)."""
    eval_ppl_by_position: bool = True
    """With ``eval_every``: also log ``val_ppl_by_position`` (mean loss / perplexity per bucket of
    ``eval.bucket_size`` positions in the document) to metrics.jsonl and wandb."""
    objective: str = "lm"
    """``lm`` (next-token cross-entropy: pretraining, SFT) | ``dpo`` (preference pairs from
    ``data.format=preference``; ``trainer.dpo.*``)."""
    dpo: DpoConfig = field(default_factory=DpoConfig)
    seed: int = 0
    device: str = "auto"
    """``auto`` | ``cuda`` | ``cpu``."""
    watchdog_factor: float = 20.0
    """Step watchdog: a training step taking more than this many times the running median step time (and at
    least ``watchdog_min_seconds``) dumps this rank's Python stacks and fails the job (a stuck or stopped
    rank). 0 turns the rule off. See docs/launch.md."""
    watchdog_min_seconds: float = 60.0
    """The step rule of the watchdog never fires before a step has run this many seconds."""
    watchdog_minutes: float = 30.0
    """Step watchdog: no progress (no step, checkpoint or evaluation finished) for this many minutes fails the
    job with stacks. 0 turns the rule off; keep it below ``parallel.timeout_minutes``."""


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
    """Steps between metrics records (metrics.jsonl, wandb, and the log line when there is no bar)."""
    progress_bar: bool = True
    """A tqdm bar on rank 0, drawn only when stderr is a terminal; otherwise (batch jobs) one log line per
    logged step (step, loss, tokens/s, MFU, memory)."""
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
    """Usable device memory, GiB (planner); default: the device table."""
    host_mem_gib: float | None = None
    """Host RAM per node, GiB (planner: pinned checkpoints of ``activation_checkpointing=offload`` and
    offloaded optimizer states must fit in it); default: the device table's server (1769.5, the 1.9e12 bytes
    an 8-GPU H100/H200/B200 node with 2 TB nominal leaves the OS, 1024 for A100)."""
    num_nodes: int = 1
    """Nodes the run expects; with ``gpus_per_node`` this is the world size a recipe declares (launchers and
    the recipe tests use it; the launched world size is what counts at run time)."""


EVAL_TASKS: tuple[str, ...] = ("ppl", "passkey", "ruler")


@dataclass
class PasskeyConfig:
    """``eval=passkey``: a random number hidden in filler text, then asked for (greedy decoding)."""

    depths: list[float] = field(default_factory=lambda: [0.0, 0.25, 0.5, 0.75, 1.0])
    """Where the passkey sits, as a fraction of the filler before it (0 = start, 1 = just before the question)."""
    trials: int = 5
    """Prompts per (length, depth) cell, each with its own passkey and seed."""
    seed: int = 0
    """Trial ``t`` of cell (length ``L``, depth ``d``) draws its passkey from ``(seed, L, d, t)``."""
    digits: int = 5
    """Digits of the passkey."""
    max_new_tokens: int = 12
    """Greedy tokens decoded for the answer (the first run of digits in them is compared)."""


RULER_TASKS: tuple[str, ...] = (
    "niah_single_1",
    "niah_single_2",
    "niah_single_3",
    "niah_multikey_1",
    "niah_multikey_2",
    "niah_multikey_3",
    "niah_multivalue",
    "niah_multiquery",
    "vt",
    "cwe",
    "fwe",
)


@dataclass
class RulerConfig:
    """``eval=ruler``: RULER's synthetic tasks (retrieval, tracing, aggregation) at every evaluated length."""

    tasks: list[str] = field(default_factory=lambda: list(RULER_TASKS))
    """Tasks evaluated (default: all of :data:`RULER_TASKS`), in this order."""
    seed: int = 0
    """Sample ``i`` of (task ``T``, length ``L``) is drawn from ``(seed, T, L, i)``."""
    samples: int = 10
    """Prompts per (task, length)."""
    haystack: str | None = None
    """A text file or a directory of ``.txt``/``.md`` files used as the essay-like haystack (cycled when
    shorter than a length needs); None: generated essay-like text (nothing is downloaded)."""
    threshold: float = 0.85
    """Effective length: the longest length up to which every length's mean score is at least ``threshold``
    x the shortest length's mean."""


@dataclass
class EvalConfig:
    """``usp-eval`` (``python -m usp.eval``) and the in-training perplexity by position."""

    task: str = "ppl"
    """``ppl`` (perplexity by position on long held-out documents) | ``passkey`` (retrieval accuracy) |
    ``ruler`` (RULER's synthetic tasks, :class:`RulerConfig`)."""
    lengths: list[int] | None = None
    """Evaluated sequence lengths in tokens; each must suit the layout (a multiple of 2 x ring x ulysses for
    zigzag). None: ``[trainer.seq_len]`` for ppl, ``[seq_len/4, seq_len/2, seq_len, 2 seq_len]`` for passkey and
    ruler."""
    micro_batch_size: int = 1
    """Sequences per forward (documents for ppl, trials for passkey, ruler prompts of one token length)."""
    bucket_size: int = 1024
    """Width of a position bucket for perplexity by position, in tokens."""
    inputs: list[str] = field(default_factory=list)
    """ppl: held-out text sources (as ``data.inputs``: files, dirs, hub names); empty: ``data.inputs`` (or the
    tiny corpus when ``data.build_tiny_corpus``). Documents shorter than a length are skipped for it."""
    num_documents: int = 8
    """ppl: documents evaluated per length (the first ones at least that long)."""
    original_context_length: int | None = None
    """Marked on the perplexity plot; None: the config's ``rope_scaling.original_max_position_embeddings``,
    else its ``max_position_embeddings``."""
    passkey: PasskeyConfig = field(default_factory=PasskeyConfig)
    chat_template: bool = False
    """passkey, ruler: wrap each prompt in the tokenizer's chat template (instruct models: the question as the
    user turn, the answer prefix opening the assistant turn); false: the plain prompt with its answer prefix."""
    ruler: RulerConfig = field(default_factory=RulerConfig)


@dataclass
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    run_dir: str = "."
    """Filled in by the entry point from ``hydra.run.dir``; every rank agrees on it."""
    run_name: str | None = None
    """A stable name for the run: the default run dir becomes ``outputs/<run_name>`` (instead of an id drawn
    per launch or per SLURM job), so a relaunched, requeued or resubmitted job continues there with
    ``trainer.resume=auto``. ``launch/slurm.sbatch`` sets it to the job name when the job is named
    (``--job-name``). An explicit ``hydra.run.dir`` (or a recipe's) wins."""
