"""Non-finite steps and loss spikes: what the trainer does when the loss or the gradient goes bad.

- :func:`usp.train.step.train_step` skips the optimizer step when the step's loss or global gradient norm is
  not finite (NaN or inf), with every rank agreeing (one MIN all-reduce of a flag); the gradients are dropped,
  the weights and AdamW moments stay as they were, the LR schedule still advances (the step's data is spent).
- :class:`StepGuard` counts those skipped steps, logs each one, and stops the run with ``RuntimeError`` after
  ``trainer.max_bad_steps`` consecutive ones (a step with no target token at all is skipped and counted too,
  but does not stop the run) (the weights are usually non-finite by then, or the data or the
  learning rate is broken: going on would only burn the allocation). It also warns about loss spikes: a finite
  loss above ``trainer.loss_spike_factor`` times the median of the last :data:`SPIKE_WINDOW` finite losses.
- :func:`check_finite_weights` (collective) runs before every checkpoint save and the export: non-finite
  weights are never written, so a NaN run cannot replace good checkpoints through keep-last pruning.
"""

from __future__ import annotations

import collections
import logging
import math
import statistics

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

logger = logging.getLogger(__name__)

SPIKE_WINDOW = 100
"""Finite losses the spike detector's running median looks back over."""
SPIKE_MIN_HISTORY = 10
"""Steps of history before the spike detector says anything (the first steps of a run fall fast)."""


class NonFiniteTrainingError(RuntimeError):
    """The run stopped: too many consecutive non-finite steps, or non-finite weights before a save/export."""


class StepGuard:
    """Counts skipped (non-finite) steps and watches for loss spikes; identical on every rank.

    Args:
        max_bad_steps: ``trainer.max_bad_steps``: this many consecutive skipped steps stop the run.
        spike_factor: ``trainer.loss_spike_factor``: warn when a loss exceeds this many times the running
            median (0 turns the detector off).
    """

    def __init__(self, max_bad_steps: int, spike_factor: float) -> None:
        self.max_bad_steps = max_bad_steps
        self.spike_factor = spike_factor
        self.consecutive = 0
        self.total = 0
        self.spikes = 0
        self.no_target_steps = 0
        self._history: collections.deque[float] = collections.deque(maxlen=SPIKE_WINDOW)
        self._last: tuple[int, float, float] = (0, 0.0, 0.0)

    def update(
        self, step: int, *, loss: float, grad_norm: float, skipped: bool, no_targets: bool = False
    ) -> None:
        """Record optimizer step ``step`` (1-based): count and log a skipped step, or watch for a spike. Call
        :meth:`stop_if_exhausted` once the step is logged. A step skipped for having no target token
        (``no_targets``) counts in :attr:`total` but not towards ``max_bad_steps`` (nothing went non-finite)."""
        self._last = (step, loss, grad_norm)
        if no_targets:
            self.total += 1
            self.no_target_steps += 1
            logger.warning(
                "step %d: no target token in the whole step (every rank, every micro-batch): optimizer step skipped "
                "(%d such steps, %d skipped in this run); check data.loss_on and the conversations' lengths",
                step,
                self.no_target_steps,
                self.total,
            )
            return
        if skipped:
            self.consecutive += 1
            self.total += 1
            logger.warning(
                "step %d: loss %s, gradient norm %s: not finite, optimizer step skipped (%d in a row, "
                "trainer.max_bad_steps=%d; %d skipped in this run)",
                step,
                loss,
                grad_norm,
                self.consecutive,
                self.max_bad_steps,
                self.total,
            )
            return
        self.consecutive = 0
        if self.spike_factor > 0 and len(self._history) >= SPIKE_MIN_HISTORY:
            median = statistics.median(self._history)
            if loss > self.spike_factor * median:
                self.spikes += 1
                logger.warning(
                    "step %d: loss spike: %.4f is %.1fx the median %.4f of the last %d steps "
                    "(trainer.loss_spike_factor=%g)",
                    step,
                    loss,
                    loss / median,
                    median,
                    len(self._history),
                    self.spike_factor,
                )
        if math.isfinite(loss):
            self._history.append(loss)

    def stop_if_exhausted(self, last_checkpoint: object) -> None:
        """Raise :class:`NonFiniteTrainingError` (the same on every rank) after ``max_bad_steps`` consecutive
        skipped steps."""
        if self.consecutive < self.max_bad_steps:
            return
        step, loss, grad_norm = self._last
        raise NonFiniteTrainingError(
            f"{self.consecutive} consecutive steps (up to step {step}) had a non-finite loss or gradient norm "
            f"(last: loss {loss}, grad norm {grad_norm}), trainer.max_bad_steps={self.max_bad_steps}: stopping. No "
            f"checkpoint or export was written from them; the last checkpoint is {last_checkpoint}. Lower "
            f"optim.lr (or raise optim.warmup_steps, or set optim.grad_clip), check the data, then resume from it."
        )


def all_finite(flag: bool, group: dist.ProcessGroup | None, device: torch.device | str) -> bool:
    """``True`` iff ``flag`` is true on every rank of ``group`` (one MIN all-reduce; none in a 1-rank world)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return bool(t.item() > 0)


@torch.no_grad()
def check_finite_weights(model: nn.Module, *, step: int, what: str, last_checkpoint: object) -> None:
    """Collective: raise :class:`NonFiniteTrainingError` on every rank if any rank's parameter shard holds a NaN
    or inf, before ``what`` (a checkpoint save, the export) writes them. One pass over the local shards."""
    local_ok = True
    device: torch.device | str = "cpu"
    for p in model.parameters():
        t = p.to_local() if isinstance(p, DTensor) else p
        device = t.device
        if t.numel() and not bool(torch.isfinite(t).all()):
            local_ok = False
            break
    if not all_finite(local_ok, None, device):
        raise NonFiniteTrainingError(
            f"the weights are not finite after step {step}: refusing to write {what} from them. The last "
            f"checkpoint is {last_checkpoint}; lower optim.lr (or raise optim.warmup_steps), then resume from it."
        )
