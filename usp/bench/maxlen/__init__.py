"""The longest sequence one device trains, measured: ``python -m usp.bench.maxlen``.

Each tried length is one run of the trainer (:mod:`usp.bench.maxlen.attempt`, a fresh process with its own
timeout) of ``--steps`` steps of a model with random weights (``--model``: a preset of
:data:`usp.plan.models.PRESETS`, default Llama-3.1-8B; ``--tiny``: the tiny Llama on the CPU) on one rank,
with ``parallel.activation_checkpointing=offload``, ``parallel.mlp_tiles`` (``auto``: the trainer's rule)
and the optimizer step on the host (``optim.name=deepspeed_cpu_adam``; ``adamw_cpu_offload`` when DeepSpeed's
CPU Adam does not build). For every length it reports the outcome (``ok``, ``oom``, ``host_mem``, ``timeout``,
``killed``, ``error``), the last step's time, tokens/s and MFU (the trainer's own figures, FLOPs from
:func:`usp.plan.compute.training_flops`), peak allocated and reserved GiB over the steps, and the planner's
prediction for the same settings (:func:`usp.plan.evaluate_layout`).

Search (:func:`~usp.bench.maxlen.search.search`, the walk of :mod:`usp.longest` that
``python -m usp.bench.throughput --find-max`` also uses): from the planner's longest length for these settings
without its headroom (:func:`usp.plan.max_seq_len`, rounded down to ``--granularity``; capped so one attempt's
predicted time fits ``--attempt-timeout``), up by ``x --factor`` while attempts succeed, or down by
``/ --factor`` until one does, then bisection to one granule. An attempt that fails for memory or time bounds the answer from above;
the answer is the longest length that trained. The whole search stops at ``--budget`` seconds of wall clock
(setup included) and writes what it has. Host memory is checked before each attempt with the planner's host
terms (offloaded states, pinned layer inputs) against this machine's RAM: an attempt that would not fit is
recorded as ``host_mem`` and not run (a host out-of-memory kill could take the whole machine down).

    python -m usp.bench.maxlen --out bench_results/maxlen/maxlen.json           # on a GPU, ~8 minutes
    python -m usp.bench.maxlen --tiny --start 2048 --granularity 256 --out /tmp/maxlen.json   # CPU, < 1 min

Modules: :mod:`~usp.bench.maxlen.cli` (the command line and the report), :mod:`~usp.bench.maxlen.search` (the
search and its records), :mod:`~usp.bench.maxlen.attempt` (one trainer run in a process of its own),
:mod:`~usp.bench.maxlen.planner` (the planner's view of the settings, the optimizer, the depth),
:mod:`~usp.bench.maxlen.setup` (the random checkpoint and the corpus).
"""

from usp.bench.maxlen.cli import build_parser, main

__all__ = ["build_parser", "main"]
