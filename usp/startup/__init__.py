"""What ``usp-train`` and ``usp-eval`` share at start-up (layer 8: below ``usp.eval`` and ``usp.train``).

- :mod:`usp.startup.degrees` - ``parallel.*`` resolved against the world once (:func:`resolve_degrees` ->
  :class:`ResolvedDegrees`: the degrees, or the planner's choice for ``auto``; node size; MLP tiles) and the
  mesh built from them (:func:`build_mesh`);
- :mod:`usp.startup.checks` - the model against those degrees: heads vs Ulysses, RoPE vs sequence parallelism
  (:func:`check_model_for_degrees`);
- :mod:`usp.startup.shell` - the ``run()`` shell: device, process group (created here -> destroyed here)
  (:func:`run_in_process_group`);
- :mod:`usp.startup.error_file` - torchrun's per-worker error file (:func:`record_error`, :func:`record_failure`),
  imported on use (the entry points compose their config without torch).
"""

from usp.startup.checks import check_model_for_degrees
from usp.startup.degrees import ResolvedDegrees, build_mesh, resolve_degrees
from usp.startup.shell import run_in_process_group

__all__ = [
    "ResolvedDegrees",
    "build_mesh",
    "check_model_for_degrees",
    "resolve_degrees",
    "run_in_process_group",
]
