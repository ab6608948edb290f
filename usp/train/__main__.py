"""The training entry point: ``python -m usp.train`` / ``usp-train``, a Hydra app composing ``conf/train.yaml``.

    torchrun --standalone --nproc-per-node 4 -m usp.train recipe=tiny hydra.run.dir=outputs/demo

Hydra stays here. The composed config becomes a typed :class:`usp.config.TrainConfig` once
(``OmegaConf.to_object`` over the ``train_schema`` stored in Hydra's ConfigStore), is checked (enum fields,
then the degrees against the launched ``WORLD_SIZE`` / ``LOCAL_WORLD_SIZE`` and ``seq_len`` against the
sequence layout: a bad setting is reported before torch is imported), and only then is
:func:`usp.train.trainer.run` called with it, which resolves it once into a frozen layout
(:func:`usp.train.validate.validate`) and never changes it. Nothing below reads Hydra or the environment for
settings (the node size: :func:`usp.parallel.mesh.launched_world`).

Every rank composes the same config; only rank 0 (``RANK`` from the launcher) writes Hydra's ``.hydra/``
files and its log, and every rank gets the same absolute ``run_dir`` (``hydra.run.dir``, where
``metrics.jsonl`` and checkpoints go).
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable, Sequence
from datetime import datetime
from pathlib import Path
from typing import NoReturn

from omegaconf import DictConfig, OmegaConf

from usp.config import TrainConfig, validate_choices, validate_layout
from usp.config_keys import check_composed_keys, check_override_keys
from usp.units import expand_length_overrides

REQUEUE_EXIT_CODE = 75
"""Exit status of a run stopped by SIGTERM/SIGUSR1/SIGINT once its checkpoint is saved (the same number as
``usp.train.signals.REQUEUE_EXIT_CODE``, which this module does not import: composing needs no torch)."""
CONF_DIR: Path = Path(__file__).resolve().parents[2] / "conf"
"""The config groups (a source checkout; ``conf/recipe`` links to the top-level ``recipes/``)."""
CONFIG_NAME = "train"
VERSION_BASE = "1.3"
_MISSING_HINTS: dict[str, str] = {
    "model.path": "model.path=/ckpt/Llama-3.1-8B (a local Hugging Face checkpoint dir: config.json, "
    "*.safetensors, tokenizer files)",
    "data.prepared_path": "data.prepared_path=/data/long-128k (a usp-prepare-data output), or data=jsonl "
    "'data.inputs=[/data/a.jsonl]' to tokenize and pack at start-up",
    "data.inputs": "'data.inputs=[/data/a.jsonl,/data/b.parquet]' (local files) or '[owner/dataset]' (hub)",
}


RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
"""What ``run_name`` may be: one path component (it names ``outputs/<run_name>``)."""


def _run_id(run_name: str | None = None) -> str:
    """A run-dir name every rank computes identically.

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
        OmegaConf.register_new_resolver("usp_run_id", _run_id)


def check_conf_dir() -> None:
    if not (CONF_DIR / f"{CONFIG_NAME}.yaml").is_file():
        raise FileNotFoundError(
            f"usp's config groups are not at {CONF_DIR}: usp-train runs from a source checkout "
            "(pip install -e .), where conf/ and recipes/ sit next to the usp package."
        )


def config_groups() -> list[str]:
    """The config-group names under ``conf/`` (``recipe``, ``model``, ...): ``group=option`` overrides."""
    return sorted(p.name for p in CONF_DIR.iterdir() if p.is_dir())


def to_train_config(cfg: DictConfig, *, run_dir: str | None = None) -> TrainConfig:
    """The composed DictConfig -> a validated :class:`TrainConfig` (the one conversion of a run).

    ``run_dir`` (absolute) is set first, so ``${run_dir}`` interpolations in the groups resolve to it.
    Raises ``ValueError`` naming the setting and the valid values for a bad enum field or a missing path, and
    for a key the schema does not have (``+trainer.gradient_accumulation_steps=4``), naming the real key.
    """
    cfg = cfg.copy()
    if run_dir is not None:
        cfg.run_dir = str(Path(run_dir).resolve())
    check_composed_keys(cfg, TrainConfig)
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        raise ValueError(
            "these settings have no value (??? in the config): "
            + "; ".join(_MISSING_HINTS.get(key, f"{key}=...") for key in missing)
        )
    schema = OmegaConf.structured(TrainConfig)
    typed = OmegaConf.merge(schema, cfg)  # no-op when cfg already carries the schema; types it otherwise
    obj = OmegaConf.to_object(typed)
    assert isinstance(obj, TrainConfig), type(obj)
    validate_choices(obj)
    return obj


def compose_config(overrides: Sequence[str] = (), *, run_dir: str | None = None) -> TrainConfig:
    """Compose ``conf/train.yaml`` with Hydra overrides (``["recipe=tiny", "trainer.max_steps=5"]``) and
    return the validated :class:`TrainConfig`, without launching anything (tests, ``usp-plan``, tools).

    The degrees are not checked against a world size here: call :func:`usp.config.validate_layout` for that.
    Unknown recipes or group options raise Hydra's ``MissingConfigException`` listing the valid options.
    """
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    check_conf_dir()
    register_configs()
    overrides = expand_length_overrides(list(overrides))
    check_override_keys(overrides, TrainConfig, config_groups())
    if GlobalHydra.instance().is_initialized():  # e.g. called from inside a running Hydra app
        GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=VERSION_BASE, job_name="usp"):
        cfg = compose(config_name=CONFIG_NAME, overrides=list(overrides))
    return to_train_config(cfg, run_dir=run_dir)


def fail_once(err: BaseException, prog: str = "usp-train", *, verbose: bool = False) -> NoReturn:
    """End the run on ``err``: :func:`usp.errors.report`'s one ``<prog>: error:`` line (once: rank 0 first,
    the other ranks after :data:`usp.errors.REPORT_GRACE_S`), the traceback in rank 0's log file (stderr too
    with ``--verbose``), and the reason in torchrun's error file (``TORCHELASTIC_ERROR_FILE``: its failure
    summary shows it as the root cause). Exit status 2 for a bad setting, 130 for an interrupt, 1 otherwise.
    """
    from usp.errors import one_line, report

    def record(e: BaseException) -> None:
        from usp.train.elastic import record_error

        record_error(RuntimeError(one_line(e)) if not isinstance(e, ValueError) else e, with_traceback=False)

    sys.exit(report(prog, err, verbose=verbose, record=record))


def _task(dcfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    cfg = to_train_config(dcfg, run_dir=HydraConfig.get().runtime.output_dir)
    from usp.parallel.mesh import launched_world  # lazy: torch is not needed to compose a config

    world_size, local_world_size = launched_world()
    validate_layout(cfg, world_size=world_size, local_world_size=local_world_size)
    from usp.train.trainer import run  # lazy: composing and validating need no torch/transformers

    result = run(cfg)
    if isinstance(result, dict) and result.get("preempted"):  # the reason, in torchrun's summary too
        from usp.train.elastic import record_error

        record_error(
            RuntimeError(
                f"stopped by a signal after saving {result['checkpoint']} (step {result['final_step']}); exit "
                f"status {REQUEUE_EXIT_CODE}: requeue, or relaunch with the same run dir, to continue from it"
            ),
            with_traceback=False,
        )
        sys.exit(REQUEUE_EXIT_CODE)


def _rank_overrides(rank: int) -> list[str]:
    """Overrides added on ranks > 0: no ``.hydra/`` output files, no Hydra log handlers (rank 0 logs)."""
    if rank == 0:
        return []
    return ["hydra.output_subdir=null", "hydra/job_logging=none", "hydra/hydra_logging=none"]


def main() -> None:
    """Console script ``usp-train``: parse Hydra overrides from ``sys.argv`` and train.

    Exit status: 0 done; 2 a bad setting (the message on stderr and in torchrun's error file);
    :data:`REQUEUE_EXIT_CODE` stopped by SIGTERM/SIGUSR1/SIGINT (Ctrl-C) after saving a checkpoint (requeue or
    relaunch to continue); 130 interrupted before the loop could checkpoint; 1 anything else. Every failure is
    one ``usp-train: error:`` line (:mod:`usp.errors`); its traceback is in ``<run dir>/usp-train.log``, and on
    stderr with ``--verbose``.
    """
    from torch.distributed.elastic.multiprocessing.errors import record  # lazy: composing needs no torch

    record(_main)()


HYDRA_FLAGS = ("--cfg", "-c", "--help", "-h", "--hydra-help", "--info", "-i", "--multirun", "-m", "--shell-completion",
               "--run", "-r", "--package", "-p", "--resolve", "--config-path", "-cp", "--config-name", "-cn",
               "--config-dir", "-cd", "--experimental-rerun")  # fmt: skip
"""Hydra's own command-line flags: with one of them the app prints or inspects instead of running."""


def hydra_run_dir(overrides: Sequence[str], config_name: str = CONFIG_NAME) -> str:
    """``hydra.run.dir`` as the app will get it for ``overrides`` (a recipe's pin, an override, or the default
    ``outputs/<run id>``), composed with Hydra's config but without starting the app."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    register_configs()
    if GlobalHydra.instance().is_initialized():
        GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=VERSION_BASE, job_name="usp"):
        cfg = compose(config_name=config_name, overrides=list(overrides), return_hydra_config=True)
    GlobalHydra.instance().clear()
    return str(cfg.hydra.run.dir)


def check_run_dir_writable(overrides: Sequence[str], config_name: str = CONFIG_NAME) -> str:
    """Preflight of ``hydra.run.dir`` (Hydra creates it and writes ``.hydra/`` before usp runs, so an
    unwritable one would fail inside Hydra): ``ValueError`` naming ``hydra.run.dir``, the path and the OS
    error. Returns the run dir."""
    from usp.errors import check_writable_dir

    run_dir = hydra_run_dir(overrides, config_name)
    check_writable_dir(run_dir, "hydra.run.dir")
    return run_dir


def run_hydra_app(task: Callable[[DictConfig], None], *, config_name: str, prog: str) -> None:
    """Run ``task`` as the Hydra app composing ``conf/<config_name>.yaml`` from ``sys.argv`` (the one
    start-up of ``usp-train`` and ``usp-eval``): ``--verbose`` is taken off the command line; the override keys
    and the run dir's writability are checked first; ranks > 0 write no ``.hydra/`` files or logs; and every
    failure of ``task`` ends in :func:`fail_once`'s one line (a bad setting: exit 2)."""
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
        fail_once(err, prog, verbose=verbose)
    sys.argv.extend(_rank_overrides(int(os.environ.get("RANK", "0"))))

    def guarded(dcfg: DictConfig) -> None:
        try:
            task(dcfg)
        except (Exception, KeyboardInterrupt) as err:  # noqa: BLE001 - the one report of every failure
            fail_once(err, prog, verbose=verbose)

    guarded.__module__, guarded.__qualname__ = task.__module__, task.__qualname__
    hydra.main(version_base=VERSION_BASE, config_path=str(CONF_DIR), config_name=config_name)(guarded)()


def _main() -> None:
    run_hydra_app(_task, config_name=CONFIG_NAME, prog="usp-train")


if __name__ == "__main__":
    main()
