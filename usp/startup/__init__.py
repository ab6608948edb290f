"""What ``usp-train`` and ``usp-eval`` share at start-up (layer 8: below ``usp.eval`` and ``usp.train``).

- :mod:`usp.startup.degrees` - ``parallel.*`` resolved against the world once (:func:`resolve_layout` ->
  :class:`usp.parallel.ParallelLayout`: the degrees, or the planner's choice for ``auto``; node size; MLP
  tiles) and the mesh that owns it (:func:`build_mesh`);
- :mod:`usp.startup.checks` - the model against those degrees: heads vs Ulysses, RoPE vs sequence parallelism
  (:func:`check_model_for_degrees`);
- :mod:`usp.startup.shell` - the ``run()`` shell: device, process group (created here -> destroyed here)
  (:func:`run_in_process_group`);
- :mod:`usp.startup.error_file` - torchrun's per-worker error file (:func:`record_error`, :func:`record_failure`,
  the recorder both entry points pass to :func:`usp.config.compose.run_hydra_app`); importing it (and this
  package) imports no torch: the names above load on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from usp.startup.checks import check_model_for_degrees
    from usp.startup.degrees import build_mesh, resolve_layout
    from usp.startup.shell import run_in_process_group

_HOMES = {
    "check_model_for_degrees": "usp.startup.checks",
    "build_mesh": "usp.startup.degrees",
    "resolve_layout": "usp.startup.degrees",
    "run_in_process_group": "usp.startup.shell",
}


def __getattr__(name: str) -> Any:
    """The names above, imported on first use: ``usp.startup.error_file`` stays importable without torch (the
    entry points record a bad setting before anything heavy is imported)."""
    if name not in _HOMES:
        raise AttributeError(f"module 'usp.startup' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name]), name)


__all__ = [
    "build_mesh",
    "check_model_for_degrees",
    "resolve_layout",
    "run_in_process_group",
]
