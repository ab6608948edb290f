"""This machine's host memory, read in one place (``/proc/meminfo`` on Linux).

:func:`meminfo_bytes` reads one field (``MemTotal``, ``MemAvailable``, ...); :func:`available_host_bytes` is
the memory new allocations can take (the offload checks), with a fallback where the file does not exist.
"""

from __future__ import annotations

import os

MEMINFO = "/proc/meminfo"


def meminfo_bytes(key: str, path: str = MEMINFO) -> int:
    """The ``key`` field of ``/proc/meminfo`` (given in kB there), in bytes. ``OSError`` when the file cannot be
    read or has no such field."""
    with open(path) as f:
        for line in f:
            name, _, value = line.partition(":")
            if name == key:
                return int(value.split()[0]) * 1024
    raise OSError(f"{path} has no {key}")


def available_host_bytes(path: str = MEMINFO) -> int:
    """Host memory available to new allocations on this node: ``MemAvailable`` of ``/proc/meminfo`` (``path``),
    or the free physical pages where that file (or field) does not exist."""
    try:
        return meminfo_bytes("MemAvailable", path)
    except OSError:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
