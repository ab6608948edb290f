"""The command lines usp launches: one process, torchrun on one node, srun + torchrun on a SLURM allocation,
and the sbatch submission of ``launch/slurm.sbatch``.

Pure functions from plain arguments to ``argv`` lists, so that ``usp-launch --dry-run``, the shell scripts and
the tests agree on one exact form. The SLURM form is the same one ``launch/slurm.sbatch`` runs inside the job:
one task per node, each task a torchrun agent that starts ``nproc_per_node`` ranks and meets the others through
a c10d rendezvous hosted on the first node of the allocation.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

from usp.launch.overrides import has_override

TRAIN_MODULE = "usp.train"
"""The entry point every launcher runs with ``-m`` (``--entry train``, the default)."""
ENTRY_MODULES: dict[str, str] = {"train": TRAIN_MODULE, "eval": "usp.eval"}
"""``usp-launch --entry NAME`` -> the module run with ``-m``: training, or evaluation (``usp-eval``)."""

RDZV_PORT_BASE = 20000
RDZV_PORT_SPAN = 10000
SIGNALS_TO_HANDLE = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"
"""What the SLURM line's torchrun forwards to its ranks: its defaults plus SIGUSR1, the signal
``launch/slurm.sbatch`` asks for before the time limit (the ranks then checkpoint and stop)."""
SHUTDOWN_TIMEOUT_S = 240
"""How long the SLURM line's torchrun waits for its ranks to save and exit after forwarding a signal
before it kills them (torchrun's default, 30 s, is shorter than a large checkpoint save); less than the
300 s before the time limit that ``launch/slurm.sbatch`` asks for SIGUSR1."""


def with_defaults(overrides: Sequence[str], defaults: Sequence[tuple[str, str]]) -> list[str]:
    """Launcher-chosen ``key=value`` overrides first, then the user's; a key the user sets is not added."""
    added = [f"{key}={value}" for key, value in defaults if not has_override(overrides, key)]
    return [*added, *overrides]


def cpu_defaults() -> list[tuple[str, str]]:
    """Overrides that pin a run to CPU processes talking over gloo (the ``tiny`` recipe, laptops, CI)."""
    return [("trainer.device", "cpu"), ("parallel.backend", "gloo")]


def rdzv_port(job_id: str) -> int:
    """Rendezvous port for a SLURM job: ``20000 + job_id % 10000``.

    Derived from the job id so that every node computes the same port without talking, and two jobs sharing a
    head node rarely collide. ``launch/slurm.sbatch`` uses the same formula.
    """
    digits = re.sub(r"\D", "", job_id)
    if not digits:
        raise ValueError(f"SLURM_JOB_ID={job_id!r} has no digits; cannot derive a rendezvous port from it.")
    return RDZV_PORT_BASE + int(digits) % RDZV_PORT_SPAN


def first_hostname(nodelist: str, scontrol: str | None = None) -> str:
    """The first host of a SLURM node list (``SLURM_JOB_NODELIST``): the rendezvous head.

    Uses ``scontrol show hostnames`` when ``scontrol`` (a path) is given, as the sbatch script does; otherwise
    expands the compressed form itself (``gpu[003-005,9],cpu1`` -> ``gpu003``).

    Raises:
        ValueError: when the list is empty or not in SLURM's hostlist form.
    """
    if not nodelist.strip():
        raise ValueError("SLURM_JOB_NODELIST is empty: cannot choose the rendezvous head node.")
    if scontrol:
        out = subprocess.run(
            [scontrol, "show", "hostnames", nodelist], check=True, capture_output=True, text=True
        ).stdout.split()
        if out:
            return out[0]
    match = re.match(r"([^,\[]*)(?:\[([^\]]+)\])?([^,\[]*)", nodelist.strip())
    if match is None or not (match.group(1) or match.group(2)):
        raise ValueError(f"SLURM_JOB_NODELIST={nodelist!r} is not a SLURM host list (e.g. gpu[001-004]).")
    prefix, ranges, suffix = match.groups()
    if ranges is None:
        return prefix + suffix
    first = ranges.split(",", 1)[0].split("-", 1)[0]
    if not first.isdigit():
        raise ValueError(f"SLURM_JOB_NODELIST={nodelist!r}: cannot read the first host of [{ranges}].")
    return prefix + first + suffix


def local_command(overrides: Sequence[str], *, python: str, module: str = TRAIN_MODULE) -> list[str]:
    """One process, no launcher: ``python -m usp.train <overrides>``."""
    return [python, "-m", module, *overrides]


def _restarts(max_restarts: int) -> list[str]:
    return ["--max-restarts", str(max_restarts)] if max_restarts else []


def torchrun_command(
    overrides: Sequence[str], *, nproc_per_node: int, max_restarts: int = 0, module: str = TRAIN_MODULE
) -> list[str]:
    """One node: ``torchrun --standalone --nproc-per-node N [--max-restarts R] -m usp.train <overrides>``.

    torchrun exports ``LOCAL_WORLD_SIZE=N`` to every rank, which the mesh reads as the node size. With
    ``max_restarts`` torchrun restarts every rank up to R times after one fails; the ranks resume from the
    run dir's last checkpoint (give ``hydra.run.dir`` or ``run_name`` to resume across launches too).
    """
    return [
        "torchrun",
        "--standalone",
        "--nproc-per-node",
        str(nproc_per_node),
        *_restarts(max_restarts),
        "-m",
        module,
        *overrides,
    ]


def srun_command(
    overrides: Sequence[str],
    *,
    nodes: int,
    nproc_per_node: int,
    job_id: str,
    head: str,
    cpus_per_task: int | None = None,
    max_restarts: int = 0,
    module: str = TRAIN_MODULE,
) -> list[str]:
    """Inside a SLURM allocation: one torchrun agent per node, c10d rendezvous on ``head``.

    ``cpus_per_task`` (the allocation's ``SLURM_CPUS_ON_NODE``) gives the one task per node all of the node's
    cores: srun does not inherit sbatch's ``--cpus-per-task``, and a cluster that binds tasks to cores would
    otherwise pin the torchrun agent, and every rank it starts, to a single core.

    ``--kill-on-bad-exit=1`` ends every node's agent when one fails, instead of leaving the others waiting in
    a collective until the NCCL timeout. The overrides pass unchanged (no ``hydra.run.dir`` is added): the
    rendezvous id is the job id, so the entry point's default run dir is one that every rank agrees on.

    torchrun forwards :data:`SIGNALS_TO_HANDLE` (SIGUSR1 too) to the ranks and waits
    :data:`SHUTDOWN_TIMEOUT_S` for them to checkpoint and exit; ``max_restarts`` as in
    :func:`torchrun_command` (every node's ranks restart together, through the c10d rendezvous).
    """
    return [
        "srun",
        f"--nodes={nodes}",
        "--ntasks-per-node=1",
        *([f"--cpus-per-task={cpus_per_task}"] if cpus_per_task else []),
        "--kill-on-bad-exit=1",
        "torchrun",
        "--nnodes",
        str(nodes),
        "--nproc-per-node",
        str(nproc_per_node),
        "--rdzv-id",
        job_id,
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"{head}:{rdzv_port(job_id)}",
        "--max-restarts",
        str(max_restarts),
        "--signals-to-handle",
        SIGNALS_TO_HANDLE,
        "--shutdown-timeout",
        str(SHUTDOWN_TIMEOUT_S),
        "-m",
        module,
        *overrides,
    ]


def sbatch_command(
    overrides: Sequence[str],
    *,
    script: str,
    nodes: int,
    gpus_per_node: int,
    partition: str | None = None,
    time: str | None = None,
    account: str | None = None,
    job_name: str = "usp",
    gres: bool = False,
    max_restarts: int = 0,
    entry: str = "train",
) -> list[str]:
    """Submit ``script`` (``launch/slurm.sbatch``) for ``nodes`` nodes of ``gpus_per_node`` GPUs.

    GPUs are requested with ``--gpus-per-node=N``, or ``--gres=gpu:N`` when ``gres`` (older or gres-only
    clusters). The script receives ``--nproc-per-node N`` and the overrides unchanged: it adds no
    ``hydra.run.dir``, so a recipe that pins its run dir keeps it, and otherwise the entry point's default run
    dir (``outputs/${usp_run_id:${run_name}}``) derives from the job's name when it is named (the script
    adds ``run_name=<job name>``), else from its id: the same on every rank, and across requeues.
    """
    cmd = ["sbatch", f"--nodes={nodes}", "--ntasks-per-node=1"]
    cmd.append(f"--gres=gpu:{gpus_per_node}" if gres else f"--gpus-per-node={gpus_per_node}")
    for flag, value in (("partition", partition), ("time", time), ("account", account)):
        if value is not None:
            cmd.append(f"--{flag}={value}")
    cmd.append(f"--job-name={job_name}")
    # the script takes its own options first; `--` ends them when Hydra flags (--cfg job) are passed through
    dashes = ["--"] if any(word.startswith("-") for word in overrides) else []
    entry_flag = [] if entry == "train" else ["--entry", entry]  # the script runs usp.train unless told
    return [
        *cmd,
        script,
        "--nproc-per-node",
        str(gpus_per_node),
        *_restarts(max_restarts),
        *entry_flag,
        *dashes,
        *overrides,
    ]


def default_sbatch_script() -> Path:
    """``launch/slurm.sbatch`` of this checkout (the package is installed editable from the repository)."""
    return Path(__file__).resolve().parents[2] / "launch" / "slurm.sbatch"


def display_path(path: Path, cwd: Path) -> str:
    """``path`` relative to ``cwd`` when it lies below it (``launch/slurm.sbatch``), else absolute."""
    try:
        return str(path.resolve().relative_to(cwd.resolve()))
    except ValueError:
        return str(path.resolve())


def visible_devices(value: str | None) -> int | None:
    """How many devices ``CUDA_VISIBLE_DEVICES=value`` exposes; None when unset or empty (no restriction).

    Entries are comma-separated indices or UUIDs; like CUDA, the list ends at a negative entry (``-1``).
    """
    if not value or not value.strip():
        return None
    count = 0
    for entry in value.split(","):
        entry = entry.strip()
        if entry.startswith("-"):
            break
        count += bool(entry)
    return count


def count_gpus(env: Mapping[str, str] | None = None) -> int:
    """GPUs this machine's processes can use: those ``nvidia-smi -L`` lists, restricted to
    ``CUDA_VISIBLE_DEVICES`` when it is set and non-empty; 0 without nvidia-smi or a working driver."""
    env = os.environ if env is None else env
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return 0
    try:
        out = subprocess.run([smi, "-L"], check=True, capture_output=True, text=True, timeout=30).stdout
    except (subprocess.SubprocessError, OSError):
        return 0
    listed = sum(1 for line in out.splitlines() if line.startswith("GPU "))
    visible = visible_devices(env.get("CUDA_VISIBLE_DEVICES"))
    return listed if visible is None else min(listed, visible)
