"""The parallel layout: one validated dataclass, one named DeviceMesh.

Rank order (row-major over the mesh axes ``("dp", "ring", "ulysses")``)::

    global_rank = (dp_rank * ring_degree + ring_rank) * ulysses_degree + ulysses_rank

so a Ulysses group is ``ulysses_degree`` *adjacent* ranks (inside one node, on NVLink) and a ring group is
strided by ``ulysses_degree`` (across nodes). Launchers number ranks node by node (torchrun gives node ``n``
the ranks ``[n * LOCAL_WORLD_SIZE, (n + 1) * LOCAL_WORLD_SIZE)``), which is what makes this hold.

Flattened axes built on the same mesh:

- ``"sp"``   = ring x ulysses: the ranks that share one sequence (loss/gradient token counts, gathers);
- ``"fsdp"`` = dp x ring x ulysses: every rank; FSDP2 shards parameters over it (sequence-parallel ranks
  hold the same weights, so they can share the shards).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from usp.modes import RingLayout, check_ring_layout, chunks_per_ring_rank
from usp.units import divisors as _divisors

MESH_AXES: tuple[str, str, str] = ("dp", "ring", "ulysses")


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of the dp x ring x ulysses layout, validated at construction.

    Args:
        world_size: number of ranks in the job.
        ulysses_degree: ranks in one Ulysses (all-to-all, head-sharded) group; adjacent ranks, inside a node.
        ring_degree: ranks in one ring (K/V rotation) group; strided across nodes.
        dp_degree: data-parallel degree; ``-1`` takes the remaining ranks ``world / (ulysses * ring)``.
        node_size: ranks per node (``LOCAL_WORLD_SIZE`` from the launcher); ``None`` means one node.
        allow_cross_node_ulysses: accept a Ulysses group that spans nodes (slow: all-to-all over the network).
    """

    world_size: int
    ulysses_degree: int = 1
    ring_degree: int = 1
    dp_degree: int = -1
    node_size: int | None = None
    allow_cross_node_ulysses: bool = False

    def __post_init__(self) -> None:
        ws = self.world_size
        if ws < 1:
            raise ValueError(f"world_size must be >= 1, got {ws}.")
        for name in ("ulysses_degree", "ring_degree"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"parallel.{name}={value!r} is invalid: it must be an integer >= 1 "
                    f"(valid degrees for world size {ws}: {_divisors(ws)})."
                )
        sp = self.ulysses_degree * self.ring_degree
        if ws % sp != 0:
            raise ValueError(
                f"parallel.ulysses_degree={self.ulysses_degree} x parallel.ring_degree={self.ring_degree} = {sp} "
                f"does not divide the world size {ws}. Choose degrees whose product divides {ws} "
                f"(divisors: {_divisors(ws)}), or launch {sp * max(1, -(-ws // sp))} ranks."
            )
        dp = self.dp_degree
        if dp == -1:
            object.__setattr__(self, "dp_degree", ws // sp)
        elif not isinstance(dp, int) or dp < 1:
            raise ValueError(
                f"parallel.dp_degree={dp!r} is invalid: use an integer >= 1, or -1 for the remaining ranks."
            )
        elif dp * sp != ws:
            raise ValueError(
                f"parallel.dp_degree={dp} x ulysses_degree={self.ulysses_degree} x ring_degree={self.ring_degree} "
                f"= {dp * sp} != world size {ws}. Set parallel.dp_degree={ws // sp} or -1 (the remaining ranks)."
            )
        node = self.node_size
        if node is not None:
            if node < 1 or ws % node != 0:
                raise ValueError(
                    f"node size {node} (parallel.node_size, or the launcher's LOCAL_WORLD_SIZE when that is unset) "
                    f"does not divide the world size {ws}: every node must "
                    f"run the same number of ranks. Set parallel.node_size to one of {_divisors(ws)}."
                )
            if not self.allow_cross_node_ulysses and node % self.ulysses_degree != 0:
                fits = _divisors(node)
                raise ValueError(
                    f"parallel.ulysses_degree={self.ulysses_degree} would make Ulysses groups span nodes of "
                    f"{node} ranks (all-to-all over the network). Use a ulysses_degree that divides the node size "
                    f"({fits}) and put the rest in parallel.ring_degree, or set "
                    f"parallel.allow_cross_node_ulysses=true if you really mean it."
                )

    @property
    def sp_degree(self) -> int:
        """Sequence-parallel degree: ranks that share one sequence (ring x ulysses)."""
        return self.ulysses_degree * self.ring_degree

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.dp_degree, self.ring_degree, self.ulysses_degree)

    def coordinates(self, rank: int) -> dict[str, int]:
        """This rank's position on each mesh axis (pure arithmetic, no process group needed)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the world of size {self.world_size}")
        u = rank % self.ulysses_degree
        r = (rank // self.ulysses_degree) % self.ring_degree
        d = rank // self.sp_degree
        return {"dp": d, "ring": r, "ulysses": u}

    def rank_grid(self) -> torch.Tensor:
        """Global ranks laid out as the mesh, ``[dp, ring, ulysses]``."""
        return torch.arange(self.world_size).reshape(self.shape)

    def groups(self, axis: str) -> list[list[int]]:
        """Every group of ``axis`` (``"dp"``, ``"ring"``, ``"ulysses"``, ``"sp"`` or ``"fsdp"``) as lists of ranks."""
        grid = self.rank_grid()
        if axis == "ulysses":
            return grid.reshape(-1, self.ulysses_degree).tolist()
        if axis == "ring":
            return grid.permute(0, 2, 1).reshape(-1, self.ring_degree).tolist()
        if axis == "dp":
            return grid.permute(1, 2, 0).reshape(-1, self.dp_degree).tolist()
        if axis == "sp":
            return grid.reshape(self.dp_degree, self.sp_degree).tolist()
        if axis == "fsdp":
            return [grid.reshape(-1).tolist()]
        raise ValueError(f"unknown mesh axis {axis!r}; expected one of {MESH_AXES + ('sp', 'fsdp')}")


@dataclass
class SPMesh:
    """The job's parallel layout and its one named DeviceMesh (axes ``dp, ring, ulysses`` + ``sp``, ``fsdp``).

    Built by :func:`init_sp_mesh`. Code below the entry point receives this object (or one of its process
    groups) as an argument; nothing reads a global.
    """

    dims: ParallelDims
    device_mesh: DeviceMesh
    ring_layout: RingLayout = "zigzag"
    group_options: Any = field(default=None, repr=False)
    """Backend options (collective timeout) for the flattened axes' groups; see :func:`init_sp_mesh`."""
    _flat: dict[str, DeviceMesh] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        check_ring_layout(self.ring_layout)
        names = self.device_mesh.mesh_dim_names
        assert names == MESH_AXES, f"SPMesh needs a DeviceMesh with axes {MESH_AXES}, got {names}"
        if not self._flat:
            override = None if self.group_options is None else (None, self.group_options)
            self._flat["sp"] = self.device_mesh["ring", "ulysses"]._flatten("sp", backend_override=override)
            self._flat["fsdp"] = self.device_mesh["dp", "ring", "ulysses"]._flatten(
                "fsdp", backend_override=override
            )

    # --- degrees and coordinates -------------------------------------------------------------------
    @property
    def ulysses_degree(self) -> int:
        return self.dims.ulysses_degree

    @property
    def ring_degree(self) -> int:
        return self.dims.ring_degree

    @property
    def dp_degree(self) -> int:
        return self.dims.dp_degree

    @property
    def sp_degree(self) -> int:
        return self.dims.sp_degree

    @property
    def ulysses_rank(self) -> int:
        return self.device_mesh.get_local_rank("ulysses")

    @property
    def ring_rank(self) -> int:
        return self.device_mesh.get_local_rank("ring")

    @property
    def dp_rank(self) -> int:
        return self.device_mesh.get_local_rank("dp")

    @property
    def sp_rank(self) -> int:
        """Position of this rank's slice in the sequence-parallel group (``ring_rank * ulysses + ulysses_rank``)."""
        return self.ring_rank * self.ulysses_degree + self.ulysses_rank

    # --- sub-meshes and groups ---------------------------------------------------------------------
    def submesh(self, axis: str) -> DeviceMesh:
        """A 1-D sub-mesh: ``"dp"``, ``"ring"``, ``"ulysses"``, ``"sp"`` (ring x ulysses) or ``"fsdp"`` (all)."""
        if axis in self._flat:
            return self._flat[axis]
        if axis in MESH_AXES:
            return self.device_mesh[axis]
        raise ValueError(f"unknown mesh axis {axis!r}; expected one of {MESH_AXES + ('sp', 'fsdp')}")

    def group(self, axis: str) -> dist.ProcessGroup:
        return self.submesh(axis).get_group()

    @property
    def ulysses_group(self) -> dist.ProcessGroup:
        return self.group("ulysses")

    @property
    def ring_group(self) -> dist.ProcessGroup:
        return self.group("ring")

    @property
    def sp_group(self) -> dist.ProcessGroup:
        return self.group("sp")

    @property
    def dp_group(self) -> dist.ProcessGroup:
        return self.group("dp")

    @property
    def fsdp_mesh(self) -> DeviceMesh:
        return self.submesh("fsdp")

    def hsdp_mesh(self, node_size: int) -> DeviceMesh:
        """A 2-D ``(replicate, shard)`` DeviceMesh over the same ranks for HSDP: shard inside a node of
        ``node_size`` ranks, replicate across nodes. Its groups get the job's collective timeout, like every
        other group of this mesh. Collective: every rank must call it.
        """
        world = self.dims.world_size
        if node_size < 1 or world % node_size != 0:
            raise ValueError(
                f"parallel.fsdp_mode=hybrid_shard needs the node size ({node_size}) to divide the world size "
                f"{world}; set parallel.node_size or use parallel.fsdp_mode=full_shard."
            )
        grid = torch.arange(world).reshape(world // node_size, node_size)  # [nodes, ranks per node]
        override = None if self.group_options is None else ((None, self.group_options),) * 2
        return DeviceMesh(
            self.device_mesh.device_type,
            grid,
            mesh_dim_names=("replicate", "shard"),
            backend_override=override,
        )

    def sequence_multiple(self) -> int:
        """Global sequence lengths must be a multiple of this (2*ring*ulysses for zigzag and balanced,
        ring*ulysses for contiguous)."""
        return sequence_multiple(self.ring_degree, self.ulysses_degree, self.ring_layout)

    def describe(self) -> dict[str, object]:
        return {
            "world_size": self.dims.world_size,
            "dp_degree": self.dp_degree,
            "ring_degree": self.ring_degree,
            "ulysses_degree": self.ulysses_degree,
            "node_size": self.dims.node_size,
            "ring_layout": self.ring_layout,
        }


def sequence_multiple(ring_degree: int, ulysses_degree: int, ring_layout: str) -> int:
    return chunks_per_ring_rank(ring_layout) * ring_degree * ulysses_degree


def launched_world(env: Mapping[str, str] | None = None) -> tuple[int, int | None]:
    """``(WORLD_SIZE, LOCAL_WORLD_SIZE)`` as the launcher set them; ``(1, None)`` without a launcher.

    The one place the node size is read from the environment: torchrun's ``--nproc-per-node`` becomes
    ``LOCAL_WORLD_SIZE``, which the mesh takes as the node size (Ulysses groups stay inside it).
    """
    env = os.environ if env is None else env
    local = env.get("LOCAL_WORLD_SIZE")
    return int(env.get("WORLD_SIZE", "1")), (int(local) if local else None)


def resolve_node_size(node_size: int | None, world_size: int, env: Mapping[str, str] | None = None) -> int:
    """Ranks per node, the one fallback rule: ``parallel.node_size`` when set, else the launcher's
    ``LOCAL_WORLD_SIZE`` (:func:`launched_world`), else ``world_size`` (one node)."""
    if node_size is not None:
        return int(node_size)
    return launched_world(env)[1] or world_size


def group_options_with_timeout(timeout: timedelta | None) -> Any:
    """Backend options carrying ``timeout`` for new groups of the default backend, or ``None``.

    Sub-groups made by ``new_group`` otherwise take the backend's default collective timeout (10 minutes for
    NCCL), not the one the default group was initialized with. ``None`` for backends without options here
    (mixed ``cpu:gloo,cuda:nccl`` groups keep their defaults).
    """
    if timeout is None:
        return None
    backend = dist.get_backend()
    if backend == "gloo":
        options = dist.ProcessGroupGloo._Options()
    elif backend == "nccl" and hasattr(dist, "ProcessGroupNCCL"):
        options = dist.ProcessGroupNCCL.Options()
    else:
        return None
    options._timeout = timeout
    return options


def init_sp_mesh(
    ulysses_degree: int,
    ring_degree: int,
    *,
    dp_degree: int = -1,
    node_size: int | None = None,
    ring_layout: RingLayout = "zigzag",
    allow_cross_node_ulysses: bool = False,
    device_type: str | None = None,
    timeout: timedelta | None = None,
) -> SPMesh:
    """Validate the degrees and build the job's DeviceMesh ``[dp, ring, ulysses]``.

    Needs an initialized default process group (``torch.distributed.init_process_group``, any backend).
    ``node_size`` defaults to the launcher's ``LOCAL_WORLD_SIZE``; without it the job is one node.
    ``timeout`` bounds every collective on the mesh's groups (default: the backend's default timeout).
    Raises ``ValueError`` (naming the setting and the fix) before any communication happens.
    """
    if not dist.is_initialized():
        raise RuntimeError(
            "init_sp_mesh needs torch.distributed to be initialized first "
            "(torch.distributed.init_process_group(backend='nccl' or 'gloo'))."
        )
    dims = ParallelDims(
        world_size=dist.get_world_size(),
        ulysses_degree=ulysses_degree,
        ring_degree=ring_degree,
        dp_degree=dp_degree,
        node_size=node_size if node_size is not None else launched_world()[1],
        allow_cross_node_ulysses=allow_cross_node_ulysses,
    )
    check_ring_layout(ring_layout)
    if device_type is None:
        device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    options = group_options_with_timeout(timeout)
    override = None if options is None else tuple((None, options) for _ in MESH_AXES)
    mesh = DeviceMesh(device_type, dims.rank_grid(), mesh_dim_names=MESH_AXES, backend_override=override)
    return SPMesh(dims=dims, device_mesh=mesh, ring_layout=ring_layout, group_options=options)
