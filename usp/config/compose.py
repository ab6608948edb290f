"""Hydra composition, once for every entry point: ``conf/train.yaml`` (``usp-train``) and ``conf/eval.yaml``
(``usp-eval``, the training config plus the ``eval=`` task) become a checked :class:`usp.config.TrainConfig`.

Hydra stays here and in the entry points that call it. The composed config becomes the typed dataclass once
(``OmegaConf.to_object`` over the ``train_schema`` stored in Hydra's ConfigStore), keys the schema does not
have are refused (:mod:`usp.config.keys`), and the enum fields are checked (:func:`usp.config.validate_choices`).

- :func:`compose_run_config` (overrides -> config, without launching: tests, ``usp-launch``, ``usp-plan``,
  benchmarks) and :func:`to_run_config` (an app's composed ``DictConfig`` -> config), each for
  ``config_name="train"`` or ``"eval"``; :func:`compose_config` / :func:`compose_eval_config` and
  :func:`to_train_config` / :func:`to_eval_config` are those two calls with the name filled in;
- :func:`run_id` (the ``${usp_run_id:}`` resolver behind the default ``hydra.run.dir``), :func:`hydra_run_dir`,
  :func:`check_run_dir_writable`;
- :func:`run_hydra_app`: the start-up of ``usp-train`` and ``usp-eval`` (override keys and run dir checked
  first, ranks > 0 write no Hydra files, every failure said once by :func:`fail_once`).

Torch-free: composing and checking a config imports neither torch nor transformers.
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import NoReturn

from omegaconf import DictConfig, OmegaConf

from usp.config.checks import validate_choices
from usp.config.keys import check_composed_keys, check_override_keys
from usp.config.schema import DataConfig, TrainConfig
from usp.units import expand_length_overrides

CONF_DIR: Path = Path(__file__).resolve().parents[2] / "conf"
"""The config groups (a source checkout; ``conf/recipe`` links to the top-level ``recipes/``)."""
TRAIN_CONFIG = "train"
EVAL_CONFIG = "eval"
VERSION_BASE = "1.3"


@dataclasses.dataclass(frozen=True)
class _Entry:
    """What differs between the entry points' compositions (``conf/<name>.yaml``)."""

    job_name: str
    needs_data: bool
    """False (evaluation): ``data.*`` left at ``???`` (a recipe's prepared data path) become empty, and the
    data settings are not checked: evaluation reads no training data."""
    missing_hints: Mapping[str, str]
    """The fix shown for a setting left at ``???``."""


_ENTRIES: dict[str, _Entry] = {
    TRAIN_CONFIG: _Entry(
        job_name="usp",
        needs_data=True,
        missing_hints={
            "model.path": "model.path=/ckpt/Llama-3.1-8B (a local Hugging Face checkpoint dir: config.json, "
            "*.safetensors, tokenizer files)",
            "data.prepared_path": "data.prepared_path=/data/long-128k (a usp-prepare-data output), or data=jsonl "
            "'data.inputs=[/data/a.jsonl]' to tokenize and pack at start-up",
            "data.inputs": "'data.inputs=[/data/a.jsonl,/data/b.parquet]' (local files) or '[owner/dataset]' (hub)",
        },
    ),
    EVAL_CONFIG: _Entry(
        job_name="usp-eval",
        needs_data=False,
        missing_hints={"model.path": "model.path=<a training run's hf/ export, or a checkpoint dir>"},
    ),
}

RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
"""What ``run_name`` may be: one path component (it names ``outputs/<run_name>``)."""


def run_id(run_name: str | None = None) -> str:
    """A run-dir name every rank computes identically (the ``${usp_run_id:}`` resolver).

    ``run_name`` (the config's ``run_name``; ``launch/slurm.sbatch`` sets it to a named job's name) wins: a
    stable name, so a relaunched, requeued or resubmitted job continues in the same run dir. Otherwise:

    torchrun's rendezvous id first: ``srun torchrun --rdzv-id $SLURM_JOB_ID`` (the multi-node launcher) gives
    ``slurm-<job id>``, so a requeued job resumes from its own checkpoints; ``torchrun --standalone`` makes a
    fresh id per launch, so separate experiments inside one ``salloc`` never share a run dir (and
    ``trainer.resume=auto`` never picks up another run). Then the SLURM job id (a launcher-less
    ``python -m usp.train`` inside a job), else a timestamp (one process only).
    """
    if run_name not in (None, ""):
        if not RUN_NAME.fullmatch(str(run_name)) or str(run_name) in (".", ".."):
            raise ValueError(
                f"run_name={run_name!r} is invalid: use letters, digits, '.', '_' and '-' (it names the run dir "
                f"outputs/<run_name>), or set hydra.run.dir=/path/of/the/run."
            )
        return str(run_name)
    job = os.environ.get("SLURM_JOB_ID", "")
    rdzv = os.environ.get("TORCHELASTIC_RUN_ID", "")
    if rdzv and rdzv != "none":
        return f"slurm-{job}" if rdzv == job else f"torchrun-{rdzv}"
    if job:
        return f"slurm-{job}"
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ValueError(
            "cannot pick a run dir that every rank agrees on (no SLURM_JOB_ID, and torchrun was started "
            "without --rdzv-id): set hydra.run.dir=/shared/path/run-name on the command line."
        )
    return datetime.now().strftime("%Y-%m-%d_%H-%M-%S")


def register_configs() -> None:
    """Store the typed schema in Hydra's ConfigStore and register the run-id resolver (idempotent)."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="train_schema", node=TrainConfig)
    if not OmegaConf.has_resolver("usp_run_id"):
        OmegaConf.register_new_resolver("usp_run_id", run_id)


def check_conf_dir() -> None:
    if not (CONF_DIR / f"{TRAIN_CONFIG}.yaml").is_file():
        raise FileNotFoundError(
            f"usp's config groups are not at {CONF_DIR}: usp-train runs from a source checkout "
            "(pip install -e .), where conf/ and recipes/ sit next to the usp package."
        )


def config_groups() -> list[str]:
    """The config-group names under ``conf/`` (``recipe``, ``model``, ...): ``group=option`` overrides."""
    return sorted(p.name for p in CONF_DIR.iterdir() if p.is_dir())


def _entry(config_name: str) -> _Entry:
    if config_name not in _ENTRIES:
        raise ValueError(
            f"config_name={config_name!r} is not an entry point's config; use one of {sorted(_ENTRIES)}."
        )
    return _ENTRIES[config_name]


def to_run_config(
    cfg: DictConfig, *, config_name: str = TRAIN_CONFIG, run_dir: str | None = None
) -> TrainConfig:
    """The composed DictConfig of ``conf/<config_name>.yaml`` -> a checked :class:`TrainConfig` (the one
    conversion of a run).

    ``run_dir`` (absolute) is set first, so ``${run_dir}`` interpolations in the groups resolve to it.
    Raises ``ValueError`` naming the setting and the valid values for a bad enum field or a missing path, and
    for a key the schema does not have (``+trainer.gradient_accumulation_steps=4``), naming the real key.
    For ``eval`` the training data settings may stay unset (they become empty) and are not checked; the
    ``eval.*`` ones are checked by the evaluation runner.
    """
    entry = _entry(config_name)
    cfg = cfg.copy()
    if run_dir is not None:
        cfg.run_dir = str(Path(run_dir).resolve())
    check_composed_keys(cfg, TrainConfig)
    if not entry.needs_data:
        for key in OmegaConf.missing_keys(cfg):
            if key.startswith("data."):
                OmegaConf.update(cfg, key, [] if key == "data.inputs" else None)
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        raise ValueError(
            "these settings have no value (??? in the config): "
            + "; ".join(entry.missing_hints.get(key, f"{key}=...") for key in missing)
        )
    typed = OmegaConf.merge(
        OmegaConf.structured(TrainConfig), cfg
    )  # types cfg (a no-op if it has the schema)
    obj = OmegaConf.to_object(typed)
    assert isinstance(obj, TrainConfig), type(obj)
    # evaluation reads no training data: everything else is checked as the trainer would
    validate_choices(
        obj if entry.needs_data else dataclasses.replace(obj, data=DataConfig(build_tiny_corpus=True))
    )
    return obj


def _compose(config_name: str, overrides: Sequence[str], *, return_hydra_config: bool = False) -> DictConfig:
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    register_configs()
    if GlobalHydra.instance().is_initialized():  # e.g. called from inside a running Hydra app
        GlobalHydra.instance().clear()
    with initialize_config_dir(
        config_dir=str(CONF_DIR), version_base=VERSION_BASE, job_name=_entry(config_name).job_name
    ):
        cfg = compose(
            config_name=config_name, overrides=list(overrides), return_hydra_config=return_hydra_config
        )
    GlobalHydra.instance().clear()
    return cfg


def compose_run_config(
    overrides: Sequence[str] = (), *, config_name: str = TRAIN_CONFIG, run_dir: str | None = None
) -> TrainConfig:
    """Compose ``conf/<config_name>.yaml`` (``train`` or ``eval``) with Hydra overrides
    (``["recipe=tiny", "trainer.max_steps=5"]``; lengths like ``trainer.seq_len=128K`` are expanded) and return
    the checked :class:`TrainConfig` (:func:`to_run_config`), without launching anything.

    The degrees are not checked against a world size here: call :func:`usp.config.validate_layout` for that.
    Unknown recipes or group options raise Hydra's ``MissingConfigException`` listing the valid options.
    """
    _entry(config_name)
    check_conf_dir()
    register_configs()
    overrides = expand_length_overrides(list(overrides))
    check_override_keys(overrides, TrainConfig, config_groups())
    cfg = _compose(config_name, overrides)
    return to_run_config(cfg, config_name=config_name, run_dir=run_dir)


def compose_config(overrides: Sequence[str] = (), *, run_dir: str | None = None) -> TrainConfig:
    """:func:`compose_run_config` of ``conf/train.yaml``: the run config ``usp-train`` gets."""
    return compose_run_config(overrides, config_name=TRAIN_CONFIG, run_dir=run_dir)


def compose_eval_config(overrides: Sequence[str] = (), *, run_dir: str | None = None) -> TrainConfig:
    """:func:`compose_run_config` of ``conf/eval.yaml``: the run config ``usp-eval`` gets."""
    return compose_run_config(overrides, config_name=EVAL_CONFIG, run_dir=run_dir)


def to_train_config(cfg: DictConfig, *, run_dir: str | None = None) -> TrainConfig:
    """:func:`to_run_config` for training."""
    return to_run_config(cfg, config_name=TRAIN_CONFIG, run_dir=run_dir)


def to_eval_config(cfg: DictConfig, *, run_dir: str | None = None) -> TrainConfig:
    """:func:`to_run_config` for evaluation (the ``data.*`` settings may stay unset)."""
    return to_run_config(cfg, config_name=EVAL_CONFIG, run_dir=run_dir)


HYDRA_FLAGS = (
    "--cfg",
    "-c",
    "--help",
    "-h",
    "--hydra-help",
    "--info",
    "-i",
    "--multirun",
    "-m",
    "--shell-completion",
    "--run",
    "-r",
    "--package",
    "-p",
    "--resolve",
    "--config-path",
    "-cp",
    "--config-name",
    "-cn",
    "--config-dir",
    "-cd",
    "--experimental-rerun",
)
"""Hydra's own command-line flags: with one of them the app prints or inspects instead of running."""


def hydra_run_dir(overrides: Sequence[str], config_name: str = TRAIN_CONFIG) -> str:
    """``hydra.run.dir`` as the app will get it for ``overrides`` (a recipe's pin, an override, or the default
    ``outputs/<run id>``), composed with Hydra's config but without starting the app."""
    return str(_compose(config_name, overrides, return_hydra_config=True).hydra.run.dir)


def check_run_dir_writable(overrides: Sequence[str], config_name: str = TRAIN_CONFIG) -> str:
    """Preflight of ``hydra.run.dir`` (Hydra creates it and writes ``.hydra/`` before usp runs, so an
    unwritable one would fail inside Hydra): ``ValueError`` naming ``hydra.run.dir``, the path and the OS
    error. Returns the run dir."""
    from usp.errors import check_writable_dir

    run_dir = hydra_run_dir(overrides, config_name)
    check_writable_dir(run_dir, "hydra.run.dir")
    return run_dir


Record = Callable[[BaseException], None]
"""Writes an error where the launcher shows it (torchrun's error file); given the error to show."""


def fail_once(
    err: BaseException, prog: str, *, verbose: bool = False, record: Record | None = None
) -> NoReturn:
    """End the run on ``err``: :func:`usp.errors.report`'s one ``<prog>: error:`` line (once: rank 0 first,
    the other ranks after :data:`usp.errors.REPORT_GRACE_S`), the traceback in rank 0's log file (stderr too
    with ``--verbose``), and the reason given to ``record`` (a ``ValueError`` as it is, anything else as its
    one line). Exit status 2 for a bad setting, 130 for an interrupt, 1 otherwise.
    """
    from usp.errors import one_line, report

    def record_reason(e: BaseException) -> None:
        if record is not None:
            record(e if isinstance(e, ValueError) else RuntimeError(one_line(e)))

    sys.exit(report(prog, err, verbose=verbose, record=record_reason))


def _rank_overrides(rank: int) -> list[str]:
    """Overrides added on ranks > 0: no ``.hydra/`` output files, no Hydra log handlers (rank 0 logs)."""
    if rank == 0:
        return []
    return ["hydra.output_subdir=null", "hydra/job_logging=none", "hydra/hydra_logging=none"]


def run_hydra_app(
    task: Callable[[DictConfig], None], *, config_name: str, prog: str, record: Record | None = None
) -> None:
    """Run ``task`` as the Hydra app composing ``conf/<config_name>.yaml`` from ``sys.argv`` (the one
    start-up of ``usp-train`` and ``usp-eval``): ``--verbose`` is taken off the command line; the override keys
    and the run dir's writability are checked first; ranks > 0 write no ``.hydra/`` files or logs; and every
    failure of ``task`` ends in :func:`fail_once`'s one line (a bad setting: exit 2; ``record`` gets the
    reason)."""
    import hydra
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from usp.errors import pop_verbose

    argv = sys.argv[1:]
    verbose = pop_verbose(argv)
    argv = expand_length_overrides(argv)  # trainer.seq_len=128K, as usp-plan and usp-prepare-data take it
    sys.argv[1:] = argv
    check_conf_dir()
    register_configs()
    try:
        check_override_keys(argv, TrainConfig, config_groups())
        if not any(a.split("=", 1)[0] in HYDRA_FLAGS for a in argv):
            check_run_dir_writable(argv, config_name)
    except (HydraException, OmegaConfBaseException):
        pass  # Hydra itself reports a composition error (an unknown recipe, a bad value) with its options
    except ValueError as err:
        fail_once(err, prog, verbose=verbose, record=record)
    sys.argv.extend(_rank_overrides(int(os.environ.get("RANK", "0"))))

    def guarded(dcfg: DictConfig) -> None:
        try:
            task(dcfg)
        except (Exception, KeyboardInterrupt) as err:  # noqa: BLE001 - the one report of every failure
            fail_once(err, prog, verbose=verbose, record=record)

    guarded.__module__, guarded.__qualname__ = task.__module__, task.__qualname__
    hydra.main(version_base=VERSION_BASE, config_path=str(CONF_DIR), config_name=config_name)(guarded)()
