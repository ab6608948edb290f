"""The training entry point: ``python -m usp.train`` / ``usp-train``, a Hydra app composing ``conf/train.yaml``.

    torchrun --standalone --nproc-per-node 4 -m usp.train recipe=tiny hydra.run.dir=outputs/demo

Parse, compose, run. :func:`usp.config.compose.run_hydra_app` parses the command line and starts Hydra;
:func:`usp.config.compose.to_run_config` turns the composed config into a typed, checked
:class:`usp.config.TrainConfig` once; the degrees are checked against the launched ``WORLD_SIZE`` /
``LOCAL_WORLD_SIZE`` and ``seq_len`` against the sequence layout (:func:`usp.config.validate_layout`: a bad
setting is reported before the trainer is imported), and only then is :func:`usp.train.trainer.run` called
with it, which resolves it once into a frozen layout and never changes it. Nothing below reads Hydra or the
environment for settings (the node size: :func:`usp.parallel.mesh.launched_world`).

Every rank composes the same config; only rank 0 (``RANK`` from the launcher) writes Hydra's ``.hydra/``
files and its log, and every rank gets the same absolute ``run_dir`` (``hydra.run.dir``, where
``metrics.jsonl`` and checkpoints go).
"""

from __future__ import annotations

import sys

from omegaconf import DictConfig

from usp.config import validate_layout
from usp.config.compose import TRAIN_CONFIG, run_hydra_app, to_run_config
from usp.startup.error_file import record_failure

REQUEUE_EXIT_CODE = 75
"""Exit status of a run stopped by SIGTERM/SIGUSR1/SIGINT once its checkpoint is saved (the same number as
``usp.train.signals.REQUEUE_EXIT_CODE``, which this module does not import: composing needs no torch)."""


def _task(dcfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    cfg = to_run_config(dcfg, config_name=TRAIN_CONFIG, run_dir=HydraConfig.get().runtime.output_dir)
    from usp.parallel.mesh import launched_world  # lazy: torch is not needed to compose a config

    world_size, local_world_size = launched_world()
    validate_layout(cfg, world_size=world_size, local_world_size=local_world_size)
    from usp.train.trainer import run  # lazy: composing and validating need no torch/transformers

    result = run(cfg)
    if isinstance(result, dict) and result.get("preempted"):  # the reason, in torchrun's summary too
        record_failure(
            RuntimeError(
                f"stopped by a signal after saving {result['checkpoint']} (step {result['final_step']}); exit "
                f"status {REQUEUE_EXIT_CODE}: requeue, or relaunch with the same run dir, to continue from it"
            )
        )
        sys.exit(REQUEUE_EXIT_CODE)


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


def _main() -> None:
    run_hydra_app(_task, config_name=TRAIN_CONFIG, prog="usp-train", record=record_failure)


if __name__ == "__main__":
    main()
