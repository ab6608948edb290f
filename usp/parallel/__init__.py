"""The parallel layout (one DeviceMesh: dp x ring x ulysses) and the sequence layout helpers."""

from usp.parallel.balance import ring_pieces, ring_rank_pairs
from usp.parallel.layout import MESH_AXES, ParallelLayout, sequence_multiple
from usp.parallel.mesh import SPMesh, init_sp_mesh
from usp.parallel.sequence import (
    check_sequence_length,
    gather_sequence,
    local_token_indices,
    mesh_token_indices,
    shard_sequence,
    shard_sequences,
    sp_permutation,
)

__all__ = [
    "MESH_AXES",
    "ParallelLayout",
    "SPMesh",
    "check_sequence_length",
    "gather_sequence",
    "init_sp_mesh",
    "local_token_indices",
    "mesh_token_indices",
    "ring_pieces",
    "ring_rank_pairs",
    "sequence_multiple",
    "shard_sequence",
    "shard_sequences",
    "sp_permutation",
]
