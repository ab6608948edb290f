"""Every recipe composes into a valid TrainConfig for the world size it declares, without running anything."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from usp.config import states_on_host, validate_layout
from usp.config.compose import compose_config

RECIPES_DIR = Path(__file__).resolve().parents[1] / "recipes"
RECIPES = sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))
CPU_RECIPES = {
    "tiny",
    "tiny_sft",
    "tiny_moe",
    "tiny_lora",
    "tiny_dpo",
    "tiny_hybrid",
    "smollm2_135m_16k",
}  # CPU over gloo (the demos; the measured SmolLM2 context extension)
REAL = [name for name in RECIPES if name not in CPU_RECIPES]
# What a user must supply for a real recipe (their checkpoint and their prepared data).
USER_SETTINGS = ["model.path=/ckpt/model", "data.prepared_path=/data/prepared"]


def test_the_promised_recipes_exist():
    expected = {
        "tiny",
        "llama31_8b_128k",
        "llama31_8b_1m",
        "llama31_8b_1m_8gpu",
        "llama31_8b_4m",
        "llama3_70b_128k",
        "llama3_70b_lora_128k",
        "llama31_8b_dpo_64k",
        "llama2_7b_rope_32k",
        "llama2_7b_rope_64k",
        "llama2_7b_rope_128k",
        "smollm2_135m_16k",
        "smollm2_135m_32k",
        "qwen3_8b_128k",
        "qwen3_30b_a3b_128k",
        "qwen3_30b_a3b_1m",
        "qwen3_next_80b_a3b_1m",
        "gemma3_12b_128k",
        "tiny_moe",
        "tiny_lora",
        "tiny_dpo",
        "tiny_hybrid",
    }
    assert expected <= set(RECIPES)


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_composes_and_fits_its_declared_world(name):
    overrides = [f"recipe={name}"] + (USER_SETTINGS if name in REAL else [])
    cfg = compose_config(overrides, run_dir="/runs/x")
    world = cfg.cluster.num_nodes * cfg.cluster.gpus_per_node
    validate_layout(cfg, world_size=world, local_world_size=cfg.cluster.gpus_per_node)
    node = cfg.parallel.node_size or cfg.cluster.gpus_per_node
    assert node % cfg.parallel.ulysses_degree == 0, "Ulysses groups must stay inside a node"
    if cfg.model.max_position_embeddings is not None:
        assert cfg.model.max_position_embeddings >= cfg.trainer.seq_len
    text = (RECIPES_DIR / f"{name}.yaml").read_text()
    assert text.startswith("# @package _global_"), "a recipe is a global experiment config"
    assert "Expects:" in text and "Memory" in text, "a recipe states the GPUs it expects and its memory"


def test_tiny_recipe_is_the_cpu_two_by_two_demo():
    cfg = compose_config(["recipe=tiny"])
    assert (cfg.parallel.ulysses_degree, cfg.parallel.ring_degree, cfg.parallel.node_size) == (2, 2, 2)
    assert cfg.parallel.backend == "gloo" and cfg.trainer.device == "cpu" and cfg.model.dtype == "float32"
    assert cfg.model.build_tiny and cfg.cluster.num_nodes * cfg.cluster.gpus_per_node == 4
    assert cfg.trainer.max_steps <= 50 and cfg.trainer.checkpoint_every < cfg.trainer.max_steps
    # torchrun --standalone --nproc-per-node 4 gives LOCAL_WORLD_SIZE=4; node_size=2 emulates 2 nodes
    validate_layout(cfg, world_size=4, local_world_size=4)


@pytest.mark.parametrize("name", REAL)
def test_real_recipes_are_bf16_long_context_on_gpus(name):
    cfg = compose_config([f"recipe={name}", *USER_SETTINGS])
    assert cfg.model.dtype == "bfloat16" and cfg.cluster.gpu != "cpu"
    assert cfg.trainer.seq_len >= 32768 and cfg.parallel.fsdp_mode == "full_shard"


@pytest.mark.parametrize("name", REAL)
def test_real_recipe_fits_by_the_planner_and_quotes_its_memory(name):
    """The planner (usp.plan) predicts the recipe's layout fits its GPUs; the comment quotes that figure. A LoRA
    recipe (``model.lora.rank`` > 0) is costed with its adapters and quotes the matching ``--lora-*`` flags."""
    plan = pytest.importorskip("usp.plan")
    cfg = compose_config([f"recipe={name}", *USER_SETTINGS])
    text = (RECIPES_DIR / f"{name}.yaml").read_text()
    model = re.search(r"override /model: (\S+)", text).group(1)
    world = cfg.cluster.num_nodes * cfg.cluster.gpus_per_node
    p = cfg.parallel
    dp = world // (p.ulysses_degree * p.ring_degree)
    tiles = cfg.parallel.mlp_tiles
    assert isinstance(tiles, int), (
        f"{name}: a recipe fixes parallel.mlp_tiles (the figures quoted are for it)"
    )
    est = plan.evaluate_layout(
        plan.load_model_spec(model),
        plan.get_device(
            cfg.cluster.gpu, memory_gib=cfg.cluster.memory_gib, host_mem_gib=cfg.cluster.host_mem_gib
        ),
        seq_len=cfg.trainer.seq_len,
        ulysses_degree=p.ulysses_degree,
        ring_degree=p.ring_degree,
        world_size=world,
        node_size=cfg.cluster.gpus_per_node,
        fsdp_mode=p.fsdp_mode,
        activation_checkpointing=p.activation_checkpointing,
        ac_every_k=p.ac_every_k,
        global_batch=dp * cfg.trainer.micro_batch_size * cfg.trainer.grad_accum_steps,
        ring_layout=p.ring_layout,
        loss_chunk_size=cfg.trainer.loss_chunk_size,
        mlp_tiles=tiles,
        states_on_host=states_on_host(cfg.optim.name, cfg.parallel.cpu_offload),
        lora=plan.LoraPlan.from_config(cfg.model.lora),
    )
    assert est.fits, f"{name}: the planner predicts {est.mem_gib_per_gpu:.1f} GiB per GPU"
    # the quoted usp-plan command is the recipe's own layout, so rerunning it refreshes the right figures
    command = " ".join(line.lstrip("# ") for line in text.splitlines() if line.startswith("#"))
    start = command.index("usp-plan")
    flags = dict(re.findall(r"--([a-z-]+) (\S+?)[)\s]", command[start : command.index(")", start) + 1]))
    units = {"K": 1024, "M": 1024 * 1024}
    seq = flags["seq-len"]
    assert (flags["model"], int(seq[:-1]) * units[seq[-1]] if seq[-1] in units else int(seq)) == (
        model,
        cfg.trainer.seq_len,
    )
    assert [
        int(flags[k]) for k in ("nodes", "gpus-per-node", "ulysses-degree", "ring-degree", "global-batch")
    ] == [
        cfg.cluster.num_nodes,
        cfg.cluster.gpus_per_node,
        p.ulysses_degree,
        p.ring_degree,
        dp * cfg.trainer.micro_batch_size * cfg.trainer.grad_accum_steps,
    ]
    quoted_command = command[start : command.index(")", start)]
    assert int(flags.get("lora-rank", 0)) == cfg.model.lora.rank
    lora_extras = "--lora-train-embeddings-and-norms" in quoted_command.split()
    assert lora_extras == (cfg.model.lora.rank > 0 and cfg.model.lora.train_embeddings_and_norms)
    quoted = float(re.search(r"([0-9.]+) GiB/GPU", text).group(1))
    assert quoted == pytest.approx(est.mem_gib_per_gpu, rel=0.05), (
        f"{name}: the comment quotes {quoted} GiB/GPU, the planner predicts {est.mem_gib_per_gpu:.1f}: rerun the "
        "usp-plan command the comment quotes and refresh its figures"
    )


def test_staged_rope_extension_chains_exports():
    """Each Llama-2 stage starts from the previous stage's export and raises rope_theta and the length."""
    stages = ["llama2_7b_rope_32k", "llama2_7b_rope_64k", "llama2_7b_rope_128k"]
    raw = {name: OmegaConf.load(RECIPES_DIR / f"{name}.yaml") for name in stages}
    for prev, nxt in zip(stages, stages[1:]):
        assert raw[nxt].model.path == f"{raw[prev].hydra.run.dir}/hf"
        assert raw[nxt].model.rope_theta > raw[prev].model.rope_theta
        assert raw[nxt].trainer.seq_len == 2 * raw[prev].trainer.seq_len
