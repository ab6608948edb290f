"""This machine's host memory, read in one place (``/proc/meminfo`` and ``/proc/self/status`` on Linux).

:func:`meminfo_bytes` reads one field (``MemTotal``, ``MemAvailable``, ...); :func:`available_host_bytes` is
the memory new allocations can take (the offload checks), with a fallback where the file does not exist;
:func:`peak_rss_bytes` is this process's own peak resident set (the CPU runs' ``peak_mem_gib``).
"""

from __future__ import annotations

import os
import sys

MEMINFO = "/proc/meminfo"
PROC_STATUS = "/proc/self/status"


def meminfo_bytes(key: str, path: str = MEMINFO) -> int:
    """The ``key`` field of ``/proc/meminfo`` (or another ``/proc`` file of ``key: value kB`` lines), in bytes.
    ``OSError`` when the file cannot be read or has no such field."""
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


def peak_rss_bytes(path: str = PROC_STATUS) -> int:
    """Peak resident set of this process's own memory since it started, in bytes: ``VmHWM`` of
    ``/proc/self/status`` (``path``) on Linux.

    Not ``getrusage().ru_maxrss``: on Linux that keeps the peak of the process image an ``exec`` replaced, and a
    child forked by a large parent (a test runner, a notebook) starts from the parent's resident set, so it
    reports the parent's peak. ``ru_maxrss`` is the fallback where the file does not exist (bytes on macOS,
    KiB elsewhere)."""
    try:
        return meminfo_bytes("VmHWM", path)  # "VmHWM:   123456 kB", the same "key: value kB" lines
    except OSError:
        pass
    import resource

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024
