"""One attempt of the longest-sequence search, in a process of its own:
``python -m usp.bench.maxlen.attempt SPEC.json``.

A fresh process per length: an out-of-memory error can leave the CUDA caching allocator fragmented, so a
later, shorter attempt in the same process could fail where a fresh one fits. The attempt is the product's
own run: the trainer's config composed from Hydra overrides (:func:`usp.config.compose.compose_config`, then
:func:`usp.config.validate_layout`) and :func:`usp.train.trainer.run` (validation, data preparation, sharded
model, weights from the checkpoint, the training loop, ``metrics.jsonl``). Two things differ from a training
run, both outside the measured steps:

- nothing is saved: ``run(cfg, save_final=False)`` with ``trainer.checkpoint_every=0`` and
  ``trainer.export_hf=false`` (for Llama-3.1-8B the final checkpoint would write 96 GB of weights and
  optimizer states after the step);
- ``fail_above`` (tests only): a forward of more tokens raises ``torch.OutOfMemoryError`` as a real step would
  (a global module forward pre-hook on the token embedding, ``torch.nn.modules.module``'s public hook: the
  trainer's step is not replaced), so the search logic can be checked on CPU against a known limit.

The spec (JSON) holds ``seq_len``, ``overrides``, ``run_dir``, ``result`` (where to write the outcome) and
``fail_above`` (or null). The result (JSON): ``seq_len``, ``status`` (``ok``, ``oom``, ``host_mem`` or
``error``), ``records`` (the trainer's ``metrics.jsonl`` records of this run), ``layout`` (as resolved by the
trainer: ``mlp_tiles`` ...), ``error`` (the exception's type and first line), ``wall_s``.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any


def classify(err: BaseException) -> str:
    """``oom`` for a device out-of-memory error (also when a loader wrapped it in its own message),
    ``host_mem`` for the trainer's refusal to pin more host memory than is available, ``error`` otherwise."""
    import torch

    text = f"{type(err).__name__}: {err}".lower()
    if isinstance(err, torch.OutOfMemoryError) or "out of memory" in text or "outofmemoryerror" in text:
        return "oom"
    if isinstance(err, ValueError) and "host memory" in text:
        return "host_mem"
    return "error"


def _inject_fail_above(limit: int) -> Any:
    """Make every forward of more than ``limit`` tokens (the input ids the token embedding sees; the attempt
    runs on one rank) raise ``torch.OutOfMemoryError``. Returns the hook's handle."""
    import torch
    from torch.nn.modules.module import register_module_forward_pre_hook

    def hook(module: torch.nn.Module, args: tuple[Any, ...]) -> None:
        if isinstance(module, torch.nn.Embedding) and args and args[0].numel() > limit:
            raise torch.OutOfMemoryError(
                f"injected by fail_above={limit}: a step of {args[0].numel()} tokens"
            )

    return register_module_forward_pre_hook(hook)


def attempt_overrides(
    seq_len: int,
    *,
    model_dir: Path,
    corpus: Path,
    cache_dir: Path,
    dtype: str,
    optim: str,
    mlp_tiles: str,
    loss_chunk_size: int,
    steps: int,
    max_position: int,
    cpu: bool,
) -> list[str]:
    """The trainer's Hydra overrides for one attempt: one rank, offload checkpointing, the tile setting, the
    optimizer; one document-unmasked row of ``seq_len`` tokens (dense causal attention, as the planner
    assumes); no evaluation, export, resume or watchdog."""
    return [
        f"model.path={model_dir}",
        f"model.dtype={dtype}",
        f"model.max_position_embeddings={max(seq_len, max_position)}",
        "data=jsonl",
        f"data.inputs=['{corpus}']",
        "data.document_masking=false",
        f"data.cache_dir={cache_dir}",
        "data.num_proc=1",
        "parallel=single",
        "parallel.activation_checkpointing=offload",
        f"parallel.mlp_tiles={mlp_tiles}",
        "optim=adamw",
        f"optim.name={optim}",
        "optim.warmup_steps=0",
        "trainer=long_context",
        f"trainer.seq_len={seq_len}",
        f"trainer.max_steps={steps}",
        f"trainer.loss_chunk_size={loss_chunk_size}",
        "trainer.checkpoint_every=0",
        "trainer.export_hf=false",
        "trainer.resume=null",
        f"trainer.device={'cpu' if cpu else 'cuda'}",
        "trainer.watchdog_factor=0",
        "trainer.watchdog_minutes=0",
        "logging.progress_bar=false",
    ]


def run_attempt(spec: dict[str, Any]) -> dict[str, Any]:
    """Compose, validate and train as ``spec`` says; returns ``{"records", "layout"}`` (raises on failure)."""
    from usp.config import validate_layout
    from usp.config.compose import compose_config
    from usp.train.trainer import run

    cfg = compose_config(spec["overrides"], run_dir=spec["run_dir"])
    validate_layout(cfg, world_size=1, local_world_size=1)
    if spec.get("fail_above") is not None:
        _inject_fail_above(int(spec["fail_above"]))
    result = run(cfg, save_final=False)
    return {"records": result["metrics"], "layout": result["layout"]}


def _descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (Linux ``/proc``; none elsewhere), children before their parents'
    siblings. Taken before killing: a killed parent's children are adopted by init and can no longer be found."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # the process ended meanwhile
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], list(children.get(pid, []))
    while todo:
        child = todo.pop()
        out.append(child)
        todo.extend(children.get(child, []))
    return out


def launch(spec: dict[str, Any], *, timeout_s: float, log_path: str | os.PathLike) -> dict[str, Any]:
    """Run ``spec`` in a fresh process (a session of its own, killed as a group at ``timeout_s``), its output
    in ``log_path``; returns its result, or ``{"status": "timeout"}`` (killed at the timeout) / ``"killed"``
    (ended by a signal without a result: the host's out-of-memory killer, typically) / ``"error"``."""
    import signal
    import subprocess

    result = Path(spec["result"])  # the run dir itself is the trainer's: it must start empty
    result.parent.mkdir(parents=True, exist_ok=True)
    result.unlink(missing_ok=True)
    spec_path = result.with_name(result.name.replace(".result.json", "") + ".spec.json")
    spec_path.write_text(json.dumps(spec, indent=1))
    root = str(Path(__file__).resolve().parents[3])  # the checkout that holds this usp package
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    start = time.perf_counter()
    timed_out = False
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "usp.bench.maxlen.attempt", str(spec_path)],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=env,
            cwd=root,
        )
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            for pid in [*_descendants(proc.pid), proc.pid]:  # compilers a JIT build starts leave the group
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            os.killpg(proc.pid, signal.SIGKILL)
            rc = proc.wait()
    wall = time.perf_counter() - start
    if result.is_file():
        return {**json.loads(result.read_text()), "wall_s": wall}
    status = "timeout" if timed_out else "killed" if rc < 0 else "error"
    return {
        "seq_len": spec["seq_len"],
        "status": status,
        "error": f"exit status {rc}, no result (see {log_path})",
        "wall_s": wall,
    }


def main(argv: list[str]) -> int:
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    spec = json.loads(Path(argv[0]).read_text())
    out: dict[str, Any] = {"seq_len": spec["seq_len"], "status": "error"}
    start = time.perf_counter()
    try:
        out.update(run_attempt(spec), status="ok")
    except Exception as err:  # noqa: BLE001 - every failure is an outcome of the attempt, written below
        import traceback

        traceback.print_exc()
        out["status"] = classify(err)
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        out["error"] = f"{type(err).__name__}: {first}"[:500]
    out["wall_s"] = time.perf_counter() - start
    path = Path(spec["result"])
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(out, default=str, indent=1))
    os.replace(tmp, path)
    print(f"attempt seq_len={spec['seq_len']}: {out['status']} {out.get('error', '')}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
