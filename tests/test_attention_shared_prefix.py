"""Shared prefixes (``shared_prefix``: DPO's prompt once) across Ulysses, ring (zigzag, contiguous, balanced).

A row ``[prompt + chosen | rejected | ...]`` whose ``rejected`` document links to the prompt must give every
token the attention it has in two separate sequences ``[prompt + chosen]`` and ``[prompt + rejected]``:
outputs, and gradients (the prompt's summed over both sequences), float64, exact.
"""

from __future__ import annotations

import torch

from tests.mesh_cache import cached_sp_mesh
from tests.test_attention_usp import HEAD_DIM
from tests.tolerance import EXACT_TOL
from usp.attention import record_comm, usp_attention
from usp.attention.blocks import join_steps, plan_prefix_blocks, plan_ring_blocks, step_blocks
from usp.attention.reference import reference_attention
from usp.parallel import gather_sequence, shard_sequence

SEQ_LEN = 48
# documents of the row: [prompt 10 + chosen 5] [rejected 7 -> prompt 10] [plain 11] [prompt 6 + chosen 4]
# [rejected 5 -> prompt 6]; the links cross zigzag chunks and ring parts
LENGTHS = [15, 7, 11, 10, 5]
PREFIX = [0, 10, 0, 0, 6]
CU = [0, 15, 22, 33, 43, 48]
LAYOUTS = {
    1: [(1, 1, "zigzag")],
    4: [(2, 2, "balanced"), (1, 4, "balanced"), (1, 4, "zigzag"), (4, 1, "zigzag")],
}


def separate_index() -> tuple[torch.Tensor, list[int]]:
    """Row token index of every token of the two-sequence layout, and that layout's document lengths: each
    linked document preceded by a copy of its prefix (``[prompt + chosen] [prompt + rejected]``)."""
    index, lengths = [], []
    for d, (a, b) in enumerate(zip(CU, CU[1:])):
        prefix = list(range(CU[d - 1], CU[d - 1] + PREFIX[d])) if PREFIX[d] else []
        index += prefix + list(range(a, b))
        lengths.append(len(prefix) + b - a)
    return torch.tensor(index), lengths


def inputs(hq: int, hkv: int, seed: int = 7) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = [(1, SEQ_LEN, hq), (1, SEQ_LEN, hkv), (1, SEQ_LEN, hkv), (1, SEQ_LEN, hq)]
    return [torch.randn(*s, HEAD_DIM, generator=g, dtype=torch.float64) for s in shapes]


def run_shared_prefix(world: int, hq: int, hkv: int) -> list:
    """Worker: every layout of ``world`` ranks; sp rank 0 returns the gathered [out, dq, dk, dv] of each."""
    results = []
    cu = torch.tensor(CU, dtype=torch.int32)
    prefix = torch.tensor(PREFIX, dtype=torch.int32)
    for u, r, layout in LAYOUTS[world]:
        mesh = cached_sp_mesh(u, r, layout)
        q, k, v, dout = inputs(hq, hkv)
        ql, kl, vl = (shard_sequence(t, mesh, cu_seqlens=cu).requires_grad_() for t in (q, k, v))
        out = usp_attention(ql, kl, vl, mesh=mesh, cu_seqlens=cu, shared_prefix=prefix, attn_head_chunks=1)
        out.backward(shard_sequence(dout, mesh, cu_seqlens=cu))
        got = [gather_sequence(t, mesh, cu_seqlens=cu) for t in (out.detach(), ql.grad, kl.grad, vl.grad)]
        results.append(got if mesh.sp_rank == 0 else None)
    return results


def separate_sequences_reference(hq: int, hkv: int) -> list[torch.Tensor]:
    """Attention of the two-sequence layout (each sequence its own document), mapped back to the row: outputs
    of the row's tokens, gradients summed over every copy of a token."""
    q, k, v, dout = inputs(hq, hkv)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    index, lengths = separate_index()
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    out2 = reference_attention(q[:, index], k[:, index], v[:, index], causal=True, cu_seqlens=cu)
    # each row token's own output: its last copy (a linked document's tokens, and chosen/prompt in their own)
    own = torch.zeros(SEQ_LEN, dtype=torch.long)
    own[index] = torch.arange(index.numel())
    out = out2[:, own]
    out.backward(dout)
    return [out.detach(), q.grad, k.grad, v.grad]


def test_shared_prefix_equals_two_separate_sequences(dist_pools):
    for world, (hq, hkv) in ((1, (4, 2)), (4, (4, 2))):
        per_rank = dist_pools(world).run(run_shared_prefix, world, hq, hkv)
        want = separate_sequences_reference(hq, hkv)
        for i, layout in enumerate(LAYOUTS[world]):
            got = per_rank[0][i]
            for what, a, b in zip(("out", "dq", "dk", "dv"), got, want):
                torch.testing.assert_close(a, b, rtol=0, atol=EXACT_TOL, msg=f"{what} {layout}")


def test_prompt_tokens_get_the_gradient_of_both_sequences():
    """The reference itself: a prompt token's dk is the sum over its two copies (not one of them)."""
    index, lengths = separate_index()
    assert sum(lengths) == SEQ_LEN + sum(PREFIX)
    assert index.bincount(minlength=SEQ_LEN).tolist() == [
        2 if (0 <= t < 10 or 33 <= t < 39) else 1 for t in range(SEQ_LEN)
    ]


def test_prefix_blocks_cover_each_link_once():
    """Over every rank and ring step the prefix blocks score each (rejected row, prompt key) pair once."""
    cu, prefix = torch.tensor(CU), torch.tensor(PREFIX)
    want = sum(p * n for p, n in zip(PREFIX, LENGTHS))
    for layout in ("zigzag", "contiguous", "balanced"):
        for ring in (1, 2, 4):
            got = sum(
                b.pairs()
                for r in range(ring)
                for b in plan_prefix_blocks(SEQ_LEN, ring, r, layout, cu, prefix)
                if b is not None
            )
            assert got == want, (layout, ring)
    # joined with the document blocks: a step holding both computes both, in that order
    main = plan_ring_blocks(SEQ_LEN, 1, 0, "zigzag", True, cu)
    (step,) = join_steps(main, plan_prefix_blocks(SEQ_LEN, 1, 0, "zigzag", cu, prefix))
    blocks = step_blocks(step)
    assert len(blocks) == 2 and blocks[0] is main[0] and not blocks[1].causal
    assert (blocks[1].q_start, blocks[1].k_start) == (15, 0)  # rows 15.. and 43.., keys 0.. and 33..
    assert blocks[1].segments.tolist() == [[0, 7, 0, 10], [28, 33, 33, 39]]


def run_bad_prefix() -> list[str]:
    mesh = cached_sp_mesh(1, 1, "zigzag")
    q = torch.randn(1, SEQ_LEN, 2, HEAD_DIM)
    cu = torch.tensor(CU, dtype=torch.int32)
    errors = []
    for kwargs in (
        dict(shared_prefix=torch.tensor(PREFIX)),  # no cu_seqlens
        dict(cu_seqlens=cu, shared_prefix=torch.tensor([0, 16, 0, 0, 0])),  # longer than the document before
        dict(
            cu_seqlens=cu, shared_prefix=torch.tensor([3, 0, 0, 0, 0])
        ),  # the first document has none before
        dict(cu_seqlens=cu, shared_prefix=torch.tensor([0, 1])),  # not one per document
        dict(cu_seqlens=cu, shared_prefix=torch.tensor(PREFIX), window=8),
    ):
        try:
            usp_attention(q, q, q, mesh=mesh, **kwargs)
        except ValueError as e:
            errors.append(str(e))
    with record_comm() as stats:
        usp_attention(q, q, q, mesh=mesh, cu_seqlens=cu, shared_prefix=torch.tensor(PREFIX))
    errors.append(stats.attention_pairs)
    return errors


def test_bad_shared_prefix_raises(dist_pools):
    (errors,) = dist_pools(1).run(run_bad_prefix)
    *messages, pairs = errors
    assert len(messages) == 5 and all("shared_prefix" in m for m in messages), messages
    # the work: each document's causal triangle plus each link's rectangle, per head
    assert pairs == 2 * (sum(n * (n + 1) // 2 for n in LENGTHS) + sum(p * n for p, n in zip(PREFIX, LENGTHS)))
