"""Worker-side cache of SPMesh objects, so many test cases reuse one set of process groups."""

from __future__ import annotations

from functools import cache

from usp.parallel import SPMesh, init_sp_mesh


@cache
def cached_sp_mesh(
    ulysses_degree: int, ring_degree: int, ring_layout: str = "zigzag", dp_degree: int = -1
) -> SPMesh:
    """Call on every rank of the pool with the same arguments (building a mesh is collective)."""
    return init_sp_mesh(ulysses_degree, ring_degree, dp_degree=dp_degree, ring_layout=ring_layout)
