"""``usp-launch ray``: the run under Ray Train, on a running Ray cluster or a local one.

::

    usp-launch ray [--address ADDR] [--nodes N] [--gpus-per-node G] [--cpu] [--max-restarts R]
                   [overrides...] [--dry-run]

It composes and checks the run like every mode (the trainer's layout checks for ``N x G`` ranks with node
size ``G``, the planner's memory estimate), then runs ``python -m usp.launch.ray_job ...``
(:mod:`usp.launch.ray_job`: a Ray Train ``TorchTrainer`` of ``N x G`` workers, each starting
``python -m usp.train OVERRIDES`` with torchrun's environment). ``--dry-run`` prints that command.

- Without ``--address`` a local Ray cluster starts on this machine: one node; ``--cpu --nproc-per-node N``
  runs N CPU workers on gloo (as ``usp-launch torchrun --cpu``), and without ``--cpu`` one worker per GPU.
- With ``--address`` (``auto``, ``ray://host:10001``, ``host:6379``) the job joins that cluster;
  ``--nodes`` / ``--gpus-per-node`` default to the run config's ``cluster.num_nodes`` /
  ``cluster.gpus_per_node``, as for ``usp-launch slurm``.
- The run dir is pinned: without ``hydra.run.dir`` or ``run_name`` on the command line, ``run_name=ray-<time>``
  is added, so every node and every restart uses the same run dir (on multi-node clusters, give a
  ``hydra.run.dir`` on storage every node shares).
- ``--max-restarts R``: after a worker fails, Ray Train restarts the whole group up to R times, and the ranks
  resume from the run dir's last checkpoint.

Ray Train is the optional extra ``usp[ray]``; without it the command stops with the install line.
"""

from __future__ import annotations

import argparse
import importlib.util
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from usp.launch import common, slurm, torchrun
from usp.launch.common import LaunchError
from usp.launch.overrides import find_override
from usp.launch.ray_job import INSTALL_HINT

NAME = "ray"
HELP = "Ray Train: a running Ray cluster (--address) or a local one"
JOB_MODULE = "usp.launch.ray_job"


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        NAME,
        help=HELP,
        description="Run the job under Ray Train (TorchTrainer): one worker per GPU (or per CPU process with "
        "--cpu), on the Ray cluster at --address or on a local one.",
        allow_abbrev=False,
    )
    p.add_argument(
        "--address",
        default=None,
        help="the Ray cluster to join (ray.init address: auto, host:6379, ray://host:10001); default: start a "
        "local one on this machine",
    )
    common.add_nproc_per_node(
        p,
        "workers (GPUs) per node (default: a local cluster's GPUs; with --address a cluster.gpus_per_node "
        "override, else the run config's cluster.gpus_per_node)",
    )
    common.add_nodes(
        p, "nodes (default: 1 locally; with --address a cluster.num_nodes override, else the run config's)"
    )
    common.add_cpu(p, "CPU workers on gloo (with --nproc-per-node N)")
    common.add_max_restarts(
        p,
        "restart all workers up to R times after one fails (Ray Train's max_failures); they resume from the "
        "last checkpoint (default 0)",
    )
    slurm.add_slurm_only_arguments(p, hidden=True)
    common.add_common_arguments(p)
    return p


def pinned_run_name(overrides: Sequence[str], now: float | None = None) -> list[str]:
    """``overrides``, plus ``run_name=ray-<date>-<time>`` when they set neither ``hydra.run.dir`` nor
    ``run_name``: every node and every restart must write to one run dir."""
    if find_override(overrides, "hydra.run.dir") is not None or find_override(overrides, "run_name"):
        return list(overrides)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    return [*overrides, f"run_name=ray-{stamp}"]


def command(
    args: argparse.Namespace, overrides: list[str], env: Mapping[str, str], hydra_flags: Sequence[str] = ()
) -> list[str]:
    """``python -m usp.launch.ray_job ...`` for what ``args`` asks, after every check."""
    common.check_counts(nproc_per_node=args.nproc_per_node, nodes=args.nodes, max_restarts=args.max_restarts)
    given = common.given_flags(args, slurm.SLURM_ONLY)
    if given:
        raise LaunchError(f"{', '.join(given)}: only for `usp-launch slurm`.")
    if hydra_flags:
        raise LaunchError(
            "Hydra's own flags after -- print instead of training: run them with `usp-launch local`, not on a "
            "Ray cluster."
        )
    local = args.address is None
    if local and args.nodes not in (None, 1):
        raise LaunchError(
            f"--nodes={args.nodes}: without --address the Ray cluster is a local one on this machine (1 node). "
            f"Start Ray on the {args.nodes} nodes and pass --address (e.g. --address auto on the head node)."
        )
    request = common.prepare(
        pinned_run_name(overrides),
        cpu=args.cpu,
        entry=args.entry,
        memory=not args.skip_memory_check,
        on_this_machine=local,
    )
    if local:
        nodes, nproc = 1, torchrun.processes_per_node(args.nproc_per_node, cpu=args.cpu)
    else:
        cfg = request.cfg
        nodes = common.flag_or_cluster(args.nodes, "--nodes", overrides, "cluster.num_nodes", cfg)
        nproc = common.flag_or_cluster(
            args.nproc_per_node, "--gpus-per-node", overrides, "cluster.gpus_per_node", cfg
        )
        nodes, nproc = nodes or cfg.cluster.num_nodes, nproc or cfg.cluster.gpus_per_node
    request.check(nodes=nodes, nproc_per_node=nproc)
    from usp.config.compose import hydra_run_dir

    run_dir = Path(hydra_run_dir(request.overrides, "eval" if args.entry == "eval" else "train")).absolute()
    return [
        "python",
        "-m",
        JOB_MODULE,
        *(["--address", args.address] if args.address else []),
        "--nodes",
        str(nodes),
        "--nproc-per-node",
        str(nproc),
        *(["--cpu"] if args.cpu else []),
        *(["--max-restarts", str(args.max_restarts)] if args.max_restarts else []),
        "--module",
        request.module,
        "--name",
        run_dir.name,
        "--",
        *request.overrides,
    ]


def run(
    args: argparse.Namespace, overrides: list[str], env: Mapping[str, str], hydra_flags: Sequence[str] = ()
) -> int:
    """``usp-launch ray``: print (``--dry-run``) or run :func:`command`; the exit status."""
    cmd = command(args, overrides, env, hydra_flags)
    if not args.dry_run and importlib.util.find_spec("ray") is None:
        raise LaunchError(f"`usp-launch ray` needs Ray Train, which is not installed: {INSTALL_HINT}")
    return common.launch(cmd, dry_run=args.dry_run)
