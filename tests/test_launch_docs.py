"""Every command in docs/launch.md's bash examples works as written: usp-launch ones print their command
(--dry-run), and the overrides of the others (torchrun.sh, slurm.sbatch, torchrun -m usp.train) compose into a
run config without an unset (???) setting or an unknown key."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from usp.launch import cli, commands

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "launch.md"
MARKERS = ("usp.train", "launch/slurm.sbatch", "launch/torchrun.sh")


def doc_commands(path: Path) -> list[list[str]]:
    """The commands of the ```bash blocks, continuation lines joined, comments dropped."""
    found = []
    for block in re.findall(r"```bash\n(.*?)```", path.read_text(), flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words:
                found.append(words)
    return found


COMMANDS = doc_commands(DOC)


def test_the_doc_has_examples():
    assert sum(words[0] == "usp-launch" for words in COMMANDS) >= 3
    assert sum(any(m in words for m in MARKERS) for words in COMMANDS) >= 5


@pytest.mark.parametrize("words", COMMANDS, ids=lambda words: " ".join(words)[:60])
def test_doc_command_works_as_written(words, monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    for var in (
        "SLURM_JOB_ID",
        "SLURM_NNODES",
        "SLURM_JOB_NODELIST",
        "SLURM_GPUS_ON_NODE",
        "SLURM_CPUS_ON_NODE",
    ):
        monkeypatch.delenv(var, raising=False)
    if words[0] == "usp-launch":
        monkeypatch.setattr(commands, "count_gpus", lambda: 8)  # the 8-GPU machine the examples assume
        argv = words[1:] if "--dry-run" in words else [*words[1:], "--dry-run"]
        assert cli.main(argv) == 0, capsys.readouterr().err
        return
    from usp.config.compose import compose_config

    start = max(words.index(m) for m in MARKERS if m in words) + 1
    overrides = [w for w in words[start:] if not w.startswith("-") and "=" in w]
    compose_config(overrides)


def fenced_blocks(path: Path) -> list[tuple[str, str]]:
    """``(language, text)`` of every fenced block (language ``""`` for a plain one)."""
    blocks: list[tuple[str, str]] = []
    lang, lines = None, []
    for line in path.read_text().splitlines(keepends=True):
        if line.startswith("```"):
            if lang is None:
                lang, lines = line[3:].strip(), []
            else:
                blocks.append((lang, "".join(lines)))
                lang = None
        elif lang is not None:
            lines.append(line)
    return blocks


def doc_errors(path: Path) -> list[tuple[list[str], str]]:
    """The ``$ usp-launch ...`` examples of the plain blocks with the error they show (wrapped lines joined; a
    trailing ``(...)`` elides the rest)."""
    found = []
    for lang, block in fenced_blocks(path):
        for example in re.split(r"^\$ ", block, flags=re.M)[1:] if lang == "" else []:
            command, _, shown = example.replace("\\\n", " ").partition("\n")
            if command.startswith("usp-launch ") and shown.startswith("usp-launch: error: "):
                found.append((shlex.split(command), " ".join(shown.split())))
    return found


ERRORS = doc_errors(DOC)


def test_the_doc_shows_errors():
    assert len(ERRORS) >= 3


@pytest.mark.parametrize(
    ("words", "shown"), ERRORS, ids=lambda x: " ".join(x)[-50:] if isinstance(x, list) else ""
)
def test_doc_error_is_what_usp_launch_says(words, shown, monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    for var in (
        "SLURM_JOB_ID",
        "SLURM_NNODES",
        "SLURM_JOB_NODELIST",
        "SLURM_GPUS_ON_NODE",
        "SLURM_CPUS_ON_NODE",
    ):
        monkeypatch.delenv(var, raising=False)
    assert cli.main(words[1:]) == 2
    said = " ".join(capsys.readouterr().err.split())
    if shown.endswith("(...)"):
        assert said.startswith(shown.removesuffix("(...)").rstrip())
    else:
        assert said == shown
