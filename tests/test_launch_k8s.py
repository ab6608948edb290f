"""usp-launch k8s: its manifests validate against the published schemas, each pod runs what a SLURM node runs,
the committed example and the docs' commands are what it writes, and bad input is one error line."""

from __future__ import annotations

import copy
import dataclasses
import functools
import re
import shlex
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from usp.config import compose
from usp.launch import cli, common, k8s
from usp.launch.k8s import K8sOptions, Volume

REPO = Path(__file__).resolve().parents[1]
SCHEMAS = REPO / "tests" / "data" / "k8s"
EXAMPLE = REPO / "launch" / "k8s-trainjob.example.yaml"
DOC = REPO / "docs" / "launch.md"
K8S_VERSION = "1.33.0"
"""The Kubernetes release whose core schemas (kubernetes-validate's, strict) the pods are checked against."""
USER = ("model.path=/ckpt/m", "data.prepared_path=/data/d")
# an override with $ in it: Kubernetes reads $(VAR) and $$ in a container's args, so it must arrive unchanged
DOLLARS = "logging.wandb.name='cost $$5 $(HOME)'"
CASES = {
    "1node": ("recipe=llama2_7b_rope_32k", *USER, "hydra.run.dir=/runs/rope32k"),  # 1 node x 8
    "4nodes": ("recipe=llama3_70b_128k", *USER, "hydra.run.dir=/runs/70b", DOLLARS),  # 4 nodes x 8
}
SIZES = {"1node": (1, 8), "4nodes": (4, 8)}
OPTIONS = K8sOptions(
    image="registry.example.com/usp:1",
    volumes=(Volume("runs", "usp-runs", "/runs"), Volume("ckpt", "usp-ckpt", "/ckpt")),
    queue="team-a",
    max_restarts=2,
)


def _cached(function):
    """``function`` computed once per set of arguments (lists as tuples)."""
    cache: dict = {}

    @functools.wraps(function)
    def once(*args, **kwargs):
        key = repr((args, sorted(kwargs.items())))
        if key not in cache:
            cache[key] = function(*args, **kwargs)
        return cache[key]

    return once


@pytest.fixture(scope="module", autouse=True)
def _compose_once():
    """Composing with Hydra is most of a usp-launch call's time (seconds on a busy machine), and the same
    overrides compose to the same run config: this module composes each set of overrides once."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(common, "prepare", _cached(common.prepare))
        mp.setattr(compose, "hydra_run_dir", _cached(compose.hydra_run_dir))
        yield


@pytest.fixture(autouse=True)
def _nothing_runs(monkeypatch):
    """No SLURM allocation, the repo as cwd, and nothing may be started."""
    for var in (
        "SLURM_JOB_ID",
        "SLURM_NNODES",
        "SLURM_JOB_NODELIST",
        "SLURM_GPUS_ON_NODE",
        "SLURM_CPUS_ON_NODE",
    ):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.chdir(REPO)

    def refuse(*args, **kwargs):
        raise AssertionError(f"usp-launch tried to run {args}")

    monkeypatch.setattr(cli.subprocess, "run", refuse)


@pytest.fixture(scope="module")
def jobs() -> dict[tuple[str, str], k8s.K8sJob]:
    """:func:`usp.launch.k8s.plan` of every case in every format."""
    return {
        (case, fmt): k8s.plan(overrides, options=dataclasses.replace(OPTIONS, fmt=fmt))
        for case, overrides in CASES.items()
        for fmt in k8s.FORMATS
    }


@functools.cache
def crd_schema(fmt: str) -> dict:
    """The CRD's schema (tests/data/k8s) made strict: every object with listed properties takes no others,
    as the API server's strict field validation (kubectl's default) refuses unknown fields, which it would
    otherwise prune."""
    schema = yaml.load(
        (SCHEMAS / f"{fmt}.schema.yaml").read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    )

    def strict(node):
        if isinstance(node, dict):
            if "properties" in node and "additionalProperties" not in node:
                if not node.get("x-kubernetes-preserve-unknown-fields"):
                    node["additionalProperties"] = False
            for value in node.values():
                strict(value)
        elif isinstance(node, list):
            for value in node:
                strict(value)

    strict(schema)
    return schema


def core_objects(manifest: dict) -> list[dict]:
    """The core objects inside ``manifest``, whole: a TrainJob's pod (its trainer settings in the patched
    runtime container), a PyTorchJob's replica pods, a JobSet's batch/v1 Job."""
    metadata, spec = manifest["metadata"], manifest["spec"]
    if manifest["kind"] == "TrainJob":
        (patch,) = spec["runtimePatches"]
        (job,) = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
        pod = copy.deepcopy(job["template"]["spec"]["template"]["spec"])
        trainer = {k: v for k, v in spec["trainer"].items() if k in ("image", "command", "args", "env")}
        pod["containers"][0].update(trainer, resources=spec["trainer"]["resourcesPerNode"])
        return [{"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": pod}]
    if manifest["kind"] == "PyTorchJob":
        replicas = spec["pytorchReplicaSpecs"].values()
        return [{"apiVersion": "v1", "kind": "Pod", "metadata": metadata, **r["template"]} for r in replicas]
    (replicated,) = spec["replicatedJobs"]
    return [{"apiVersion": "batch/v1", "kind": "Job", "metadata": metadata, **replicated["template"]}]


def validate(manifest: dict) -> None:
    """``manifest`` against its CRD's schema, and its core objects against Kubernetes' (strict)."""
    fmt = manifest["kind"].lower()
    jsonschema.Draft4Validator(crd_schema(fmt)).validate(manifest)
    for obj in core_objects(manifest):
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def containers(manifest: dict) -> list[dict]:
    """Every pod's container as the pod gets it (a TrainJob's: the trainer's settings)."""
    spec = manifest["spec"]
    if manifest["kind"] == "TrainJob":
        return [spec["trainer"]]
    return [
        c for pod in core_objects(manifest) for c in pod["spec"].get("template", pod)["spec"]["containers"]
    ]


def kube_expand(word: str, env: dict[str, str]) -> str:
    """``word`` as a container gets it from its args: Kubernetes turns ``$$`` into ``$``, and ``$(VAR)`` into
    VAR's value for a VAR the container declares (else it is left as written)."""

    def one(match: re.Match) -> str:
        if match.group(0) == "$$":
            return "$"
        return env.get(match.group(1), match.group(0))

    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)", one, word)


def pod_argv(manifest: dict, index: int = 0) -> list[str]:
    """What the container of pod ``index`` runs, after Kubernetes' expansion (a JobSet pod's index is its
    ``JOB_COMPLETION_INDEX``)."""
    (container, *_) = containers(manifest)
    declared = {e["name"] for e in container.get("env", [])}
    env = {"JOB_COMPLETION_INDEX": str(index)} if "JOB_COMPLETION_INDEX" in declared else {}
    return [kube_expand(w, env) for w in [*container["command"], *container["args"]]]


def torchrun_parts(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    """torchrun's ``--flag value`` pairs, and what follows them (``-m module overrides...``)."""
    start = argv.index("torchrun") + 1
    cut = argv.index("-m", start)
    flags = argv[start:cut]
    return dict(zip(flags[::2], flags[1::2])), argv[cut:]


def usp_launch(capsys, *argv: str) -> tuple[int, str, str]:
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def error_line(capsys, *argv: str) -> str:
    """The one line usp-launch says for bad input (exit status 2, nothing on stdout)."""
    rc, out, err = usp_launch(capsys, *argv)
    assert (rc, out) == (2, ""), err
    assert err.startswith("usp-launch: error: ") and err.count("\n") == 1, err
    return err


# --- the manifests ------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", k8s.FORMATS)
@pytest.mark.parametrize("case", CASES)
def test_manifest_validates_against_the_published_schemas(jobs, case, fmt):
    manifest = jobs[case, fmt].manifest
    validate(manifest)
    assert yaml.safe_load(jobs[case, fmt].text) == manifest
    assert "&id" not in jobs[case, fmt].text  # no YAML anchors: every pod template written out
    nodes, gpus = SIZES[case]
    assert manifest["metadata"]["labels"] == {"kueue.x-k8s.io/queue-name": "team-a"}
    (container, *_) = containers(manifest)
    limits = (container.get("resources") or container["resourcesPerNode"])["limits"]
    assert limits == {"nvidia.com/gpu": gpus}
    pods = core_objects(manifest)
    spec = manifest["spec"]
    if fmt == "trainjob":
        assert (spec["trainer"]["numNodes"], spec["trainer"]["numProcPerNode"]) == (nodes, gpus)
        assert spec["runtimeRef"]["name"] == "torch-distributed"
    elif fmt == "pytorchjob":
        roles = {role: r["replicas"] for role, r in spec["pytorchReplicaSpecs"].items()}
        assert roles == ({"Master": 1, "Worker": nodes - 1} if nodes > 1 else {"Master": 1})
        assert {r["restartPolicy"] for r in spec["pytorchReplicaSpecs"].values()} == {"OnFailure"}
        assert (spec["runPolicy"]["backoffLimit"], spec["nprocPerNode"]) == (2, str(gpus))
    else:
        job = spec["replicatedJobs"][0]["template"]["spec"]
        assert (job["parallelism"], job["completions"], job["completionMode"]) == (nodes, nodes, "Indexed")
        assert (job["backoffLimit"], spec["failurePolicy"]["maxRestarts"]) == (0, 2)
    for pod in pods:
        pod_spec = pod["spec"].get("template", pod)["spec"]
        assert pod_spec["terminationGracePeriodSeconds"] == 300 > 240  # torchrun's --shutdown-timeout
        claims = {v["name"]: v.get("persistentVolumeClaim", {}).get("claimName") for v in pod_spec["volumes"]}
        assert claims == {"runs": "usp-runs", "ckpt": "usp-ckpt", "dshm": None}
        mounts = {m["mountPath"] for m in pod_spec["containers"][0]["volumeMounts"]}
        assert mounts == {"/runs", "/ckpt", "/dev/shm"}


@pytest.mark.parametrize(
    ("fmt", "where", "misspelled"),
    [
        ("trainjob", ("spec", "trainer"), "numProcsPerNode"),
        ("pytorchjob", ("spec", "runPolicy"), "backofLimit"),
        ("jobset", ("spec", "failurePolicy"), "maxRestart"),
    ],
)
def test_a_misspelled_field_fails_validation(jobs, fmt, where, misspelled):
    """The schemas are strict enough to catch a typo, in the CRD's own fields and in the core pod spec."""
    manifest = copy.deepcopy(jobs["1node", fmt].manifest)
    validate(manifest)
    node = manifest
    for key in where:
        node = node[key]
    node[misspelled] = 1
    with pytest.raises(jsonschema.ValidationError, match=misspelled):
        validate(manifest)
    manifest = copy.deepcopy(jobs["1node", fmt].manifest)
    (obj, *_) = core_objects(manifest)
    obj["spec"].get("template", obj)["spec"]["containers"][0]["volumeMount"] = []
    with pytest.raises(jsonschema.ValidationError, match="volumeMount"):
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_each_pod_runs_what_a_slurm_node_runs(jobs, capsys, monkeypatch):
    """The torchrun line of every pod (after Kubernetes' expansion of the args; a JobSet pod's node rank is
    its index) equals the one ``usp-launch slurm`` runs on each node for the same overrides: the module, the
    overrides verbatim (``$`` included), --nnodes, --nproc-per-node, --max-restarts, the forwarded signals
    and the shutdown timeout. Intended differences: the rendezvous (SLURM: c10d on the first host, the job id
    as rendezvous id; Kubernetes: the operator's PET_* variables, or for a JobSet --node-rank <pod index>
    --master-addr <pod 0's DNS name>), and ``run_name=<job name>`` in front of the overrides, which
    ``launch/slurm.sbatch`` adds too for a named job (``--job-name``), but srun in an allocation does not."""
    nodes, gpus = SIZES["4nodes"]
    allocation = {"SLURM_JOB_ID": "4242", "SLURM_NNODES": str(nodes), "SLURM_GPUS_ON_NODE": str(gpus)}
    for var, value in {**allocation, "SLURM_JOB_NODELIST": "gpu[001-004]"}.items():
        monkeypatch.setenv(var, value)
    rc, out, err = usp_launch(capsys, "slurm", "--max-restarts", "2", *CASES["4nodes"], "--dry-run")
    assert rc == 0, err
    slurm_flags, slurm_rest = torchrun_parts(shlex.split(out))
    for fmt in k8s.FORMATS:
        manifest = jobs["4nodes", fmt].manifest
        name = manifest["metadata"]["name"]
        for index in range(nodes):
            flags, rest = torchrun_parts(pod_argv(manifest, index))
            assert rest == [*slurm_rest[:2], f"run_name={name}", *slurm_rest[2:]]
            assert DOLLARS in rest
            same = {k: v for k, v in slurm_flags.items() if not k.startswith("--rdzv-")}
            head = {
                "--node-rank": str(index),
                "--master-addr": f"{name}-node-0-0.{name}",
                "--master-port": "29500",
            }
            assert flags == (same | head if fmt == "jobset" else same)


# --- the command line ---------------------------------------------------------------------------------
def example_words() -> list[str]:
    """The command the committed example names in its first line."""
    first = EXAMPLE.read_text().splitlines()[0]
    assert first.startswith("# usp-launch k8s "), first
    return shlex.split(first[2:])


def test_the_example_is_what_its_command_writes(capsys, tmp_path):
    """launch/k8s-trainjob.example.yaml is regenerated by the command in its header (--output writes it)."""
    written = tmp_path / "out" / "job.yaml"
    written.parent.mkdir()
    rc, out, err = usp_launch(capsys, *example_words()[1:], "--output", str(written))
    assert (rc, out) == (0, ""), err
    assert f"usp-launch: wrote {written}" in err
    assert written.read_text() == EXAMPLE.read_text()


def test_dry_run_prints_yaml_that_parses(capsys):
    rc, out, err = usp_launch(capsys, *example_words()[1:], "--dry-run")
    assert rc == 0, err
    assert out == EXAMPLE.read_text()
    manifest = yaml.safe_load(out)
    assert (manifest["kind"], manifest["metadata"]["name"]) == ("TrainJob", "ctx128k")
    validate(manifest)
    assert not list(REPO.glob("ctx128k.yaml"))  # --dry-run writes nothing


def test_the_modes_command_is_what_each_pod_runs():
    """``usp-launch``'s plan_command (the mode's ``command``) is the pods' command and args, as written."""
    args, overrides = cli.build_parser().parse_known_args(example_words()[1:])
    trainer = yaml.safe_load(EXAMPLE.read_text())["spec"]["trainer"]
    assert cli.plan_command(args, overrides, {}) == [*trainer["command"], *trainer["args"]]


def test_apply_runs_kubectl_on_the_written_file(capsys, monkeypatch, tmp_path):
    ran = []
    monkeypatch.setattr(k8s.common, "run_command", lambda cmd: ran.append(cmd) or 0)
    monkeypatch.setattr(k8s.shutil, "which", lambda name: f"/usr/bin/{name}")
    monkeypatch.chdir(tmp_path)
    rc, out, err = usp_launch(capsys, *example_words()[1:], "--apply")
    assert rc == 0, err
    assert ran == [["kubectl", "apply", "-f", "ctx128k.yaml"]]  # the default --output: <job name>.yaml
    assert (tmp_path / "ctx128k.yaml").read_text() == EXAMPLE.read_text()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["recipe=llama31_8b_128k", *USER], "no --image: give the image every pod runs"),
        (["--image", "x", "--volume", "data=usp-data", "recipe=tiny"], "no mount path after CLAIM"),
        (["--image", "x", "--volume", "data=usp-data:", "recipe=tiny"], "no mount path after CLAIM"),
        (["--image", "x", "--volume", "data=usp-data:data", "recipe=tiny"], "data is not absolute"),
        (["--image", "x", "--volume", "Data=usp-data:/data", "recipe=tiny"], "NAME takes lowercase"),
        (["--image", "x", "--volume", "/data", "recipe=tiny"], "/data: not NAME=CLAIM:PATH"),
        (
            ["--image", "x", "--volume", "a=b:/d", "--volume", "c=d:/d/", "recipe=tiny"],
            "the path /d is taken",
        ),
        (["--image", "x", "--cpu", "recipe=tiny"], "Kubernetes pods use GPUs (drop --cpu)"),
        (
            ["--image", "x", "--format", "jobset", "--runtime", "r", "recipe=tiny"],
            "drop it for --format jobset",
        ),
        (["--image", "x", "--job-name", "Big_Name", "recipe=tiny"], "--job-name Big_Name: use lowercase"),
    ],
)
def test_bad_input_is_one_error_line(capsys, argv, message):
    assert message in error_line(capsys, "k8s", *argv, "--dry-run")


def test_more_gpus_per_pod_than_the_node_size(capsys, tmp_path):
    """The layout check accepts 16 ranks per node with node size 8 (two emulated nodes per machine); on
    Kubernetes one pod is one node, so k8s refuses it, naming both settings."""
    flags = ["--image", "x", "--nodes", "1", "--gpus-per-node", "16"]
    overrides = ["recipe=llama31_8b_128k", *USER, "parallel.node_size=8", f"hydra.run.dir={tmp_path}"]
    err = error_line(capsys, "k8s", *flags, *overrides, "--dry-run")
    assert (
        "--gpus-per-node=16 is more than the node size parallel.node_size=8, but one pod is one node" in err
    )


def test_apply_without_kubectl_is_an_error(capsys, monkeypatch):
    monkeypatch.setattr(k8s.shutil, "which", lambda name: None)
    err = error_line(capsys, "k8s", *example_words()[2:], "--apply")
    assert "--apply: kubectl is not on PATH" in err


def test_run_dir_on_no_volume_is_a_warning(capsys):
    assert k8s.on_volume("/runs/x/checkpoints", [Volume("r", "c", "/runs")])
    assert not k8s.on_volume("/runsx", [Volume("r", "c", "/runs")])
    assert not k8s.on_volume("outputs/x", [Volume("r", "c", "/runs")])
    k8s._warn_off_volume(["hydra.run.dir=outputs/x"], None, "train", [Volume("r", "c", "/runs")])
    assert "warning: hydra.run.dir=outputs/x is on no --volume" in capsys.readouterr().err


# --- the docs -----------------------------------------------------------------------------------------
def fenced_blocks() -> list[tuple[str, str]]:
    """``(language, text)`` of docs/launch.md's fenced blocks (language ``""`` for a plain one)."""
    blocks, lang, lines = [], None, []
    for line in DOC.read_text().splitlines(keepends=True):
        if line.startswith("```") and lang is None:
            lang, lines = line[3:].strip(), []
        elif line.startswith("```"):
            blocks.append((lang, "".join(lines)))
            lang = None
        elif lang is not None:
            lines.append(line)
    return blocks


def doc_commands() -> list[list[str]]:
    """The ``usp-launch k8s`` commands of the bash blocks, continuation lines joined, comments dropped."""
    found = []
    for lang, text in fenced_blocks():
        for line in text.replace("\\\n", " ").splitlines() if lang == "bash" else []:
            words = shlex.split(line, comments=True)
            found += [words] if words[:2] == ["usp-launch", "k8s"] else []
    return found


def doc_errors() -> list[tuple[list[str], str]]:
    """The ``$ usp-launch k8s ...`` examples of the plain blocks, with the error line each shows."""
    found = []
    for lang, text in fenced_blocks():
        for example in re.split(r"^\$ ", text, flags=re.M)[1:] if lang == "" else []:
            command, _, shown = example.replace("\\\n", " ").partition("\n")
            if shown.startswith("usp-launch: error: ") and command.startswith("usp-launch k8s "):
                found.append((shlex.split(command), " ".join(shown.split())))
    return found


def test_the_docs_commands_work_as_written(capsys):
    """docs/launch.md's k8s commands print a valid manifest of their format (with --dry-run), one per format,
    and its errors are what usp-launch says."""
    formats = []
    for words in doc_commands():
        formats.append(words[words.index("--format") + 1] if "--format" in words else "trainjob")
        rc, out, err = usp_launch(capsys, *words[1:], *([] if "--dry-run" in words else ["--dry-run"]))
        assert rc == 0, (words, err)
        manifest = yaml.safe_load(out)
        assert manifest["kind"].lower() == formats[-1]
        validate(manifest)
    assert sorted(formats) == sorted(k8s.FORMATS)
    errors = doc_errors()
    assert len(errors) >= 2
    for words, shown in errors:
        assert " ".join(error_line(capsys, *words[1:]).split()) == shown
