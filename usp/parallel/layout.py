"""The run's parallel layout: one frozen record from the command line to the kernel.

:class:`ParallelLayout` holds the degrees (``dp x ring x ulysses``), the node size, how the sequence is placed
on the ring, and the memory modes (FSDP mode, activation checkpointing, MLP tiles, head chunks, where the sharded
states live). It is validated once, when it is made, and every quantity derived from it (``sp_degree``,
``sequence_multiple``, local tokens, rank coordinates and groups) is a method, not re-derived by callers.

Who makes one:

- the config check and start-up (:func:`usp.startup.resolve_layout`), from ``parallel.*`` or the planner's
  choice for ``auto``;
- the planner (:func:`usp.plan.auto_degrees`, :func:`usp.plan.search_layouts`): each candidate it costs is one;
- ``usp-launch``'s pre-launch check, with :meth:`ParallelLayout.from_settings` (the same constructor the config
  check uses);
- :func:`usp.parallel.init_sp_mesh`, whose :class:`usp.parallel.SPMesh` owns the run's layout (``mesh.layout``).

Rank order (row-major over the mesh axes ``("dp", "ring", "ulysses")``)::

    global_rank = (dp_rank * ring_degree + ring_rank) * ulysses_degree + ulysses_rank
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from usp.modes import AC_MODES, FSDP_MODES, check_ring_layout, chunks_per_ring_rank
from usp.units import divisors as _divisors

MESH_AXES: tuple[str, str, str] = ("dp", "ring", "ulysses")

STATE_PLACEMENTS: tuple[str, ...] = ("device", "cpu_offload")
"""Where the sharded parameters, gradients and optimizer states live: on the device, or on the host with the
optimizer step there (FSDP2 CPU offload, :func:`usp.config.states_on_host`)."""


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def sequence_multiple(ring_degree: int, ulysses_degree: int, ring_layout: str) -> int:
    """Global sequence lengths must be a multiple of this: ``2 * ring * ulysses`` for ``zigzag`` and
    ``balanced``, ``ring * ulysses`` for ``contiguous``."""
    return chunks_per_ring_rank(ring_layout) * ring_degree * ulysses_degree


def sequence_length_error(
    seq_len: int, ring_degree: int, ulysses_degree: int, ring_layout: str, setting: str = "trainer.seq_len"
) -> str | None:
    """The message for a ``seq_len`` that does not suit the layout (naming ``setting``, a config key such as
    ``trainer.seq_len`` or a flag such as ``--seq-len``, and the nearest valid lengths), or ``None`` when it
    does."""
    m = sequence_multiple(ring_degree, ulysses_degree, ring_layout)
    if seq_len > 0 and seq_len % m == 0:
        return None
    lower = (seq_len // m) * m
    nearest = [x for x in (lower, lower + m) if x > 0]
    chunks = chunks_per_ring_rank(ring_layout)
    why = "ring_degree x ulysses_degree" if chunks == 1 else f"{chunks} x ring_degree x ulysses_degree"
    assign = " " if setting.startswith("-") else " = "  # a command-line flag, or a config key
    return (
        f"sequence length {seq_len} is not divisible by {m} (= {why} for the {ring_layout} layout with "
        f"ring_degree={ring_degree}, ulysses_degree={ulysses_degree}). Use {setting}{assign}"
        f"{' or '.join(str(x) for x in nearest)} (nearest valid), or change the degrees."
    )


@dataclass(frozen=True)
class ParallelLayout:
    """The run's layout, validated at construction (``ValueError`` naming the ``parallel.*`` setting and the fix).

    Args:
        world_size: number of ranks in the job.
        ulysses_degree: ranks in one Ulysses (all-to-all, head-sharded) group; adjacent ranks, inside a node.
        ring_degree: ranks in one ring (K/V rotation) group; strided across nodes.
        dp_degree: data-parallel degree; ``-1`` takes the remaining ranks ``world / (ulysses * ring)``.
        node_size: ranks per node; ``None`` means one node (``world_size``).
        allow_cross_node_ulysses: accept a Ulysses group that spans nodes (slow: all-to-all over the network).
        ring_layout: ``zigzag``, ``contiguous`` or ``balanced`` (:data:`usp.modes.RING_LAYOUTS`).
        fsdp_mode, activation_checkpointing, ac_every_k, mlp_tiles, attn_head_chunks: the ``parallel.*``
            memory modes, resolved (no ``auto``).
        states: one of :data:`STATE_PLACEMENTS`.
        reason: why this layout (``set in the config``, or the planner's line).
    """

    world_size: int
    ulysses_degree: int = 1
    ring_degree: int = 1
    dp_degree: int = -1
    node_size: int | None = None
    allow_cross_node_ulysses: bool = False
    ring_layout: str = "zigzag"
    fsdp_mode: str = "full_shard"
    activation_checkpointing: str = "none"
    ac_every_k: int = 2
    mlp_tiles: int = 1
    attn_head_chunks: int = 1
    states: str = "device"
    reason: str = "set in the config"

    def __post_init__(self) -> None:
        ws = self.world_size
        if not _is_int(ws) or ws < 1:
            raise ValueError(f"world_size must be an integer >= 1, got {ws!r}.")
        for name in ("ulysses_degree", "ring_degree"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
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
        elif not _is_int(dp) or dp < 1:
            raise ValueError(
                f"parallel.dp_degree={dp!r} is invalid: use an integer >= 1, or -1 for the remaining ranks."
            )
        elif dp * sp != ws:
            raise ValueError(
                f"parallel.dp_degree={dp} x ulysses_degree={self.ulysses_degree} x ring_degree={self.ring_degree} "
                f"= {dp * sp} != world size {ws}. Set parallel.dp_degree={ws // sp} or -1 (the remaining ranks)."
            )
        node = self.node_size
        if node is None:
            object.__setattr__(self, "node_size", ws)
        elif not _is_int(node) or node < 1 or ws % node != 0:
            raise ValueError(
                f"node size {node} (parallel.node_size, or the launcher's LOCAL_WORLD_SIZE when that is unset) "
                f"does not divide the world size {ws}: every node must "
                f"run the same number of ranks. Set parallel.node_size to one of {_divisors(ws)}."
            )
        elif not self.allow_cross_node_ulysses and node % self.ulysses_degree != 0:
            raise ValueError(
                f"parallel.ulysses_degree={self.ulysses_degree} would make Ulysses groups span nodes of "
                f"{node} ranks (all-to-all over the network). Use a ulysses_degree that divides the node size "
                f"({_divisors(node)}) and put the rest in parallel.ring_degree, or set "
                f"parallel.allow_cross_node_ulysses=true if you really mean it."
            )
        self._check_modes()

    def _check_modes(self) -> None:
        check_ring_layout(self.ring_layout)
        for name, value, allowed in (
            ("fsdp_mode", self.fsdp_mode, FSDP_MODES),
            ("activation_checkpointing", self.activation_checkpointing, AC_MODES),
            ("states", self.states, STATE_PLACEMENTS),
        ):
            if value not in allowed:
                raise ValueError(f"parallel.{name}={value!r} is unknown; choose one of {list(allowed)}.")
        for name in ("ac_every_k", "mlp_tiles", "attn_head_chunks"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise ValueError(f"parallel.{name}={value!r} is invalid: it must be an integer >= 1.")

    @classmethod
    def from_settings(
        cls,
        *,
        world_size: int,
        ulysses_degree: object,
        ring_degree: object,
        dp_degree: object = -1,
        node_size: int | None = None,
        allow_cross_node_ulysses: object = False,
        ring_layout: str = "zigzag",
    ) -> ParallelLayout:
        """The layout the settings fix before the planner runs, for the checks made before start-up (the
        config check, ``usp-launch``): a degree that is ``auto`` or unknown (``None``) counts as 1 (what the
        planner chooses for it only multiplies the product, so a layout failing here fails at start-up too), and
        ``dp_degree`` then takes the remaining ranks; any other value is validated as given.
        ``allow_cross_node_ulysses`` holds unless it is ``False`` or ``None``. The memory modes keep their
        defaults (the config check validates them)."""
        open_degrees = ("auto", None)
        fixed = ulysses_degree not in open_degrees and ring_degree not in open_degrees
        return cls(
            world_size=world_size,
            ulysses_degree=1 if ulysses_degree in open_degrees else ulysses_degree,  # type: ignore[arg-type]
            ring_degree=1 if ring_degree in open_degrees else ring_degree,  # type: ignore[arg-type]
            dp_degree=dp_degree if fixed and dp_degree is not None else -1,  # type: ignore[arg-type]
            node_size=node_size,
            allow_cross_node_ulysses=allow_cross_node_ulysses not in (None, False),
            ring_layout=ring_layout,
        )

    def replace(self, **changes: Any) -> ParallelLayout:
        """A copy with ``changes`` (validated again)."""
        return dataclasses.replace(self, **changes)

    # --- derived quantities --------------------------------------------------------------------------
    @property
    def sp_degree(self) -> int:
        """Sequence-parallel degree: ranks that share one sequence (ring x ulysses)."""
        return self.ulysses_degree * self.ring_degree

    @property
    def shape(self) -> tuple[int, int, int]:
        """The mesh shape ``(dp, ring, ulysses)``."""
        return (self.dp_degree, self.ring_degree, self.ulysses_degree)

    @property
    def states_on_host(self) -> bool:
        """The sharded states and the optimizer step on the host (FSDP2 CPU offload)."""
        return self.states == "cpu_offload"

    @property
    def num_nodes(self) -> int:
        assert self.node_size is not None
        return self.world_size // self.node_size

    def sequence_multiple(self) -> int:
        """Global sequence lengths must be a multiple of this (:func:`sequence_multiple`)."""
        return sequence_multiple(self.ring_degree, self.ulysses_degree, self.ring_layout)

    def check_sequence_length(self, seq_len: int, setting: str = "trainer.seq_len") -> None:
        """``ValueError`` naming ``setting`` and the nearest valid lengths unless ``seq_len`` suits the layout."""
        message = sequence_length_error(
            seq_len, self.ring_degree, self.ulysses_degree, self.ring_layout, setting
        )
        if message is not None:
            raise ValueError(message)

    def local_tokens(self, seq_len: int) -> int:
        """Tokens of one sequence that each rank holds (``seq_len / (ring * ulysses)``)."""
        assert seq_len % self.sp_degree == 0, f"seq_len {seq_len} is not split by sp degree {self.sp_degree}"
        return seq_len // self.sp_degree

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

    # --- records -----------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Every field, JSON-ready: the ``layout`` entry of ``metrics.jsonl`` and of ``usp-plan --json`` rows."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, record: Mapping[str, Any]) -> ParallelLayout:
        """The layout of a :meth:`to_dict` record (unknown keys are ignored: records may carry more)."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in record.items() if k in names})


__all__ = [
    "MESH_AXES",
    "STATE_PLACEMENTS",
    "ParallelLayout",
    "sequence_length_error",
    "sequence_multiple",
]
