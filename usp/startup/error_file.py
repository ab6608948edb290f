"""What train and eval entry points take from torchrun (``torch.distributed.elastic``): error files. (The rendezvous store per
restart, :func:`launcher_store`, lives with the rest of the process-group setup in
:mod:`usp.parallel.process_group`.)

**Error files.** torchrun gives each worker ``TORCHELASTIC_ERROR_FILE`` and prints the content of the first
failing rank's file in its failure summary. :func:`record_error` writes it (the same JSON as
``torch.distributed.elastic.multiprocessing.errors.record``), for errors the entry point reports itself
instead of raising.
"""

from __future__ import annotations

import json
import os
import time


def record_error(error: BaseException, *, with_traceback: bool = True) -> None:
    """Write ``error`` to this worker's torchrun error file (``TORCHELASTIC_ERROR_FILE``; nothing without it),
    where torchrun's failure summary shows it. Call inside the ``except`` block.

    ``with_traceback=False`` (a user error: a bad setting, whose message names the fix) records the message
    in place of the Python stack, so the summary shows the reason, not N copies of a traceback.
    """
    if with_traceback:
        from torch.distributed.elastic.multiprocessing.errors import (
            ErrorHandler,  # lazy: no torch to import this
        )

        ErrorHandler().record_exception(error)
        return
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    message = f"{type(error).__name__}: {error}"
    data = {
        "message": {
            "message": message,
            "extraInfo": {"py_callstack": message, "timestamp": str(int(time.time()))},
        }
    }
    with open(path, "w") as f:
        json.dump(data, f)


def record_failure(error: BaseException) -> None:
    """The entry points' recorder for a failure they report themselves (a bad setting: the reason, no
    traceback), passed to :func:`usp.config.compose.run_hydra_app`."""
    record_error(error, with_traceback=False)
