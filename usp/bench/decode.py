"""Benchmark of :mod:`usp.eval`: exactness and speed of the sharded forward and of sharded-KV decoding.

    torchrun --standalone --nproc-per-node 4 -m usp.bench.decode --layouts u2r2,u4r1,u1r4 \\
        --prompt-lengths 256,1024 --new-tokens 16 --out bench_decode.json

For each layout (``uUrR``: Ulysses ``U`` x ring ``R``, zigzag) and prompt length, on the tiny random Llama
(GQA; or ``--model DIR``): ``token_losses`` vs the unsharded model's per-token losses (max abs difference),
``decode`` vs ``transformers`` greedy ``generate`` (tokens equal? max abs logit difference), prefill
tokens/s (the sharded forward over the prompt) and decode tokens/s (single-token steps, all rows). Every rank
computes the single-process reference itself (the model is tiny). Rank 0 prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from usp.bench.flags import comma_ints
from usp.parallel.process_group import init_distributed


def _layouts(text: str) -> list[tuple[int, int]]:
    out = []
    for word in text.split(","):
        u, r = word.strip().lstrip("u").split("r")
        out.append((int(u), int(r)))
    return out


def _reference(model, ids: torch.Tensor, new: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from transformers import GenerationConfig

    with torch.no_grad():
        logits = model(input_ids=ids).logits
    vocab = logits.size(-1)
    losses = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, vocab).float(), ids[:, 1:].reshape(-1), reduction="none"
    ).view(ids.size(0), -1)
    cfg = GenerationConfig(
        max_new_tokens=new,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
    )
    g = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=cfg)
    return losses, g.sequences[:, ids.size(1) :], torch.stack(g.logits, dim=1).float()


def main(argv: list[str] | None = None) -> int:
    from usp.eval.decode import decode
    from usp.eval.losses import token_losses
    from usp.model import apply_usp, load_causal_lm
    from usp.parallel import init_sp_mesh
    from usp.tiny import build_tiny_llama

    p = argparse.ArgumentParser(prog="python -m usp.bench.decode", description=__doc__.split("\n\n")[0])
    p.add_argument("--layouts", default="u2r2,u4r1,u1r4")
    p.add_argument("--prompt-lengths", type=comma_ints, default="256,1024")
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--model", default=None, help="a local HF checkpoint (default: a tiny random Llama)")
    p.add_argument("--out", default=None, help="write the results as JSON here (rank 0)")
    args = p.parse_args(argv)

    init_distributed(torch.device("cpu"))  # gloo, in the launcher's store (usp.parallel.process_group)
    torch.set_num_threads(1)
    rank = dist.get_rank()
    model_dir = args.model
    if model_dir is None:
        box = [str(Path(tempfile.mkdtemp(prefix="usp-bench-decode-")) / "tiny")] if rank == 0 else [None]
        dist.broadcast_object_list(box, src=0)
        if rank == 0:
            build_tiny_llama(box[0])
        dist.barrier()
        model_dir = box[0]
    ref_model = load_causal_lm(model_dir, dtype=torch.float32).eval()
    rows = []
    for ulysses, ring in _layouts(args.layouts):
        mesh = init_sp_mesh(ulysses, ring, dp_degree=dist.get_world_size() // (ulysses * ring))
        model = apply_usp(load_causal_lm(model_dir, dtype=torch.float32).eval(), mesh)
        for length in args.prompt_lengths:
            ids = torch.randint(
                3,
                model.config.vocab_size,
                (args.batch, length),
                generator=torch.Generator().manual_seed(length),
            )
            ref_losses, ref_tokens, ref_logits = _reference(ref_model, ids, args.new_tokens)
            t0 = time.perf_counter()
            losses = token_losses(model, ids, mesh)
            forward_s = time.perf_counter() - t0
            res = decode(model, ids, mesh, args.new_tokens, keep_logits=True)
            rows.append(
                {
                    "layout": f"u{ulysses}r{ring}",
                    "prompt": length,
                    "batch": args.batch,
                    "new_tokens": args.new_tokens,
                    "loss_max_abs_diff": float((losses[:, :-1] - ref_losses).abs().max()),
                    "loss_max_abs": float(ref_losses.abs().max()),
                    "tokens_equal": bool(torch.equal(res.tokens, ref_tokens)),
                    "logit_max_abs_diff": float((res.logits - ref_logits).abs().max()),
                    "logit_max_abs": float(ref_logits.abs().max()),
                    "forward_tokens_per_s": args.batch * length / forward_s,
                    "prefill_tokens_per_s": res.prefill_tokens / res.prefill_s,
                    "decode_tokens_per_s": args.batch * res.decode_steps / res.decode_s,
                    "kv_tokens_per_rank": res.kv_tokens,
                }
            )
    if rank == 0:
        print(
            f"{'layout':7} {'prompt':>6} {'loss |d|':>9} {'tokens':>6} {'logit |d|':>9} {'prefill t/s':>11} "
            f"{'decode t/s':>10}"
        )
        for r in rows:
            print(
                f"{r['layout']:7} {r['prompt']:6d} {r['loss_max_abs_diff']:9.2e} {str(r['tokens_equal']):>6} "
                f"{r['logit_max_abs_diff']:9.2e} {r['prefill_tokens_per_s']:11.0f} {r['decode_tokens_per_s']:10.1f}"
            )
        if args.out:
            Path(args.out).write_text(
                json.dumps({"world_size": dist.get_world_size(), "rows": rows}, indent=2) + "\n"
            )
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
