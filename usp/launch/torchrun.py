"""``usp-launch torchrun``: one node, ``torchrun --standalone``.

::

    usp-launch torchrun [--nproc-per-node N] [--cpu] [--max-restarts R] [overrides...] [--dry-run]

``--nproc-per-node`` defaults to the GPUs that ``nvidia-smi`` lists (no more than ``CUDA_VISIBLE_DEVICES``
shows), and it is what torchrun exports as ``LOCAL_WORLD_SIZE``, the node size the mesh uses to keep Ulysses
groups inside a node. ``--cpu`` starts CPU processes on gloo (and then needs ``--nproc-per-node``).
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence

from usp.launch import commands, common, slurm
from usp.launch.common import LaunchError

NAME = "torchrun"
HELP = "one node: torchrun --standalone"


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        NAME,
        help=HELP,
        description="Run torchrun --standalone on this machine: one node of --nproc-per-node processes.",
        allow_abbrev=False,
    )
    common.add_nproc_per_node(
        p, "processes per node (default: the GPUs listed by nvidia-smi, or CUDA_VISIBLE_DEVICES)"
    )
    common.add_cpu(p, "CPU processes on gloo (with --nproc-per-node N)")
    common.add_max_restarts(
        p,
        "restart all ranks up to R times after one fails; they resume from the last checkpoint (default 0)",
    )
    common.add_nodes(p, argparse.SUPPRESS)  # 1 at most: taken to point elsewhere for more
    slurm.add_slurm_only_arguments(p, hidden=True)
    common.add_common_arguments(p)
    return p


def command(
    args: argparse.Namespace, overrides: list[str], env: Mapping[str, str], hydra_flags: Sequence[str] = ()
) -> list[str]:
    """The torchrun command ``args`` asks for, after every check."""
    common.check_counts(nproc_per_node=args.nproc_per_node, nodes=args.nodes, max_restarts=args.max_restarts)
    slurm.refuse_on_this_machine(
        common.given_flags(args, slurm.SLURM_ONLY), args.nodes, mode=NAME, where="on this machine"
    )
    request = common.prepare(
        overrides, hydra_flags, cpu=args.cpu, entry=args.entry, memory=not args.skip_memory_check
    )
    nproc = processes_per_node(args.nproc_per_node, cpu=args.cpu)
    request.check(nodes=1, nproc_per_node=nproc)
    return commands.torchrun_command(
        request.overrides, nproc_per_node=nproc, max_restarts=args.max_restarts, module=request.module
    )


def processes_per_node(given: int | None, *, cpu: bool) -> int:
    """``given`` (``--nproc-per-node``), else this machine's GPUs (:func:`usp.launch.commands.count_gpus`)."""
    if given is not None:
        return given
    if cpu:
        raise LaunchError("--cpu needs --nproc-per-node N (the number of CPU processes, e.g. 4).")
    count = commands.count_gpus()
    if count == 0:
        raise LaunchError(
            "no GPUs found (nvidia-smi lists none, or CUDA_VISIBLE_DEVICES hides them): pass "
            "--nproc-per-node N, or --cpu --nproc-per-node N for CPU processes on gloo."
        )
    return count


def run(
    args: argparse.Namespace, overrides: list[str], env: Mapping[str, str], hydra_flags: Sequence[str] = ()
) -> int:
    """``usp-launch torchrun``: print (``--dry-run``) or run :func:`command`; the exit status."""
    return common.launch(command(args, overrides, env, hydra_flags), dry_run=args.dry_run)
