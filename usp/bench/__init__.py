"""Benchmarks and measurement tools (the top layer: they may import any usp package; nothing imports them).

- ``usp-bench`` (:mod:`usp.bench.attention`): attention timing, bytes communicated, per-rank FLOPs balance;
  :mod:`usp.bench.kernels`, :mod:`usp.bench.balance`, :mod:`usp.bench.ring1`, :mod:`usp.bench.decode`,
  :mod:`usp.bench.host_adam`, :mod:`usp.bench.memory`: single-purpose timings and memory probes;
- :mod:`usp.bench.throughput`: the trainer's step on random weights (``--find-max``: the longest that fits);
- :mod:`usp.bench.maxlen`: the longest sequence one device trains, one trainer run per length;
- :mod:`usp.bench.track_memory`: peak and held bytes of a block of code (CUDA and CPU);
- :mod:`usp.bench.fake_memory` (with ``fake_cuda``, ``fake_kernels``): a training step's memory without a GPU;
- :mod:`usp.bench.figures`, :mod:`usp.bench.layout_figure`: the figures in docs/;
- :mod:`usp.bench.flags`: the list-valued flag types the tools share.

Both length searches use :func:`usp.longest.search_longest`.
"""
