"""``usp-plan`` (the CLI) and the library (:func:`usp.plan.evaluate_layout`, :class:`usp.plan.request.PlanRequest`,
what ``usp-launch`` and the trainer use) print the same memory figure for the same fixed layout.

The two cases once disagreed: Llama-3.1-8B at 1M tokens on 8 GPUs (Ulysses 8, ring 1), and the 128K recipe
on 2 x 8 GPUs, whose 8 accumulation steps keep the fp32 gradient shards through every micro step: the CLI
counted them from ``--global-batch``, ``PlanRequest.evaluate`` did not (no global batch passed).
"""

from __future__ import annotations

import json

import pytest

from usp.config import states_on_host
from usp.plan import evaluate_layout, get_device, load_model_spec
from usp.plan.cli import main as plan_main
from usp.plan.request import PlanRequest
from usp.train.__main__ import compose_config

USER_SETTINGS = ["model.path=/ckpt/model", "data.prepared_path=/data/prepared"]
CASES = [  # (recipe, usp-plan flags)
    ("llama31_8b_1m_8gpu", "--seq-len 1M --nodes 1 --gpus-per-node 8 --ulysses-degree 8 --ring-degree 1 --global-batch 1"),
    ("llama31_8b_128k", "--seq-len 128K --nodes 2 --gpus-per-node 8 --ulysses-degree 8 --ring-degree 2 --global-batch 8"),
]  # fmt: skip


def _cli_rows(flags: str, capsys) -> list[dict]:
    capsys.readouterr()
    assert plan_main(["--model", "llama-3.1-8b", *flags.split(), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize(("recipe", "flags"), CASES)
def test_cli_json_equals_the_library_for_the_recipe_layout(recipe, flags, capsys):
    cfg = compose_config([f"recipe={recipe}", *USER_SETTINGS])
    p, t = cfg.parallel, cfg.trainer
    world = cfg.cluster.num_nodes * cfg.cluster.gpus_per_node
    rows = _cli_rows(flags, capsys)
    row = next(
        r for r in rows
        if (r["activation_checkpointing"], r["fsdp_mode"], r["mlp_tiles"], r["attn_head_chunks"], r["states"])
        == (p.activation_checkpointing, p.fsdp_mode, p.mlp_tiles, p.attn_head_chunks, "device")
    )  # fmt: skip
    model, device = load_model_spec("llama-3.1-8b"), get_device(cfg.cluster.gpu)
    request = PlanRequest.from_config(cfg)
    via_request = request.evaluate(model, device, world_size=world, node_size=cfg.cluster.gpus_per_node,
                                   mlp_tiles=p.mlp_tiles)  # fmt: skip
    dp = world // (p.ulysses_degree * p.ring_degree)
    direct = evaluate_layout(
        model, device, seq_len=t.seq_len, ulysses_degree=p.ulysses_degree, ring_degree=p.ring_degree,
        world_size=world, node_size=cfg.cluster.gpus_per_node, fsdp_mode=p.fsdp_mode,
        activation_checkpointing=p.activation_checkpointing, ac_every_k=p.ac_every_k,
        global_batch=dp * t.micro_batch_size * t.grad_accum_steps, ring_layout=p.ring_layout,
        loss_chunk_size=t.loss_chunk_size, mlp_tiles=p.mlp_tiles, attn_head_chunks=p.attn_head_chunks,
        offload=states_on_host(cfg.optim.name, p.cpu_offload),
    )  # fmt: skip
    assert row["mem_gib_per_gpu"] == pytest.approx(direct.mem_gib_per_gpu, abs=1e-3)
    assert row["mem_gib_per_gpu"] == pytest.approx(via_request.mem_gib_per_gpu, abs=1e-3)
    assert row["memory_gib"] == pytest.approx(
        {k: round(v, 3) for k, v in via_request.memory_gib.items()}, abs=1e-3
    )


def test_grad_accumulation_keeps_the_gradient_shards():
    """``trainer.grad_accum_steps`` > 1 counts the fp32 gradient shards (a check that can fail if the request
    drops the accumulation again)."""
    cfg = compose_config(["recipe=llama31_8b_128k", *USER_SETTINGS])
    model, device = load_model_spec("llama-3.1-8b"), get_device(cfg.cluster.gpu)
    kw = dict(world_size=16, node_size=8, mlp_tiles=1)
    accum = PlanRequest.from_config(cfg)
    assert accum.grad_accum_steps == 8
    gib = accum.evaluate(model, device, **kw).memory_gib["sharded_states"]
    one = PlanRequest(**{**accum.__dict__, "grad_accum_steps": 1}).evaluate(model, device, **kw)
    assert gib - one.memory_gib["sharded_states"] == pytest.approx(
        4 * model.num_params / 16 / 1024**3, rel=1e-6
    )
