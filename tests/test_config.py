"""The entry point's composition and validation: overrides reach the typed config, bad input fails clearly."""

from __future__ import annotations

import os
import subprocess
import sys
import types
import typing
from pathlib import Path

import pytest
from hydra.errors import MissingConfigException

from usp.config import TrainConfig, validate_choices, validate_layout
from usp.config.compose import compose_config, run_id
from usp.parallel.mesh import launched_world
from usp.train.__main__ import main

REPO = Path(__file__).resolve().parents[1]


def test_stable_overrides_reach_the_typed_config():
    cfg = compose_config(
        [
            "recipe=tiny",
            "parallel.ulysses_degree=4",
            "parallel.ring_degree=1",
            "trainer.max_steps=7",
            "trainer.seq_len=256",
            "logging.wandb.mode=offline",
        ],
        run_dir="/tmp/usp-run",
    )
    assert isinstance(cfg, TrainConfig)
    assert (cfg.parallel.ulysses_degree, cfg.parallel.ring_degree) == (4, 1)
    assert (cfg.trainer.max_steps, cfg.trainer.seq_len) == (7, 256)
    assert cfg.logging.wandb.mode == "offline"
    assert cfg.run_dir == "/tmp/usp-run"
    assert cfg.model.path == "/tmp/usp-run/tiny-llama"  # ${run_dir} interpolation
    assert cfg.optim.betas == (0.9, 0.95) and isinstance(cfg.optim.betas, tuple)
    # the recipe's own settings survive the overrides it does not touch
    assert cfg.parallel.node_size == 2 and cfg.parallel.backend == "gloo" and cfg.model.build_tiny


def test_default_without_recipe_is_a_single_process_tiny_run():
    cfg = compose_config([])
    assert cfg.model.build_tiny and cfg.data.build_tiny_corpus
    assert (cfg.parallel.ulysses_degree, cfg.parallel.ring_degree) == (1, 1)
    validate_layout(cfg, world_size=1, local_world_size=None)


def test_auto_degrees_are_accepted_and_left_to_the_planner():
    cfg = compose_config(["parallel=auto"])
    assert cfg.parallel.ulysses_degree == "auto" and cfg.parallel.ring_degree == "auto"
    validate_layout(cfg, world_size=16, local_world_size=8)
    cfg = compose_config(["parallel=auto", "parallel.ring_degree=3"])
    with pytest.raises(
        ValueError,
        match=r"ring_degree=3 = 3 does not divide the world size 16.*ulysses_degree=auto counted as 1",
    ):
        validate_layout(cfg, world_size=16, local_world_size=8)
    cfg = compose_config(
        ["parallel=auto", "parallel.ulysses_degree=16"]
    )  # ParallelLayout's node rule, auto or not
    with pytest.raises(
        ValueError, match=r"ulysses_degree=16 would make Ulysses groups span nodes of 8 ranks"
    ):
        validate_layout(cfg, world_size=16, local_world_size=8)


def test_unknown_recipe_lists_the_valid_ones():
    with pytest.raises(MissingConfigException) as err:
        compose_config(["recipe=llama_9000"])
    message = str(err.value)
    assert "recipe/llama_9000" in message
    for name in ("tiny", "llama31_8b_128k", "llama2_7b_rope_32k"):
        assert name in message


def test_unknown_group_option_lists_the_valid_ones():
    with pytest.raises(MissingConfigException) as err:
        compose_config(["cluster=tpu-v9"])
    assert all(name in str(err.value) for name in ("h100-80g", "h200", "b200", "cpu"))


def test_misspelled_key_fails_at_composition():
    with pytest.raises(
        ValueError, match="unknown config key 'trainer.max_step': did you mean trainer.max_steps"
    ):
        compose_config(["trainer.max_step=5"])


@pytest.mark.parametrize(
    ("override", "setting", "valid"),
    [
        ("parallel.fsdp_mode=zero3", "parallel.fsdp_mode", "full_shard, hybrid_shard"),
        (
            "parallel.activation_checkpointing=some",
            "parallel.activation_checkpointing",
            "none, full, every_k",
        ),
        ("logging.wandb.mode=on", "logging.wandb.mode", "online, offline, disabled"),
        ("model.dtype=fp8", "model.dtype", "bfloat16, float32, float16"),
        ("parallel.ring_layout=spiral", "parallel.ring_layout", "zigzag, contiguous"),
        ("parallel.ulysses_degree=0", "parallel.ulysses_degree", "'auto'"),
    ],
)
def test_bad_enum_value_names_the_setting_and_valid_values(override, setting, valid):
    with pytest.raises(ValueError) as err:
        compose_config(["recipe=tiny", override])
    assert setting in str(err.value) and valid in str(err.value)


def test_missing_checkpoint_path_and_data_are_named():
    with pytest.raises(ValueError, match=r"model\.path=/ckpt"):
        compose_config(["recipe=llama31_8b_128k"])
    with pytest.raises(ValueError, match=r"data\.prepared_path="):
        compose_config(["recipe=llama31_8b_128k", "model.path=/ckpt/llama"])


def test_command_line_data_group_beats_the_recipe():
    cfg = compose_config(
        ["recipe=llama31_8b_128k", "model.path=/m", "data=jsonl", "data.inputs=[/d/a.jsonl]"]
    )
    assert cfg.data.inputs == ["/d/a.jsonl"] and cfg.data.prepared_path is None
    cfg = compose_config(["recipe=llama31_8b_128k", "model.path=/m", "data.prepared_path=/d/packed"])
    assert cfg.data.prepared_path == "/d/packed" and cfg.data.inputs == []


def test_degrees_that_do_not_fit_the_world_fail_with_the_numbers():
    cfg = compose_config(["recipe=tiny"])
    with pytest.raises(ValueError, match=r"= 4 does not divide the world size 6"):
        validate_layout(cfg, world_size=6, local_world_size=6)
    cfg = compose_config(["recipe=tiny", "parallel.node_size=null"])
    with pytest.raises(ValueError, match=r"ulysses_degree=2 would make Ulysses groups span nodes of 1"):
        validate_layout(cfg, world_size=4, local_world_size=1)


def test_seq_len_must_suit_the_layout():
    cfg = compose_config(["recipe=tiny", "trainer.seq_len=500"])
    with pytest.raises(ValueError, match=r"trainer.seq_len = 496 or 504"):
        validate_layout(cfg, world_size=4, local_world_size=4)


def test_max_position_embeddings_shorter_than_seq_len_is_rejected():
    cfg = compose_config(["recipe=tiny"])
    cfg.model.max_position_embeddings = 256
    with pytest.raises(
        ValueError, match="model.max_position_embeddings=256 is shorter than trainer.seq_len=512"
    ):
        validate_choices(cfg)


def test_launched_world_reads_the_launcher_env():
    assert launched_world({}) == (1, None)
    assert launched_world({"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"}) == (16, 8)


def test_run_id_is_shared_by_all_ranks_or_refused(monkeypatch):
    for key in ("SLURM_JOB_ID", "TORCHELASTIC_RUN_ID", "WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    assert run_id() == "slurm-4242"
    monkeypatch.delenv("SLURM_JOB_ID")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "abc")
    assert run_id() == "torchrun-abc"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    monkeypatch.setenv("WORLD_SIZE", "8")
    with pytest.raises(ValueError, match="hydra.run.dir="):
        run_id()


def test_run_id_prefers_the_rendezvous_id_inside_a_slurm_allocation(monkeypatch):
    """torchrun --standalone inside salloc: each launch its own run dir (not the shared slurm-<job id>);
    srun torchrun --rdzv-id $SLURM_JOB_ID keeps slurm-<job id>; no torchrun id -> the job id."""
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "3f2a9c")
    assert run_id() == "torchrun-3f2a9c"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "4242")
    assert run_id() == "slurm-4242"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    assert run_id() == "slurm-4242"


def test_main_hands_the_typed_config_to_the_trainer(tmp_path, monkeypatch):
    """The Hydra app end to end, with a stand-in trainer: absolute run dir, typed config, .hydra on rank 0."""
    seen: list[TrainConfig] = []
    fake = types.ModuleType("usp.train.trainer")
    fake.run = seen.append
    monkeypatch.setitem(sys.modules, "usp.train.trainer", fake)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["usp-train", "recipe=tiny", "hydra.run.dir=run", "trainer.max_steps=3"])
    main()
    (cfg,) = seen
    assert cfg.run_dir == str(tmp_path / "run") and os.path.isabs(cfg.run_dir)
    assert cfg.model.path == str(tmp_path / "run" / "tiny-llama")
    assert cfg.trainer.max_steps == 3
    assert (tmp_path / "run" / ".hydra" / "config.yaml").is_file()


def _entry(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    full_env = {**os.environ, **env}
    return subprocess.run(
        [sys.executable, "-m", "usp.train", *args],
        env=full_env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_bad_world_fails_at_start_and_only_rank0_writes(tmp_path):
    """Degrees vs the launched world are checked before the trainer is imported; rank 1 writes no .hydra."""
    args = ["recipe=tiny", f"hydra.run.dir={tmp_path}/run"]
    rank0 = _entry(args, {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}, tmp_path)
    assert rank0.returncode == 2, rank0.stderr
    assert "does not divide the world size 2" in rank0.stderr
    assert (tmp_path / "run" / ".hydra").is_dir()
    (tmp_path / "run" / ".hydra" / "config.yaml").unlink()
    (tmp_path / "run" / ".hydra" / "overrides.yaml").unlink()
    (tmp_path / "run" / ".hydra" / "hydra.yaml").unlink()
    (tmp_path / "run" / ".hydra").rmdir()
    rank1 = _entry(args, {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}, tmp_path)
    assert rank1.returncode == 2
    assert "usp-train: error" not in rank1.stderr  # rank 0 reports
    assert not (tmp_path / "run" / ".hydra").exists()


def test_conf_recipe_link_points_at_recipes():
    link = REPO / "conf" / "recipe"
    assert link.is_symlink() and link.resolve() == (REPO / "recipes").resolve()


def test_valid_values_match_the_modules_that_implement_them():
    """The entry point's checks accept exactly what the trainer, mesh and kernels implement."""
    from usp import modes
    from usp.attention import kernels
    from usp.parallel import layout as mesh
    from usp.train import parallelize

    assert set(modes.FSDP_MODES) == set(parallelize.FSDP_MODES)
    assert set(modes.AC_MODES) == set(parallelize.AC_MODES)
    # the mesh checks ring layouts with usp.modes' own rule: every value it lists is placed, others refused
    assert set(typing.get_args(modes.RingLayout)) == set(modes.RING_LAYOUTS)
    for layout in modes.RING_LAYOUTS:
        assert mesh.sequence_multiple(2, 1, layout) in (2, 4)
    with pytest.raises(ValueError, match="ring_layout"):
        mesh.sequence_multiple(2, 1, "striped")
    assert set(modes.ATTENTION_BACKENDS) == set(kernels.BACKENDS)
