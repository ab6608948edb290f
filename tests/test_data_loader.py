"""Loaders over packed rows: token conservation over dp x sp ranks, boundaries, labels, positions, resume."""

from __future__ import annotations

import copy
import json
import logging
import shutil
from pathlib import Path

import datasets
import numpy as np
import pytest
import torch

from tests.mesh_cache import cached_sp_mesh
from usp.config import DataConfig
from usp.data import IGNORE_INDEX, build_dataloaders, load_tokenizer, prepare_dataset, split_rows
from usp.parallel import local_token_indices
from usp.tiny import build_tiny_tokenizer, tiny_corpus_texts

SEQ_LEN = 48


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A tiny tokenizer dir, a jsonl corpus and its packed rows (prepared once, in this process)."""
    root = tmp_path_factory.mktemp("data_loader")
    tok = build_tiny_tokenizer(root / "tok")
    src = root / "corpus.jsonl"
    texts = tiny_corpus_texts(90, seed=11)
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    prep = prepare_dataset(
        [str(src)],
        tokenizer=tok,
        seq_len=SEQ_LEN,
        output=root / "prepared",
        cache_dir=root / "hf",
        log=lambda _: None,
    )
    return {"root": root, "tok": str(root / "tok"), "src": str(src), "prepared": str(prep.path)}


def _expected_labels_positions(row: dict) -> tuple[list[int], list[int]]:
    """Reference for one global row, written loop by loop (independent of usp.data.batch)."""
    ids, lengths, first = row["input_ids"], row["document_lengths"], row["first_position"]
    labels, positions, start = [], [], 0
    for k, n in enumerate(lengths):
        for j in range(n):
            t = start + j
            last_of_doc = j == n - 1
            labels.append(IGNORE_INDEX if last_of_doc or t == len(ids) - 1 else ids[t + 1])
            positions.append(j + (first if k == 0 else 0))
        start += n
    return labels, positions


def _epoch_worker(
    cfg_kwargs: dict, ulysses: int, ring: int, layout: str, dp: int, batch: int, tok_dir: str, cache: str
):
    mesh = cached_sp_mesh(ulysses, ring, layout, dp)
    tok = load_tokenizer(tok_dir)
    cfg = DataConfig(**cfg_kwargs)
    kw = dict(tokenizer=tok, seq_len=SEQ_LEN, mesh=mesh, micro_batch_size=batch, seed=3, cache_dir=cache)
    train, val = build_dataloaders(cfg, **kw)
    steps = -(-train.num_samples // train.samples_per_step)  # one epoch, the last step may straddle the next
    out = {"coords": (mesh.dp_rank, mesh.ring_rank, mesh.ulysses_rank), "steps": [], "val": []}
    it = iter(train)
    for s in range(steps):
        ids = train.sample_ids(s * train.samples_per_step)
        out["steps"].append((ids, next(it)))
    out["val"] = [(val.sample_ids(s * val.samples_per_step), b) for s, b in enumerate(val)]
    out["train_rows"], out["val_rows"] = train.indices.tolist(), val.indices.tolist()
    out["tokens_dropped"] = (train.tokens_dropped, val.tokens_dropped)
    # resume: a fresh loader restored from the state after k steps yields the uninterrupted next batch
    k = steps + 1
    for _ in range(k - steps):
        next(it)
    state = train.state_dict()
    expected = next(it)
    restored, _ = build_dataloaders(cfg, **kw)
    restored.load_state_dict(state)
    got = next(iter(restored))
    out["resume_equal"] = all(
        torch.equal(got[key], expected[key])
        if isinstance(got[key], torch.Tensor)
        else got[key] == expected[key]
        for key in expected
    )
    return out


def _reconstruct(results: list[dict], ulysses: int, ring: int, layout: str, key: str, kind: str):
    """Global [B, S] tensors per (step, dp rank) from the per-rank slices, by local_token_indices."""
    out: dict[tuple[int, int], torch.Tensor] = {}
    for res in results:
        d, r, u = res["coords"]
        idx = local_token_indices(SEQ_LEN, ring, ulysses, r, u, layout)
        for s, (_, b) in enumerate(res[kind]):
            full = out.setdefault((s, d), torch.full((b[key].size(0), SEQ_LEN), -12345, dtype=torch.long))
            assert (full[:, idx] == -12345).all(), "two sp ranks hold the same position"
            full[:, idx] = b[key]
    return out


@pytest.mark.parametrize(
    "ulysses, ring, layout, dp, batch",
    [(2, 1, "zigzag", 2, 1), (2, 2, "zigzag", 1, 1), (1, 2, "contiguous", 2, 2), (1, 1, "zigzag", 4, 1)],
)
def test_every_token_once_per_epoch_world4(dist_pools, corpus, ulysses, ring, layout, dp, batch):
    cfg = {"prepared_path": corpus["prepared"], "validation_fraction": 0.1, "seed": 5}
    results = dist_pools(4).run(
        _epoch_worker,
        cfg,
        ulysses,
        ring,
        layout,
        dp,
        batch,
        corpus["tok"],
        str(corpus["root"] / f"c{dp}{ring}"),
    )
    ds = datasets.load_from_disk(corpus["prepared"])
    train_rows, val_rows = results[0]["train_rows"], results[0]["val_rows"]
    assert sorted(train_rows + val_rows) == list(range(len(ds)))  # disjoint split covering every row
    assert len(val_rows) == round(0.1 * len(ds))
    seen = {}
    for kind in ("steps", "val"):
        glob = {
            key: _reconstruct(results, ulysses, ring, layout, key, kind)
            for key in ("input_ids", "labels", "position_ids")
        }
        for res in results:
            d = res["coords"][0]
            for s, (ids, b) in enumerate(res[kind]):
                assert b["row_index"] == ids  # the dataset rows of the samples, on every sp rank
                assert "document_roles" not in b and "document_index" not in b  # text rows: no pair keys
                for j, row_id in enumerate(ids):
                    row = ds[row_id]
                    assert glob["input_ids"][s, d][j].tolist() == row["input_ids"]
                    labels, positions = _expected_labels_positions(row)
                    assert glob["labels"][s, d][j].tolist() == labels
                    assert glob["position_ids"][s, d][j].tolist() == positions
                    assert b["document_lengths"][j] == row["document_lengths"]
                    if batch == 1:
                        assert b["cu_seqlens"].dtype == torch.int32
                        assert b["cu_seqlens"].tolist() == np.cumsum([0, *row["document_lengths"]]).tolist()
                    else:
                        assert b["cu_seqlens"] is None
                    if res["coords"][1:] == (0, 0):  # count each dp sample once (sp ranks hold slices of it)
                        seen.setdefault(kind, []).append((s, d, j, row_id))
    # train: the first N samples of the stream are each train row exactly once
    per_step = dp * batch
    stream = sorted(seen["steps"], key=lambda x: (x[0], x[1], x[2]))
    assert [x[0] * per_step + x[1] * batch + x[2] for x in stream] == list(range(len(stream)))
    assert sorted(x[3] for x in stream[: len(train_rows)]) == train_rows
    # validation: whole steps only, each served row once, all from the held-out rows
    val_ids = [x[3] for x in seen["val"]]
    assert len(val_ids) == len(set(val_ids)) == (len(val_rows) // per_step) * per_step
    assert set(val_ids) <= set(val_rows)
    assert results[0]["tokens_dropped"][1] == (len(val_rows) % per_step) * SEQ_LEN
    assert all(r["resume_equal"] for r in results)


def _on_the_fly_worker(src: str, tok_dir: str, cache: str, seq_len: int):
    mesh = cached_sp_mesh(2, 1, "zigzag", 2)
    cfg = DataConfig(inputs=[src], seed=1)
    train, val = build_dataloaders(
        cfg,
        tokenizer=load_tokenizer(tok_dir),
        seq_len=seq_len,
        mesh=mesh,
        micro_batch_size=1,
        seed=0,
        cache_dir=cache,
    )
    return (
        train.num_samples,
        train.tokens_dropped,
        val,
        sorted(p.name for p in (Path(cache) / "packed").iterdir()),
    )


def test_on_the_fly_preparation_runs_once_world4(dist_pools, corpus):
    cache = str(corpus["root"] / "fly")
    results = dist_pools(4).run(_on_the_fly_worker, corpus["src"], corpus["tok"], cache, SEQ_LEN)
    ref = datasets.load_from_disk(corpus["prepared"])
    assert [r[:3] for r in results] == [(len(ref), results[0][1], None)] * 4
    assert len(results[0][3]) == 1  # one cache entry, written by rank 0 only
    assert (
        results[0][1]
        == json.loads((Path(corpus["prepared"]) / "usp_prepare.json").read_text())["tokens_dropped"]
    )


def _bad_seq_len_worker(tok_dir: str, cache: str):
    mesh = cached_sp_mesh(2, 2, "zigzag", 1)
    cfg = DataConfig(inputs=["/does/not/exist.jsonl"])
    try:
        build_dataloaders(
            cfg,
            tokenizer=load_tokenizer(tok_dir),
            seq_len=30,
            mesh=mesh,
            micro_batch_size=1,
            seed=0,
            cache_dir=cache,
        )
    except ValueError as e:
        return str(e)
    return None


def test_bad_seq_len_raises_before_reading_inputs(dist_pools, corpus):
    msgs = dist_pools(4).run(_bad_seq_len_worker, corpus["tok"], str(corpus["root"] / "bad"))
    assert all(m is not None and "trainer.seq_len = 24 or 32" in m for m in msgs)


def test_resume_single_process_and_errors(corpus):
    tok = load_tokenizer(corpus["tok"])
    cfg = DataConfig(prepared_path=corpus["prepared"])
    kw = dict(tokenizer=tok, seq_len=SEQ_LEN, mesh=None, micro_batch_size=2, seed=9, cache_dir=corpus["root"])
    train, val = build_dataloaders(cfg, **kw)
    assert val is None and train.tokens_dropped > 0
    it = iter(train)
    batches = [next(it) for _ in range(train.steps_per_epoch + 3)]  # crosses into the second epoch
    for k, b in enumerate(batches):
        assert b["row_index"] == train.sample_ids(k * train.samples_per_step)
    for k in (0, 1, train.steps_per_epoch - 1, train.steps_per_epoch + 1):
        fresh, _ = build_dataloaders(cfg, **kw)
        for _ in zip(range(k), fresh):
            pass
        state = fresh.state_dict()
        restored, _ = build_dataloaders(cfg, **kw)
        restored.load_state_dict(state)
        got = next(iter(restored))
        assert torch.equal(got["input_ids"], batches[k]["input_ids"]), k
        assert got["document_lengths"] == batches[k]["document_lengths"]
    # a new epoch is a new order, the same rows
    epoch0 = torch.cat([b["input_ids"] for b in batches[: train.steps_per_epoch]])
    other, _ = build_dataloaders(cfg, **{**kw, "seed": 10})
    assert not torch.equal(
        epoch0, torch.cat([next(iter(other))["input_ids"] for _ in range(train.steps_per_epoch)])
    )
    with pytest.raises(ValueError, match="seed"):
        other.load_state_dict(state)
    with pytest.raises(ValueError, match=r"rows of 48 tokens but trainer.seq_len=96.*--seq-len 96"):
        build_dataloaders(cfg, **{**kw, "seq_len": 96})
    with pytest.raises(ValueError, match="data.build_tiny_corpus"):
        build_dataloaders(DataConfig(), **kw)


def test_small_validation_fraction_holds_out_one_step(corpus, tmp_path):
    """conf/data/prepared.yaml's 0.001 on a modest corpus: one validation step is held out, not an error."""
    tok = load_tokenizer(corpus["tok"])
    kw = dict(tokenizer=tok, seq_len=SEQ_LEN, mesh=None, micro_batch_size=2, seed=9, cache_dir=tmp_path)
    train, val = build_dataloaders(
        DataConfig(prepared_path=corpus["prepared"], validation_fraction=0.001), **kw
    )
    n = datasets.load_from_disk(corpus["prepared"]).num_rows
    assert n * 0.001 < 0.5 and val is not None and val.num_samples == 2 and train.num_samples == n - 2
    assert len(val) == 1 and not set(val.indices) & set(train.indices)
    t, v = split_rows(5, 0.001, seed=0)
    assert (len(t), len(v)) == (4, 1)
    assert [len(x) for x in split_rows(5, 0.0, seed=0)] == [5, 0]
    with pytest.raises(ValueError, match=r"data.validation_fraction=0.5.*only 1 rows.*validation_fraction=0"):
        split_rows(1, 0.5, seed=0)
    with pytest.raises(ValueError, match=r"only 3 rows.*prepare more data"):
        split_rows(3, 0.001, seed=0, min_rows=2)


def test_prepared_data_must_match_the_tokenizer(corpus, tmp_path, caplog):
    prepared = tmp_path / "prepared"
    shutil.copytree(corpus["prepared"], prepared)
    tok = load_tokenizer(corpus["tok"])
    kw = dict(seq_len=SEQ_LEN, mesh=None, micro_batch_size=1, seed=0, cache_dir=tmp_path)
    cfg = DataConfig(prepared_path=str(prepared))
    build_dataloaders(cfg, tokenizer=tok, **kw)  # the same tokenizer: fine
    other = copy.deepcopy(tok)
    other.add_tokens(["<extra_a>", "<extra_b>"])
    with pytest.raises(ValueError, match=r"data.prepared_path=.*another tokenizer.*vocab_size.*--tokenizer"):
        build_dataloaders(cfg, tokenizer=other, **kw)
    stats_file = prepared / "usp_prepare.json"
    stats = json.loads(stats_file.read_text())
    assert 0 < stats["extra"]["max_token_id"] < len(tok)
    stats["extra"]["max_token_id"] = len(tok) + 7  # ids the model's embedding does not have
    stats_file.write_text(json.dumps(stats))
    with pytest.raises(ValueError, match=rf"holds token id {len(tok) + 7}.*model.path"):
        build_dataloaders(cfg, tokenizer=tok, **kw)
    for k in ("max_token_id", "tokenizer_identity"):  # an older output: accepted with a warning
        del stats["extra"][k]
    stats_file.write_text(json.dumps(stats))
    with caplog.at_level(logging.WARNING, logger="usp.data.loader"):
        build_dataloaders(cfg, tokenizer=other, **kw)
    assert "no tokenizer fingerprint" in caplog.text


def _input_seen_by_one_rank_worker(src: str, tok_dir: str, cache: str, fail_rank: int):
    """``check_inputs`` fails on ``fail_rank`` only (an input on one node's local disk)."""
    import torch.distributed as dist

    import usp.data.loader as loader_mod

    real, calls = loader_mod.check_inputs, []

    def check(*args, **kwargs):
        calls.append(dist.get_rank())
        if dist.get_rank() == fail_rank:
            raise ValueError(f"data.inputs: input {src!r} does not exist (rank {fail_rank})")
        return real(*args, **kwargs)

    loader_mod.check_inputs = check
    try:
        train, _ = build_dataloaders(
            DataConfig(inputs=[src], seed=1),
            tokenizer=load_tokenizer(tok_dir),
            seq_len=SEQ_LEN,
            mesh=cached_sp_mesh(2, 1, "zigzag", 1),
            micro_batch_size=1,
            seed=0,
            cache_dir=cache,
        )
        return ("ok", train.num_samples, calls)
    except ValueError as e:
        return ("error", str(e), calls)
    finally:
        loader_mod.check_inputs = real


def test_inputs_are_checked_on_rank0_only_world2(dist_pools, corpus):
    """Every rank reaches the same collective whichever rank cannot see an input: no hang, same outcome."""
    pool = dist_pools(2)
    ok = pool.run(_input_seen_by_one_rank_worker, corpus["src"], corpus["tok"], str(corpus["root"] / "r1"), 1)
    assert [r[0] for r in ok] == ["ok", "ok"] and ok[0][1] == ok[1][1] > 0
    assert ok[1][2] == []  # rank 1 never looks at the inputs: rank 0 reads them and shares the rows
    bad = pool.run(
        _input_seen_by_one_rank_worker, corpus["src"], corpus["tok"], str(corpus["root"] / "r0"), 0
    )
    assert [r[0] for r in bad] == ["error", "error"]
    assert all("does not exist" in r[1] for r in bad)


def test_tiny_corpus_on_the_fly(tmp_path):
    tok = build_tiny_tokenizer(tmp_path / "tok")
    cfg = DataConfig(build_tiny_corpus=True, validation_fraction=0.05, document_masking=False)
    train, val = build_dataloaders(
        cfg, tokenizer=tok, seq_len=64, mesh=None, micro_batch_size=1, seed=0, cache_dir=tmp_path / "cache"
    )
    b = next(iter(train))
    assert b["cu_seqlens"] is None and b["document_lengths"] == [[64]]
    assert b["position_ids"].tolist() == [list(range(64))]
    assert (b["labels"][0, :-1] == b["input_ids"][0, 1:]).all() and b["labels"][0, -1] == IGNORE_INDEX
    assert val is not None and len(val) == val.num_samples
