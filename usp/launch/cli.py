"""``usp-launch``: print, run or submit the command that starts ``usp.train`` from one set of Hydra overrides.

::

    usp-launch local    [--cpu] [overrides...] [--dry-run]
    (any mode) --entry eval: start usp.eval (usp-eval) instead of usp.train, with the same checks
    usp-launch torchrun [--nproc-per-node N] [--cpu] [--max-restarts R] [overrides...] [--dry-run]
    usp-launch slurm    [--nodes N] [--gpus-per-node G] [--partition P] [--time T] [--account A]
                        [--job-name J] [--gres] [--submit] [--max-restarts R] [overrides...] [--dry-run]

``local`` runs one plain process. ``torchrun`` runs one node; ``--nproc-per-node`` defaults to the GPUs that
``nvidia-smi`` lists (no more than ``CUDA_VISIBLE_DEVICES`` shows), and it is what torchrun exports as
``LOCAL_WORLD_SIZE``, the node size the mesh uses to keep Ulysses groups inside a node. ``slurm`` submits ``launch/slurm.sbatch`` with sbatch; inside an allocation
(``SLURM_JOB_ID`` set, e.g. under salloc) it runs ``srun ... torchrun ...`` directly, as the script would.
Without ``--nodes`` / ``--gpus-per-node``, the run config's ``cluster.num_nodes`` / ``cluster.gpus_per_node``
(the size the recipe declares, or a ``cluster.*`` override) sizes the sbatch job.

Before anything runs, the overrides are parsed with Hydra's override parser
(:mod:`usp.launch.overrides`) and composed once into the trainer's run config (the same composition
``usp.train`` does, :func:`usp.config.compose.compose_run_config`, so an unknown recipe, a misspelled key, a
value of the wrong type or a missing ``model.path`` is reported here). The composed layout (``parallel.*``,
from the recipe or the command line) is then checked against the processes about to start by the trainer's
own checks, :func:`usp.config.validate_layout` (:class:`usp.parallel.ParallelDims` and ``trainer.seq_len``),
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
import re
import shlex
import shutil
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from usp.config import TrainConfig
from usp.errors import pop_verbose, report
from usp.launch import commands, preflight
from usp.launch.overrides import check_degrees, find_override, validate_override_syntax

MODES = ("local", "torchrun", "slurm")
SLURM_ONLY = ("partition", "time", "account", "job_name", "gres", "submit", "script")


class LaunchError(ValueError):
    """A user mistake found before launching; the message names the setting and the fix."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="usp-launch",
        usage="usp-launch {local,torchrun,slurm} [options] [hydra overrides...] [--dry-run]",
        description="Print, run or submit the command that starts usp.train (or usp.eval: --entry eval) with the "
        "given Hydra overrides.",
        epilog="Example: usp-launch torchrun --cpu --nproc-per-node 4 recipe=tiny --dry-run",
        allow_abbrev=False,
    )
    p.add_argument("mode", choices=MODES, help="local: one process; torchrun: one node; slurm: several nodes")
    p.add_argument(
        "--nproc-per-node",
        "--gpus-per-node",
        dest="nproc_per_node",
        type=int,
        default=None,
        metavar="N",
        help="processes (GPUs) per node; torchrun default: GPUs listed by nvidia-smi (or CUDA_VISIBLE_DEVICES); "
        "slurm default: a cluster.gpus_per_node override, else the allocation's SLURM_GPUS_ON_NODE, else the "
        "run config's cluster.gpus_per_node (the recipe's)",
    )
    p.add_argument(
        "--nodes",
        type=int,
        default=None,
        help="slurm: number of nodes (default: a cluster.num_nodes override, else the allocation's SLURM_NNODES, else the run config's cluster.num_nodes, the recipe's)",
    )
    p.add_argument("--partition", help="slurm: sbatch --partition")
    p.add_argument("--time", help="slurm: sbatch --time (e.g. 04:00:00)")
    p.add_argument("--account", help="slurm: sbatch --account")
    p.add_argument("--job-name", dest="job_name", default=None, help="slurm: sbatch --job-name (default usp)")
    p.add_argument("--gres", action="store_true", help="slurm: request GPUs with --gres=gpu:N")
    p.add_argument(
        "--submit", action="store_true", help="slurm: submit with sbatch even inside an allocation"
    )
    p.add_argument("--script", default=None, help="slurm: the batch script (default launch/slurm.sbatch)")
    p.add_argument("--cpu", action="store_true", help="local/torchrun: CPU processes on gloo")
    p.add_argument(
        "--max-restarts",
        dest="max_restarts",
        type=int,
        default=0,
        metavar="R",
        help="torchrun/slurm: restart all ranks up to R times after one fails; they resume from the last "
        "checkpoint (default 0)",
    )
    p.add_argument(
        "--skip-memory-check",
        dest="skip_memory_check",
        action="store_true",
        help="submit even when the planner predicts the layout does not fit the device memory",
    )
    p.add_argument("--dry-run", dest="dry_run", action="store_true", help="print the command; run nothing")
    p.add_argument(
        "--entry",
        choices=tuple(commands.ENTRY_MODULES),
        default="train",
        help="train: usp.train (default); eval: usp.eval (usp-eval: eval=ppl|passkey|ruler, model.path=RUN/hf)",
    )
    return p


def _positive(value: int | None, flag: str) -> None:
    if value is not None and value < 1:
        raise LaunchError(f"{flag}={value} is invalid: use an integer >= 1.")


def _slurm_gpus(env: dict[str, str]) -> int | None:
    """GPUs per node of the current allocation, from SLURM_GPUS_ON_NODE or SLURM_GPUS_PER_NODE (``h100:8``)."""
    if env.get("SLURM_GPUS_ON_NODE", "").isdigit():
        return int(env["SLURM_GPUS_ON_NODE"])
    numbers = re.findall(r"\d+", env.get("SLURM_GPUS_PER_NODE", "").split("(", 1)[0])
    return int(numbers[-1]) if numbers else None


def _flag_or_cluster(
    value: int | None, flag: str, overrides: list[str], key: str, cfg: TrainConfig | None
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


def _check_dirs(overrides: Sequence[str], cfg: TrainConfig, entry: str, *, on_this_machine: bool) -> None:
    """``hydra.run.dir`` (and for training ``trainer.checkpoint_dir``) must be writable: the trainer's own
    start-up check (:func:`usp.errors.check_writable_dir`). For ``slurm`` the job's nodes may see other
    filesystems than this login node: a warning instead of an error."""
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


def _launching(nodes: int, nproc_per_node: int, node_size: object) -> str:
    """What usp-launch is about to start, for a layout error: the world size and the node size's origin."""
    where = (
        f"usp-launch starts {nodes} node(s) x {nproc_per_node} process(es) per node = "
        f"{nodes * nproc_per_node} ranks"
    )
    if node_size is None:
        return f"{where}, node size {nproc_per_node} = LOCAL_WORLD_SIZE"
    return f"{where}, node size parallel.node_size={node_size}"


def _is_train(args: argparse.Namespace) -> bool:
    return getattr(args, "entry", "train") == "train"


def _check(
    overrides: Sequence[str],
    cfg: TrainConfig | None,
    *,
    nodes: int,
    nproc_per_node: int,
    memory: bool = True,
    train: bool = True,
) -> None:
    """The layout against ``nodes x nproc_per_node`` processes: the composed config's, with the trainer's own
    checks (:func:`usp.launch.preflight.check_layout`: :class:`usp.parallel.ParallelDims`, then
    ``trainer.seq_len``), or without a config (``cfg`` None: Hydra flags after ``--``) the degrees the command
    line sets (:func:`check_degrees`). Then, for training (``train``), the planner's memory estimate (its
    figure is printed on stderr; an excess is an error unless ``memory`` is false, ``--skip-memory-check``).

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


def plan_command(
    args: argparse.Namespace, overrides: list[str], env: dict[str, str], hydra_flags: Sequence[str] = ()
) -> list[str]:
    """The command ``args`` asks for, after every check. Raises LaunchError (or ValueError) on bad input.

    ``hydra_flags`` (what followed ``--`` that is not an override, e.g. ``--cfg job``) go last, unchanged.
    They change what ``usp.train`` does (print the config, the help) rather than train, so the run config is
    then not composed here: only the degrees the command line sets are checked.
    """
    overrides = [*overrides, *hydra_flags]
    _positive(args.nproc_per_node, "--nproc-per-node")
    _positive(args.nodes, "--nodes")
    if args.max_restarts < 0:
        raise LaunchError(f"--max-restarts={args.max_restarts} is invalid: use an integer >= 0.")
    if args.mode == "local" and args.max_restarts:
        raise LaunchError("--max-restarts: `local` runs one plain process, without torchrun; use `torchrun`.")
    if args.mode != "slurm":
        misplaced = [
            f"--{name.replace('_', '-')}" for name in SLURM_ONLY if getattr(args, name) not in (None, False)
        ]
        if misplaced:
            raise LaunchError(
                f"{', '.join(misplaced)}: only for `usp-launch slurm`; "
                f"`{args.mode}` runs on this machine{' as one process' if args.mode == 'local' else ''}."
            )
        if args.nodes not in (None, 1):
            raise LaunchError(
                f"--nodes={args.nodes}: `{args.mode}` starts processes on this machine only. "
                f"For {args.nodes} nodes use `usp-launch slurm --nodes {args.nodes}`."
            )
    if args.mode == "slurm" and args.cpu:
        raise LaunchError("--cpu applies to local and torchrun; SLURM runs use GPUs (drop --cpu).")
    if args.cpu:
        overrides = commands.with_defaults(overrides, commands.cpu_defaults())
    entry = getattr(args, "entry", "train")
    module = commands.ENTRY_MODULES[entry]
    cfg = None if hydra_flags else compose_run_config(overrides, entry)
    if cfg is not None:
        _check_dirs(overrides, cfg, entry, on_this_machine=args.mode != "slurm")

    if args.mode == "local":
        if args.nproc_per_node not in (None, 1):
            raise LaunchError(
                f"--nproc-per-node={args.nproc_per_node}: `local` runs one process. "
                f"Use `usp-launch torchrun --nproc-per-node {args.nproc_per_node}` for several."
            )
        _check(
            overrides,
            cfg,
            nodes=1,
            nproc_per_node=1,
            memory=not args.skip_memory_check,
            train=_is_train(args),
        )
        return commands.local_command(overrides, python=sys.executable, module=module)

    if args.mode == "torchrun":
        nproc = args.nproc_per_node
        if nproc is None:
            if args.cpu:
                raise LaunchError("--cpu needs --nproc-per-node N (the number of CPU processes, e.g. 4).")
            nproc = commands.count_gpus()
            if nproc == 0:
                raise LaunchError(
                    "no GPUs found (nvidia-smi lists none, or CUDA_VISIBLE_DEVICES hides them): pass "
                    "--nproc-per-node N, or --cpu --nproc-per-node N for CPU processes on gloo."
                )
        _check(
            overrides,
            cfg,
            nodes=1,
            nproc_per_node=nproc,
            memory=not args.skip_memory_check,
            train=_is_train(args),
        )
        return commands.torchrun_command(
            overrides, nproc_per_node=nproc, max_restarts=args.max_restarts, module=module
        )

    job_id = env.get("SLURM_JOB_ID")
    if job_id and not args.submit:
        return _srun_in_allocation(args, overrides, cfg, env, job_id)
    return _sbatch(args, overrides, cfg)


def _srun_in_allocation(
    args: argparse.Namespace, overrides: list[str], cfg: TrainConfig | None, env: dict[str, str], job_id: str
) -> list[str]:
    sbatch_only = [
        f"--{n.replace('_', '-')}"
        for n in ("partition", "time", "account", "job_name", "gres", "script")
        if getattr(args, n) not in (None, False)
    ]
    if sbatch_only:
        raise LaunchError(
            f"{', '.join(sbatch_only)} are sbatch options, but this shell is inside SLURM job {job_id}, where "
            f"usp-launch runs srun directly. Add --submit to queue a new job with sbatch instead."
        )
    allocated = int(env["SLURM_NNODES"]) if env.get("SLURM_NNODES", "").isdigit() else None
    if allocated is None:
        raise LaunchError(
            f"SLURM_JOB_ID={job_id} is set but SLURM_NNODES is not: cannot tell the node count."
        )
    nodes = _flag_or_cluster(args.nodes, "--nodes", overrides, "cluster.num_nodes", cfg) or allocated
    if nodes != allocated:
        # srun would pick `nodes` of the allocation, not necessarily the rendezvous head among them
        raise LaunchError(
            f"{nodes} node(s) asked for, but SLURM job {job_id} has {allocated}: inside an allocation usp-launch "
            f"runs on all of its nodes. Allocate {nodes} node(s), or add --submit to queue a job of that size."
        )
    nproc = _flag_or_cluster(args.nproc_per_node, "--gpus-per-node", overrides, "cluster.gpus_per_node", cfg)
    on_node = _slurm_gpus(env)
    if nproc is not None and on_node is not None and nproc > on_node:
        raise LaunchError(f"{nproc} processes per node, but SLURM job {job_id} has {on_node} GPUs per node.")
    nproc = nproc or on_node
    if nproc is None:
        raise LaunchError(
            f"SLURM job {job_id} shows no GPUs (SLURM_GPUS_ON_NODE / SLURM_GPUS_PER_NODE unset): "
            f"pass --gpus-per-node N, or allocate with --gpus-per-node=N."
        )
    _check(
        overrides,
        cfg,
        nodes=nodes,
        nproc_per_node=nproc,
        memory=not args.skip_memory_check,
        train=_is_train(args),
    )
    cpus = int(env["SLURM_CPUS_ON_NODE"]) if env.get("SLURM_CPUS_ON_NODE", "").isdigit() else None
    head = commands.first_hostname(env.get("SLURM_JOB_NODELIST", ""), shutil.which("scontrol"))
    return commands.srun_command(
        overrides,
        nodes=nodes,
        nproc_per_node=nproc,
        job_id=job_id,
        head=head,
        cpus_per_task=cpus,
        max_restarts=args.max_restarts,
        module=commands.ENTRY_MODULES[getattr(args, "entry", "train")],
    )


def _sbatch(args: argparse.Namespace, overrides: list[str], cfg: TrainConfig | None) -> list[str]:
    """sbatch for the flags' size, else the run config's declared ``cluster.num_nodes x cluster.gpus_per_node``."""
    nodes = _flag_or_cluster(args.nodes, "--nodes", overrides, "cluster.num_nodes", cfg)
    gpus = _flag_or_cluster(args.nproc_per_node, "--gpus-per-node", overrides, "cluster.gpus_per_node", cfg)
    if cfg is None and (nodes is None or gpus is None):
        raise LaunchError(
            "with Hydra flags after --, usp-launch does not compose the run config, so it cannot read the job's "
            "size from the recipe: pass --nodes N --gpus-per-node G."
        )
    nodes = nodes or cfg.cluster.num_nodes
    gpus = gpus or cfg.cluster.gpus_per_node
    _check(
        overrides,
        cfg,
        nodes=nodes,
        nproc_per_node=gpus,
        memory=not args.skip_memory_check,
        train=_is_train(args),
    )
    script = Path(args.script) if args.script else commands.default_sbatch_script()
    if not script.is_file():
        raise LaunchError(
            f"--script {script}: no such file. Pass --script PATH to your copy of slurm.sbatch."
        )
    return commands.sbatch_command(
        overrides,
        script=commands.display_path(script, Path.cwd()),
        nodes=nodes,
        gpus_per_node=gpus,
        partition=args.partition,
        time=args.time,
        account=args.account,
        job_name=args.job_name or "usp",
        gres=args.gres,
        max_restarts=args.max_restarts,
        entry=getattr(args, "entry", "train"),
    )


def _run(cmd: list[str]) -> int:
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
        args, extra = parser.parse_known_args(words)
    except SystemExit as exc:  # argparse already printed the usage / help
        return int(exc.code or 0)
    # After a literal `--`, words that are not key=value overrides are passed to usp.train unchanged: Hydra's
    # own flags and their values (--cfg job, --help, --info defaults).
    hydra_mode = any(word.startswith("-") for word in after_dashes)
    overrides = [*extra, *([] if hydra_mode else after_dashes)]
    hydra_flags = after_dashes if hydra_mode else []
    try:
        validate_override_syntax(overrides)
        cmd = plan_command(args, overrides, dict(os.environ), hydra_flags)
        if args.dry_run:
            print(shlex.join(cmd))
            return 0
        return _run(cmd)
    except (Exception, KeyboardInterrupt) as exc:  # noqa: BLE001 - the one report of a failure (usp.errors)
        return report("usp-launch", exc, verbose=verbose)


if __name__ == "__main__":
    raise SystemExit(main())
