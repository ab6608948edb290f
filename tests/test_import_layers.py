"""The package's import direction: a module imports only its own layer or lower ones, and no two packages import
each other. Read from the source (every ``import``, function-local ones included), so it fails on the commit that
adds a wrong-way import, not when that import happens to run.

Layers, low to high (README, "Layout of the repository"):
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "usp"

LAYERS: tuple[tuple[str, ...], ...] = (
    ("units", "modes", "mlp_tiles", "longest", "host", "errors", "atomic", "tiny", "real"),
    ("parallel",),
    ("attention",),
    ("model",),
    ("config",),
    ("data",),
    ("plan",),
    ("checkpoint", "startup"),
    ("eval",),
    ("train",),
    ("bench", "launch"),
)
RANK = {name: i for i, names in enumerate(LAYERS) for name in names}
__doc__ += "\n".join(
    f"{i + 1}. " + ", ".join(f"``usp.{n}``" for n in names) for i, names in enumerate(LAYERS)
)


def _unit(module: str) -> str | None:
    """``usp.train.trainer`` -> ``train``; ``None`` for ``usp`` itself."""
    parts = module.split(".")
    return parts[1] if parts[0] == "usp" and len(parts) > 1 else None


def _imports() -> list[tuple[str, str, int]]:
    """``(importing unit, imported usp module, line)`` for every import in usp/."""
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        here = ".".join(rel.parts)
        unit = _unit(here)
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = here.split(".")[: len(here.split(".")) - node.level + (1 if is_pkg else 0)]
                    targets = [".".join(base + ([node.module] if node.module else []))]
                elif node.module:
                    targets = [node.module]
                if targets[0] == "usp":  # from usp import x: x is the unit
                    targets = [f"usp.{a.name}" for a in node.names]
            for t in targets:
                if t.startswith("usp.") and unit is not None:
                    found.append((f"{here}:{node.lineno}", t, RANK.get(unit, -1)))
    return found


def test_every_unit_has_a_layer() -> None:
    units = {p.stem if p.is_file() else p.name for p in ROOT.iterdir() if p.suffix == ".py" or p.is_dir()}
    units -= {"__init__", "__pycache__"}
    assert units <= set(RANK), (
        f"put these in LAYERS (tests/test_import_layers.py) and the README: {units - set(RANK)}"
    )


@pytest.mark.parametrize("names", LAYERS, ids=lambda names: "+".join(names))
def test_no_import_goes_up(names: tuple[str, ...]) -> None:
    wrong = []
    for where, target, rank in _imports():
        if rank != RANK[names[0]]:
            continue
        unit = _unit(target)
        if unit in RANK and RANK[unit] > rank:
            wrong.append(f"{where} imports {target} (layer {RANK[unit] + 1} > {rank + 1})")
    assert not wrong, "lower layers must not import higher ones:\n" + "\n".join(wrong)


def test_no_cycle_between_units_of_one_layer() -> None:
    edges = {(where.split(".")[1].split(":")[0], _unit(t)) for where, t, _ in _imports()}
    edges = {(a, b) for a, b in edges if a != b and b is not None}
    both = sorted({tuple(sorted(e)) for e in edges if (e[1], e[0]) in edges})
    assert not both, f"packages importing each other: {both}"
