"""The evaluation entry point: ``python -m usp.eval`` / ``usp-eval``, a Hydra app composing ``conf/eval.yaml``.

    torchrun --standalone --nproc-per-node 4 -m usp.eval recipe=tiny model.path=outputs/demo/hf eval=passkey \\
        hydra.run.dir=outputs/demo

``conf/eval.yaml`` is ``conf/train.yaml`` (the same recipes and groups: a recipe's model, parallel and cluster
settings carry over) plus Hydra's help and job name. The task is the ``eval=`` group (``ppl``, ``passkey``, ``ruler``).
Hydra stays here: the composed config becomes a typed :class:`usp.config.TrainConfig` once (the training data
settings may stay unset: evaluation reads none of them), its choices are checked, and
:func:`usp.eval.runner.run` gets it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from usp.config import DataConfig, TrainConfig, validate_choices
from usp.config_keys import check_composed_keys, check_override_keys
from usp.train.__main__ import (
    CONF_DIR,
    VERSION_BASE,
    check_conf_dir,
    config_groups,
    register_configs,
    run_hydra_app,
)
from usp.units import expand_length_overrides

CONFIG_NAME = "eval"


def to_eval_config(cfg: DictConfig, *, run_dir: str | None = None) -> TrainConfig:
    """The composed DictConfig -> a validated :class:`TrainConfig` for evaluation.

    ``data.*`` settings left at ``???`` (a recipe's prepared data path) are not needed and become empty;
    anything else missing (``model.path``) raises ``ValueError`` naming it. Enum fields and simple ranges are
    checked as for training, the ``eval.*`` ones by :func:`usp.eval.runner.check_eval_settings` later.
    """
    cfg = cfg.copy()
    if run_dir is not None:
        cfg.run_dir = str(Path(run_dir).resolve())
    check_composed_keys(cfg, TrainConfig)
    for key in OmegaConf.missing_keys(cfg):
        if key.startswith("data."):
            OmegaConf.update(cfg, key, [] if key == "data.inputs" else None)
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        hints = {"model.path": "model.path=<a training run's hf/ export, or a checkpoint dir>"}
        raise ValueError(
            "these settings have no value (??? in the config): " + "; ".join(hints.get(k, f"{k}=...") for k in missing)
        )
    typed = OmegaConf.merge(OmegaConf.structured(TrainConfig), cfg)
    obj = OmegaConf.to_object(typed)
    assert isinstance(obj, TrainConfig), type(obj)
    # evaluation reads no training data: check everything else as the trainer would
    validate_choices(dataclasses.replace(obj, data=DataConfig(build_tiny_corpus=True)))
    return obj


def compose_eval_config(overrides: Sequence[str] = (), *, run_dir: str | None = None) -> TrainConfig:
    """Compose ``conf/eval.yaml`` with Hydra overrides and return the validated config (tests, usp-launch)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    check_conf_dir()
    register_configs()
    overrides = expand_length_overrides(list(overrides))
    check_override_keys(overrides, TrainConfig, config_groups())
    if GlobalHydra.instance().is_initialized():
        GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=VERSION_BASE, job_name="usp-eval"):
        cfg = compose(config_name=CONFIG_NAME, overrides=list(overrides))
    return to_eval_config(cfg, run_dir=run_dir)


def _task(dcfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    cfg = to_eval_config(dcfg, run_dir=HydraConfig.get().runtime.output_dir)
    from usp.eval.runner import run  # lazy: composing and validating need no torch/transformers

    run(cfg)


def main() -> None:
    """Console script ``usp-eval``: parse Hydra overrides from ``sys.argv`` and evaluate (a bad setting: said
    once, exit 2; other failures land in torchrun's error file too, elastic's ``record``)."""
    from torch.distributed.elastic.multiprocessing.errors import record  # lazy: composing needs no torch

    record(_main)()


def _main() -> None:
    run_hydra_app(_task, config_name=CONFIG_NAME, prog="usp-eval")


if __name__ == "__main__":
    main()
