"""``usp-launch k8s``: the run as a Kubernetes manifest (Kubeflow Trainer TrainJob, PyTorchJob or JobSet).

::

    usp-launch k8s --image IMAGE [--format trainjob|pytorchjob|jobset] [--volume NAME=CLAIM:PATH ...]
                   [--namespace NS] [--queue Q] [--nodes N] [--gpus-per-node G] [--job-name J]
                   [--runtime R] [--output FILE] [--apply] [--max-restarts R] [overrides...] [--dry-run]

It checks the run as ``usp-launch slurm`` does (nodes and GPUs per node default to ``cluster.num_nodes`` /
``cluster.gpus_per_node``), then writes a manifest (:func:`build_manifest`) of one pod per node, each with
``nvidia.com/gpu: G`` and running :func:`pod_command`: ``launch/slurm.sbatch``'s torchrun line (its sizes,
restarts, signals, shutdown timeout, ``-m usp.train`` and the overrides verbatim) with the operator's
rendezvous (Trainer and PyTorchJob export ``PET_NODE_RANK`` / ``PET_MASTER_ADDR``; a JobSet's line names the
pod's index and pod 0's DNS name), and ``run_name=<job name>`` first (unless the overrides set it), as the
sbatch script adds for a named job: one run dir for every pod and restart. ``--dry-run`` prints it; else it
goes to ``--output`` (default ``<job name>.yaml``) and, with ``--apply``, to ``kubectl apply -f``.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import shutil
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path, PurePosixPath

import yaml

from usp.launch import commands, common
from usp.launch.common import LaunchError
from usp.launch.overrides import find_override, has_override

NAME = "k8s"
HELP = "Kubernetes: a TrainJob, PyTorchJob or JobSet manifest (kubectl apply)"

API = {
    "trainjob": ("trainer.kubeflow.org/v1alpha1", "TrainJob"),
    "pytorchjob": ("kubeflow.org/v1", "PyTorchJob"),
    "jobset": ("jobset.x-k8s.io/v1alpha2", "JobSet"),
}
"""``--format`` -> the object's apiVersion and kind."""
FORMATS = tuple(API)
DEFAULT_RUNTIME = "torch-distributed"
"""The ClusterTrainingRuntime a TrainJob names unless ``--runtime``: Kubeflow Trainer's PyTorch runtime."""
NODE = "node"
"""``torch-distributed``'s replicated job and container; JobSet pod ``i`` is ``<job name>-node-0-i``."""
MASTER_PORT = 29500
"""The JobSet's rendezvous port on pod 0 (torchrun's default ``--master-port``)."""
GRACE_PERIOD_S = commands.SHUTDOWN_TIMEOUT_S + 60
"""``terminationGracePeriodSeconds``, 300: on SIGTERM (deletion, eviction, preemption) torchrun, the
container's process, forwards it to the ranks, which save a checkpoint after the step and exit, and waits
up to its ``--shutdown-timeout`` (240 s) for them; a minute more lets torchrun exit before the SIGKILL."""
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
SHM = {"name": "dshm", "emptyDir": {"medium": "Memory"}}
"""Memory-backed ``/dev/shm`` in every pod: a container's default 64 MiB is too small for NCCL."""
_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")  # DNS-1123 label: volume and namespace names
_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")  # claim names
_JOB_NAME = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")  # RFC 1035 label: what the operators accept


@dataclass(frozen=True)
class Volume:
    """``--volume NAME=CLAIM:PATH``: the PersistentVolumeClaim ``claim`` mounted at ``path`` in every pod."""

    name: str
    claim: str
    path: str

    def __str__(self) -> str:
        return f"{self.name}={self.claim}:{self.path}"


def parse_volume(spec: str) -> Volume:
    """``NAME=CLAIM:PATH`` -> :class:`Volume`; a LaunchError says what is wrong, and the form."""
    name, eq, rest = spec.partition("=")
    claim, colon, path = rest.partition(":")
    problem = None
    if not eq:
        problem = "not NAME=CLAIM:PATH"
    elif not _LABEL.fullmatch(name) or len(name) > 63:
        problem = "NAME takes lowercase letters, digits and '-' (63 at most)"
    elif not _SUBDOMAIN.fullmatch(claim) or len(claim) > 253:
        problem = "CLAIM is not a PersistentVolumeClaim's name (lowercase letters, digits, '-', '.')"
    elif not colon or not path:
        problem = "no mount path after CLAIM"
    elif not path.startswith("/"):
        problem = f"the mount path {path} is not absolute"
    if problem:
        raise LaunchError(
            f"--volume {spec}: {problem}. Use NAME=CLAIM:PATH, the PersistentVolumeClaim CLAIM mounted at "
            "PATH, e.g. --volume data=usp-data:/data."
        )
    return Volume(name, claim, str(PurePosixPath(path)))


def check_volumes(volumes: Sequence[Volume]) -> None:
    """No two volumes with one name or one mount path, nor :data:`SHM`'s (``dshm``, ``/dev/shm``)."""
    for field, own in (("name", SHM["name"]), ("path", "/dev/shm")):
        values = [getattr(v, field) for v in volumes] + [own]
        twice = sorted({value for value in values if values.count(value) > 1})
        if twice:
            raise LaunchError(f"--volume: the {field} {twice[0]} is taken (dshm on /dev/shm is usp's).")


def on_volume(path: str, volumes: Sequence[Volume]) -> bool:
    """Whether ``path`` lies on one of ``volumes``: absolute, and at or below one's mount path."""
    p = PurePosixPath(path)
    return p.is_absolute() and any(p.is_relative_to(v.path) for v in volumes)


def default_job_name(overrides: Sequence[str]) -> str:
    """``usp-<recipe>`` (``recipe=llama31_8b_128k``: ``usp-llama31-8b-128k``), ``usp`` without a recipe."""
    recipe = find_override(overrides, "recipe")
    return "-".join(["usp", *re.findall(r"[a-z0-9]+", recipe.lower())]) if isinstance(recipe, str) else "usp"


def check_job_name(name: str, *, fmt: str, nodes: int) -> None:
    """An RFC 1035 label short enough for the pod names the operator derives from it (63 characters)."""
    longest = f"{name}-worker-{nodes - 1}" if fmt == "pytorchjob" else f"{name}-{NODE}-0-{nodes - 1}-xxxxx"
    if not _JOB_NAME.fullmatch(name) or len(longest) > 63:
        raise LaunchError(
            f"--job-name {name}: use lowercase letters, digits and '-', starting with a letter, and at most "
            f"{63 - len(longest) + len(name)} characters here (pod names, e.g. {longest}, must fit in 63)."
        )


def pod_command(
    overrides: Sequence[str],
    *,
    nodes: int,
    gpus_per_node: int,
    max_restarts: int = 0,
    module: str = commands.TRAIN_MODULE,
    rendezvous: Sequence[str] = (),
) -> list[str]:
    """What each pod runs: torchrun with :func:`usp.launch.commands.srun_command`'s node count, processes,
    restarts, signals and shutdown timeout, and ``rendezvous`` (empty: the operator's ``PET_*`` variables)."""
    sizes = ["--nnodes", str(nodes), "--nproc-per-node", str(gpus_per_node), *rendezvous]
    restarts = ["--max-restarts", str(max_restarts), "--signals-to-handle", commands.SIGNALS_TO_HANDLE]
    shutdown = ["--shutdown-timeout", str(commands.SHUTDOWN_TIMEOUT_S)]
    return ["torchrun", *sizes, *restarts, *shutdown, "-m", module, *overrides]


def jobset_rendezvous(name: str) -> list[str]:
    """A JobSet's static rendezvous: the node rank is the pod's completion index, the host pod 0."""
    head = f"{name}-{NODE}-0-0.{name}"  # pod 0's hostname . the JobSet's headless service (its subdomain)
    rank = ["--node-rank", "$(JOB_COMPLETION_INDEX)"]  # declared in the container's env (build_manifest)
    return [*rank, "--master-addr", head, "--master-port", str(MASTER_PORT)]


@dataclass(frozen=True)
class K8sOptions:
    """The manifest's own settings (``usp-launch k8s``'s flags); None: not given (for ``nodes`` and
    ``gpus_per_node``: the run config's ``cluster.*``)."""

    fmt: str = "trainjob"
    image: str | None = None
    volumes: tuple[Volume, ...] = ()
    namespace: str = "default"
    queue: str | None = None
    nodes: int | None = None
    gpus_per_node: int | None = None
    job_name: str | None = None
    runtime: str = DEFAULT_RUNTIME
    max_restarts: int = 0

    def flags(self) -> list[str]:
        """These settings as ``usp-launch k8s`` flags: ``--format``, and those not at their defaults."""
        words = []
        for field in fields(self):
            value = getattr(self, field.name)
            if field.name != "fmt" and value == field.default:
                continue
            flag = "--" + {"fmt": "format", "volumes": "volume"}.get(field.name, field.name).replace("_", "-")
            for one in value if field.name == "volumes" else [value]:
                words += [flag, str(one)]
        return words


def build_manifest(
    options: K8sOptions, *, name: str, command: Sequence[str], nodes: int, gpus_per_node: int
) -> dict:
    """The ``options.fmt`` object (:data:`API`) named ``name``, of ``nodes`` pods of ``gpus_per_node`` GPUs,
    each running ``command`` (``command[0]`` as the container's command, the rest as its args, as written:
    Kubernetes reads ``$(VAR)`` there), with ``options``' image, namespace, Kueue queue and volumes.

    Restarts (``options.max_restarts``): a JobSet recreates all its pods after one fails (``failurePolicy``;
    its Job's ``backoffLimit`` is 0, so one failed pod fails the Job); a PyTorchJob restarts failed containers
    (``OnFailure``, up to ``runPolicy.backoffLimit``); a TrainJob's are its runtime's (TrainJob v1alpha1 has
    no such field). A TrainJob gets the volumes, ``/dev/shm`` and the grace period as ``runtimePatches``."""
    o = options
    api_version, kind = API[o.fmt]
    metadata = {"name": name, "namespace": o.namespace}
    metadata.update({"labels": {QUEUE_LABEL: o.queue}} if o.queue else {})
    mounts = [{"name": v.name, "mountPath": v.path} for v in o.volumes]
    mounts.append({"name": SHM["name"], "mountPath": "/dev/shm"})
    claims = [{"name": v.name, "persistentVolumeClaim": {"claimName": v.claim}} for v in o.volumes]
    pod: dict = {"terminationGracePeriodSeconds": GRACE_PERIOD_S, "containers": [], "volumes": [*claims, SHM]}
    container = {"name": NODE, "image": o.image, "command": list(command[:1]), "args": list(command[1:])}
    gpus = {"limits": {"nvidia.com/gpu": gpus_per_node}}
    if o.fmt == "trainjob":
        pod["containers"] = [{"name": NODE, "volumeMounts": mounts}]
        jobs = [{"name": NODE, "template": {"spec": {"template": {"spec": pod}}}}]
        trainer = {**container, "numNodes": nodes, "numProcPerNode": gpus_per_node, "resourcesPerNode": gpus}
        del trainer["name"]
        runtime = {"apiGroup": "trainer.kubeflow.org", "kind": "ClusterTrainingRuntime", "name": o.runtime}
        runtime_spec = {"template": {"spec": {"replicatedJobs": jobs}}}
        patch = {"manager": "usp-launch", "trainingRuntimeSpec": runtime_spec}
        spec = {"runtimeRef": runtime, "trainer": trainer, "runtimePatches": [patch]}
    elif o.fmt == "pytorchjob":
        pod["containers"] = [{**container, "name": "pytorch", "resources": gpus, "volumeMounts": mounts}]
        role = {"restartPolicy": "OnFailure" if o.max_restarts else "Never", "template": {"spec": pod}}
        roles = {"Master": {"replicas": 1, **role}, "Worker": {"replicas": nodes - 1, **role}}
        spec = {"nprocPerNode": str(gpus_per_node), "runPolicy": {"backoffLimit": o.max_restarts}}
        spec["pytorchReplicaSpecs"] = roles if nodes > 1 else {"Master": roles["Master"]}
    else:  # jobset: $(JOB_COMPLETION_INDEX) is declared, so Kubernetes puts the pod's index in the args
        index = "metadata.annotations['batch.kubernetes.io/job-completion-index']"
        env = [{"name": "JOB_COMPLETION_INDEX", "valueFrom": {"fieldRef": {"fieldPath": index}}}]
        pod["containers"] = [{**container, "env": env, "resources": gpus, "volumeMounts": mounts}]
        job = {"parallelism": nodes, "completions": nodes, "completionMode": "Indexed", "backoffLimit": 0}
        job["template"] = {"spec": {"restartPolicy": "Never", **pod}}
        spec = {"failurePolicy": {"maxRestarts": o.max_restarts}, "network": {"enableDNSHostnames": True}}
        spec["replicatedJobs"] = [{"name": NODE, "replicas": 1, "template": {"spec": job}}]
    return {"apiVersion": api_version, "kind": kind, "metadata": metadata, "spec": spec}


def render(manifest: Mapping, generated_by: Sequence[str]) -> str:
    """The manifest as YAML under a comment naming the command that wrote it (``generated_by``, its words)."""
    line = shlex.join(generated_by).replace("\n", "\\n")
    header = f"# {line}\n# Written by usp-launch (docs/launch.md, Kubernetes). Submit: kubectl apply -f <this file>\n"
    plain = json.loads(json.dumps(manifest))  # shares no objects, so no YAML anchors (PyTorchJob replicas)
    return header + yaml.safe_dump(plain, sort_keys=False, width=1_000_000)


@dataclass(frozen=True)
class K8sJob:
    """A checked run: its name, what each pod's container runs (as the manifest writes it: Kubernetes reads
    ``$(VAR)`` and ``$$`` there), the manifest and its YAML (:func:`render`)."""

    name: str
    command: list[str]
    manifest: dict
    text: str


def plan(
    overrides: Sequence[str],
    hydra_flags: Sequence[str] = (),
    *,
    options: K8sOptions,
    entry: str = "train",
    memory: bool = True,
) -> K8sJob:
    """Every check, then the manifest. The options' own checks come first (a bad flag composes nothing); then
    the overrides, with ``run_name=<job name>`` in front, are composed (:func:`usp.launch.common.prepare`)
    and checked for ``nodes x gpus_per_node`` processes as ``usp-launch slurm`` checks them."""
    o = options
    if not o.image or any(c.isspace() for c in o.image):
        raise LaunchError(
            "no --image: give the image every pod runs, with this repository installed (pip install -e .) "
            "and a CUDA build of torch, e.g. --image registry.example.com/team/usp:0.1.0."
        )
    check_volumes(o.volumes)
    if not _LABEL.fullmatch(o.namespace):
        raise LaunchError(f"--namespace {o.namespace}: use lowercase letters, digits and '-' (a namespace).")
    if o.runtime != DEFAULT_RUNTIME and o.fmt != "trainjob":
        raise LaunchError(f"--runtime is a TrainJob's ClusterTrainingRuntime: drop it for --format {o.fmt}.")
    name = o.job_name or default_job_name(overrides)
    check_job_name(name, fmt=o.fmt, nodes=o.nodes or 1)  # before composing; with the run's node count below
    # run_name: one run dir for every pod and every restart (outputs/<job name>, unless hydra.run.dir)
    words = [*([] if has_override(overrides, "run_name") else [f"run_name={name}"]), *overrides]
    request = common.prepare(words, hydra_flags, entry=entry, memory=memory, on_this_machine=False)
    cfg, words = request.cfg, request.overrides
    nodes = common.flag_or_cluster(o.nodes, "--nodes", words, "cluster.num_nodes", cfg)
    gpus = common.flag_or_cluster(o.gpus_per_node, "--gpus-per-node", words, "cluster.gpus_per_node", cfg)
    if cfg is None and (nodes is None or gpus is None):
        raise LaunchError(
            "with Hydra flags after --, usp-launch does not compose the run config, so it cannot read the "
            "job's size from the recipe: pass --nodes N --gpus-per-node G."
        )
    nodes, gpus = nodes or cfg.cluster.num_nodes, gpus or cfg.cluster.gpus_per_node
    check_job_name(name, fmt=o.fmt, nodes=nodes)
    node_size = cfg.parallel.node_size if cfg is not None else find_override(words, "parallel.node_size")
    if isinstance(node_size, int) and gpus > node_size:
        raise LaunchError(
            f"--gpus-per-node={gpus} is more than the node size parallel.node_size={node_size}, but one "
            f"pod is one node: use --gpus-per-node {node_size} (more --nodes), or parallel.node_size={gpus}."
        )
    request.check(nodes=nodes, nproc_per_node=gpus)
    if cfg is not None:
        _warn_off_volume(words, cfg.trainer.checkpoint_dir, entry, o.volumes)
    rdzv = jobset_rendezvous(name) if o.fmt == "jobset" else ()
    words = [w.replace("$", "$$") for w in words]  # Kubernetes reads $(VAR) and $$ in args: $ as written
    sizes = {"nodes": nodes, "gpus_per_node": gpus, "max_restarts": o.max_restarts}
    cmd = pod_command(words, **sizes, module=request.module, rendezvous=rdzv)
    if o.fmt == "trainjob" and len(cmd) > 129:
        raise LaunchError(f"a TrainJob's spec.trainer.args holds 128 words; this run has {len(cmd) - 1}.")
    manifest = build_manifest(o, name=name, command=cmd, nodes=nodes, gpus_per_node=gpus)
    flags = [*options.flags(), *(["--entry", entry] if entry != "train" else [])]
    flags += [] if memory else ["--skip-memory-check"]
    generated_by = ["usp-launch", NAME, *flags, *overrides, *(["--", *hydra_flags] if hydra_flags else [])]
    return K8sJob(name=name, command=cmd, manifest=manifest, text=render(manifest, generated_by))


def _warn_off_volume(words: Sequence[str], ckpt: str | None, entry: str, volumes: Sequence[Volume]) -> None:
    """A warning for a run dir (or checkpoint dir) on no ``--volume``: each pod would write its own dir."""
    from usp.config.compose import hydra_run_dir

    try:
        run_dir = hydra_run_dir(words, "eval" if entry == "eval" else "train")
    except Exception:  # noqa: BLE001 - a run dir only the job resolves: common.prepare's check said so
        return
    dirs = [("hydra.run.dir", run_dir)]
    if entry == "train":
        dirs.append(("trainer.checkpoint_dir", ckpt or str(PurePosixPath(run_dir) / "checkpoints")))
    for setting, path in dirs:
        if not on_volume(path, volumes):
            print(
                f"usp-launch: warning: {setting}={path} is on no --volume: each pod writes its own, and "
                f"a restarted pod finds no checkpoint; put it on a claim all pods mount (--volume).",
                file=sys.stderr,
            )
            return


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        NAME,
        help=HELP,
        description="Write the run as a Kubernetes manifest, one pod per node: a Kubeflow Trainer TrainJob, "
        "a Kubeflow PyTorchJob or a JobSet; --apply submits it with kubectl.",
        allow_abbrev=False,
    )
    p.add_argument("--format", choices=FORMATS, default="trainjob", help="the object (default trainjob)")
    p.add_argument("--image", help="the image every pod runs (required): usp installed, a CUDA torch")
    mount = "mount the PersistentVolumeClaim CLAIM at PATH in every pod (repeatable)"
    p.add_argument("--volume", dest="volumes", action="append", metavar="NAME=CLAIM:PATH", help=mount)
    p.add_argument("--namespace", metavar="NS", default="default", help="the namespace (default: default)")
    p.add_argument("--queue", metavar="Q", help=f"a Kueue LocalQueue: the {QUEUE_LABEL} label")
    p.add_argument("--job-name", metavar="J", help="its name and run_name (default usp-<recipe>)")
    p.add_argument("--runtime", default=DEFAULT_RUNTIME, help="TrainJob: the ClusterTrainingRuntime")
    p.add_argument("--output", metavar="FILE", help="where to write the manifest (default <job name>.yaml)")
    p.add_argument("--apply", action="store_true", help="then run kubectl apply -f FILE")
    common.add_nproc_per_node(p, "GPUs (processes) per pod, one per node (default: cluster.gpus_per_node)")
    common.add_nodes(p, "number of nodes, one pod each (default: the run config's cluster.num_nodes)")
    common.add_max_restarts(p, "torchrun's restarts of each pod's ranks, and the job's restarts of its pods")
    common.add_cpu(p, argparse.SUPPRESS)  # taken only to refuse it: the pods use GPUs
    common.add_common_arguments(p)
    return p


def _plan_from_args(args: argparse.Namespace, overrides: list[str], hydra_flags: Sequence[str]) -> K8sJob:
    """:func:`plan` of the parsed flags (with :func:`command` and :func:`run`, the one reader of ``args``)."""
    common.check_counts(nproc_per_node=args.nproc_per_node, nodes=args.nodes, max_restarts=args.max_restarts)
    if args.cpu:
        raise LaunchError("--cpu applies to local and torchrun; Kubernetes pods use GPUs (drop --cpu).")
    same = {
        key: getattr(args, key) for key in ("image", "namespace", "queue", "nodes", "job_name", "runtime")
    }
    volumes = tuple(parse_volume(spec) for spec in args.volumes or ())
    given = dict(
        fmt=args.format, volumes=volumes, gpus_per_node=args.nproc_per_node, max_restarts=args.max_restarts
    )
    options = K8sOptions(**same, **given)
    return plan(overrides, hydra_flags, options=options, entry=args.entry, memory=not args.skip_memory_check)


def command(
    args: argparse.Namespace, overrides: list[str], env: Mapping[str, str], hydra_flags: Sequence[str] = ()
) -> list[str]:
    """What each pod runs (:attr:`K8sJob.command`), after every check."""
    return _plan_from_args(args, overrides, hydra_flags).command


def run(
    args: argparse.Namespace, overrides: list[str], env: Mapping[str, str], hydra_flags: Sequence[str] = ()
) -> int:
    """``usp-launch k8s``: print the manifest (``--dry-run``: nothing written or applied), or write it to
    ``--output`` and, with ``--apply``, run ``kubectl apply -f`` on it; the exit status."""
    if args.apply and not args.dry_run and shutil.which("kubectl") is None:
        raise LaunchError(
            "--apply: kubectl is not on PATH. Install it and point it at the cluster, or drop --apply and "
            "run kubectl apply -f FILE where kubectl is."
        )
    job = _plan_from_args(args, overrides, hydra_flags)
    if args.dry_run:
        print(job.text, end="")
        return 0
    path = Path(args.output or f"{job.name}.yaml")
    path.write_text(job.text)
    print(f"usp-launch: wrote {path}", file=sys.stderr)
    return common.run_command(["kubectl", "apply", "-f", str(path)]) if args.apply else 0
