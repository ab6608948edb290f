"""``usp-launch slurm``: several nodes under SLURM.

::

    usp-launch slurm [--nodes N] [--gpus-per-node G] [--partition P] [--time T] [--account A]
                     [--job-name J] [--gres] [--submit] [--script PATH] [--max-restarts R] [overrides...]
                     [--dry-run]

Outside an allocation it submits ``launch/slurm.sbatch`` with sbatch (:func:`sbatch`); inside one
(``SLURM_JOB_ID`` set, e.g. under salloc) it runs ``srun ... torchrun ...`` directly, as the script would
(:func:`srun_in_allocation`), unless ``--submit``. Without ``--nodes`` / ``--gpus-per-node``, the run config's
``cluster.num_nodes`` / ``cluster.gpus_per_node`` (the size the recipe declares, or a ``cluster.*`` override)
size the sbatch job.

The sbatch-only flags (:data:`SLURM_ONLY`) are this mode's; :func:`add_slurm_only_arguments` and
:func:`refuse_on_this_machine` let the modes that run on this machine refuse them with a pointed message.
"""

from __future__ import annotations

import argparse
import re
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from usp.launch import commands, common
from usp.launch.common import LaunchError, RunRequest

NAME = "slurm"
HELP = "several nodes: sbatch, or srun inside an allocation"

SLURM_ONLY = ("partition", "time", "account", "job_name", "gres", "submit", "script")
"""The flags (dests) only ``usp-launch slurm`` takes."""
SBATCH_ONLY = ("partition", "time", "account", "job_name", "gres", "script")
"""Of :data:`SLURM_ONLY`, those that only a submission with sbatch uses (not srun inside an allocation)."""


def add_slurm_only_arguments(parser: argparse.ArgumentParser, *, hidden: bool = False) -> None:
    """The flags of :data:`SLURM_ONLY`; ``hidden`` (not in the help) for a mode that only refuses them."""

    def say(text: str) -> str:
        return argparse.SUPPRESS if hidden else text

    parser.add_argument("--partition", help=say("sbatch --partition"))
    parser.add_argument("--time", help=say("sbatch --time (e.g. 04:00:00)"))
    parser.add_argument("--account", help=say("sbatch --account"))
    parser.add_argument(
        "--job-name", dest="job_name", default=None, help=say("sbatch --job-name (default usp)")
    )
    parser.add_argument("--gres", action="store_true", help=say("request GPUs with --gres=gpu:N"))
    parser.add_argument(
        "--submit", action="store_true", help=say("submit with sbatch even inside an allocation")
    )
    parser.add_argument("--script", default=None, help=say("the batch script (default launch/slurm.sbatch)"))


def refuse_on_this_machine(given: Sequence[str], nodes: int | None, *, mode: str, where: str) -> None:
    """For a mode that runs on this machine (``mode``; it ``runs {where}``): no :data:`SLURM_ONLY` flag
    (``given``, as :func:`usp.launch.common.given_flags` spells them), and one node at most."""
    if given:
        raise LaunchError(f"{', '.join(given)}: only for `usp-launch slurm`; `{mode}` runs {where}.")
    if nodes not in (None, 1):
        raise LaunchError(
            f"--nodes={nodes}: `{mode}` starts processes on this machine only. "
            f"For {nodes} nodes use `usp-launch slurm --nodes {nodes}`."
        )


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        NAME,
        help=HELP,
        description="Submit launch/slurm.sbatch with sbatch, or inside a SLURM allocation run srun + torchrun on "
        "all of its nodes.",
        allow_abbrev=False,
    )
    common.add_nproc_per_node(
        p,
        "GPUs (processes) per node (default: a cluster.gpus_per_node override, else the allocation's "
        "SLURM_GPUS_ON_NODE, else the run config's cluster.gpus_per_node, the recipe's)",
    )
    common.add_nodes(
        p,
        "number of nodes (default: a cluster.num_nodes override, else the allocation's SLURM_NNODES, else the "
        "run config's cluster.num_nodes, the recipe's)",
    )
    add_slurm_only_arguments(p)
    common.add_max_restarts(
        p,
        "restart all ranks up to R times after one fails; they resume from the last checkpoint (default 0)",
    )
    common.add_cpu(p, argparse.SUPPRESS)  # taken only to refuse it: SLURM runs use GPUs
    common.add_common_arguments(p)
    return p


def command(
    args: argparse.Namespace, overrides: list[str], env: Mapping[str, str], hydra_flags: Sequence[str] = ()
) -> list[str]:
    """The sbatch (or, inside an allocation, srun) command ``args`` asks for, after every check."""
    common.check_counts(nproc_per_node=args.nproc_per_node, nodes=args.nodes, max_restarts=args.max_restarts)
    if args.cpu:
        raise LaunchError("--cpu applies to local and torchrun; SLURM runs use GPUs (drop --cpu).")
    request = common.prepare(
        overrides,
        hydra_flags,
        entry=args.entry,
        memory=not args.skip_memory_check,
        on_this_machine=False,
    )
    job_id = env.get("SLURM_JOB_ID")
    if job_id and not args.submit:
        sbatch_only = common.given_flags(args, SBATCH_ONLY)
        if sbatch_only:
            raise LaunchError(
                f"{', '.join(sbatch_only)} are sbatch options, but this shell is inside SLURM job {job_id}, "
                f"where usp-launch runs srun directly. Add --submit to queue a new job with sbatch instead."
            )
        return srun_in_allocation(
            request,
            env,
            job_id,
            nodes=args.nodes,
            nproc_per_node=args.nproc_per_node,
            max_restarts=args.max_restarts,
        )
    options = SbatchOptions(
        partition=args.partition,
        time=args.time,
        account=args.account,
        job_name=args.job_name,
        gres=args.gres,
        script=args.script,
    )
    return sbatch(
        request,
        nodes=args.nodes,
        gpus_per_node=args.nproc_per_node,
        max_restarts=args.max_restarts,
        options=options,
    )


def run(
    args: argparse.Namespace, overrides: list[str], env: Mapping[str, str], hydra_flags: Sequence[str] = ()
) -> int:
    """``usp-launch slurm``: print (``--dry-run``), submit or run :func:`command`; the exit status."""
    return common.launch(command(args, overrides, env, hydra_flags), dry_run=args.dry_run)


def _slurm_gpus(env: Mapping[str, str]) -> int | None:
    """GPUs per node of the current allocation, from SLURM_GPUS_ON_NODE or SLURM_GPUS_PER_NODE (``h100:8``)."""
    if env.get("SLURM_GPUS_ON_NODE", "").isdigit():
        return int(env["SLURM_GPUS_ON_NODE"])
    numbers = re.findall(r"\d+", env.get("SLURM_GPUS_PER_NODE", "").split("(", 1)[0])
    return int(numbers[-1]) if numbers else None


def srun_in_allocation(
    request: RunRequest,
    env: Mapping[str, str],
    job_id: str,
    *,
    nodes: int | None = None,
    nproc_per_node: int | None = None,
    max_restarts: int = 0,
) -> list[str]:
    """``srun ... torchrun ...`` on every node of SLURM job ``job_id`` (this shell's allocation, ``env``).

    ``nodes`` / ``nproc_per_node`` (the flags; None: not given) must agree with the allocation, which sizes
    the run otherwise."""
    allocated = int(env["SLURM_NNODES"]) if env.get("SLURM_NNODES", "").isdigit() else None
    if allocated is None:
        raise LaunchError(
            f"SLURM_JOB_ID={job_id} is set but SLURM_NNODES is not: cannot tell the node count."
        )
    nodes = (
        common.flag_or_cluster(nodes, "--nodes", request.overrides, "cluster.num_nodes", request.cfg)
        or allocated
    )
    if nodes != allocated:
        # srun would pick `nodes` of the allocation, not necessarily the rendezvous head among them
        raise LaunchError(
            f"{nodes} node(s) asked for, but SLURM job {job_id} has {allocated}: inside an allocation usp-launch "
            f"runs on all of its nodes. Allocate {nodes} node(s), or add --submit to queue a job of that size."
        )
    nproc = common.flag_or_cluster(
        nproc_per_node, "--gpus-per-node", request.overrides, "cluster.gpus_per_node", request.cfg
    )
    on_node = _slurm_gpus(env)
    if nproc is not None and on_node is not None and nproc > on_node:
        raise LaunchError(f"{nproc} processes per node, but SLURM job {job_id} has {on_node} GPUs per node.")
    nproc = nproc or on_node
    if nproc is None:
        raise LaunchError(
            f"SLURM job {job_id} shows no GPUs (SLURM_GPUS_ON_NODE / SLURM_GPUS_PER_NODE unset): "
            f"pass --gpus-per-node N, or allocate with --gpus-per-node=N."
        )
    request.check(nodes=nodes, nproc_per_node=nproc)
    cpus = int(env["SLURM_CPUS_ON_NODE"]) if env.get("SLURM_CPUS_ON_NODE", "").isdigit() else None
    head = commands.first_hostname(env.get("SLURM_JOB_NODELIST", ""), shutil.which("scontrol"))
    return commands.srun_command(
        request.overrides,
        nodes=nodes,
        nproc_per_node=nproc,
        job_id=job_id,
        head=head,
        cpus_per_task=cpus,
        max_restarts=max_restarts,
        module=request.module,
    )


@dataclass(frozen=True)
class SbatchOptions:
    """sbatch's own options (``--partition`` ...); None: not passed (sbatch's or the cluster's default)."""

    partition: str | None = None
    time: str | None = None
    account: str | None = None
    job_name: str | None = None
    """None: ``usp``."""
    gres: bool = False
    """Request GPUs with ``--gres=gpu:N`` instead of ``--gpus-per-node=N``."""
    script: str | None = None
    """The batch script; None: this checkout's ``launch/slurm.sbatch``."""


def sbatch(
    request: RunRequest,
    *,
    nodes: int | None = None,
    gpus_per_node: int | None = None,
    max_restarts: int = 0,
    options: SbatchOptions | None = None,
) -> list[str]:
    """sbatch for ``nodes x gpus_per_node`` (the flags), else the run config's declared
    ``cluster.num_nodes x cluster.gpus_per_node``, with sbatch's own ``options``."""
    options = options or SbatchOptions()
    overrides, cfg = request.overrides, request.cfg
    nodes = common.flag_or_cluster(nodes, "--nodes", overrides, "cluster.num_nodes", cfg)
    gpus = common.flag_or_cluster(gpus_per_node, "--gpus-per-node", overrides, "cluster.gpus_per_node", cfg)
    if cfg is None and (nodes is None or gpus is None):
        raise LaunchError(
            "with Hydra flags after --, usp-launch does not compose the run config, so it cannot read the job's "
            "size from the recipe: pass --nodes N --gpus-per-node G."
        )
    nodes = nodes or cfg.cluster.num_nodes
    gpus = gpus or cfg.cluster.gpus_per_node
    request.check(nodes=nodes, nproc_per_node=gpus)
    script = Path(options.script) if options.script else commands.default_sbatch_script()
    if not script.is_file():
        raise LaunchError(
            f"--script {script}: no such file. Pass --script PATH to your copy of slurm.sbatch."
        )
    return commands.sbatch_command(
        overrides,
        script=commands.display_path(script, Path.cwd()),
        nodes=nodes,
        gpus_per_node=gpus,
        partition=options.partition,
        time=options.time,
        account=options.account,
        job_name=options.job_name or "usp",
        gres=options.gres,
        max_restarts=max_restarts,
        entry=request.entry,
    )
