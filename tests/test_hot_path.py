"""Checks at the boundary, none on the hot path: after the first step a training step makes no
``check_sequence_length``, head-split, backend-resolution or layout-validation call, and computes each
micro-batch's token indices once for its three sharded tensors.

Counted, not timed: a profile hook (``sys.setprofile`` on every thread) counts calls of the watched functions'
code objects in the window of each ``train_step`` call of a real ``usp.train.run`` (tiny Llama, ring 2 with the
balanced layout and documents, 2 micro-batches a step). Start-up and the first step must call them (which
shows the counter sees them); later steps must not.
"""

from __future__ import annotations

import sys
import threading

import pytest

from tests.test_train_run import make_config

STEPS = 4
ACCUM = 2


def _watched() -> dict[str, object]:
    """Name -> code object of each function a step must not call after the first (or, for token indices,
    must call once per micro-batch)."""
    from usp.attention import heads, kernels, ring
    from usp.attention import usp as usp_attention
    from usp.parallel import layout, sequence

    functions = {
        "check_sequence_length": sequence.check_sequence_length,
        "sequence_length_error": layout.sequence_length_error,
        "ParallelLayout.__post_init__": layout.ParallelLayout.__post_init__,
        "ulysses_heads": heads.ulysses_heads,
        "resolve_backend": kernels.resolve_backend,
        "check_attn_head_chunks": usp_attention.check_attn_head_chunks,
        "check_head_chunks": ring.check_head_chunks,  # ring_attention's own check, not on usp_attention's path
        "attention call setup": usp_attention._call_setup,
        "token indices": sequence.mesh_token_indices,  # a micro-batch's shard (block plans compute their own)
    }
    # a cached function's body runs only on a miss: that is the work counted
    return {name: getattr(f, "__wrapped__", f).__code__ for name, f in functions.items()}


def count_worker(cfg) -> list[dict[str, int]]:
    """Worker: ``usp.train.run(cfg)`` under the profile hook; the counts of each window (0: start-up, k: from
    the k-th ``train_step`` call to the next)."""
    from usp.train import step as step_module
    from usp.train.trainer import run

    watched = {code: name for name, code in _watched().items()}
    step_code = step_module.train_step.__code__
    windows: list[dict[str, int]] = [dict.fromkeys(watched.values(), 0)]

    def hook(frame, event, arg):
        if event != "call":
            return
        code = frame.f_code
        if code is step_code:
            windows.append(dict.fromkeys(watched.values(), 0))
        elif code in watched:
            windows[-1][watched[code]] += 1

    sys.setprofile(hook)
    threading.setprofile(hook)
    try:
        run(cfg)
    finally:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]
    return windows


@pytest.mark.timeout(600)
def test_a_training_step_makes_no_checks_after_the_first(dist_pools, tmp_path):
    from usp.tiny import build_tiny_llama

    model = str(build_tiny_llama(tmp_path / "model"))
    cfg = make_config(model, str(tmp_path / "run"), str(tmp_path / "cache"), ring_degree=2)
    cfg.parallel.ring_layout = "balanced"
    cfg.trainer.max_steps = STEPS
    cfg.trainer.grad_accum_steps = ACCUM
    cfg.trainer.eval_every = 0
    cfg.data.validation_fraction = 0.0
    cfg.trainer.checkpoint_every = 0
    cfg.trainer.export_hf = False
    for rank, windows in enumerate(dist_pools(2).run(count_worker, cfg)):
        assert len(windows) == STEPS + 1, f"rank {rank}: {len(windows) - 1} train_step calls"
        startup, first, later = windows[0], windows[1], windows[2:]
        # the counter sees them: start-up checks the length and builds the layout, the first step sets up
        # the attention call kind (one per model: every layer and micro-batch reuses it)
        assert startup["check_sequence_length"] + startup["sequence_length_error"] > 0, startup
        assert startup["ParallelLayout.__post_init__"] > 0, startup
        assert first["attention call setup"] + startup["attention call setup"] >= 1, first
        assert first["check_head_chunks"] + startup["check_head_chunks"] >= 1, first
        for k, window in enumerate(later, start=2):
            checks = {name: n for name, n in window.items() if name != "token indices" and n}
            assert not checks, f"rank {rank}, step {k} (after start-up and the first step) called {checks}"
            # one index computation per micro-batch (shared by input_ids, labels and position_ids); the loader
            # builds the next step's micro-batches in this window, the last step has none after it
            assert window["token indices"] == (ACCUM if k < STEPS else 0), f"rank {rank}, step {k}: {window}"
