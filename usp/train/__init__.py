"""Training: ``run(cfg)`` (:mod:`usp.train.trainer`) and its parts.

- :mod:`usp.train.validate` - the run resolved and checked once, before any weights or data (``Layout``);
- :mod:`usp.train.loss` - chunked, token-weighted cross-entropy (``ChunkedCausalLMLoss``);
- :mod:`usp.train.parallelize` - the recipe: ``apply_usp``, activation checkpointing, FSDP2 / HSDP;
- :mod:`usp.train.optim` - AdamW, warmup + cosine, global-norm clipping;
- :mod:`usp.train.step` - one optimizer step over micro-batches (``train_step``);
- :mod:`usp.train.checkpoint`, :mod:`usp.train.export` - checkpoints and the Hugging Face export; :mod:`usp.train.rng` - the RNG states they carry;
- :mod:`usp.train.metrics` - metrics.jsonl, wandb, MFU;
- :mod:`usp.train.throughput` - step throughput on random weights.

Submodules are imported on use (``from usp.train.trainer import run``), so ``python -m usp.train`` composes
and validates its config without importing torch.
"""
