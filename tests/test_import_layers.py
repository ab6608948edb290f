"""The package's import direction: a module imports only its own layer or lower ones, and no two packages import
each other. Read from the source (every ``import``, function-local ones included), so it fails on the commit that
adds a wrong-way import, not when that import happens to run.

Layers, low to high (README, "Layout of the repository"):
"""

from __future__ import annotations

import ast
import functools
from collections import deque
from collections.abc import Iterator
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


def _module_name(path: Path) -> str:
    """``usp/data/prepare.py`` -> ``usp.data.prepare``; ``usp/data/__init__.py`` -> ``usp.data``."""
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = rel.parts[:-1] if path.name == "__init__.py" else rel.parts
    return ".".join(parts)


@functools.cache
def _walk(path: Path) -> tuple[tuple[str, int, str, tuple[str, ...]], ...]:
    """``(module, line, imported usp module, names imported from it)`` for every import of ``usp`` in one file
    (function-local ones included); ``names`` is empty for ``import usp.x``."""
    return tuple(_walk_tree(path))


def _walk_tree(path: Path) -> Iterator[tuple[str, int, str, tuple[str, ...]]]:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    here = ".".join(rel.parts)
    is_pkg = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("usp."):
                    yield here, node.lineno, a.name, ()
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here.split(".")[: len(here.split(".")) - node.level + (1 if is_pkg else 0)]
                target = ".".join(base + ([node.module] if node.module else []))
            elif node.module:
                target = node.module
            else:
                continue
            names = tuple(a.name for a in node.names)
            if target == "usp":  # from usp import x: x is the unit
                for name in names:
                    yield here, node.lineno, f"usp.{name}", ()
            elif target.startswith("usp."):
                yield here, node.lineno, target, names


def _imports() -> list[tuple[str, str, int]]:
    """``(importing unit, imported usp module, line)`` for every import in usp/."""
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        for here, line, target, _ in _walk(path):
            unit = _unit(here)
            if unit is not None:
                found.append((f"{here}:{line}", target, RANK.get(unit, -1)))
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


PACKAGES = tuple(sorted(p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file()))
KNOWN_CYCLES: set[str] = set()
"""Packages whose modules still import each other in a cycle (``test_no_cycle_among_the_modules_of_a_package``
expects them to fail until fixed). Their owners: break the cycle (shared code in a module both import, the
command line in a module of its own), then take the package out of this set; the test fails while a package
is listed here without a cycle."""


def _module_graph(package: str) -> dict[str, dict[str, int]]:
    """``{module: {imported module of the same package: line}}`` for ``usp.<package>`` (its ``__init__`` is
    ``usp.<package>``); ``from usp.p import m`` of a submodule ``m`` is an edge to ``usp.p.m``."""
    prefix = f"usp.{package}"
    paths = sorted((ROOT / package).rglob("*.py"))
    modules = {_module_name(p) for p in paths}
    graph: dict[str, dict[str, int]] = {m: {} for m in modules}
    for path in paths:
        for _, line, target, names in _walk(path):
            here = _module_name(path)
            if target != prefix and not target.startswith(prefix + "."):
                continue
            subs = [f"{target}.{n}" for n in names if f"{target}.{n}" in modules]
            for t in subs or [target]:
                while t not in modules and "." in t:  # usp.p.m.attr -> usp.p.m
                    t = t.rsplit(".", 1)[0]
                if t != here and t in modules:
                    graph[here].setdefault(t, line)
    return graph


def _cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The shortest cycle through each module that is on one, each cycle once (``[a, b, ..., a]``)."""
    found: dict[frozenset[tuple[str, str]], list[str]] = {}
    for start in sorted(graph):
        parent: dict[str, str] = {}
        todo = deque([start])
        end = None
        while todo and end is None:
            node = todo.popleft()
            for nxt in sorted(graph[node]):
                if nxt == start:
                    end = node
                    break
                if nxt not in parent:
                    parent[nxt] = node
                    todo.append(nxt)
        if end is None:
            continue
        chain = [end]
        while chain[-1] != start:
            chain.append(parent[chain[-1]])
        chain = [*reversed(chain), start]
        found.setdefault(frozenset(zip(chain, chain[1:])), chain)
    return list(found.values())


def _chain_text(chain: list[str], graph: dict[str, dict[str, int]]) -> str:
    """``usp.p.a:12 -> usp.p.b:40 -> usp.p.a`` (each module with the line of its import of the next)."""
    return " -> ".join(f"{a}:{graph[a][b]}" for a, b in zip(chain, chain[1:])) + f" -> {chain[-1]}"


@pytest.mark.parametrize(
    "package",
    [
        pytest.param(
            p,
            marks=pytest.mark.xfail(
                strict=True, reason=f"usp.{p} has a known import cycle (KNOWN_CYCLES); fix it, then unlist it"
            ),
        )
        if p in KNOWN_CYCLES
        else p
        for p in PACKAGES
    ],
)
def test_no_cycle_among_the_modules_of_a_package(package: str) -> None:
    """No module of ``usp.<package>`` imports, through others of the package, itself (function-local
    imports count: they only defer the cycle). Each cycle is printed as a chain of ``module:line`` imports."""
    graph = _module_graph(package)
    chains = [_chain_text(c, graph) for c in _cycles(graph)]
    assert not chains, f"import cycles in usp.{package}:\n" + "\n".join(chains)


def test_known_cycles_are_packages() -> None:
    assert KNOWN_CYCLES <= set(PACKAGES), f"not packages of usp: {KNOWN_CYCLES - set(PACKAGES)}"
