"""Long-context evaluation on the training mesh: ``python -m usp.eval`` / ``usp-eval``.

Public Python entries (stable names):

- :func:`token_losses` ``(model, input_ids, mesh) -> Tensor [B, S]``: per-token losses of the sharded
  forward, float32, global order, on every rank (:mod:`usp.eval.losses`);
- :func:`generate` ``(model, input_ids, mesh, max_new_tokens) -> LongTensor [B, max_new_tokens]``: greedy
  decoding with the KV cache sharded over the mesh ("pass-Q"), identical on every rank (:mod:`usp.eval.decode`).

Tasks: :mod:`usp.eval.ppl` (perplexity by position), :mod:`usp.eval.passkey` (passkey retrieval),
:mod:`usp.eval.ruler` (RULER's synthetic tasks; prompts for instruct models: :mod:`usp.eval.chat`); outputs:
:mod:`usp.eval.report`; the job: :mod:`usp.eval.runner`. Submodules are imported on use, so the entry point
composes and validates its config without importing torch.
"""

from __future__ import annotations

from typing import Any

__all__ = ["generate", "token_losses"]


def __getattr__(name: str) -> Any:
    if name == "token_losses":
        from usp.eval.losses import token_losses

        return token_losses
    if name == "generate":
        from usp.eval.decode import generate

        return generate
    raise AttributeError(f"module 'usp.eval' has no attribute {name!r}")
