"""The parallel layout object: degree validation, rank groups, and the sequence layout helpers."""

from __future__ import annotations

import pytest
import torch

from tests.mesh_cache import cached_sp_mesh
from usp.parallel import ParallelLayout, gather_sequence, local_token_indices, shard_sequence, sp_permutation


def test_groups_world16_node8_ulysses8_ring2():
    dims = ParallelLayout(world_size=16, ulysses_degree=8, ring_degree=2, node_size=8)
    assert dims.dp_degree == 1
    assert dims.groups("ulysses") == [list(range(0, 8)), list(range(8, 16))]
    assert dims.groups("ring") == [[i, i + 8] for i in range(8)]
    assert dims.groups("fsdp") == [list(range(16))]


def test_groups_world16_node8_ulysses4_ring2_dp2():
    dims = ParallelLayout(world_size=16, ulysses_degree=4, ring_degree=2, dp_degree=-1, node_size=8)
    assert dims.dp_degree == 2
    assert dims.groups("ulysses") == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    assert dims.groups("ring") == [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]]
    assert dims.groups("dp") == [[0, 8], [1, 9], [2, 10], [3, 11], [4, 12], [5, 13], [6, 14], [7, 15]]
    assert dims.groups("sp") == [list(range(8)), list(range(8, 16))]
    assert dims.coordinates(13) == {"dp": 1, "ring": 1, "ulysses": 1}
    # every Ulysses group stays inside one node of 8
    for g in dims.groups("ulysses"):
        assert len({r // 8 for r in g}) == 1


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(world_size=8, ulysses_degree=3, ring_degree=1), "does not divide the world size 8"),
        (dict(world_size=8, ulysses_degree=0, ring_degree=1), "parallel.ulysses_degree=0"),
        (dict(world_size=8, ulysses_degree=2, ring_degree=-1), "parallel.ring_degree=-1"),
        (dict(world_size=8, ulysses_degree=2, ring_degree=2, dp_degree=3), "parallel.dp_degree=3"),
        (dict(world_size=16, ulysses_degree=16, ring_degree=1, node_size=8), "span nodes"),
        (dict(world_size=12, ulysses_degree=4, ring_degree=1, node_size=6), "span nodes"),
        (
            dict(world_size=8, ulysses_degree=1, ring_degree=1, node_size=3),
            "Set parallel.node_size to one of",
        ),
    ],
)
def test_bad_degrees_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ParallelLayout(**kwargs)


def test_cross_node_ulysses_allowed_explicitly():
    dims = ParallelLayout(world_size=16, ulysses_degree=16, node_size=8, allow_cross_node_ulysses=True)
    assert dims.groups("ulysses") == [list(range(16))]


def test_zigzag_indices_cover_sequence_once():
    for ring, uly in [(1, 1), (2, 1), (1, 4), (2, 2), (4, 2)]:
        for layout in ("zigzag", "contiguous"):
            perm = sp_permutation(32, ring, uly, layout)
            assert sorted(perm.tolist()) == list(range(32))
    # ring 2, zigzag: 4 chunks of 4; ring rank 0 holds chunks 0 and 3, split over 2 ulysses ranks
    assert local_token_indices(16, 2, 2, 0, 0, "zigzag").tolist() == [0, 1, 2, 3]
    assert local_token_indices(16, 2, 2, 0, 1, "zigzag").tolist() == [12, 13, 14, 15]
    assert local_token_indices(16, 2, 2, 1, 0, "zigzag").tolist() == [4, 5, 6, 7]
    assert local_token_indices(16, 2, 1, 1, 0, "contiguous").tolist() == list(range(8, 16))


def test_bad_sequence_length_names_nearest():
    with pytest.raises(ValueError, match=r"trainer.seq_len = 24 or 32"):
        local_token_indices(30, 2, 2, 0, 0, "zigzag")


def _shard_gather_roundtrip(ulysses: int, ring: int, layout: str):
    mesh = cached_sp_mesh(ulysses, ring, layout)
    torch.manual_seed(0)
    x = torch.randn(2, 48, 3)
    local = shard_sequence(x, mesh, dim=1)
    back = gather_sequence(local, mesh, dim=1)
    torch.testing.assert_close(back, x, rtol=0, atol=0)
    pos = shard_sequence(torch.arange(48)[None], mesh)
    return pos[0].tolist(), mesh.sp_rank, mesh.describe()


@pytest.mark.parametrize("ulysses, ring", [(1, 4), (2, 2), (4, 1)])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_shard_gather_world4(dist_pools, ulysses, ring, layout):
    results = dist_pools(4).run(_shard_gather_roundtrip, ulysses, ring, layout)
    seen = sorted(p for positions, _, _ in results for p in positions)
    assert seen == list(range(48))
    for rank, (positions, sp_rank, desc) in enumerate(results):
        assert sp_rank == rank  # dp = 1: sp rank == global rank
        assert desc["ring_degree"] == ring and desc["ulysses_degree"] == ulysses
        r, u = rank // ulysses, rank % ulysses
        assert positions == local_token_indices(48, ring, ulysses, r, u, layout).tolist()


def _fake_world_groups(rank: int, world_size: int, **mesh_kwargs) -> dict[str, list[int]]:
    """Build the real DeviceMesh as ``rank`` of a fake (no-communication) world; return its groups' ranks."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from usp.parallel import init_sp_mesh

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        mesh = init_sp_mesh(**mesh_kwargs)
        out = {
            axis: dist.get_process_group_ranks(mesh.group(axis)) for axis in ("ulysses", "ring", "dp", "sp")
        }
        out["fsdp"] = mesh.submesh("fsdp").mesh.tolist()
        out["coords"] = [mesh.dp_rank, mesh.ring_rank, mesh.ulysses_rank]
        return out
    finally:
        dist.destroy_process_group()


def test_device_mesh_world16_node8_every_rank():
    """World 16 on 2 nodes of 8, ulysses 4 x ring 2 x dp 2: the process groups every rank really gets."""
    for rank in range(16):
        got = _fake_world_groups(rank, 16, ulysses_degree=4, ring_degree=2, node_size=8)
        base = rank - rank % 4
        assert got["ulysses"] == [base, base + 1, base + 2, base + 3]  # adjacent, inside one node
        assert rank // 8 == base // 8
        dp_block = rank - rank % 8
        assert got["ring"] == [dp_block + rank % 4, dp_block + 4 + rank % 4]  # strided by the ulysses degree
        assert got["dp"] == [rank % 8, rank % 8 + 8]
        assert got["sp"] == list(range(dp_block, dp_block + 8))
        assert got["fsdp"] == list(range(16))
        assert got["coords"] == [rank // 8, (rank // 4) % 2, rank % 4]


def test_device_mesh_world16_ulysses8_ring2_spans_nodes_by_ring():
    """Ulysses 8 fills each node of 8; the ring pairs rank i of node 0 with rank i of node 1."""
    for rank in (0, 3, 8, 15):
        got = _fake_world_groups(rank, 16, ulysses_degree=8, ring_degree=2, node_size=8)
        assert got["ulysses"] == list(range(rank - rank % 8, rank - rank % 8 + 8))
        assert got["ring"] == [rank % 8, rank % 8 + 8]


def _group_timeouts(timeout_s: float | None) -> dict[str, float]:
    from datetime import timedelta

    from usp.parallel import init_sp_mesh

    mesh = init_sp_mesh(2, 2, timeout=None if timeout_s is None else timedelta(seconds=timeout_s))
    out = {}
    for axis in ("dp", "ring", "ulysses", "sp", "fsdp"):
        backend = mesh.group(axis)._get_backend(torch.device("cpu"))
        out[axis] = backend.options._timeout.total_seconds()
    hsdp = mesh.hsdp_mesh(2)  # the HSDP mesh is built from the same mesh, with the same timeout
    for axis in ("replicate", "shard"):
        out[f"hsdp_{axis}"] = (
            hsdp.get_group(axis)._get_backend(torch.device("cpu")).options._timeout.total_seconds()
        )
    t = torch.ones(1)
    torch.distributed.all_reduce(t, group=mesh.ring_group)  # the groups still work
    return out


def test_mesh_groups_take_the_requested_timeout(dist_pools):
    """``init_sp_mesh(timeout=...)`` reaches every axis' group (new_group would otherwise use the default)."""
    for got in dist_pools(4).run(_group_timeouts, 123.0):
        assert got == {
            "dp": 123.0,
            "ring": 123.0,
            "ulysses": 123.0,
            "sp": 123.0,
            "fsdp": 123.0,
            "hsdp_replicate": 123.0,
            "hsdp_shard": 123.0,
        }
    for got in dist_pools(4).run(_group_timeouts, None):
        assert set(got.values()) != {123.0}
