"""Speed of the AdamW step on the host CPU: torch for-each, torch fused, DeepSpeed's ``DeepSpeedCPUAdam``.

What ``optim.name`` chooses between when the optimizer states live in host memory (docs/memory.md). One fp32
parameter of ``--params`` elements with a random gradient; prints one JSON line per implementation and thread
count (``params_per_s``: parameters updated per second, after one warm-up step)::

    python -m usp.bench.host_adam --params 50000000 --threads 1 2

``DeepSpeedCPUAdam`` compiles its C++ op on first use (minutes; cached under ``TORCH_EXTENSIONS_DIR``).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from typing import Any

import torch


def _optimizer(name: str, p: torch.nn.Parameter) -> torch.optim.Optimizer:
    kw: dict[str, Any] = {"lr": 1e-3, "betas": (0.9, 0.95), "weight_decay": 0.1}
    if name == "deepspeed_cpu_adam":
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        from usp.train.deepspeed_parts import load_cpu_adam_op

        load_cpu_adam_op()  # built once per machine and version, not per virtualenv
        return DeepSpeedCPUAdam([p], adamw_mode=True, **kw)
    return torch.optim.AdamW(
        [p],
        fused=True if name == "torch_fused" else None,
        foreach=True if name == "torch_foreach" else None,
        **kw,
    )


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(
        prog="python -m usp.bench.host_adam", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--params", type=int, default=50_000_000)
    parser.add_argument("--threads", type=int, nargs="+", default=[1])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--impl", nargs="+", default=["torch_foreach", "torch_fused", "deepspeed_cpu_adam"])
    args = parser.parse_args(argv)
    out = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        for name in args.impl:
            p = torch.nn.Parameter(torch.randn(args.params))
            p.grad = torch.randn(args.params)
            opt = _optimizer(name, p)
            opt.step()  # warm-up (state allocation)
            start = time.perf_counter()
            for _ in range(args.steps):
                opt.step()
            seconds = (time.perf_counter() - start) / args.steps
            rec = {
                "impl": name,
                "threads": threads,
                "params": args.params,
                "step_s": seconds,
                "params_per_s": args.params / seconds,
            }
            out.append(rec)
            print(json.dumps(rec), flush=True)
    return out


if __name__ == "__main__":
    main()
