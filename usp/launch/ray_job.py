"""The Ray Train job that ``usp-launch ray`` starts: ``python -m usp.launch.ray_job [options] -- OVERRIDES``.

The driver (:func:`main`) joins a Ray cluster (``--address``) or starts a local one, and runs a Ray Train
``TorchTrainer`` with one worker per GPU (``--cpu``: one CPU worker each, on gloo). Every worker
(:func:`train_worker`) starts the same entry point torchrun would, ``python -m usp.train OVERRIDES``, as its
child process, with the environment torchrun gives a rank:

- ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK`` / ``NODE_RANK`` from Ray
  Train's context (ranks grouped by node: the ranks of node ``n`` are ``[n G, (n + 1) G)``, which is what keeps
  each Ulysses group inside one node, :mod:`usp.parallel.mesh`);
- ``MASTER_ADDR`` / ``MASTER_PORT``: rank 0's node and a port free there, chosen by rank 0 for each attempt
  and broadcast over Ray Train's own (gloo, CPU-only) process group; rank 0 hosts usp's store on it.

Placement: the workers are packed by node (``PACK``), and before anything trains every worker checks that its
node holds exactly ``--nproc-per-node`` of the run's workers; otherwise a Ulysses group could span nodes and
the run stops with a message saying so.

Failures: a child that exits non-zero (a crash, a killed rank, the exit status 75 of a SIGTERM / SIGUSR1
checkpoint) fails its worker; Ray Train then ends the worker group, whose children die with their workers
(``PR_SET_PDEATHSIG``), and with ``--max-restarts R`` (Ray Train's ``FailureConfig(max_failures=R)``) starts
it again, up to R times: the new children resume from the run dir's last checkpoint, as torchrun's restarts
do. The run dir must therefore be the same for every attempt and every node: ``usp-launch ray`` pins it
(``run_name``) unless the command line does.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Mapping, Sequence
from typing import Any

INSTALL_HINT = "pip install 'usp[ray]'"
"""The install line of Ray Train, the optional extra ``usp[ray]``."""
_PR_SET_PDEATHSIG = 1


class PlacementError(RuntimeError):
    """Ray placed the run's workers so that a node holds another number of them than the run expects."""


def worker_env(
    base: Mapping[str, str],
    *,
    rank: int,
    world_size: int,
    local_rank: int,
    local_world_size: int,
    node_rank: int,
    master_addr: str,
    master_port: int,
) -> dict[str, str]:
    """``base`` with the variables torchrun exports to a rank (what :mod:`usp.parallel.process_group` and the
    mesh read); Ray Train's own ``MASTER_ADDR`` / ``MASTER_PORT`` (its process group's) are replaced."""
    return {
        **base,
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(local_world_size),
        "GROUP_RANK": str(node_rank),
        "NODE_RANK": str(node_rank),
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
    }


def check_placement(
    *, local_world_size: int, nproc_per_node: int, node_rank: int, local_rank: int, rank: int
) -> None:
    """:class:`PlacementError` unless this worker's node holds ``nproc_per_node`` of the run's workers and
    the ranks go node by node (``rank = node_rank x nproc_per_node + local_rank``), which is what keeps every
    Ulysses group (consecutive ranks) inside one node."""
    if local_world_size == nproc_per_node and rank != node_rank * nproc_per_node + local_rank:
        raise PlacementError(
            f"Ray Train gave rank {rank} to local rank {local_rank} of node {node_rank}: the ranks of a node are "
            f"not consecutive, so a Ulysses group could span nodes. Report this with your Ray version."
        )
    if local_world_size != nproc_per_node:
        raise PlacementError(
            f"Ray placed {local_world_size} of the run's workers on node {node_rank} (rank {rank}'s), but the "
            f"run expects {nproc_per_node} per node (--nproc-per-node / cluster.gpus_per_node): a Ulysses group "
            f"could span nodes. Give every node {nproc_per_node} free GPUs for this job (nothing else on them), "
            f"or launch with --nproc-per-node equal to the GPUs each node has."
        )


def free_port() -> int:
    """A TCP port free on this host now (the OS's choice)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return int(sock.getsockname()[1])


def _die_with_parent() -> None:
    """In the child, before exec: be killed when the worker thread that started it ends (Linux), so that a
    worker Ray Train ends takes its rank with it and no old rank writes into the run dir after a restart."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: Ray's own clean-up of worker children applies
        pass


def train_worker(config: dict[str, Any]) -> None:
    """One Ray Train worker: check the placement, agree on the rendezvous, run the entry point as a child
    process and wait for it. ``config``: ``module``, ``overrides``, ``nproc_per_node``, ``workdir``.

    Raises ``RuntimeError`` when the child exits non-zero, which Ray Train handles as a worker failure."""
    import ray
    import ray.train
    import torch.distributed as dist

    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    node_rank, local_world, local_rank = ctx.get_node_rank(), ctx.get_local_world_size(), ctx.get_local_rank()
    check_placement(
        local_world_size=local_world,
        nproc_per_node=config["nproc_per_node"],
        node_rank=node_rank,
        local_rank=local_rank,
        rank=rank,
    )
    address: list[Any] = [ray.util.get_node_ip_address(), free_port()] if rank == 0 else [None, None]
    dist.broadcast_object_list(address, src=0)  # over Ray Train's gloo group: rank 0's node and port
    gpu_ids = [str(i) for i in ray.get_gpu_ids()]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")
    if gpu_ids and gpu_ids[0] in visible:
        # usp reads LOCAL_RANK only to pick its CUDA device among the visible ones (Ray shows each worker
        # every GPU of its node's workers, for NCCL's peer-to-peer paths): point it at this worker's GPU
        local_rank = visible.index(gpu_ids[0])
    env = worker_env(
        os.environ,
        rank=rank,
        world_size=world,
        local_rank=local_rank,
        local_world_size=local_world,
        node_rank=node_rank,
        master_addr=str(address[0]),
        master_port=int(address[1]),
    )
    cmd = [sys.executable, "-m", config["module"], *config["overrides"]]
    proc = subprocess.Popen(cmd, cwd=config["workdir"], env=env, preexec_fn=_die_with_parent)
    returncode = proc.wait()
    if returncode != 0:
        raise RuntimeError(
            f"rank {rank}: `python -m {config['module']}` exited with status {returncode} (its log is above and "
            f"in the run dir's usp-train.log)"
        )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m usp.launch.ray_job",
        description="Run usp.train (or usp.eval) under Ray Train; usp-launch ray prints and runs this command.",
    )
    p.add_argument(
        "--address", default=None, help="a running Ray cluster (ray.init address); default: a local one"
    )
    p.add_argument("--nodes", type=int, required=True)
    p.add_argument("--nproc-per-node", dest="nproc_per_node", type=int, required=True)
    p.add_argument("--cpu", action="store_true", help="CPU workers (gloo) instead of one GPU each")
    p.add_argument("--max-restarts", dest="max_restarts", type=int, default=0)
    p.add_argument("--module", default="usp.train")
    p.add_argument(
        "--storage-path",
        dest="storage_path",
        default=None,
        help="where Ray Train keeps its own state (default: Ray's, ~/ray_results); not the run dir, which is usp's",
    )
    p.add_argument("--name", default="usp", help="the Ray Train run's name")
    p.add_argument("overrides", nargs="*", help="the entry point's Hydra overrides (after --)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Start the job; the exit status: 0 when every worker's entry point exited 0."""
    args = build_parser().parse_args(argv)
    try:
        import ray
        from ray.train import FailureConfig, RunConfig, ScalingConfig
        from ray.train.torch import TorchConfig, TorchTrainer
    except ImportError as exc:
        print(
            f"usp.launch.ray_job: error: Ray Train is not installed ({exc}): {INSTALL_HINT}", file=sys.stderr
        )
        return 2
    workers = args.nodes * args.nproc_per_node
    if args.address:
        ray.init(address=args.address, include_dashboard=False)
    else:  # a local cluster: this machine, with room for every worker
        ray.init(num_cpus=max(os.cpu_count() or 1, workers), include_dashboard=False)
    try:
        trainer = TorchTrainer(
            train_worker,
            train_loop_config={
                "module": args.module,
                "overrides": list(args.overrides),
                "nproc_per_node": args.nproc_per_node,
                "workdir": os.getcwd(),
            },
            # Ray Train's own group only carries the rendezvous address: gloo, so it never touches a GPU
            torch_config=TorchConfig(backend="gloo"),
            scaling_config=ScalingConfig(
                num_workers=workers,
                use_gpu=not args.cpu,
                resources_per_worker={"CPU": 1} if args.cpu else {"CPU": 1, "GPU": 1},
                placement_strategy="PACK",
            ),
            run_config=RunConfig(
                name=args.name,
                storage_path=args.storage_path,
                failure_config=FailureConfig(max_failures=args.max_restarts),
            ),
        )
        trainer.fit()
    except Exception as exc:  # noqa: BLE001 - Ray Train's failure after its restarts: one line, the status
        print(f"usp.launch.ray_job: error: the run failed: {exc}", file=sys.stderr)
        return 1
    finally:
        ray.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
