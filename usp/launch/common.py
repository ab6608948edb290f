"""What every ``usp-launch`` mode shares: the flags several modes take, composing and checking the run config,
and printing or running the command.

A mode module (:mod:`usp.launch.local`, :mod:`usp.launch.torchrun`, :mod:`usp.launch.slurm`) parses its own
flags and calls these with plain values: :func:`prepare` composes the overrides into a :class:`RunRequest`
once (the same composition ``usp.train`` does, :func:`usp.config.compose.compose_run_config`), whose
:meth:`RunRequest.check` runs the trainer's own layout checks and the planner's memory estimate for the
processes the mode is about to start (:mod:`usp.launch.preflight`); :func:`launch` prints the command
(``--dry-run``) or runs it. Every user mistake is a :class:`LaunchError`, reported by :mod:`usp.launch.cli`
as one ``usp-launch: error:`` line with exit status 2.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from usp.config import TrainConfig
from usp.launch import commands, preflight
from usp.launch.overrides import check_degrees, find_override


class LaunchError(ValueError):
    """A user mistake found before launching; the message names the setting and the fix."""


# --- flags ---------------------------------------------------------------------------------------------
# One definition per flag that several modes take, so that its spelling, type and argparse errors
# ("argument --nproc-per-node/--gpus-per-node: invalid int value") are the same in every mode; each mode
# gives its own help, or argparse.SUPPRESS for a flag it takes only to refuse it with a pointed message.


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of every mode: ``--skip-memory-check``, ``--dry-run``, ``--entry``."""
    parser.add_argument(
        "--skip-memory-check",
        dest="skip_memory_check",
        action="store_true",
        help="submit even when the planner predicts the layout does not fit the device memory",
    )
    parser.add_argument(
        "--dry-run", dest="dry_run", action="store_true", help="print the command; run nothing"
    )
    parser.add_argument(
        "--entry",
        choices=tuple(commands.ENTRY_MODULES),
        default="train",
        help="train: usp.train (default); eval: usp.eval (usp-eval: eval=ppl|passkey|ruler, model.path=RUN/hf)",
    )


def add_nproc_per_node(parser: argparse.ArgumentParser, help: str) -> None:
    """``--nproc-per-node N`` (alias ``--gpus-per-node``): processes per node, ``args.nproc_per_node``."""
    parser.add_argument(
        "--nproc-per-node",
        "--gpus-per-node",
        dest="nproc_per_node",
        type=int,
        default=None,
        metavar="N",
        help=help,
    )


def add_nodes(parser: argparse.ArgumentParser, help: str) -> None:
    """``--nodes N``: the number of nodes, ``args.nodes``."""
    parser.add_argument("--nodes", type=int, default=None, help=help)


def add_max_restarts(parser: argparse.ArgumentParser, help: str) -> None:
    """``--max-restarts R``: torchrun's restarts of every rank after one fails, ``args.max_restarts``."""
    parser.add_argument("--max-restarts", dest="max_restarts", type=int, default=0, metavar="R", help=help)


def add_cpu(parser: argparse.ArgumentParser, help: str) -> None:
    """``--cpu``: CPU processes on gloo, ``args.cpu``."""
    parser.add_argument("--cpu", action="store_true", help=help)


def given_flags(args: argparse.Namespace, names: Sequence[str]) -> list[str]:
    """The flags among ``names`` (their dests) that the command line gave, spelled as flags, in the order of
    ``names``: ``["--partition", "--job-name"]``."""
    return [f"--{name.replace('_', '-')}" for name in names if getattr(args, name) not in (None, False)]


def check_counts(*, nproc_per_node: int | None, nodes: int | None, max_restarts: int) -> None:
    """``--nproc-per-node`` and ``--nodes`` are at least 1 when given, ``--max-restarts`` at least 0."""
    _positive(nproc_per_node, "--nproc-per-node")
    _positive(nodes, "--nodes")
    if max_restarts < 0:
        raise LaunchError(f"--max-restarts={max_restarts} is invalid: use an integer >= 0.")


def _positive(value: int | None, flag: str) -> None:
    if value is not None and value < 1:
        raise LaunchError(f"{flag}={value} is invalid: use an integer >= 1.")


# --- the run config ------------------------------------------------------------------------------------
def _one_line_hydra_error(exc: Exception) -> str:
    """Hydra's composition error on one line: no config search path, its list of valid options comma-separated."""
    parts: list[str] = []
    options: list[str] = []
    for raw in str(exc).split("Config search path:", 1)[0].strip().splitlines():
        if raw.startswith("\t"):  # Hydra lists the options of a group one per tab-indented line
            options.append(raw.strip())
            continue
        match = re.fullmatch(r"Available options in '([^']+)':", raw.strip())
        if raw.strip():
            parts.append(f"- valid {match.group(1)} options:" if match else raw.strip())
    if options:
        parts.append(", ".join(options))
    cause = exc.__cause__
    if cause is not None and str(cause).strip() and str(cause).strip() not in str(exc):
        parts.append(f"({str(cause).strip().splitlines()[0]})")
    return " ".join(parts)


def compose_run_config(overrides: Sequence[str], entry: str = "train") -> TrainConfig:
    """The run config for ``overrides``, composed as ``usp.train`` (or ``usp.eval``, ``entry="eval"``) will.

    Raises:
        LaunchError: for an unknown recipe or group option (listing the valid ones), a key the config does
            not have, a value of the wrong type, or a required setting left unset (``???``).
    """
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from usp.config.compose import compose_run_config as compose

    try:
        return compose(list(overrides), config_name="eval" if entry == "eval" else "train")
    except (HydraException, OmegaConfBaseException) as exc:
        raise LaunchError(
            f"the overrides do not compose into a run config: {_one_line_hydra_error(exc)}"
        ) from exc
    except ValueError as exc:
        raise LaunchError(str(exc)) from exc


def check_dirs(overrides: Sequence[str], cfg: TrainConfig, entry: str, *, on_this_machine: bool) -> None:
    """``hydra.run.dir`` (and for training ``trainer.checkpoint_dir``) must be writable: the trainer's own
    start-up check (:func:`usp.errors.check_writable_dir`). For a job on other machines (``slurm``), whose
    nodes may see other filesystems than this login node: a warning instead of an error."""
    from usp.config.compose import hydra_run_dir
    from usp.errors import check_writable_dir

    try:
        run_dir = hydra_run_dir(overrides, "eval" if entry == "eval" else "train")
    except Exception:  # noqa: BLE001 - a run dir only the job can resolve (no rendezvous id here): its own check
        return
    dirs = [("hydra.run.dir", run_dir)]
    if entry == "train":
        dirs.append(
            ("trainer.checkpoint_dir", cfg.trainer.checkpoint_dir or str(Path(run_dir) / "checkpoints"))
        )
    for setting, path in dirs:
        try:
            check_writable_dir(path, setting)
        except ValueError as exc:
            if on_this_machine:
                raise LaunchError(str(exc)) from exc
            print(
                f"usp-launch: warning: {exc} (from this machine; the job's nodes may see it otherwise)",
                file=sys.stderr,
            )


@dataclass(frozen=True)
class RunRequest:
    """What a mode launches, composed and ready to check against the processes it starts."""

    overrides: list[str]
    """The words the entry point gets: launcher defaults (``--cpu``), the user's overrides, Hydra's flags."""
    cfg: TrainConfig | None
    """The composed run config; None with Hydra flags after ``--`` (then not composed)."""
    entry: str
    """``train`` or ``eval`` (``--entry``)."""
    memory: bool = True
    """Whether a layout above the device memory is an error (not ``--skip-memory-check``)."""

    @property
    def module(self) -> str:
        """The module the command runs with ``-m``: ``usp.train`` or ``usp.eval``."""
        return commands.ENTRY_MODULES[self.entry]

    def check(self, *, nodes: int, nproc_per_node: int) -> None:
        """:func:`check` of this run against ``nodes x nproc_per_node`` processes."""
        check(
            self.overrides,
            self.cfg,
            nodes=nodes,
            nproc_per_node=nproc_per_node,
            memory=self.memory,
            train=self.entry == "train",
        )


def prepare(
    overrides: Sequence[str],
    hydra_flags: Sequence[str] = (),
    *,
    cpu: bool = False,
    entry: str = "train",
    memory: bool = True,
    on_this_machine: bool = True,
) -> RunRequest:
    """``overrides`` composed into the run config (:func:`compose_run_config`) and its dirs checked
    (:func:`check_dirs`; ``on_this_machine`` false for a job on other machines: a warning).

    ``cpu`` adds :func:`usp.launch.commands.cpu_defaults` in front (unless the user sets those keys).
    ``hydra_flags`` (what followed ``--`` that is not an override, e.g. ``--cfg job``) go last, unchanged.
    They change what ``usp.train`` does (print the config, the help) rather than train, so the run config is
    then not composed: only the degrees the command line sets are checked.
    """
    words = [*overrides, *hydra_flags]
    if cpu:
        words = commands.with_defaults(words, commands.cpu_defaults())
    cfg = None if hydra_flags else compose_run_config(words, entry)
    if cfg is not None:
        check_dirs(words, cfg, entry, on_this_machine=on_this_machine)
    return RunRequest(overrides=words, cfg=cfg, entry=entry, memory=memory)


def flag_or_cluster(
    value: int | None, flag: str, overrides: Sequence[str], key: str, cfg: TrainConfig | None
) -> int | None:
    """``flag``'s value, else the override ``key`` (``cluster.num_nodes``, ``cluster.gpus_per_node``) when the
    command line sets it: a recipe's declared size given on the command line sizes the SLURM job. Both given
    must agree. The value is the composed config's (typed and resolved: ``'4'``, ``${oc.env:N}``), or Hydra's
    parse of the override when no config is composed (Hydra flags after ``--``)."""
    given = find_override(overrides, key)
    if given is None:
        return value
    if cfg is not None:
        given = getattr(cfg.cluster, key.rsplit(".", 1)[1])
    if isinstance(given, bool) or not isinstance(given, int) or given < 1:
        raise LaunchError(f"{key}={given!r} is invalid: use an integer >= 1.")
    if value is not None and value != given:
        raise LaunchError(
            f"{flag}={value} but {key}={given}: the job and the run config disagree; make them equal."
        )
    return given


# --- checks --------------------------------------------------------------------------------------------
def _launching(nodes: int, nproc_per_node: int, node_size: object) -> str:
    """What usp-launch is about to start, for a layout error: the world size and the node size's origin."""
    where = (
        f"usp-launch starts {nodes} node(s) x {nproc_per_node} process(es) per node = "
        f"{nodes * nproc_per_node} ranks"
    )
    if node_size is None:
        return f"{where}, node size {nproc_per_node} = LOCAL_WORLD_SIZE"
    return f"{where}, node size parallel.node_size={node_size}"


def check(
    overrides: Sequence[str],
    cfg: TrainConfig | None,
    *,
    nodes: int,
    nproc_per_node: int,
    memory: bool = True,
    train: bool = True,
) -> None:
    """The layout against ``nodes x nproc_per_node`` processes: the composed config's, with the trainer's own
    checks (:func:`usp.launch.preflight.check_layout`: :class:`usp.parallel.ParallelLayout`, then
    ``trainer.seq_len``), or without a config (``cfg`` None: Hydra flags after ``--``) the degrees the command
    line sets (:func:`usp.launch.overrides.check_degrees`). Then, for training (``train``), the planner's
    memory estimate (its figure is printed on stderr; an excess is an error unless ``memory`` is false,
    ``--skip-memory-check``), or for evaluation ``usp-eval``'s own checks.

    A layout error keeps the trainer's message and adds where the world size comes from."""
    world = nodes * nproc_per_node
    try:
        if cfg is None:
            check_degrees(overrides, nodes=nodes, nproc_per_node=nproc_per_node)
            return
        preflight.check_layout(cfg, world_size=world, local_world_size=nproc_per_node)
    except ValueError as exc:
        node_size = find_override(overrides, "parallel.node_size") if cfg is None else cfg.parallel.node_size
        raise LaunchError(f"{exc} ({_launching(nodes, nproc_per_node, node_size)})") from exc
    if not train:  # the estimate is of training memory; usp-eval's own checks instead
        try:
            note = preflight.check_eval(cfg, world_size=world, local_world_size=nproc_per_node)
        except ValueError as exc:
            raise LaunchError(f"{exc} ({_launching(nodes, nproc_per_node, cfg.parallel.node_size)})") from exc
        if note:
            print(f"usp-launch: {note}", file=sys.stderr)
        return
    try:
        note = preflight.check_memory(cfg, world_size=world, local_world_size=nproc_per_node)
    except ValueError as exc:
        if memory:
            raise
        note = f"warning: {exc}"
    if note is None:
        note = preflight.memory_skipped_reason(cfg)
    if note:
        print(f"usp-launch: {note}", file=sys.stderr)


# --- printing or running -------------------------------------------------------------------------------
def launch(cmd: Sequence[str], *, dry_run: bool) -> int:
    """Print ``cmd`` (``--dry-run``: exit status 0), or run it (:func:`run_command`: its exit status)."""
    if dry_run:
        print(shlex.join(cmd))
        return 0
    return run_command(list(cmd))


def run_command(cmd: list[str]) -> int:
    """Run ``cmd`` with this interpreter's bin dir first on PATH (torchrun, and the job's torchrun via sbatch)."""
    bindir = str(Path(sys.executable).parent)
    env = dict(os.environ, PATH=os.pathsep.join([bindir, os.environ.get("PATH", "")]))
    exe = shutil.which(cmd[0], path=env["PATH"])
    if exe is None:
        where = (
            "a SLURM login node" if cmd[0] in ("sbatch", "srun") else "an environment with torch installed"
        )
        raise LaunchError(
            f"`{cmd[0]}` is not on PATH: run this on {where}, or use --dry-run to print the command."
        )
    print(f"usp-launch: {shlex.join(cmd)}", file=sys.stderr, flush=True)
    # Ctrl-C reaches the job too (the terminal's process group), which checkpoints and exits: wait for it
    # instead of dying first. A Python handler, not SIG_IGN: the child starts with the default again.
    previous = signal.signal(signal.SIGINT, lambda *_: None)
    try:
        return subprocess.run([exe, *cmd[1:]], env=env).returncode
    finally:
        signal.signal(signal.SIGINT, previous)
