"""The small rules every layer shares, each defined once (usp.units, usp.modes, usp.mlp_tiles, usp.host,
usp.parallel.mesh)."""

from __future__ import annotations

import os

import pytest

from usp import host
from usp.mlp_tiles import check_mlp_tiles_setting, resolve_mlp_tiles
from usp.modes import RING_LAYOUTS, check_ring_layout, chunks_per_ring_rank
from usp.parallel.layout import sequence_multiple
from usp.parallel.mesh import resolve_node_size
from usp.units import GIB, divisors


def test_divisors_match_brute_force() -> None:
    for n in range(1, 200):
        assert divisors(n) == [d for d in range(1, n + 1) if n % d == 0]
    with pytest.raises(ValueError):
        divisors(0)
    assert GIB == 2**30


def test_ring_layout_rule() -> None:
    assert [chunks_per_ring_rank(x) for x in ("contiguous", "zigzag", "balanced")] == [1, 2, 2]
    assert set(RING_LAYOUTS) == {"contiguous", "zigzag", "balanced"}
    with pytest.raises(ValueError, match="parallel.ring_layout='ring'"):
        check_ring_layout("ring")
    assert sequence_multiple(4, 2, "zigzag") == 16 and sequence_multiple(4, 2, "contiguous") == 8


def test_mlp_tiles_rule() -> None:
    assert resolve_mlp_tiles("auto", local_tokens=96, hidden_size=64) == 2
    assert resolve_mlp_tiles("auto", local_tokens=64, hidden_size=64) == 1
    assert resolve_mlp_tiles("4", local_tokens=96, hidden_size=64) == 4
    with pytest.raises(ValueError, match="does not divide the 96 local tokens"):
        resolve_mlp_tiles(5, local_tokens=96, hidden_size=64)
    for bad in (0, -1, True, 1.5, "x"):
        with pytest.raises(ValueError, match="parallel.mlp_tiles"):
            check_mlp_tiles_setting(bad)


def test_node_size_fallback() -> None:
    assert resolve_node_size(4, 16, env={"LOCAL_WORLD_SIZE": "8"}) == 4
    assert resolve_node_size(None, 16, env={"LOCAL_WORLD_SIZE": "8"}) == 8
    assert resolve_node_size(None, 16, env={}) == 16


def test_head_dim_fallback() -> None:
    from types import SimpleNamespace

    from usp.plan.models import head_dim_of

    assert head_dim_of({"hidden_size": 4096, "num_attention_heads": 32}) == 128
    assert head_dim_of({"hidden_size": 4096, "num_attention_heads": 32, "head_dim": 64}) == 64
    assert head_dim_of(SimpleNamespace(hidden_size=576, num_attention_heads=9, head_dim=None)) == 64


def test_meminfo_read(tmp_path, monkeypatch) -> None:
    info = tmp_path / "meminfo"
    info.write_text("MemTotal:       16384 kB\nMemFree:         1024 kB\nMemAvailable:    8192 kB\n")
    assert host.meminfo_bytes("MemTotal", str(info)) == 16384 * 1024
    assert host.meminfo_bytes("MemAvailable", str(info)) == 8192 * 1024
    with pytest.raises(OSError, match="no Mem"):
        host.meminfo_bytes("Mem", str(info))  # a prefix is not a field
    assert host.available_host_bytes(str(info)) == 8192 * 1024
    # without the file: the free physical pages (fixed here: the real count moves while other tests allocate)
    pages = {"SC_AVPHYS_PAGES": 1000, "SC_PAGE_SIZE": 4096}
    monkeypatch.setattr(host.os, "sysconf", lambda name: pages[name])
    assert host.available_host_bytes(str(tmp_path / "absent")) == 1000 * 4096


@pytest.mark.skipif(not os.path.exists(host.PROC_STATUS), reason="no /proc/self/status (not Linux)")
@pytest.mark.serial  # its 512 MiB parent and the child's peak are read while other workers allocate
def test_peak_rss_is_the_process_own_not_the_parent_it_was_forked_from() -> None:
    """A child forked by a parent holding 512 MiB and exec-ing a small program: its peak is its own (tens of
    MiB); getrusage in the same child reports the parent's (Linux keeps the replaced image's peak), which is
    what made a CPU rank launched from a large process report the launcher's memory."""
    import subprocess
    import sys

    code = (
        "import os, sys\n"
        'hold = b"x" * (512 * 2**20)\n'  # written, so resident
        "r, w = os.pipe()\n"
        "if os.fork() == 0:\n"
        "    os.dup2(w, 1)\n"
        '    child = "import resource; from usp.host import peak_rss_bytes; "\n'
        '    child += "print(peak_rss_bytes(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)"\n'
        '    os.execv(sys.executable, [sys.executable, "-c", child])\n'
        "os.close(w)\n"
        "print(os.read(r, 200).decode().strip())\n"
        "os.wait()\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    own, rusage = (int(v) for v in out.stdout.split())
    assert own < 256 * 2**20, f"the child's own peak {own / 2**20:.0f} MiB includes the parent's 512 MiB"
    assert rusage > 512 * 2**20, "getrusage no longer carries the parent's peak: the case this guards is gone"
    assert host.peak_rss_bytes(str(os.devnull)) > 0  # no VmHWM line: the getrusage fallback
