"""Training checkpoints: atomic, resharding-friendly saves of model, optimizer, scheduler and trainer state.

Layout of one checkpoint (``<ckpt_root>/step_<N>/``)::

    dcp/            torch.distributed.checkpoint of {"model": ..., "optim": ...}; every rank writes its shards
    meta.pt         rank 0: {"step", "scheduler", "world_size", "format_version"}
    rank_<r>.pt     rank r: {"extra": the ``extra`` dict that rank passed, "rank", "world_size"}
    COMPLETE        rank 0, written last (json): the marker that makes the directory a checkpoint, with the
                    size and SHA-256 of every other file (``"files"``), verified before a load

``meta.pt`` and ``rank_<r>.pt`` hold plain data only (tensors, numbers, strings, lists, tuples, dicts): they
are written with ``torch.save`` and read with ``torch.load(weights_only=True)``, so a crafted checkpoint cannot
run code through them; ``save_checkpoint`` refuses an ``extra`` holding anything else. DCP's own
``.metadata`` is read by an unpickler that only admits DCP's metadata classes (:class:`SafeFileSystemReader`).

Model and optimizer state go through ``get_state_dict`` / ``set_state_dict``: keys are the model's own FQNs and
FSDP2 shards are DTensors, so DCP stores global tensors and a load reshards into whatever mesh (or no mesh) the
new job has: save at world 4 under FSDP2, resume at world 2, or load into a plain single-process model.

Atomicity: everything is written into ``<ckpt_root>/.tmp-step_<N>``; after every rank has finished (a
collective that also carries errors, so a failure on one rank raises on all ranks instead of hanging them),
rank 0 writes ``COMPLETE`` and renames the directory to ``step_<N>`` (one ``rename`` on the same filesystem,
:func:`usp.atomic.publish_dir`; ``meta.pt``, ``rank_<r>.pt`` and ``COMPLETE`` are each written atomically too).
Only then are checkpoints beyond the newest ``keep_last`` deleted. A crash at any point leaves the previous
checkpoints untouched; :func:`latest_checkpoint` only reports directories named ``step_<N>`` that hold the
marker, so a leftover ``.tmp-step_*`` is never picked up (the next save removes it).

``extra`` is stored per rank. On load, a job with the same world size gets back exactly what *its* rank saved
(per-rank RNG states are restored exactly); a job with a different world size gets rank 0's ``extra`` on every
rank (per-rank RNG states cannot map one-to-one then). So keep global state in ``extra`` in a form that any
layout can interpret — e.g. the data loader's position in *global* samples, which is equal on every rank — and
put per-rank state (RNG) next to it. The returned dict says which case applied (``"extra_rank"``).

The checkpoint root must be on a filesystem every rank sees (a shared filesystem across nodes).

The public surface is what this package exports (``from usp.checkpoint import save_checkpoint, ...``); the
modules behind it, one idea each:

- :mod:`usp.checkpoint.save` - :func:`save_checkpoint`;
- :mod:`usp.checkpoint.load` - :func:`load_checkpoint`, :func:`read_saved_extra`;
- :mod:`usp.checkpoint.files` - the file names, ``FORMAT_VERSION`` and the queries (:func:`list_checkpoints`,
  :func:`latest_checkpoint`, :func:`resolve_checkpoint`, :func:`is_complete_checkpoint`);
- :mod:`usp.checkpoint.integrity` - :func:`check_plain_data`, the per-file checksums and their verification
  (:func:`verify_checkpoint`, :func:`find_intact_checkpoint`, :func:`file_digest`);
- :mod:`usp.checkpoint.reader` - the pickle-free reads (:func:`load_plain`, :class:`SafeFileSystemReader`);
- :mod:`usp.checkpoint.dcp_state` - what save and load share around ``torch.distributed.checkpoint``.

Layer: below ``usp.eval`` and ``usp.train`` (both read checkpoints; neither is imported here).
"""

from usp.checkpoint.files import (
    FORMAT_VERSION,
    is_complete_checkpoint,
    latest_checkpoint,
    list_checkpoints,
    resolve_checkpoint,
)
from usp.checkpoint.integrity import check_plain_data, file_digest, find_intact_checkpoint, verify_checkpoint
from usp.checkpoint.load import load_checkpoint, read_saved_extra
from usp.checkpoint.save import save_checkpoint

__all__ = [
    "FORMAT_VERSION",
    "check_plain_data",
    "file_digest",
    "find_intact_checkpoint",
    "is_complete_checkpoint",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "read_saved_extra",
    "resolve_checkpoint",
    "save_checkpoint",
    "verify_checkpoint",
]
