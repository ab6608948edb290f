"""``usp-launch``: print, run or submit the command that starts ``usp.train`` from one set of Hydra overrides.

::

    usp-launch local    [--cpu] [overrides...] [--dry-run]
    (any mode) --entry eval: start usp.eval (usp-eval) instead of usp.train, with the same checks
    usp-launch torchrun [--nproc-per-node N] [--cpu] [--max-restarts R] [overrides...] [--dry-run]
    usp-launch slurm    [--nodes N] [--gpus-per-node G] [--partition P] [--time T] [--account A]
                        [--job-name J] [--gres] [--submit] [--max-restarts R] [overrides...] [--dry-run]
    usp-launch k8s      --image IMAGE [--format trainjob|pytorchjob|jobset] [--volume NAME=CLAIM:PATH ...]
                        [--namespace NS] [--queue Q] [--nodes N] [--gpus-per-node G] [--job-name J]
                        [--runtime R] [--output FILE] [--apply] [--max-restarts R] [overrides...] [--dry-run]
    usp-launch ray      [--address ADDR] [--nodes N] [--gpus-per-node G] [--cpu] [--max-restarts R]
                        [overrides...] [--dry-run]

This module only dispatches: each mode is one module of :data:`MODE_MODULES` (:mod:`usp.launch.local`: one
plain process; :mod:`usp.launch.torchrun`: one node; :mod:`usp.launch.slurm`: sbatch, or srun inside an
allocation; :mod:`usp.launch.ray_train`: Ray Train), with its own sub-command and flags, and what they share
is :mod:`usp.launch.common`. A mode module has

- ``NAME``, its sub-command, and ``HELP``, its line in ``usp-launch --help``;
- ``add_parser(subparsers)``: ``subparsers.add_parser(NAME, ...)``, its flags (with
  :func:`usp.launch.common.add_common_arguments`), and the parser;
- ``run(args, overrides, env, hydra_flags) -> int``: everything else, from the parsed flags ``args``, the
  Hydra overrides, the environment (a copy of ``os.environ``) and the Hydra flags given after ``--``; it
  returns the exit status and raises :class:`LaunchError` (or ``ValueError``) for a user mistake.

Before anything runs, the overrides are parsed with Hydra's override parser
(:mod:`usp.launch.overrides`) and composed once into the trainer's run config (the same composition
``usp.train`` does, :func:`usp.config.compose.compose_run_config`, so an unknown recipe, a misspelled key, a
value of the wrong type or a missing ``model.path`` is reported here). The composed layout (``parallel.*``,
from the recipe or the command line) is then checked against the processes about to start by the trainer's
own checks, :func:`usp.config.validate_layout` (:class:`usp.parallel.ParallelLayout` and ``trainer.seq_len``),
and its memory by the planner's estimate (:mod:`usp.launch.preflight`; ``--skip-memory-check`` lets a
layout above the device memory through; a skipped estimate is said, with why), or for ``--entry eval`` the
eval's own checks (lengths, heads); ``hydra.run.dir`` and ``trainer.checkpoint_dir`` must be writable.
Errors print one ``usp-launch: error:`` line naming the setting and the fix (:mod:`usp.errors`;
``--verbose`` adds the traceback), and exit with status 2.

Words after a literal ``--`` that are not ``key=value`` overrides (Hydra's own flags: ``-- --cfg job``,
``-- --help``) are passed to ``usp.train`` unchanged; the run config is then not composed, and only the
degrees the command line sets are checked (:func:`usp.launch.overrides.check_degrees`).
"""

from __future__ import annotations

import argparse
import os

# shutil, subprocess: what the modes run through (callers and tests patch cli.subprocess.run, cli.shutil.which)
import shutil  # noqa: F401
import subprocess  # noqa: F401
import sys
from collections.abc import Mapping, Sequence

from usp.errors import pop_verbose, report
from usp.launch import k8s, local, ray_train, slurm, torchrun
from usp.launch.common import LaunchError, compose_run_config
from usp.launch.overrides import validate_override_syntax

__all__ = [
    "MODES",
    "MODE_MODULES",
    "LaunchError",
    "build_parser",
    "compose_run_config",
    "main",
    "plan_command",
]

MODE_MODULES = (local, torchrun, slurm, k8s, ray_train)
"""The launch modes, in the order ``usp-launch --help`` lists them: adding a mode is one module here."""
MODES = tuple(mode.NAME for mode in MODE_MODULES)
USAGE = f"usp-launch {{{','.join(MODES)}}} [options] [hydra overrides...] [--dry-run]"


def build_parser() -> argparse.ArgumentParser:
    """``usp-launch``'s parser: one sub-command per mode of :data:`MODE_MODULES`, each with its own flags."""
    p = argparse.ArgumentParser(
        prog="usp-launch",
        usage=USAGE,
        description="Print, run or submit the command that starts usp.train (or usp.eval: --entry eval) with the "
        "given Hydra overrides.",
        epilog="Example: usp-launch torchrun --cpu --nproc-per-node 4 recipe=tiny --dry-run. A mode's options: "
        "usp-launch MODE --help.",
        allow_abbrev=False,
    )
    subparsers = p.add_subparsers(dest="mode", required=True)
    for mode in MODE_MODULES:
        sub = mode.add_parser(subparsers)
        # argparse's own errors (a bad flag value) read the same whichever mode was chosen
        sub.prog, sub.usage = p.prog, p.usage
    return p


def _mode_parsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return next(a.choices for a in parser._actions if isinstance(a, argparse._SubParsersAction))


def _mode_first(words: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """Options given before the mode (``usp-launch --dry-run local ...``, as the parser before sub-commands
    took them) moved after it, in their order. Without a mode after them, their values are dropped, so that
    the parser's error is about the word where the mode should be (or its absence), as it was."""
    modes = _mode_parsers(parser)
    takes_value = {
        option: action.nargs != 0
        for sub in modes.values()
        for option, action in sub._option_string_actions.items()
        if option not in ("-h", "--help")
    }
    options: list[str] = []
    i = 0
    while i < len(words):
        option, equals, _ = words[i].partition("=")
        if option not in takes_value:
            break
        options.append(words[i])
        i += 2 if takes_value[option] and not equals else 1
    if i < len(words) and words[i] in modes:
        return [words[i], *words[:i], *words[i + 1 :]]
    return [*options, *words[i:]] if options else words


def plan_command(
    args: argparse.Namespace, overrides: list[str], env: Mapping[str, str], hydra_flags: Sequence[str] = ()
) -> list[str]:
    """The command ``args`` (a parse of :func:`build_parser`) asks for, after every check: its mode's
    ``command``. Raises LaunchError (or ValueError) on bad input."""
    return dict(zip(MODES, MODE_MODULES))[args.mode].command(args, overrides, env, hydra_flags)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``usp-launch``; returns the exit status (the launched command's, or 2 on bad input)."""
    words = list(sys.argv[1:] if argv is None else argv)
    after_dashes: list[str] = []
    tail = words[words.index("--") :] if "--" in words else []
    head = words[: len(words) - len(tail)]
    verbose = pop_verbose(
        head
    )  # usp-launch's own --verbose: before a literal -- (after it: the entry's words)
    words = [*head, *tail]
    if "--" in words:
        cut = words.index("--")
        words, after_dashes = words[:cut], words[cut + 1 :]
        if after_dashes[-1:] == ["--dry-run"]:  # the usage's trailing [--dry-run] stays usp-launch's
            words, after_dashes = [*words, "--dry-run"], after_dashes[:-1]
    parser = build_parser()
    try:
        args, extra = parser.parse_known_args(_mode_first(words, parser))
    except SystemExit as exc:  # argparse already printed the usage / help
        return int(exc.code or 0)
    # After a literal `--`, words that are not key=value overrides are passed to usp.train unchanged: Hydra's
    # own flags and their values (--cfg job, --help, --info defaults).
    hydra_mode = any(word.startswith("-") for word in after_dashes)
    overrides = [*extra, *([] if hydra_mode else after_dashes)]
    hydra_flags = after_dashes if hydra_mode else []
    mode = dict(zip(MODES, MODE_MODULES))[args.mode]
    try:
        validate_override_syntax(overrides)
        return mode.run(args, overrides, dict(os.environ), hydra_flags)
    except (Exception, KeyboardInterrupt) as exc:  # noqa: BLE001 - the one report of a failure (usp.errors)
        return report("usp-launch", exc, verbose=verbose)


if __name__ == "__main__":
    raise SystemExit(main())
