"""The run configuration: typed schema, its checks, its keys, and the one Hydra composition of the entry points.

Files:

- :mod:`usp.config.schema`: the dataclasses (:class:`TrainConfig` and its groups ``model``, ``data``,
  ``parallel``, ``optim``, ``trainer``, ``logging``, ``cluster``, ``eval``), the same names as the YAML groups
  under ``conf/`` and the command-line keys (``parallel.ulysses_degree=4``);
- :mod:`usp.config.checks`: :func:`validate_choices` (enum fields and ranges), :func:`validate_layout` (the
  degrees against a world size, ``seq_len`` against the sequence layout), :func:`states_on_host`,
  :func:`text_fields_per_input`;
- :mod:`usp.config.keys`: unknown keys are errors, naming the real key (or usp's name for a neighbouring
  tool's key);
- :mod:`usp.config.compose`: Hydra (``conf/train.yaml``, ``conf/eval.yaml``): the ConfigStore schema, the
  run-dir id, :func:`~usp.config.compose.compose_run_config` (overrides -> a checked config, for training or
  evaluation), :func:`~usp.config.compose.run_hydra_app` (the start-up of ``usp-train`` and ``usp-eval``).

Public surface: the schema classes and the checks are importable from here
(``from usp.config import TrainConfig, validate_choices, validate_layout``); composition is imported from
:mod:`usp.config.compose`, keys from :mod:`usp.config.keys`. Importing ``usp.config`` or
``usp.config.compose`` needs no torch or transformers (only :func:`validate_layout`, when called, imports
:mod:`usp.parallel`). This is the config layer: it imports base modules (``usp.modes``, ``usp.mlp_tiles``,
``usp.units``, ``usp.errors``) and :mod:`usp.parallel`, never data, planner, train, eval, bench or launch.
"""

from usp.config.checks import (
    DEVICES,
    DTYPES,
    PROCESS_GROUP_BACKENDS,
    REDUCE_DTYPES,
    WANDB_MODES,
    states_on_host,
    text_fields_per_input,
    validate_choices,
    validate_layout,
)
from usp.config.schema import (
    EVAL_TASKS,
    RULER_TASKS,
    ClusterConfig,
    DataConfig,
    DpoConfig,
    EvalConfig,
    LoggingConfig,
    LoraConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    PasskeyConfig,
    RulerConfig,
    TrainConfig,
    TrainerConfig,
    WandbConfig,
)

__all__ = [
    "DEVICES",
    "DTYPES",
    "EVAL_TASKS",
    "PROCESS_GROUP_BACKENDS",
    "REDUCE_DTYPES",
    "RULER_TASKS",
    "WANDB_MODES",
    "ClusterConfig",
    "DataConfig",
    "EvalConfig",
    "LoggingConfig",
    "DpoConfig",
    "LoraConfig",
    "ModelConfig",
    "OptimConfig",
    "ParallelConfig",
    "PasskeyConfig",
    "RulerConfig",
    "TrainConfig",
    "TrainerConfig",
    "WandbConfig",
    "states_on_host",
    "text_fields_per_input",
    "validate_choices",
    "validate_layout",
]
