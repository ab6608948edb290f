"""The planner's records (Workload, Candidate, SearchSpace): the keyword API maps every argument onto them, and
the planner's modules import each other without a cycle."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

import usp.plan
from usp.plan import (
    Candidate,
    SearchSpace,
    Workload,
    evaluate_layout,
    get_device,
    held_activation_bytes,
    host_memory,
    load_model_spec,
    offload_time,
    plan_layouts,
    training_memory,
)
from usp.plan.estimate import enumerate_candidates, estimate_layout
from usp.plan.layout import from_keywords
from usp.plan.memory import held_bytes, peak_memory
from usp.plan.offload import host_bytes, offload_seconds
from usp.plan.search import enumerate_layouts, search_layouts

MODEL = load_model_spec("llama-3.1-8b")
H100 = get_device("h100-80g")
# Every field away from its default, so an argument the keyword form dropped or swapped shows.
WORK = Workload(
    MODEL,
    65536,
    global_batch=4,
    micro_batch_size=2,
    compute_bytes=4,
    loss_chunk_size=1024,
    ring_layout="zigzag",
    overhead_frac=0.1,
    headroom_gib=3.0,
)
CAND = Candidate(
    ulysses_degree=2,
    ring_degree=4,
    world_size=16,
    node_size=8,
    fsdp_mode="hybrid_shard",
    activation_checkpointing="every_k",
    ac_every_k=3,
    mlp_tiles=4,
    attn_head_chunks=2,
    states="cpu_offload",
)


def test_records_are_frozen_and_derive_dp():
    assert CAND.dp_degree == 2 and CAND.states_on_host
    with pytest.raises(dataclasses.FrozenInstanceError):
        CAND.mlp_tiles = 8  # type: ignore[misc]


def test_keyword_forms_map_every_argument():
    placement = dict(
        seq_len=WORK.seq_len,
        ulysses_degree=2,
        ring_degree=4,
        world_size=16,
        node_size=8,
        fsdp_mode="hybrid_shard",
        activation_checkpointing="every_k",
    )
    mem = training_memory(
        MODEL,
        H100,
        **placement,
        ac_every_k=3,
        micro_batch_size=2,
        loss_chunk_size=1024,
        overhead_frac=0.1,
        states_on_host=True,
        compute_bytes=4,
        mlp_tiles=4,
        attn_head_chunks=2,
    )
    assert mem == peak_memory(WORK, CAND, H100)
    assert mem != peak_memory(
        dataclasses.replace(WORK, seq_len=2 * WORK.seq_len), CAND, H100
    )  # the check can fail
    held = held_activation_bytes(
        MODEL,
        seq_len=WORK.seq_len,
        ulysses_degree=2,
        ring_degree=4,
        activation_checkpointing="every_k",
        ac_every_k=3,
        mlp_tiles=4,
        micro_batch_size=2,
        compute_bytes=4,
        loss_chunk_size=1024,
    )
    assert held == held_bytes(WORK, CAND)
    off = dict(
        placement,
        activation_checkpointing="offload",
        states_on_host=True,
        micro_batch_size=2,
        compute_bytes=4,
    )
    ckpt = dataclasses.replace(CAND, activation_checkpointing="offload")
    assert host_memory(MODEL, **off) == host_bytes(WORK, ckpt)
    assert offload_time(MODEL, H100, **off, layer_fwd_s=1e-3, layer_bwd_s=2e-3) == offload_seconds(
        WORK, ckpt, H100, layer_fwd_s=1e-3, layer_bwd_s=2e-3
    )
    one = dataclasses.replace(WORK, micro_batch_size=1)  # evaluate_layout costs micro batch 1
    est = evaluate_layout(
        MODEL,
        H100,
        **placement,
        ac_every_k=3,
        global_batch=4,
        ring_layout="zigzag",
        loss_chunk_size=1024,
        overhead_frac=0.1,
        states_on_host=True,
        compute_bytes=4,
        mlp_tiles=4,
        headroom_gib=3.0,
        attn_head_chunks=2,
    )
    assert est.to_dict() == estimate_layout(one, CAND, H100).to_dict()


def test_plan_layouts_is_search_layouts_on_the_records():
    kw = dict(seq_len=131072, world_size=16, node_size=8, ulysses_degree=4, ac_modes=("full", "offload"))
    ranked = plan_layouts(MODEL, H100, **kw, global_batch=4, mlp_tiles=None, states=("device", "cpu_offload"))
    work = Workload(MODEL, 131072, global_batch=4)
    space = SearchSpace(
        16, 8, ulysses_degree=4, ac_modes=("full", "offload"), states=("device", "cpu_offload")
    )
    assert [e.to_dict() for e in ranked] == [e.to_dict() for e in search_layouts(work, space, H100)]
    assert {e.activation_checkpointing for e in ranked} <= {"full", "offload"} and {
        e.ulysses_degree for e in ranked
    } == {4}


def test_from_keywords_routes_each_field_and_refuses_the_rest():
    kw = dict(seq_len=65536, ulysses_degree=2, ring_degree=4, world_size=16, node_size=8, mlp_tiles=4)
    work, cand = from_keywords(MODEL, Candidate, **kw, global_batch=4, states_on_host=True)
    assert work == Workload(MODEL, 65536, global_batch=4)
    assert cand == Candidate(
        ulysses_degree=2, ring_degree=4, world_size=16, node_size=8, mlp_tiles=4, states="cpu_offload"
    )
    _, space = from_keywords(
        MODEL, SearchSpace, seq_len=65536, world_size=16, node_size=8, states_on_host=True
    )
    assert space.states == ("cpu_offload",)
    _, space = from_keywords(MODEL, SearchSpace, seq_len=65536, world_size=16, node_size=8, states=None)
    assert space.states == ("device",)
    # a keyword no record has (a typo) is refused with the fields that exist, not ignored
    with pytest.raises(TypeError, match=r"unknown keyword\(s\) \['mlp_tile'\].*'mlp_tiles'"):
        training_memory(MODEL, H100, **{**kw, "mlp_tile": 4})
    with pytest.raises(TypeError, match="ac_modes"):  # a search field is not a layout's
        evaluate_layout(MODEL, H100, **kw, ac_modes=("full",))
    with pytest.raises(ValueError, match="pass one"):
        from_keywords(MODEL, Candidate, **kw, states_on_host=True, states="device")
    # the searches and estimates cost one sequence per micro step
    with pytest.raises(ValueError, match="micro_batch_size=2.*global_batch"):
        plan_layouts(MODEL, H100, seq_len=65536, world_size=16, node_size=8, micro_batch_size=2)


def test_enumerate_layouts_is_enumerate_candidates_on_the_records():
    kw = dict(seq_len=131072, world_size=16, node_size=8, ring_degree=2, ac_modes=("full",))
    layouts, rejected = enumerate_layouts(MODEL, H100, **kw, states_on_host=True)
    space = SearchSpace(16, 8, ring_degree=2, ac_modes=("full",), states=("cpu_offload",))
    want, want_rejected = enumerate_candidates(Workload(MODEL, 131072), space, H100)
    assert [e.to_dict() for e in layouts] == [e.to_dict() for e in want] and rejected == want_rejected
    assert layouts and {e.states for e in layouts} == {"cpu_offload"}


def _plan_imports(path: Path) -> tuple[set[str], set[str]]:
    """usp.plan modules a file imports at module level, and inside functions."""
    top: set[str] = set()
    nested: set[str] = set()
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("usp.plan."):
            (top if node in tree.body else nested).add(node.module)
    return top, nested


def test_planner_modules_have_no_import_cycle():
    """Module-level imports inside usp/plan form no cycle, and no planner module imports another inside a
    function (the way a cycle was hidden before: search imported advice lazily, advice imported search)."""
    root = Path(usp.plan.__file__).parent
    graph = {}
    for path in sorted(root.glob("*.py")):
        top, nested = _plan_imports(path)
        assert not nested, f"{path.name} imports {sorted(nested)} inside a function"
        graph[f"usp.plan.{path.stem}"] = top
    state: dict[str, int] = {}  # 1 visiting, 2 done

    def visit(mod: str, trail: list[str]) -> None:
        if state.get(mod) == 2:
            return
        assert state.get(mod) != 1, "import cycle: " + " -> ".join([*trail, mod])
        state[mod] = 1
        for dep in graph.get(mod, ()):
            visit(dep, [*trail, mod])
        state[mod] = 2

    for mod in graph:
        visit(mod, [])
    assert "usp.plan.search" not in graph["usp.plan.advice"] and "usp.plan.advice" in graph["usp.plan.search"]
