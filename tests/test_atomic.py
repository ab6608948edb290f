"""usp.atomic: a file or directory is replaced whole or not at all, and a crash leaves only named temps."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import usp.atomic as atomic
from usp.atomic import ASIDE_TAG, publish_dir, restore_aside, temp_path, write_dir, write_file, write_text


def _tree(path: Path) -> dict[str, str]:
    return {str(p.relative_to(path)): p.read_text() for p in sorted(path.rglob("*")) if p.is_file()}


def _fill(files: dict[str, str]):
    def write(tmp: Path) -> None:
        for rel, text in files.items():
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            (tmp / rel).write_text(text)

    return write


def _boom(*args, **kwargs):
    raise OSError("disk full (simulated)")


def test_temp_paths_are_hidden_siblings_named_after_the_target(tmp_path):
    final = tmp_path / "sub" / "hf"
    assert temp_path(final, "tmp-export", unique=False) == tmp_path / "sub" / ".hf.tmp-export"
    a, b = temp_path(final, "work"), temp_path(final, "work")
    assert a != b and a.parent == final.parent
    assert a.name.startswith(".hf.work-") and a.name.split("-")[1] == str(os.getpid())


def test_write_file_creates_and_replaces(tmp_path):
    path = tmp_path / "m.json"
    write_text(path, "one\n")
    assert path.read_text() == "one\n"
    write_file(path, lambda f: f.write(b"two\n"))
    assert path.read_text() == "two\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.json"]


def test_write_file_crash_in_callback_keeps_old_content_and_no_temp(tmp_path):
    path = tmp_path / "m.json"
    path.write_text("old\n")

    def half(f):
        f.write(b"new, half written")
        raise OSError("disk full (simulated)")

    with pytest.raises(OSError, match="disk full"):
        write_file(path, half)
    assert path.read_text() == "old\n"
    with pytest.raises(OSError, match="disk full"):
        write_file(tmp_path / "fresh.json", half)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.json"]  # no partial target, no temp


def test_write_dir_creates_and_replaces_an_existing_dir(tmp_path):
    final = tmp_path / "out"
    assert write_dir(final, _fill({"a.txt": "1", "sub/b.txt": "2"})) is True
    assert _tree(final) == {"a.txt": "1", "sub/b.txt": "2"}
    assert write_dir(final, _fill({"c.txt": "3"})) is True  # nothing of the old one is left
    assert _tree(final) == {"c.txt": "3"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temp and no aside copy left


def test_write_dir_crash_in_callback_keeps_old_dir_and_cleans_temp(tmp_path):
    final = tmp_path / "out"
    write_dir(final, _fill({"a.txt": "old"}))

    def half(tmp: Path) -> None:
        (tmp / "a.txt").write_text("new")
        raise RuntimeError("killed mid-write (simulated)")

    with pytest.raises(RuntimeError, match="mid-write"):
        write_dir(final, half)
    assert _tree(final) == {"a.txt": "old"}
    with pytest.raises(RuntimeError, match="mid-write"):
        write_dir(tmp_path / "fresh", half, tag="tmp-export", unique=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no partial target, no temp


def test_fixed_temp_name_left_by_a_killed_run_is_cleared_by_the_next(tmp_path):
    final = tmp_path / "hf"
    leftover = temp_path(final, "tmp-export", unique=False)
    leftover.mkdir()
    (leftover / "half.safetensors").write_text("torn")
    write_dir(final, _fill({"config.json": "{}"}), tag="tmp-export", unique=False)
    assert _tree(final) == {"config.json": "{}"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def test_no_replace_keeps_what_another_writer_published(tmp_path):
    final = tmp_path / "llama"
    write_dir(final, _fill({"w": "first"}), replace=False)

    def race(tmp: Path) -> None:  # another writer is slower: the target is occupied when it publishes
        (tmp / "w").write_text("second")

    assert write_dir(final, race, replace=False) is False
    assert _tree(final) == {"w": "first"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["llama"]
    with pytest.raises(FileExistsError):
        publish_dir(_make(tmp_path / "t", {"w": "x"}), final, replace=False)
    assert _tree(tmp_path / "t") == {"w": "x"}  # the refused one is left for the caller
    (tmp_path / "empty").mkdir()  # an empty directory is not occupied
    publish_dir(tmp_path / "t", tmp_path / "empty", replace=False)
    assert _tree(tmp_path / "empty") == {"w": "x"}


def test_file_exists_error_from_the_callback_is_not_taken_for_a_lost_race(tmp_path):
    def clash(tmp: Path) -> None:
        raise FileExistsError("the writer's own error")

    with pytest.raises(FileExistsError, match="own error"):
        write_dir(tmp_path / "x", clash, replace=False)
    assert list(tmp_path.iterdir()) == []


def _make(path: Path, files: dict[str, str]) -> Path:
    path.mkdir()
    _fill(files)(path)
    return path


def test_failed_swap_moves_the_old_dir_back(tmp_path, monkeypatch):
    final = _make(tmp_path / "out", {"a": "old"})
    new = _make(tmp_path / ".out.tmp", {"a": "new"})
    real = os.replace

    def fail_into_place(src, dst):
        if Path(src) == new:
            raise OSError("rename refused (simulated)")
        return real(src, dst)

    monkeypatch.setattr(atomic.os, "replace", fail_into_place)
    with pytest.raises(OSError, match="rename refused"):
        publish_dir(new, final)
    monkeypatch.undo()
    assert _tree(final) == {"a": "old"} and _tree(new) == {"a": "new"}
    assert sorted(p.name for p in tmp_path.iterdir()) == [".out.tmp", "out"]


_KILL_BETWEEN_RENAMES = textwrap.dedent(
    """
    import os, sys
    from pathlib import Path
    import usp.atomic as atomic
    root = Path(sys.argv[1])
    real = os.replace
    def die_after_first(src, dst):
        real(src, dst)
        os._exit(17)  # killed after the old copy went aside, before the new one is in place
    atomic.os.replace = die_after_first
    atomic.publish_dir(root / ".out.tmp", root / "out")
    """
)


def test_killed_between_the_renames_old_copy_survives_and_comes_back(tmp_path):
    _make(tmp_path / "out", {"a": "old"})
    _make(tmp_path / ".out.tmp", {"a": "new"})
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run(
        [sys.executable, "-c", _KILL_BETWEEN_RENAMES, str(tmp_path)], env=env, capture_output=True, timeout=60
    )
    assert proc.returncode == 17, proc.stderr.decode()[-2000:]
    assert not (tmp_path / "out").exists()
    (aside,) = tmp_path.glob(f".out.{ASIDE_TAG}-*")  # the old copy, whole, under a clear name
    assert _tree(aside) == {"a": "old"} and _tree(tmp_path / ".out.tmp") == {"a": "new"}
    assert restore_aside(tmp_path / "out") is True
    assert _tree(tmp_path / "out") == {"a": "old"}
    # the next publish finds the same state after a crash and finishes the job
    (tmp_path / "out").rename(aside)
    publish_dir(tmp_path / ".out.tmp", tmp_path / "out")
    assert _tree(tmp_path / "out") == {"a": "new"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_publish_replaces_a_file_and_clears_stale_aside_copies(tmp_path):
    final = tmp_path / "out"
    final.write_text("a file where the directory goes")
    stale = temp_path(final, ASIDE_TAG)
    _make(stale, {"a": "older still"})
    publish_dir(_make(tmp_path / "t", {"a": "new"}), final)
    assert _tree(final) == {"a": "new"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
