"""``usp-plan`` and the library give one figure for one run (issue 23 item 3).

For a recipe with fixed degrees, three paths cost the same layout: the ``usp-plan`` command the recipe header
quotes (its ``--json`` row with the recipe's checkpointing and tiles), :func:`usp.plan.evaluate_layout` with the
recipe's settings, and :meth:`usp.plan.request.PlanRequest.evaluate` of the composed config (what
``usp-launch --dry-run`` and the trainer use). They used to differ: the launcher's request ignored
``trainer.grad_accum_steps`` (45.8 vs 47.7 GiB for ``llama31_8b_128k``).
"""

from __future__ import annotations

import json

import pytest

from usp.config import states_on_host
from usp.config.compose import compose_config
from usp.plan import cli, evaluate_layout, get_device, load_model_spec
from usp.plan.request import PlanRequest
from usp.startup.degrees import plan_layout

USER_SETTINGS = ["model.path=/ckpt/model", "data.prepared_path=/data/prepared"]
CASES = {  # recipe: the usp-plan flags its header quotes
    "llama31_8b_1m_8gpu": "--seq-len 1M --nodes 1 --gpus-per-node 8 --ulysses-degree 8 --ring-degree 1 --global-batch 1",
    "llama31_8b_128k": "--seq-len 128K --nodes 2 --gpus-per-node 8 --ulysses-degree 8 --ring-degree 2 --global-batch 8",
}


@pytest.mark.parametrize("recipe", sorted(CASES))
def test_cli_library_and_request_agree(recipe, capsys):
    cfg = compose_config([f"recipe={recipe}", *USER_SETTINGS])
    p, t, c = cfg.parallel, cfg.trainer, cfg.cluster
    assert cli.main(["--model", "llama-3.1-8b", *CASES[recipe].split(), "--top", "100", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    want = (p.activation_checkpointing, p.mlp_tiles, p.attn_head_chunks, "device", p.fsdp_mode)
    row = next(
        r
        for r in rows
        if (r["activation_checkpointing"], r["mlp_tiles"], r["attn_head_chunks"], r["states"], r["fsdp_mode"])
        == want
    )
    model = load_model_spec("llama-3.1-8b")
    world = c.num_nodes * c.gpus_per_node
    request = PlanRequest.from_config(cfg)
    device = request.device(c.gpu, c.memory_gib)
    layout = plan_layout(  # the layout start-up and usp-launch make for this run
        cfg, {"hidden_size": model.hidden_size}, world_size=world, node_size=c.gpus_per_node, gpu=c.gpu
    )
    via_request = request.evaluate(model, device, layout)
    dp = world // (p.ulysses_degree * p.ring_degree)
    via_library = evaluate_layout(
        model,
        get_device(c.gpu, memory_gib=c.memory_gib),
        seq_len=t.seq_len,
        ulysses_degree=p.ulysses_degree,
        ring_degree=p.ring_degree,
        world_size=world,
        node_size=c.gpus_per_node,
        fsdp_mode=p.fsdp_mode,
        activation_checkpointing=p.activation_checkpointing,
        ac_every_k=p.ac_every_k,
        global_batch=dp * t.micro_batch_size * t.grad_accum_steps,
        ring_layout=p.ring_layout,
        loss_chunk_size=t.loss_chunk_size,
        mlp_tiles=p.mlp_tiles,
        states_on_host=states_on_host(cfg.optim.name, p.cpu_offload),
        attn_head_chunks=p.attn_head_chunks,
    )
    assert row["mem_gib_per_gpu"] == pytest.approx(via_library.mem_gib_per_gpu, abs=1e-3)
    assert row["mem_gib_per_gpu"] == pytest.approx(via_request.mem_gib_per_gpu, abs=1e-3)
    for term, gib in via_request.memory_gib.items():
        assert row["memory_gib"][term] == pytest.approx(gib, abs=1e-3), term


def test_request_reads_every_planner_key_of_the_config():
    """``PlanRequest.from_config`` reads a composed config as ``from_dict`` reads a saved one (one reading of the
    keys): every planner key set away from its default arrives."""
    cfg = compose_config(
        [
            "recipe=llama31_8b_128k",
            *USER_SETTINGS,
            "model.dtype=float32",
            "trainer.seq_len=65536",
            "trainer.loss_chunk_size=1024",
            "trainer.grad_accum_steps=3",
            "trainer.micro_batch_size=2",
            "parallel.ring_layout=contiguous",
            "parallel.mlp_tiles=4",
            "parallel.attn_head_chunks=2",
            "parallel.cpu_offload=true",
            "cluster.host_mem_gib=512",
            "parallel.ulysses_degree=4",
            "parallel.ring_degree=auto",
            "parallel.fsdp_mode=hybrid_shard",
            "parallel.activation_checkpointing=every_k",
            "parallel.ac_every_k=3",
        ]
    )
    assert PlanRequest.from_config(cfg) == PlanRequest(
        seq_len=65536,
        compute_bytes=4,
        ring_layout="contiguous",
        loss_chunk_size=1024,
        grad_accum_steps=3,
        micro_batch_size=2,
        mlp_tiles=4,
        attn_head_chunks=2,
        states_on_host=True,
        host_mem_gib=512,
        ulysses_degree=4,
        ring_degree="auto",
        fsdp_mode="hybrid_shard",
        activation_checkpointing="every_k",
        ac_every_k=3,
    )
