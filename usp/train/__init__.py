"""Training: ``run(cfg)`` (:mod:`usp.train.trainer`: the loop and the end of the run) and its parts.

- :mod:`usp.train.job` - start-up: everything before the first step as one ``Job``;
- :mod:`usp.train.validation` - the validation loss and loss by position a run logs;
- :mod:`usp.train.checks` - the trainer's start-up checks, once, before any weights or data (the degrees
  themselves: :mod:`usp.startup`);
- :mod:`usp.train.loss` - chunked, token-weighted cross-entropy (``ChunkedCausalLMLoss``);
- :mod:`usp.train.parallelize` - the recipe: ``apply_usp``, activation checkpointing, FSDP2 / HSDP;
- :mod:`usp.train.optim` - AdamW, warmup + cosine, global-norm clipping;
- :mod:`usp.train.step` - one optimizer step over micro-batches (``train_step``);
- :mod:`usp.train.export` - the Hugging Face export (checkpoints themselves: :mod:`usp.checkpoint`, a lower
  layer that ``usp.eval`` reads too); :mod:`usp.train.rng` - the RNG states a checkpoint carries;
- :mod:`usp.train.tiling`, :mod:`usp.train.checkpoint_offload` - sequence tiles and checkpoint offload (docs/memory.md);
- :mod:`usp.train.resume`, :mod:`usp.train.rundir`, :mod:`usp.train.dir_lock`, :mod:`usp.train.guard`,
  :mod:`usp.train.signals`, :mod:`usp.train.watchdog` - faults: resume (and whose checkpoints a run may touch),
  run dirs, their lock, bad steps, preemption, hangs;
- :mod:`usp.train.metrics` - the per-step logger (metrics.jsonl, wandb, progress bar); :mod:`usp.train.flops` -
  model FLOPs and attention balance; :mod:`usp.train.peak_flops` - peak FLOP/s and MFU;
  :mod:`usp.train.peak_memory` - memory probes; :mod:`usp.train.metrics_file`, :mod:`usp.train.wandb_run`;

Submodules are imported on use (``from usp.train.trainer import run``), so ``python -m usp.train`` composes
and validates its config without importing torch.
"""
