"""The evaluation entry point: ``python -m usp.eval`` / ``usp-eval``, a Hydra app composing ``conf/eval.yaml``.

    torchrun --standalone --nproc-per-node 4 -m usp.eval recipe=tiny model.path=outputs/demo/hf eval=passkey \\
        hydra.run.dir=outputs/demo

``conf/eval.yaml`` is ``conf/train.yaml`` (the same recipes and groups: a recipe's model, parallel and cluster
settings carry over) plus Hydra's help and job name. The task is the ``eval=`` group (``ppl``, ``passkey``, ``ruler``).
Parse, compose, run: :func:`usp.config.compose.run_hydra_app` starts Hydra, the composed config becomes a
typed :class:`usp.config.TrainConfig` once (:func:`usp.config.compose.to_run_config`; the training data
settings may stay unset: evaluation reads none of them), its choices are checked, and
:func:`usp.eval.runner.run` gets it.
"""

from __future__ import annotations

from omegaconf import DictConfig

from usp.config.compose import EVAL_CONFIG, run_hydra_app, to_run_config
from usp.startup.error_file import record_failure


def _task(dcfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    cfg = to_run_config(dcfg, config_name=EVAL_CONFIG, run_dir=HydraConfig.get().runtime.output_dir)
    from usp.eval.runner import run  # lazy: composing and validating need no torch/transformers

    run(cfg)


def main() -> None:
    """Console script ``usp-eval``: parse Hydra overrides from ``sys.argv`` and evaluate (a bad setting: said
    once, exit 2; other failures land in torchrun's error file too, elastic's ``record``)."""
    from torch.distributed.elastic.multiprocessing.errors import record  # lazy: composing needs no torch

    record(_main)()


def _main() -> None:
    run_hydra_app(_task, config_name=EVAL_CONFIG, prog="usp-eval", record=record_failure)


if __name__ == "__main__":
    main()
