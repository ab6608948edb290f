"""``usp-launch local``: one plain process, no launcher.

::

    usp-launch local [--cpu] [overrides...] [--dry-run]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping, Sequence

from usp.launch import commands, common, slurm
from usp.launch.common import LaunchError

NAME = "local"
HELP = "one process: python -m usp.train"


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        NAME,
        help=HELP,
        description="Run one plain process on this machine, without torchrun.",
        allow_abbrev=False,
    )
    common.add_cpu(p, "a CPU process on gloo")
    # taken only to refuse them with a pointed message (one process; torchrun and slurm start more)
    common.add_nproc_per_node(p, argparse.SUPPRESS)
    common.add_nodes(p, argparse.SUPPRESS)
    common.add_max_restarts(p, argparse.SUPPRESS)
    slurm.add_slurm_only_arguments(p, hidden=True)
    common.add_common_arguments(p)
    return p


def command(
    args: argparse.Namespace, overrides: list[str], env: Mapping[str, str], hydra_flags: Sequence[str] = ()
) -> list[str]:
    """``python -m usp.train <overrides>`` (this interpreter), after every check."""
    common.check_counts(nproc_per_node=args.nproc_per_node, nodes=args.nodes, max_restarts=args.max_restarts)
    if args.max_restarts:
        raise LaunchError("--max-restarts: `local` runs one plain process, without torchrun; use `torchrun`.")
    slurm.refuse_on_this_machine(
        common.given_flags(args, slurm.SLURM_ONLY),
        args.nodes,
        mode=NAME,
        where="on this machine as one process",
    )
    request = common.prepare(
        overrides, hydra_flags, cpu=args.cpu, entry=args.entry, memory=not args.skip_memory_check
    )
    if args.nproc_per_node not in (None, 1):
        raise LaunchError(
            f"--nproc-per-node={args.nproc_per_node}: `local` runs one process. "
            f"Use `usp-launch torchrun --nproc-per-node {args.nproc_per_node}` for several."
        )
    request.check(nodes=1, nproc_per_node=1)
    return commands.local_command(request.overrides, python=sys.executable, module=request.module)


def run(
    args: argparse.Namespace, overrides: list[str], env: Mapping[str, str], hydra_flags: Sequence[str] = ()
) -> int:
    """``usp-launch local``: print (``--dry-run``) or run :func:`command`; the exit status."""
    return common.launch(command(args, overrides, env, hydra_flags), dry_run=args.dry_run)
