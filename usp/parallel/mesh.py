"""The parallel layout's one named DeviceMesh (:class:`SPMesh`, owning the run's
:class:`usp.parallel.layout.ParallelLayout`).

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

from usp.modes import RingLayout
from usp.parallel.layout import MESH_AXES, ParallelLayout


@dataclass(eq=False)
class SPMesh:
    """The job's parallel layout and its one named DeviceMesh (axes ``dp, ring, ulysses`` + ``sp``, ``fsdp``).

    Built by :func:`init_sp_mesh`. Code below the entry point receives this object (or one of its process
    groups) as an argument; nothing reads a global. Compared and hashed by identity (one per job), so caches
    can key on it.
    """

    layout: ParallelLayout
    device_mesh: DeviceMesh
    group_options: Any = field(default=None, repr=False)
    """Backend options (collective timeout) for the flattened axes' groups; see :func:`init_sp_mesh`."""
    _flat: dict[str, DeviceMesh] = field(default_factory=dict, repr=False)
    _ranks: dict[str, int] = field(default_factory=dict, repr=False)
    _groups: dict[str, dist.ProcessGroup] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        names = self.device_mesh.mesh_dim_names
        assert names == MESH_AXES, f"SPMesh needs a DeviceMesh with axes {MESH_AXES}, got {names}"
        if not self._flat:
            override = None if self.group_options is None else (None, self.group_options)
            self._flat["sp"] = self.device_mesh["ring", "ulysses"]._flatten("sp", backend_override=override)
            self._flat["fsdp"] = self.device_mesh["dp", "ring", "ulysses"]._flatten(
                "fsdp", backend_override=override
            )
        if not self._ranks:  # this rank's coordinates, read on every step: looked up once
            self._ranks.update((axis, self.device_mesh.get_local_rank(axis)) for axis in MESH_AXES)

    # --- degrees and coordinates (the layout's; read often, so plain attributes) ------------------------
    @property
    def ulysses_degree(self) -> int:
        return self.layout.ulysses_degree

    @property
    def ring_degree(self) -> int:
        return self.layout.ring_degree

    @property
    def dp_degree(self) -> int:
        return self.layout.dp_degree

    @property
    def sp_degree(self) -> int:
        return self.layout.sp_degree

    @property
    def ring_layout(self) -> RingLayout:
        return self.layout.ring_layout  # type: ignore[return-value]

    @property
    def ulysses_rank(self) -> int:
        return self._ranks["ulysses"]

    @property
    def ring_rank(self) -> int:
        return self._ranks["ring"]

    @property
    def dp_rank(self) -> int:
        return self._ranks["dp"]

    @property
    def sp_rank(self) -> int:
        """Position of this rank's slice in the sequence-parallel group (``ring_rank * ulysses + ulysses_rank``)."""
        return self.ring_rank * self.ulysses_degree + self.ulysses_rank

    # --- sub-meshes and groups ---------------------------------------------------------------------
    def submesh(self, axis: str) -> DeviceMesh:
        """A 1-D sub-mesh: ``"dp"``, ``"ring"``, ``"ulysses"``, ``"sp"`` (ring x ulysses) or ``"fsdp"`` (all).
        Sliced once per axis and kept: slicing a DeviceMesh costs milliseconds, and every attention call asks."""
        if axis in self._flat:
            return self._flat[axis]
        if axis in MESH_AXES:
            self._flat[axis] = self.device_mesh[axis]
            return self._flat[axis]
        raise ValueError(f"unknown mesh axis {axis!r}; expected one of {MESH_AXES + ('sp', 'fsdp')}")

    def group(self, axis: str) -> dist.ProcessGroup:
        group = self._groups.get(axis)
        if group is None:
            group = self._groups[axis] = self.submesh(axis).get_group()
        return group

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
        world = self.layout.world_size
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
        return self.layout.sequence_multiple()

    def describe(self) -> dict[str, object]:
        return {
            "world_size": self.layout.world_size,
            "dp_degree": self.dp_degree,
            "ring_degree": self.ring_degree,
            "ulysses_degree": self.ulysses_degree,
            "node_size": self.layout.node_size,
            "ring_layout": self.ring_layout,
        }


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
    ulysses_degree: int | None = None,
    ring_degree: int | None = None,
    *,
    layout: ParallelLayout | None = None,
    dp_degree: int = -1,
    node_size: int | None = None,
    ring_layout: RingLayout = "zigzag",
    allow_cross_node_ulysses: bool = False,
    device_type: str | None = None,
    timeout: timedelta | None = None,
) -> SPMesh:
    """Build the job's DeviceMesh ``[dp, ring, ulysses]`` for ``layout`` (the run's, from start-up), or for a
    layout of the given degrees (the keyword form, for scripts and tests: ``init_sp_mesh(2, 2)``).

    Needs an initialized default process group (``torch.distributed.init_process_group``, any backend).
    In the keyword form ``node_size`` defaults to the launcher's ``LOCAL_WORLD_SIZE``; without it the job is one
    node. ``timeout`` bounds every collective on the mesh's groups (default: the backend's default timeout).
    Raises ``ValueError`` (naming the setting and the fix) before any communication happens.
    """
    if not dist.is_initialized():
        raise RuntimeError(
            "init_sp_mesh needs torch.distributed to be initialized first "
            "(torch.distributed.init_process_group(backend='nccl' or 'gloo'))."
        )
    if layout is None:
        layout = ParallelLayout(
            world_size=dist.get_world_size(),
            ulysses_degree=1 if ulysses_degree is None else ulysses_degree,
            ring_degree=1 if ring_degree is None else ring_degree,
            dp_degree=dp_degree,
            node_size=node_size if node_size is not None else launched_world()[1],
            allow_cross_node_ulysses=allow_cross_node_ulysses,
            ring_layout=ring_layout,
        )
    else:
        assert ulysses_degree is None and ring_degree is None, "pass a layout or degrees, not both"
        if layout.world_size != dist.get_world_size():
            raise ValueError(
                f"the layout is for {layout.world_size} ranks, but the job has {dist.get_world_size()}."
            )
    if device_type is None:
        device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    options = group_options_with_timeout(timeout)
    override = None if options is None else tuple((None, options) for _ in MESH_AXES)
    mesh = DeviceMesh(device_type, layout.rank_grid(), mesh_dim_names=MESH_AXES, backend_override=override)
    return SPMesh(layout=layout, device_mesh=mesh, group_options=options)
