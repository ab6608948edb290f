"""Loss equality across parallel layouts: USP + FSDP2 training steps vs the plain single-process HF model.

The same global batches train a tiny GQA Llama for a few optimizer steps (2 micro-batches each, warmup +
clipping active, uneven ignored targets) under world 1 and (u2,r2), (u4,r1), (u1,r4), (u2,r1,dp2); per-step
losses, grad norms and final gradients must match a plain ``LlamaForCausalLM`` trained on one process with
``F.cross_entropy`` on full logits: float64, ``tests.tolerance.EXACT_TOL``. bf16 compute (fp32 master weights)
against that reference: ``tests.tolerance.rounding_tolerance`` over the tokens of a step.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.exact_model import load_float64, whole
from tests.mesh_cache import cached_sp_mesh
from tests.tolerance import EXACT_DTYPE, assert_exact, rounding_tolerance
from usp.config import OptimConfig
from usp.model import load_causal_lm
from usp.parallel import shard_sequence
from usp.train.optim import build_optimizer, clip_grad_norm
from usp.train.parallelize import parallelize
from usp.train.step import train_step

SEQ_LEN = 32
GLOBAL_BATCH = 2  # rows per micro-batch, over all dp replicas
MICRO_STEPS = 2
STEPS = 3
OPTIM = OptimConfig(lr=3e-3, weight_decay=0.1, warmup_steps=2, min_lr_ratio=0.1, grad_clip=1.0)
GRAD_PARAMS = (
    "model.layers.0.self_attn.q_proj.weight",
    "model.layers.1.self_attn.k_proj.weight",
    "model.layers.1.mlp.down_proj.weight",
    "model.embed_tokens.weight",
    "lm_head.weight",
)


def make_batches(vocab: int, seed: int = 0) -> list[list[dict[str, torch.Tensor]]]:
    """``STEPS`` x ``MICRO_STEPS`` global micro-batches ``[GLOBAL_BATCH, SEQ_LEN]`` with shifted labels."""
    g = torch.Generator().manual_seed(seed)
    steps = []
    for _ in range(STEPS):
        micro = []
        for _ in range(MICRO_STEPS):
            ids = torch.randint(3, vocab, (GLOBAL_BATCH, SEQ_LEN), generator=g)
            labels = torch.cat([ids[:, 1:], torch.full((GLOBAL_BATCH, 1), -100)], dim=1)
            start = int(torch.randint(0, SEQ_LEN - 8, (1,), generator=g))
            labels[0, start : start + 7] = -100  # uneven target counts across ranks
            pos = torch.arange(SEQ_LEN).expand(GLOBAL_BATCH, -1).clone()
            micro.append({"input_ids": ids, "labels": labels, "position_ids": pos})
        steps.append(micro)
    return steps


def local_batch(batch: dict[str, torch.Tensor], mesh) -> dict[str, torch.Tensor]:
    rows = GLOBAL_BATCH // mesh.dp_degree
    r0 = mesh.dp_rank * rows
    return {k: shard_sequence(v[r0 : r0 + rows], mesh) for k, v in batch.items()}


def train_then_grads(loss_model, model, mesh, optimizer, scheduler, batches) -> tuple[list, list, dict]:
    """Train one step per entry of ``batches``, then backward the first step's batches without an optimizer
    step; returns ``(losses, grad_norms, named parameters)`` (their ``.grad`` set). Shared by the layout tests."""
    losses, norms = [], []
    for step in batches:
        res = train_step(
            loss_model,
            optimizer,
            scheduler,
            [local_batch(b, mesh) for b in step],
            mesh=mesh,
            grad_clip=OPTIM.grad_clip,
        )
        losses.append(res.loss)
        norms.append(res.grad_norm)
    n = sum(int((b["labels"] != -100).sum()) for b in batches[0])
    for b in batches[0]:
        lb = local_batch(b, mesh)
        loss_model(lb["input_ids"], lb["labels"], position_ids=lb["position_ids"], num_targets=n).backward()
    return losses, norms, dict(model.named_parameters())


def train_layout(
    model_dir: str,
    ulysses: int,
    ring: int,
    dp: int,
    ac: str,
    fsdp_mode: str = "full_shard",
    param_dtype: torch.dtype = EXACT_DTYPE,
) -> dict | None:
    """Worker: train under the layout; rank 0 returns losses, grad norms and the final step's gradients.
    float64 (the exactness runs), or fp32 weights with ``param_dtype`` compute (bf16)."""
    mesh = cached_sp_mesh(ulysses, ring, "zigzag", dp)
    exact = param_dtype == EXACT_DTYPE
    model = load_float64(model_dir) if exact else load_causal_lm(model_dir, dtype=torch.float32)
    loss_model = parallelize(
        model,
        mesh,
        param_dtype=param_dtype,
        reduce_dtype=EXACT_DTYPE if exact else torch.float32,
        loss_chunk_size=7,
        activation_checkpointing=ac,
        ac_every_k=2,
        fsdp_mode=fsdp_mode,
        node_size=2,
    )
    optimizer, scheduler = build_optimizer(loss_model, OPTIM, max_steps=STEPS + 2)
    # gradients after training, on the first step's batches (no optimizer step)
    losses, norms, params = train_then_grads(
        loss_model, model, mesh, optimizer, scheduler, make_batches(model.config.vocab_size)
    )
    grads = {name: whole(params[name].grad) for name in GRAD_PARAMS}
    if mesh.device_mesh.get_rank() != 0:
        return None
    return {"losses": losses, "grad_norms": norms, "grads": grads}


def reference_run(model_dir: str) -> dict:
    """Plain transformers model, one process, full logits, F.cross_entropy mean over all targets of a step;
    float64."""
    torch.manual_seed(0)
    model = load_float64(model_dir)
    optimizer, scheduler = build_optimizer(model, OPTIM, max_steps=STEPS + 2)
    batches = make_batches(model.config.vocab_size)

    def step_loss(step):
        ids = torch.cat([b["input_ids"] for b in step])
        labels = torch.cat([b["labels"] for b in step])
        logits = model(input_ids=ids).logits
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)

    losses, norms = [], []
    for step in batches:
        loss = step_loss(step)
        loss.backward()
        norms.append(clip_grad_norm(model.parameters(), OPTIM.grad_clip))
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        losses.append(loss.item())
    step_loss(batches[0]).backward()
    params = dict(model.named_parameters())
    return {"losses": losses, "grad_norms": norms, "grads": {n: params[n].grad for n in GRAD_PARAMS}}


@pytest.fixture(scope="module")
def reference(tiny_llama) -> dict:
    return reference_run(tiny_llama)


LAYOUTS = [
    pytest.param(1, 1, 1, 1, "none", "full_shard", id="world1"),
    pytest.param(4, 2, 2, 1, "full", "full_shard", id="u2r2", marks=pytest.mark.slow),
    pytest.param(4, 4, 1, 1, "every_k", "full_shard", id="u4r1", marks=pytest.mark.slow),
    pytest.param(4, 1, 4, 1, "none", "full_shard", id="u1r4", marks=pytest.mark.slow),
    pytest.param(4, 2, 1, 2, "full", "full_shard", id="u2r1dp2", marks=pytest.mark.slow),
    pytest.param(4, 1, 2, 2, "none", "hybrid_shard", id="u1r2dp2-hsdp", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("world, ulysses, ring, dp, ac, fsdp_mode", LAYOUTS)
def test_layout_matches_plain_hf(dist_pools, tiny_llama, reference, world, ulysses, ring, dp, ac, fsdp_mode):
    out = dist_pools(world).run(train_layout, tiny_llama, ulysses, ring, dp, ac, fsdp_mode)[0]
    where = f"world={world} u{ulysses} r{ring} dp{dp} ac={ac} {fsdp_mode}"
    for key in ("losses", "grad_norms"):
        assert_exact(
            torch.tensor(out[key], dtype=EXACT_DTYPE),
            torch.tensor(reference[key], dtype=EXACT_DTYPE),
            f"{where}: {key}",
        )
    for name in GRAD_PARAMS:
        assert_exact(out["grads"][name], reference["grads"][name], f"{where}: {name}")


@pytest.mark.slow
def test_bf16_compute_close_to_the_reference(dist_pools, tiny_llama, reference):
    """bf16 parameters for compute (fp32 master weights and reduction): the float64 reference's losses, grad
    norms and gradients to bf16 rounding, :func:`tests.tolerance.rounding_tolerance` over a step's tokens."""
    out = dist_pools(4).run(train_layout, tiny_llama, 2, 2, 1, "full", "full_shard", torch.bfloat16)[0]
    tol = rounding_tolerance(torch.bfloat16, MICRO_STEPS * GLOBAL_BATCH * SEQ_LEN)
    for key in ("losses", "grad_norms"):
        torch.testing.assert_close(
            torch.tensor(out[key], dtype=EXACT_DTYPE),
            torch.tensor(reference[key], dtype=EXACT_DTYPE),
            rtol=tol,
            atol=0,
            msg=lambda m, key=key: f"bf16 u2r2 {key}: {m}",
        )
    for name in GRAD_PARAMS:
        g, r = out["grads"][name], reference["grads"][name]
        assert g.dtype == torch.float32  # gradients reach the fp32 master weights
        rel = float((g.double() - r).norm() / r.norm())
        assert rel < tol, f"bf16 u2r2 {name}: relative gradient error {rel:.2e} above {tol:.2e}"
