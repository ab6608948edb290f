"""The memory settings through the trainer: bad values fail before any step; resume and export unaffected.

- ``parallel.mlp_tiles`` < 1, not dividing the local tokens, or asked for without DeepSpeed; ``offload`` with
  too little host memory; ``optim.name`` unknown or DeepSpeed missing: ``ValueError`` naming the setting;
- a run with ``activation_checkpointing=offload`` and ``mlp_tiles=2`` under u2 (world 2), stopped after 2
  steps and resumed, has the losses of a plain run (fp32, the trainer's master weights: the rounding rule of
  ``tests.test_train_run.fp32_run_tolerance``), and its Hugging Face export has the same tensor names and
  values bitwise equal to the same run without the interruption;
- torch's fused AdamW (``adamw``, ``adamw_cpu_offload``) gives the for-each kernel's parameters, float64 at
  ``tests.tolerance.EXACT_TOL``.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.test_train_run import fp32_run_tolerance, run_worker
from tests.test_train_run import make_config as train_run_config
from tests.tolerance import EXACT_DTYPE, assert_close_scaled, assert_exact
from usp.config import TrainConfig, validate_choices
from usp.mlp_tiles import resolve_mlp_tiles
from usp.tiny import build_tiny_llama
from usp.train import checkpoint_offload, checks
from usp.train.checkpoint_offload import check_host_memory


def make_config(model_dir: str, run_dir: str, **parallel) -> TrainConfig:
    """:func:`tests.test_train_run.make_config` without validation data or accumulation: 4 steps, a
    checkpoint every 2, the data cache beside the run."""
    cfg = train_run_config(model_dir, run_dir, f"{run_dir}/../data_cache", **parallel)
    cfg.data.validation_fraction = 0.0
    cfg.trainer.eval_every = 0
    cfg.trainer.max_steps = 4
    cfg.trainer.grad_accum_steps = 1
    cfg.trainer.checkpoint_every = 2
    return cfg


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return str(build_tiny_llama(tmp_path_factory.mktemp("mem_run") / "model"))


# --- bad input (pure validation: no process group, no weights) ------------------------------------------
def test_mlp_tiles_resolution_and_errors():
    assert resolve_mlp_tiles(1, local_tokens=96, hidden_size=64) == 1
    assert resolve_mlp_tiles("4", local_tokens=96, hidden_size=64) == 4
    assert resolve_mlp_tiles("auto", local_tokens=64, hidden_size=64) == 1  # short: off
    assert resolve_mlp_tiles("auto", local_tokens=96, hidden_size=64) == 2  # ceil(96 / 64) = 2 divides 96
    assert resolve_mlp_tiles("auto", local_tokens=131072, hidden_size=4096) == 32  # 8B at 128K per rank
    assert resolve_mlp_tiles("auto", local_tokens=455, hidden_size=64) == 13  # 455 = 5 x 7 x 13: first >= 8
    with pytest.raises(ValueError, match=r"parallel.mlp_tiles=0 is invalid: use an integer >= 1"):
        resolve_mlp_tiles(0, local_tokens=96, hidden_size=64)
    with pytest.raises(
        ValueError, match=r"parallel.mlp_tiles=5 does not divide the 96 local tokens .*1, 2, 3, 4, 6"
    ):
        resolve_mlp_tiles(5, local_tokens=96, hidden_size=64)


def test_config_rejects_bad_memory_settings():
    for section, name, value, match in [
        ("parallel", "mlp_tiles", 0, "parallel.mlp_tiles=0 is invalid"),
        ("parallel", "mlp_tiles", "many", "parallel.mlp_tiles='many' is invalid"),
        (
            "parallel",
            "activation_checkpointing",
            "host",
            "parallel.activation_checkpointing='host' is invalid",
        ),
        ("optim", "name", "sgd", "optim.name='sgd' is invalid"),
    ]:
        cfg = make_config("/m", "/r")
        setattr(getattr(cfg, section), name, value)
        with pytest.raises(ValueError, match=match):
            validate_choices(cfg)


def test_offload_host_memory_check_says_how_much():
    need = check_host_memory(
        num_layers=32,
        local_tokens=131072,
        hidden_size=4096,
        compute_bytes=2,
        ranks_per_node=8,
        available_bytes=1 << 50,
    )
    assert need == 32 * 131072 * 4096 * 2 * 8  # 256 GiB for 8B at 1M tokens on 8 GPUs of a node
    with pytest.raises(
        ValueError, match=r"offload needs 256.00 GiB of host memory per node .* 32.00 GiB per rank"
    ):
        check_host_memory(
            num_layers=32,
            local_tokens=131072,
            hidden_size=4096,
            compute_bytes=2,
            ranks_per_node=8,
            available_bytes=100 << 30,
        )


def test_trainer_validation_catches_them_before_any_weights(model_dir, tmp_path, monkeypatch):
    cpu = torch.device("cpu")
    # local tokens: 64 / (u2 x r1) = 32; 5 does not divide it
    cfg = make_config(model_dir, str(tmp_path), ulysses_degree=2, ring_degree=1, mlp_tiles=5)
    with pytest.raises(ValueError, match=r"parallel.mlp_tiles=5 does not divide the 32 local tokens"):
        checks.check_training_run(cfg, 2, cpu)
    cfg.parallel.mlp_tiles = "auto"
    assert checks.check_training_run(cfg, 2, cpu)[1].mlp_tiles == 1  # 32 local tokens <= hidden 64: off
    cfg.parallel.mlp_tiles, cfg.parallel.activation_checkpointing = 4, "offload"
    assert checks.check_training_run(cfg, 2, cpu)[1].mlp_tiles == 4
    monkeypatch.setattr(checkpoint_offload, "available_host_bytes", lambda: 1000)
    with pytest.raises(ValueError, match=r"activation_checkpointing=offload needs 0.00 GiB .* only 0.00 GiB"):
        checks.check_training_run(cfg, 2, cpu)
    monkeypatch.undo()
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # as if not installed: import raises ImportError
    monkeypatch.setitem(sys.modules, "deepspeed.runtime.sequence_parallel.ulysses_sp", None)
    monkeypatch.setitem(sys.modules, "deepspeed.ops.adam", None)
    with pytest.raises(
        ValueError, match=r"parallel.mlp_tiles > 1 uses DeepSpeed's TiledMLP.*parallel.mlp_tiles=1"
    ):
        checks.check_training_run(cfg, 2, cpu)
    cfg.parallel.mlp_tiles, cfg.optim.name = 1, "deepspeed_cpu_adam"
    with pytest.raises(
        ValueError,
        match=r"optim.name=deepspeed_cpu_adam uses DeepSpeed's DeepSpeedCPUAdam.*adamw_cpu_offload",
    ):
        checks.check_training_run(cfg, 2, cpu)
    monkeypatch.undo()
    import deepspeed

    monkeypatch.setattr(
        deepspeed, "__version__", "0.16.4"
    )  # too old: the interfaces used were not checked there
    cfg.parallel.mlp_tiles, cfg.optim.name = 4, "adamw"
    with pytest.raises(ValueError, match=r"checked against deepspeed>=0.19.8, but 0.16.4 is installed"):
        checks.check_training_run(cfg, 2, cpu)


def test_host_states_rule():
    from usp.config import states_on_host

    cfg = make_config("/m", "/r")
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert not checks.keeps_states_on_host(cfg, cuda)
    for name in ("adamw_cpu_offload", "deepspeed_cpu_adam"):
        cfg.optim.name = name
        assert states_on_host(name, False) and checks.keeps_states_on_host(cfg, cuda)
        assert not checks.keeps_states_on_host(cfg, cpu)  # host memory already
    cfg.optim.name, cfg.parallel.cpu_offload = "adamw", True
    assert checks.keeps_states_on_host(cfg, cuda)


# --- resume and export (world 2, u2) ------------------------------------------------------------------
def f64(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def exported_tensors(export_dir: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(Path(export_dir).glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


@pytest.mark.slow
def test_offload_and_tiles_resume_and_export_like_the_plain_run(dist_pools, model_dir, tmp_path):
    plain = dist_pools(2).run(run_worker, make_config(model_dir, str(tmp_path / "plain"), ulysses_degree=2))[
        0
    ]
    tricks_dir = tmp_path / "tricks"
    cfg = make_config(
        model_dir, str(tricks_dir), ulysses_degree=2, activation_checkpointing="offload", mlp_tiles=2
    )
    first = dist_pools(2).run(run_worker, cfg)[0]
    assert first["layout"]["mlp_tiles"] == 2 and first["layout"]["activation_checkpointing"] == "offload"
    shutil.rmtree(tricks_dir / "checkpoints" / "step_4")  # as if the job had died after step 2
    shutil.move(tricks_dir / "hf", tricks_dir / "hf_straight")
    second = dist_pools(2).run(run_worker, cfg)[0]
    assert second["start_step"] == 2
    tol = fp32_run_tolerance(model_dir, cfg.trainer.seq_len * cfg.trainer.grad_accum_steps)
    assert_close_scaled(f64(first["losses"]), f64(plain["losses"]), tol, "offload + tiles vs plain: losses")
    assert_close_scaled(f64(second["losses"]), f64(plain["losses"][2:]), tol, "resumed vs plain: losses")
    ref, got = exported_tensors(plain["export_dir"]), exported_tensors(second["export_dir"])
    assert sorted(got) == sorted(ref)  # the same Hugging Face names: no wrapper in the parameter paths
    straight = exported_tensors(str(tricks_dir / "hf_straight"))
    for name in ref:
        torch.testing.assert_close(
            got[name],
            straight[name],
            rtol=0,
            atol=0,
            msg=lambda report, name=name: f"resume, export {name}: {report}",
        )  # bitwise
    # No value comparison with the plain run's export: Adam divides each element's update by its own gradient
    # scale, so the fp32 summation-order noise of a near-zero gradient entry becomes an update-sized difference
    # (measured: 1.05e-5 relative norm on an up_proj, above the rule's 9.8e-6), which no rounding rule bounds.
    # The tricks equal the plain run on the losses above (the rule) and exactly in float64 on every gradient
    # (tests/test_train_memory_tricks.py).


# Compiling DeepSpeed's C++ op: measured 2-5 minutes on 2 cores, longer on a loaded machine; once per machine
# and version set (usp.train.deepspeed_parts.load_cpu_adam_op), seconds when cached.
CPU_ADAM_BUILD_TIMEOUT_S = 1800


@pytest.fixture(scope="module")
def cpu_adam_built() -> None:
    """DeepSpeed's CPU Adam op, compiled (or found in usp's per-machine cache, ``~/.cache/usp/ops``, through
    :func:`usp.train.deepspeed_parts.load_cpu_adam_op`, which the ranks call too) by one child process before
    any rank asks for it, under its own time limit: a first build inside the ranks would run under the pool's
    collective timeout (300 s), which a cold 2-core build can exceed."""
    code = "from usp.train.deepspeed_parts import load_cpu_adam_op; load_cpu_adam_op()"
    try:
        done = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=CPU_ADAM_BUILD_TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"DeepSpeed's CPU Adam op did not build within {CPU_ADAM_BUILD_TIMEOUT_S} s")
    assert done.returncode == 0, f"DeepSpeed's CPU Adam op failed to build:\n{done.stderr[-4000:]}"


@pytest.mark.slow
def test_deepspeed_cpu_adam_trains_and_resumes_like_adamw(cpu_adam_built, dist_pools, model_dir, tmp_path):
    """``optim.name=deepspeed_cpu_adam`` on FSDP2 shards (world 2): the losses of torch AdamW (fp32, the
    rounding rule of ``tests.test_train_run.fp32_run_tolerance``), and a resume through a distributed
    checkpoint continues them. The C++ op is built first (``cpu_adam_built``), outside the ranks."""
    plain = dist_pools(2).run(run_worker, make_config(model_dir, str(tmp_path / "adamw"), ring_degree=2))[0]
    cfg = make_config(model_dir, str(tmp_path / "ds"), ring_degree=2)
    cfg.optim.name = "deepspeed_cpu_adam"
    cfg.trainer.export_hf = False
    first = dist_pools(2).run(run_worker, cfg)[0]
    shutil.rmtree(tmp_path / "ds" / "checkpoints" / "step_4")
    second = dist_pools(2).run(run_worker, cfg)[0]
    assert second["start_step"] == 2
    tol = fp32_run_tolerance(model_dir, cfg.trainer.seq_len * cfg.trainer.grad_accum_steps)
    assert_close_scaled(
        f64(first["losses"]), f64(plain["losses"]), tol, "deepspeed_cpu_adam vs adamw: losses"
    )
    assert second["losses"] == first["losses"][2:]  # resume: bitwise


def fused_vs_foreach(model_dir: str) -> dict:
    """Worker (world 1): 3 AdamW steps on FSDP2 shards with ``optim.name`` adamw and adamw_cpu_offload, and
    torch's for-each AdamW on the same parameter groups as the reference; float64."""
    from tests.exact_model import load_float64, whole
    from tests.mesh_cache import cached_sp_mesh
    from usp.config import OptimConfig
    from usp.train.optim import build_optimizer
    from usp.train.parallelize import parallelize

    mesh = cached_sp_mesh(1, 1, "zigzag", 1)
    out = {}
    for name in ("foreach", "adamw", "adamw_cpu_offload"):
        model = load_float64(model_dir)
        loss_model = parallelize(model, mesh, param_dtype=EXACT_DTYPE, reduce_dtype=EXACT_DTYPE)
        cfg = OptimConfig(name="adamw" if name == "foreach" else name, lr=1e-2, warmup_steps=0)
        opt, _ = build_optimizer(loss_model, cfg, max_steps=10)
        if name == "foreach":  # the same groups and hyper-parameters, torch's default multi-tensor kernel
            groups = [
                {k: v for k, v in g.items() if k in ("params", "weight_decay")} for g in opt.param_groups
            ]
            opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, foreach=True)
        g = torch.Generator().manual_seed(1)
        for _ in range(3):
            ids = torch.randint(3, model.config.vocab_size, (1, 64), generator=g)
            loss_model(ids, torch.roll(ids, -1, 1), num_targets=64).backward()
            opt.step()
            opt.zero_grad()
        out[name] = {
            "fused": bool(opt.defaults.get("fused")),
            "params": {n: whole(p).detach() for n, p in model.named_parameters()},
        }
    return out


def test_adamw_uses_the_fused_kernel_with_the_for_each_result(dist_pools, model_dir):
    out = dist_pools(1).run(fused_vs_foreach, model_dir)[0]
    assert out["adamw"]["fused"] and out["adamw_cpu_offload"]["fused"] and not out["foreach"]["fused"]
    for name, ref in out["foreach"]["params"].items():
        for opt_name in ("adamw", "adamw_cpu_offload"):
            assert_exact(out[opt_name]["params"][name], ref, f"{opt_name} vs for-each: {name}")
