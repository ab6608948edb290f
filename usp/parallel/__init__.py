"""The parallel layout (one DeviceMesh: dp x ring x ulysses) and the sequence layout helpers."""

from usp.parallel.balance import ring_pieces, ring_rank_pairs
from usp.parallel.mesh import MESH_AXES, ParallelDims, SPMesh, init_sp_mesh, sequence_multiple
from usp.parallel.sequence import (
    check_sequence_length,
    gather_sequence,
    local_token_indices,
    shard_sequence,
    sp_permutation,
)

__all__ = [
    "MESH_AXES",
    "ParallelDims",
    "SPMesh",
    "check_sequence_length",
    "gather_sequence",
    "init_sp_mesh",
    "local_token_indices",
    "ring_pieces",
    "ring_rank_pairs",
    "sequence_multiple",
    "shard_sequence",
    "sp_permutation",
]
