"""The trainer's own path for families beyond Llama: the meta skeleton, FSDP2 + USP (``parallelize``), the
sharded loader, the chunked loss with the family's LM-head transform; its first-step loss equals the model's
own ``outputs.loss`` on the same batch.

Tiny random checkpoints of :mod:`tests.family_models` saved as transformers saves them; 4 gloo ranks, u2r2
zigzag; fp32 on both sides (the trainer's master weights), so the comparison uses the rounding rule over the
longest reduction (the vocabulary's softmax).
"""

from __future__ import annotations

import pytest
import torch

from tests.family_models import SEQ_LEN, build_family
from tests.mesh_cache import cached_sp_mesh
from tests.tolerance import assert_close_scaled, rounding_tolerance

FAMILIES = [
    "gemma3_text",
    "gemma2",
    "cohere2",
    "phi3",
    "granite",
    "olmo3",
    "qwen3_5_text",
    "falcon_h1",
    "lfm2",
    "bamba",
]
"""Non-persistent buffers (Gemma's ``embed_scale``), eager-only attention (Gemma 2), LM-head transforms,
LongRoPE, sliding windows, hybrid recurrent and convolution mixers: what the trainer's loader and loss must handle beyond Llama."""


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("families")
    paths = {}
    for family in FAMILIES:
        model = build_family(family, dtype=torch.float32)
        with torch.no_grad():  # logits of a few units, so a final softcap of 4-5 changes them (not ~0.1)
            model.get_output_embeddings().weight.mul_(100.0)
        model.save_pretrained(root / family)
        paths[family] = str(root / family)
    return paths


def _batch(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, vocab, (1, SEQ_LEN), generator=g)
    labels = torch.full_like(ids, -100)
    labels[:, :-1] = ids[:, 1:]
    return ids, labels


def trainer_losses(paths: dict[str, str]) -> dict[str, float] | None:
    """Worker: each checkpoint through the trainer's build (meta skeleton, parallelize, sharded load) and one
    forward of its loss module; the total loss over the sp group."""
    from usp.model import build_empty_causal_lm, check_model_dir, load_sharded_weights
    from usp.parallel import shard_sequence
    from usp.train.loss import count_targets, global_target_count
    from usp.train.parallelize import parallelize

    mesh = cached_sp_mesh(2, 2, "zigzag", 1)
    out = {}
    for family, path in paths.items():
        model = build_empty_causal_lm(check_model_dir(path))
        loss_model = parallelize(
            model, mesh, param_dtype=torch.float32, reduce_dtype=torch.float32, loss_chunk_size=5
        )
        load_sharded_weights(model, path, device=torch.device("cpu"))
        ids, labels = _batch(model.config.vocab_size)
        pos = torch.arange(SEQ_LEN)[None]
        local = shard_sequence(labels, mesh)
        total = global_target_count(count_targets(local), mesh.sp_group)
        with torch.no_grad():
            loss = loss_model(
                shard_sequence(ids, mesh), local, position_ids=shard_sequence(pos, mesh), num_targets=total
            )
        torch.distributed.all_reduce(loss, group=mesh.sp_group)
        out[family] = float(loss)
    return out if torch.distributed.get_rank() == 0 else None


def test_trainer_first_step_loss_is_the_models_own(dist_pools, checkpoints):
    from transformers import AutoModelForCausalLM

    got = dist_pools(4).run(trainer_losses, checkpoints)[0]
    for family, path in checkpoints.items():
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
        ids, _ = _batch(model.config.vocab_size)
        with torch.no_grad():
            own = model(input_ids=ids, labels=ids).loss
        tol = rounding_tolerance(torch.float32, model.config.vocab_size)
        assert_close_scaled(
            torch.tensor([got[family]]), own.reshape(1), tol, f"{family}: trainer loss vs outputs.loss"
        )
