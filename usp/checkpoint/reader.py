"""Reading a checkpoint's files without unpickling code.

- :func:`load_plain` - ``meta.pt`` / ``rank_<r>.pt`` through ``torch.load(weights_only=True)``: plain data only;
- :class:`SafeFileSystemReader` - DCP's file reader whose ``.metadata`` unpickler (:class:`MetadataUnpickler`)
  admits only DCP's metadata classes, torch dtypes/sizes/layouts, paths and plain containers (``_SAFE_GLOBALS``);
  anything else raises ``pickle.UnpicklingError`` with :data:`REFUSED` in its message.

Used by the load in :mod:`usp.checkpoint.load`.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta


def load_plain(path: Path, what: str = "trainer.resume") -> Any:
    """``torch.load(weights_only=True)`` of a checkpoint's ``meta.pt`` / ``rank_<r>.pt``: plain data only.

    Anything else (a pickled object that would run code, a torn file) raises ``ValueError`` naming the file.
    """
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError as e:
        raise ValueError(
            f"{what}: {path} is missing; the checkpoint is damaged. Point {what} at another "
            f"step_<N> directory."
        ) from e
    except Exception as e:  # noqa: BLE001 - UnpicklingError, RuntimeError (torn zip), EOFError, ...
        raise ValueError(
            f"{what}: {path} cannot be read as plain checkpoint data ({type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''}); it is damaged, or it holds pickled objects, which "
            f"usp refuses to unpickle. Point {what} at another step_<N> directory."
        ) from e


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader, but ``.metadata`` is unpickled with :class:`MetadataUnpickler`: only DCP's metadata
    dataclasses, torch dtypes/sizes/layouts, paths and plain containers are admitted, so a crafted checkpoint
    cannot run code through it."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            metadata = MetadataUnpickler(f).load()
        if not isinstance(metadata, Metadata):
            raise pickle.UnpicklingError(f"{path} holds a {type(metadata).__name__}, not DCP Metadata")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


REFUSED = "is not allowed in a checkpoint's DCP .metadata"
"""The words in every refusal of :class:`MetadataUnpickler` (the load recognises its error by them, however DCP
wrapped it)."""
_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
_SAFE_GLOBALS = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch._utils", "_get_layout"),
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("pathlib._local", "PosixPath"),
    ("pathlib._local", "WindowsPath"),
}


class MetadataUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` for DCP's ``.metadata`` that admits only the globals listed above."""

    def find_class(self, module: str, name: str) -> Any:
        if module == _METADATA_MODULE and (not name.startswith("_") or name == "_MEM_FORMAT_ENCODING"):
            obj = super().find_class(module, name)
            if isinstance(obj, type) and obj.__module__ == module:  # DCP's own dataclasses and enums only
                return obj
        if (module, name) in _SAFE_GLOBALS or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} {REFUSED}")
