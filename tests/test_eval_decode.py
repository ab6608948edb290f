"""usp.eval.token_losses and usp.eval.generate under u2r2, u4r1, u1r4 vs the single-process model.

token_losses: equal to the unsharded model's per-token cross-entropy. generate: the same tokens as
transformers' greedy ``generate`` and the same logits, for a tiny MHA Llama and GQA/MQA configs (all float64
on both sides, ``tests.tolerance.EXACT_TOL``), including the decode corner cases: a prompt shorter than the layout (every shard empty at first,
then one-token shards), and generations longer than the prefill so appended tokens outnumber prefill ones.
"""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig

from tests.exact_model import load_float64
from tests.mesh_cache import cached_sp_mesh
from tests.tolerance import EXACT_DTYPE, assert_exact
from usp.model import apply_usp
from usp.tiny import build_tiny_llama

LAYOUTS = [(2, 2, "zigzag"), (4, 1, "zigzag"), (1, 4, "zigzag")]
LAYOUT_IDS = ["u2r2", "u4r1", "u1r4"]
SEQ_LEN = 32
# (prompt length, new tokens): fits the layout (multiple of 8 = 2 x ring x ulysses); shorter than one layout
# unit (no prefill: shards empty, then one token each); 1 token; appended tokens outnumbering the prefill
# (8 prefilled = 2 per rank, 12 appended = 3 per rank); a fitting prefix plus a decoded tail (13 = 8 + 5)
PROMPTS = [(16, 6), (3, 5), (1, 4), (8, 12), (13, 5)]


def _ids(vocab: int, batch: int, length: int, seed: int) -> torch.Tensor:
    return torch.randint(3, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def eval_worker(model_dir: str, ulysses: int, ring: int, layout: str, dp: int = 1) -> dict:
    """Worker: token_losses on one batch and decode on every PROMPTS case; every rank returns its results."""
    from usp.eval import token_losses
    from usp.eval.decode import decode

    mesh = cached_sp_mesh(ulysses, ring, layout, dp)
    model = apply_usp(load_float64(model_dir).eval(), mesh)
    vocab = model.config.vocab_size
    out = {"losses": token_losses(model, _ids(vocab, 2, SEQ_LEN, 0), mesh), "decode": []}
    for i, (length, new) in enumerate(PROMPTS):
        res = decode(model, _ids(vocab, 2, length, 10 + i), mesh, new, keep_logits=True)
        out["decode"].append({"tokens": res.tokens, "logits": res.logits, "kv": res.kv_tokens})
    return out


def _build(path, kv_heads: int) -> str:
    return str(build_tiny_llama(path, num_key_value_heads=kv_heads))


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("eval-models")
    return {"mha": _build(root / "mha", 4), "gqa": _build(root / "gqa", 2), "mqa": _build(root / "mqa", 1)}


def _reference(model_dir: str) -> dict:
    model = load_float64(model_dir).eval()
    vocab = model.config.vocab_size
    ids = _ids(vocab, 2, SEQ_LEN, 0)
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    losses = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, vocab), ids[:, 1:].reshape(-1), reduction="none"
    ).view(2, SEQ_LEN - 1)
    decodes = []
    for i, (length, new) in enumerate(PROMPTS):
        prompt = _ids(vocab, 2, length, 10 + i)
        cfg = GenerationConfig(
            max_new_tokens=new,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            return_dict_in_generate=True,
        )
        g = model.generate(prompt, attention_mask=torch.ones_like(prompt), generation_config=cfg)
        # generate hands its logits out in fp32: the float64 ones are one forward over prompt + new tokens
        with torch.no_grad():
            logits = model(input_ids=g.sequences[:, :-1]).logits[:, length - 1 :]  # [B, new, V]
        decodes.append({"tokens": g.sequences[:, length:], "logits": logits})
    return {"losses": losses, "decode": decodes}


@pytest.mark.parametrize("family", ["mha", "gqa", "mqa"])
@pytest.mark.parametrize("ulysses, ring, layout", LAYOUTS, ids=LAYOUT_IDS)
def test_token_losses_and_generate_match_single_process(dist_pools, models, family, ulysses, ring, layout):
    _check_against_reference(
        dist_pools(4).run(eval_worker, models[family], ulysses, ring, layout), models[family]
    )


@pytest.mark.slow  # two more worlds of the same checks
@pytest.mark.parametrize(
    "ulysses, ring, layout, dp",
    [(2, 1, "zigzag", 2), (2, 2, "contiguous", 1)],
    ids=["u2r1-dp2", "u2r2-contiguous"],
)
def test_generate_with_dp_replicas_and_contiguous_layout(dist_pools, models, ulysses, ring, layout, dp):
    _check_against_reference(
        dist_pools(4).run(eval_worker, models["gqa"], ulysses, ring, layout, dp), models["gqa"]
    )


def _check_against_reference(per_rank: list[dict], model_dir: str) -> None:
    ref = _reference(model_dir)
    for rank, got in enumerate(per_rank):
        assert got["losses"].dtype == EXACT_DTYPE and got["losses"].shape == (2, SEQ_LEN)
        assert_exact(got["losses"][:, :-1], ref["losses"], f"rank {rank}: token losses")
        assert torch.equal(got["losses"][:, -1], torch.zeros(2, dtype=EXACT_DTYPE))  # no next token
        for (length, new), mine, theirs in zip(PROMPTS, got["decode"], ref["decode"]):
            where = f"rank {rank}, prompt {length}, {new} new"
            assert mine["tokens"].dtype == torch.long and mine["tokens"].shape == (2, new), where
            assert torch.equal(mine["tokens"], theirs["tokens"]), where
            assert_exact(mine["logits"], theirs["logits"], f"{where}: logits")
            assert torch.equal(mine["tokens"], per_rank[0]["decode"][PROMPTS.index((length, new))]["tokens"])
            total = length + new - 1  # the last new token is never fed back
            assert sum(mine["kv"]) == total and max(mine["kv"]) - min(mine["kv"]) <= 1, (where, mine["kv"])


def merge_worker() -> dict:
    """Worker: merge_partials where some ranks hold no key (lse = -inf) vs one softmax over all keys (float64)."""
    import torch.distributed as dist

    from usp.eval.decode import merge_partials

    mesh = cached_sp_mesh(2, 2, "zigzag", 1)
    g = torch.Generator().manual_seed(5)
    f64 = {"generator": g, "dtype": EXACT_DTYPE}
    q = torch.randn(2, 1, 4, 8, **f64)
    keys = [torch.randn(2, n, 4, 8, **f64) for n in (0, 1, 5, 0)]  # sp ranks 0 and 3 hold nothing
    vals = [torch.randn(2, n, 4, 8, **f64) for n in (0, 1, 5, 0)]
    r = mesh.sp_rank
    if keys[r].size(1) == 0:
        out, lse = (
            torch.zeros(2, 1, 4, 8, dtype=EXACT_DTYPE),
            torch.full((2, 4, 1), float("-inf"), dtype=EXACT_DTYPE),
        )
    else:
        s = torch.einsum("bqhd,bkhd->bhqk", q, keys[r]) / 8**0.5
        lse = torch.logsumexp(s, -1)
        out = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, -1), vals[r])
    merged = merge_partials(out, lse, mesh)
    k, v = torch.cat(keys, 1), torch.cat(vals, 1)
    ref = torch.einsum(
        "bhqk,bkhd->bqhd", torch.softmax(torch.einsum("bqhd,bkhd->bhqk", q, k) / 8**0.5, -1), v
    )
    return {"merged": merged, "ref": ref, "rank": dist.get_rank()}


def test_merge_with_empty_shards_is_exact(dist_pools):
    results = dist_pools(4).run(merge_worker)
    for r in results:
        assert torch.isfinite(r["merged"]).all()
        assert_exact(r["merged"], r["ref"], f"rank {r['rank']}: merged attention")
        assert torch.equal(r["merged"], results[0]["merged"])  # bitwise the same on every rank


def test_cache_appends_past_its_reserve():
    """The buffer grows when appends outrun the reserve; the filled slots are the tokens in order."""
    from types import SimpleNamespace

    from usp.eval.decode import ShardedKVCache

    cache = ShardedKVCache(SimpleNamespace(sp_degree=1, sp_rank=0), num_layers=1, reserve=1)
    g = torch.Generator().manual_seed(3)
    ks = [torch.randn(2, 3, 2, 4, generator=g)] + [torch.randn(2, 1, 2, 4, generator=g) for _ in range(6)]
    cache.keep(0, ks[0], -ks[0])
    for k in ks[1:]:
        cache._append(0, k, -k)
    n = cache.used[0]
    assert n == 9 and cache.k[0].size(1) >= n
    assert torch.equal(cache.k[0][:, :n], torch.cat(ks, 1)) and torch.equal(
        cache.v[0][:, :n], -torch.cat(ks, 1)
    )
