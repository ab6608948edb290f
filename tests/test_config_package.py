"""The config package: one composition for train and eval (what the entry points build), its layer (no import
of data, planner, train, eval, bench or launch; no torch), and the shared rules its checks use."""

from __future__ import annotations

import ast
import dataclasses
import subprocess
import sys
import types
from pathlib import Path

import pytest

from usp.config import DataConfig, TrainConfig, validate_choices, validate_layout
from usp.config.compose import (
    EVAL_CONFIG,
    TRAIN_CONFIG,
    compose_config,
    compose_eval_config,
    compose_run_config,
    to_eval_config,
    to_run_config,
    to_train_config,
)

REPO = Path(__file__).resolve().parents[1]
CONFIG_DIR = REPO / "usp" / "config"
# what the config layer may import (TEAM.md's layers: base modules, then usp.parallel)
ALLOWED = (
    "usp.config",
    "usp.units",
    "usp.modes",
    "usp.mlp_tiles",
    "usp.errors",
    "usp.atomic",
    "usp.parallel",
)
OVERRIDES = ["recipe=tiny", "trainer.max_steps=3", "trainer.seq_len=256"]


def _run_main(module: str, stand_in: str, argv: list[str], tmp_path: Path, monkeypatch) -> TrainConfig:
    """``main()`` of an entry point end to end, with ``stand_in`` (the module its task imports ``run`` from)
    replaced by one that keeps the config it gets."""
    import importlib

    seen: list[TrainConfig] = []
    fake = types.ModuleType(stand_in)
    fake.run = seen.append
    monkeypatch.setitem(sys.modules, stand_in, fake)
    for key, value in {"RANK": "0", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", argv)
    importlib.import_module(module).main()
    (cfg,) = seen
    return cfg


def test_the_train_entry_point_gets_what_compose_builds(tmp_path, monkeypatch):
    got = _run_main(
        "usp.train.__main__",
        "usp.train.trainer",
        ["usp-train", *OVERRIDES, "hydra.run.dir=run"],
        tmp_path,
        monkeypatch,
    )
    want = compose_run_config(OVERRIDES, config_name=TRAIN_CONFIG, run_dir=str(tmp_path / "run"))
    assert got == want
    assert compose_config(OVERRIDES, run_dir=str(tmp_path / "run")) == want  # the thin name, the same call


def test_the_eval_entry_point_gets_what_compose_builds(tmp_path, monkeypatch):
    overrides = [*OVERRIDES, "model.path=/ckpt/hf", "eval=passkey", "eval.lengths=[128,256]"]
    got = _run_main(
        "usp.eval.__main__",
        "usp.eval.runner",
        ["usp-eval", *overrides, "hydra.run.dir=run"],
        tmp_path,
        monkeypatch,
    )
    want = compose_run_config(overrides, config_name=EVAL_CONFIG, run_dir=str(tmp_path / "run"))
    assert got == want
    assert got.eval.task == "passkey" and got.eval.lengths == [128, 256] and got.model.path == "/ckpt/hf"
    assert compose_eval_config(overrides, run_dir=str(tmp_path / "run")) == want
    assert (tmp_path / "run" / ".hydra-eval" / "config.yaml").is_file()  # eval.yaml's own Hydra output dir


def test_train_and_eval_differ_only_in_the_training_data_rule():
    """A recipe without its training data: training refuses it, evaluation needs none; all the
    rest of the composition (recipe, groups, overrides, checks) is the same."""
    overrides = ["recipe=llama31_8b_128k", "model.path=/ckpt"]
    with pytest.raises(ValueError, match=r"no training data: set data.prepared_path="):
        compose_run_config(overrides, config_name=TRAIN_CONFIG)
    evaluated = compose_run_config(overrides, config_name=EVAL_CONFIG)
    assert evaluated.data.prepared_path is None and evaluated.data.inputs == []
    trained = compose_run_config([*overrides, "data.prepared_path=/d"], config_name=TRAIN_CONFIG)
    assert dataclasses.replace(evaluated, data=trained.data) == trained
    with pytest.raises(ValueError, match=r"model.path=<a training run's hf/ export"):
        compose_run_config(["recipe=llama31_8b_128k"], config_name=EVAL_CONFIG)
    with pytest.raises(ValueError, match=r"model.dtype='fp8' is invalid"):  # the same checks for both
        compose_run_config([*overrides, "model.dtype=fp8"], config_name=EVAL_CONFIG)
    with pytest.raises(ValueError, match=r"config_name='serve' is not an entry point's config"):
        compose_run_config(overrides, config_name="serve")


def test_the_dictconfig_conversions_are_one_function():
    from hydra import compose, initialize_config_dir

    from usp.config.compose import CONF_DIR, VERSION_BASE, register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=VERSION_BASE):
        dcfg = compose(config_name="eval", overrides=["recipe=llama31_8b_128k", "model.path=/m"])
    assert to_eval_config(dcfg, run_dir="/r") == to_run_config(dcfg, config_name=EVAL_CONFIG, run_dir="/r")
    with pytest.raises(ValueError, match="data.prepared_path"):
        to_train_config(dcfg, run_dir="/r")


def _imports(path: Path) -> set[str]:
    """Every module a file imports, at the top or inside a function (relative imports resolved)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path.name}: use absolute imports"
            names.add(node.module or "")
    return names


def test_config_imports_only_base_modules_and_parallel():
    files = sorted(CONFIG_DIR.glob("*.py"))
    assert {f.name for f in files} >= {"__init__.py", "schema.py", "checks.py", "keys.py", "compose.py"}
    for path in files:
        for name in _imports(path):
            if name == "usp" or name.startswith("usp."):
                assert name.startswith(ALLOWED), f"usp/config/{path.name} imports {name} (a higher layer)"


def test_importing_and_composing_pulls_in_no_higher_layer_and_no_torch():
    code = (
        "import sys\n"
        "import usp.config, usp.config.compose\n"
        "from usp.config import validate_choices\n"
        "cfg = usp.config.compose.compose_config(['recipe=tiny', 'data.text_field=[text]'])\n"
        "usp.config.compose.compose_eval_config(['recipe=tiny', 'model.path=/m'])\n"
        "validate_choices(cfg)\n"
        "print(' '.join(sorted(sys.modules)))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    loaded = out.stdout.split()
    assert "usp.config.compose" in loaded
    higher = (
        "usp.data",
        "usp.plan",
        "usp.train",
        "usp.eval",
        "usp.bench",
        "usp.launch",
        "usp.checkpoint",
        "usp.startup",
        "usp.model",
        "usp.attention",
        "usp.parallel",
    )
    assert [m for m in loaded if m.startswith(higher)] == []
    assert [m for m in loaded if m.split(".")[0] in ("torch", "transformers", "datasets")] == []


def test_the_checks_use_the_shared_rules():
    """``parallel.ring_layout`` and ``parallel.mlp_tiles`` say what their one home says; the node size falls
    back as :func:`usp.parallel.mesh.resolve_node_size` does (``parallel.node_size``, else the launcher's
    LOCAL_WORLD_SIZE, else one node)."""
    from usp.mlp_tiles import check_mlp_tiles_setting
    from usp.modes import check_ring_layout

    base = TrainConfig(data=DataConfig(build_tiny_corpus=True))
    base.model.path = "/m"
    for setting, value, rule in [
        ("ring_layout", "zagzig", check_ring_layout),
        ("mlp_tiles", 0, check_mlp_tiles_setting),
    ]:
        with pytest.raises(ValueError) as from_home:
            rule(value)
        cfg = dataclasses.replace(base, parallel=dataclasses.replace(base.parallel, **{setting: value}))
        with pytest.raises(ValueError) as from_config:
            validate_choices(cfg)
        assert str(from_config.value) == str(from_home.value)

    def layout(node_size: int | None) -> TrainConfig:
        parallel = dataclasses.replace(base.parallel, ulysses_degree=4, ring_degree=1, node_size=node_size)
        return dataclasses.replace(
            base, parallel=parallel, trainer=dataclasses.replace(base.trainer, seq_len=256)
        )

    with pytest.raises(ValueError, match="span nodes of 2 ranks"):  # LOCAL_WORLD_SIZE=2 is the node
        validate_layout(layout(None), world_size=8, local_world_size=2)
    validate_layout(layout(4), world_size=8, local_world_size=2)  # parallel.node_size wins
    validate_layout(layout(None), world_size=8, local_world_size=None)  # no launcher: one node
    with pytest.raises(ValueError, match="span nodes of 2 ranks"):
        validate_layout(layout(2), world_size=8, local_world_size=8)
