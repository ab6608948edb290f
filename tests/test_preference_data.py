"""Preference (DPO) data: text and chat pairs, the row layout contract, packing, counts, bad input, the batch's
``document_roles`` / ``document_index`` / ``row_index`` (sharded consistently with ``labels``), the CLI.

The expected token ids are built independently of ``usp.data.preference``: text form ``[BOS] + tokens(prompt) +
tokens(completion) + [EOS]``; chat form the template's rendering of ``prompt + completion`` tokenized once, with
exactly ``tokens(completion content + end-of-turn marker)`` as targets.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import datasets
import numpy as np
import pytest
import torch

from usp.config import DataConfig, TrainConfig, validate_choices
from usp.data.batch import IGNORE_INDEX, collate_rows
from usp.data.chat_prepare import ChatOptions, chat_preparation_key
from usp.data.cli import main as prepare_main
from usp.data.loader import build_dataloaders
from usp.data.pack import PackStats
from usp.data.pack_preference import pack_preference_pairs
from usp.data.preference import preference_pair_of
from usp.data.preference_prepare import (
    PreferenceOptions,
    preference_preparation_key,
    prepare_preference_dataset,
)
from usp.data.prepared import read_stats
from usp.tiny import build_tiny_tokenizer

TEMPLATE = (Path(__file__).parents[1] / "usp" / "data" / "templates" / "tiny_chatml.jinja").read_text()
END_OF_TURN = "</s>"  # tiny_chatml closes a turn with the tiny tokenizer's EOS

TEXT_PAIRS = [
    {"prompt": "count 1 2 3", "chosen": " 4 5 6", "rejected": " 7 8"},
    {"prompt": "repeat the ring", "chosen": " the ring , the ring", "rejected": " ring"},
    {"prompt": "the query", "chosen": " key value", "rejected": " value key layer batch step"},
    {"prompt": "", "chosen": "a long context", "rejected": "a short one"},
    {"prompt": "merge send", "chosen": " receive", "rejected": " zigzag ulysses chunk"},
    {"prompt": "10 11 12 13", "chosen": " 14", "rejected": " 15 16 17 18 19 20"},
]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    """The tiny tokenizer, saved with tiny_chatml as its own chat template."""
    path = tmp_path_factory.mktemp("pref_tok") / "tok"
    tok = build_tiny_tokenizer(path)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tokenizer(tok_dir):
    from usp.data.tokenize import load_tokenizer

    return load_tokenizer(tok_dir)


def _write(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _documents(row: dict) -> list[tuple[int, list[int], list[int]]]:
    """``(role, ids, loss_mask)`` of each document of a packed row."""
    out, start = [], 0
    for n, role in zip(row["document_lengths"], row["document_roles"]):
        out.append((role, row["input_ids"][start : start + n], row["loss_mask"][start : start + n]))
        start += n
    return out


def _check_layout(
    row: dict, seq_len: int, pad_id: int
) -> list[tuple[list[int], list[int], list[int], list[int]]]:
    """The row contract; returns its pairs ``(chosen ids, chosen mask, rejected ids, rejected mask)``."""
    assert len(row["input_ids"]) == len(row["loss_mask"]) == seq_len and row["first_position"] == 0
    assert sum(row["document_lengths"]) == seq_len
    roles = row["document_roles"]
    assert len(roles) == len(row["document_lengths"])
    k = len(roles) - (roles[-1] == 0)
    assert k >= 2 and k % 2 == 0 and roles[:k] == [1, 2] * (k // 2) and 0 not in roles[:k]
    docs = _documents(row)
    if roles[-1] == 0:  # the padding: one trailing document of its own, never a target
        _, ids, mask = docs[-1]
        assert set(ids) == {pad_id} and not any(mask)
    return [(docs[i][1], docs[i][2], docs[i + 1][1], docs[i + 1][2]) for i in range(0, k, 2)]


def _expected_text(tokenizer, prompt: str, completion: str) -> tuple[list[int], list[int]]:
    head = [tokenizer.bos_token_id] + _ids(tokenizer, prompt)
    tail = _ids(tokenizer, completion) + [tokenizer.eos_token_id]
    return head + tail, [0] * len(head) + [1] * len(tail)


def test_text_pairs_layout_decode_and_mask(tokenizer, tmp_path):
    src = _write(tmp_path / "pairs.jsonl", TEXT_PAIRS)
    prep = prepare_preference_dataset(
        [src],
        tokenizer=tokenizer,
        seq_len=64,
        output=tmp_path / "out",
        cache_dir=tmp_path / "hf",
        log=lambda _: None,
    )
    ds = datasets.load_from_disk(str(prep.path))
    assert ds.column_names == [
        "input_ids",
        "document_lengths",
        "first_position",
        "loss_mask",
        "document_roles",
    ]
    assert (
        ds.features["document_roles"].feature.dtype == "int8"
        and ds.features["loss_mask"].feature.dtype == "uint8"
    )
    expected = Counter()
    for p in TEXT_PAIRS:
        c_ids, c_mask = _expected_text(tokenizer, p["prompt"], p["chosen"])
        r_ids, r_mask = _expected_text(tokenizer, p["prompt"], p["rejected"])
        expected[(tuple(c_ids), tuple(c_mask), tuple(r_ids), tuple(r_mask))] += 1
    got = Counter()
    for row in ds:
        for c_ids, c_mask, r_ids, r_mask in _check_layout(row, 64, tokenizer.pad_token_id):
            got[(tuple(c_ids), tuple(c_mask), tuple(r_ids), tuple(r_mask))] += 1
    assert got == expected  # every pair once, whole, in one row, chosen before rejected, exact masks
    for row in ds:  # each document decodes to prompt + completion
        texts = [tokenizer.decode(ids, skip_special_tokens=True) for role, ids, _ in _documents(row) if role]
        for t in texts:
            assert any(
                t.replace(" ", "") == (p["prompt"] + p[k]).replace(" ", "")
                for p in TEXT_PAIRS
                for k in ("chosen", "rejected")
            ), t
    x = read_stats(prep.path)["extra"]
    assert x["pairs_read"] == x["pairs_packed"] == len(TEXT_PAIRS) and x["data_format"] == "preference"
    assert x["target_tokens"] == sum(sum(k[1]) + sum(k[3]) for k in expected)
    assert x["fill_ratio"] == pytest.approx(sum(len(k[0]) + len(k[2]) for k in expected) / (64 * len(ds)))


def _expected_chat(tokenizer, prompt: list[dict], completion: list[dict]) -> tuple[list[int], list[int]]:
    ids = _ids(
        tokenizer, tokenizer.apply_chat_template(prompt + completion, tokenize=False, chat_template=TEMPLATE)
    )
    target = _ids(tokenizer, completion[-1]["content"].strip() + END_OF_TURN)
    starts = [i for i in range(len(ids)) if ids[i : i + len(target)] == target]
    start = starts[-1]
    return ids, [int(start <= i < start + len(target)) for i in range(len(ids))]


@pytest.mark.parametrize(
    "template", [None, "tiny_chatml"]
)  # the tokenizer's own template, or --chat-template
def test_chat_pairs_mask_only_the_completion(tokenizer, tmp_path, template):
    prompt = [
        {"role": "system", "content": "you count numbers"},
        {"role": "user", "content": "1 2 3"},
        {"role": "assistant", "content": "4 5 6"},  # a prompt turn of the assistant: never a target
        {"role": "user", "content": "and again"},
    ]
    chosen = {"role": "assistant", "content": "7 8 9"}
    rows = [
        {
            "prompt": prompt,
            "chosen": prompt + [chosen],
            "rejected": "the ring",
        },  # TRL: chosen repeats the prompt
        {
            "prompt": "repeat the ring",
            "chosen": [{"role": "assistant", "content": "the ring"}],
            "rejected": "ring",
        },
        {
            "prompt": "x",
            "chosen": [{"role": "assistant", "content": "  "}],
            "rejected": "y",
        },  # empty: dropped
        {"prompt": prompt, "chosen": prompt, "rejected": "z"},  # only the prompt again: empty completion
    ]
    src = _write(tmp_path / "chat.jsonl", rows)
    prep = prepare_preference_dataset(
        [src],
        tokenizer=tokenizer,
        seq_len=256,
        output=tmp_path / "out",
        options=PreferenceOptions(chat_template=template),
        cache_dir=tmp_path / "hf",
        log=lambda _: None,
    )
    ds = datasets.load_from_disk(str(prep.path))
    pairs = [p for row in ds for p in _check_layout(row, 256, tokenizer.pad_token_id)]
    user = lambda s: [{"role": "user", "content": s}]  # noqa: E731
    assistant = lambda s: [{"role": "assistant", "content": s}]  # noqa: E731
    expected = [
        (
            _expected_chat(tokenizer, prompt, [chosen]),
            _expected_chat(tokenizer, prompt, assistant("the ring")),
        ),
        (
            _expected_chat(tokenizer, user("repeat the ring"), assistant("the ring")),
            _expected_chat(tokenizer, user("repeat the ring"), assistant("ring")),
        ),
    ]
    want = sorted((c[0], c[1], r[0], r[1]) for c, r in expected)
    assert sorted((list(a), list(b), list(c), list(d)) for a, b, c, d in pairs) == want
    x = read_stats(prep.path)["extra"]
    assert (
        x["pairs_read"],
        x["pairs_chat_form"],
        x["pairs_packed"],
        x["pairs_dropped_empty_completion"],
    ) == (4, 4, 2, 2)


def test_row_forms_and_missing_fields():
    assert preference_pair_of({"prompt": "a", "chosen": "b", "rejected": "c"})["chat"] is False
    p = preference_pair_of(
        {"q": "hi", "good": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}], "bad": "no"},
        ("q", "good", "bad"),
    )
    assert p["chat"] and p["prompt_messages"] == [{"role": "user", "content": "hi"}]
    assert p["chosen_messages"] == [{"role": "assistant", "content": "yo"}]  # the repeated prompt stripped
    assert p["rejected_messages"] == [{"role": "assistant", "content": "no"}]
    with pytest.raises(
        ValueError, match=r"row 4: the 'rejected' field \(rejected\) is missing.*--rejected-field"
    ):
        preference_pair_of({"prompt": "a", "chosen": "b"}, where="row 4")
    with pytest.raises(ValueError, match=r"the 'chosen' field \(chosen\) is of type int"):
        preference_pair_of({"prompt": "a", "chosen": 3, "rejected": "c"})


def test_missing_field_raises_before_any_output(tokenizer, tmp_path):
    rows = [dict(TEXT_PAIRS[0]), dict(TEXT_PAIRS[1]), {"prompt": "a", "chosen": "b"}]
    src = _write(tmp_path / "bad.jsonl", rows)
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=r"bad.jsonl', row 2: the 'rejected' field \(rejected\) is missing"):
        prepare_preference_dataset(
            [src], tokenizer=tokenizer, seq_len=64, output=out, cache_dir=tmp_path / "hf"
        )
    assert not [p for p in tmp_path.iterdir() if out.name in p.name]  # no output, no work dir left
    no_prompt = _write(tmp_path / "noprompt.jsonl", [{"question": "a", "chosen": "b", "rejected": "c"}])
    with pytest.raises(ValueError, match=r"row 0: the 'prompt' field \(prompt\) is missing.*'question'"):
        prepare_preference_dataset(
            [no_prompt], tokenizer=tokenizer, seq_len=64, output=out, cache_dir=tmp_path / "hf"
        )
    with pytest.raises(ValueError, match="three different column names"):
        PreferenceOptions(chosen_field="prompt").check()


def _pair(value: int, prompt: int, chosen: int, rejected: int):
    """A synthetic pair: every token ``value``; the first ``prompt`` tokens of each sequence not targets."""
    out = []
    for n in (prompt + chosen, prompt + rejected):
        mask = np.zeros(n, np.uint8)
        mask[prompt:] = 1
        out += [np.full(n, value, np.int32), mask]
    return tuple(out)


def test_pairs_best_fit_never_split_and_dropped_counted():
    sizes = {10: (2, 4, 2), 11: (3, 2, 2), 12: (4, 3, 2), 13: (1, 2, 2), 14: (1, 1, 2), 15: (2, 2, 2)}
    # pair sizes 10, 10, 13, 6, 5, 8 (= 52 tokens): best-fit decreasing fills 3 rows of 20 (13+6, 10+10, 8+5)
    pairs = [_pair(v, *s) for v, s in sizes.items()]
    pairs += [_pair(20, 5, 10, 5), _pair(21, 21, 1, 1)]  # 25 tokens > 20; a prompt of 21 > 20 alone
    stats = PackStats(seq_len=20)
    batches = list(pack_preference_pairs([pairs[:4], pairs[4:]], 20, pad_id=0, stats=stats))
    rows = [r for b in batches for r in b.to_pylist()]
    # windows are packed separately: window 1 (10, 10, 13, 6) -> 13+6, 10+10; window 2 (5, 8) -> 8+5
    assert len(rows) == stats.rows == 3
    seen = []
    for row in rows:
        for c_ids, c_mask, r_ids, r_mask in _check_layout(row, 20, 0):
            v = c_ids[0]
            assert set(c_ids) == set(r_ids) == {v}  # the two documents of one pair, together
            p, c, r = sizes[v]
            assert c_mask == [0] * p + [1] * c and r_mask == [0] * p + [1] * r
            seen.append(v)
    assert sorted(seen) == sorted(sizes)
    full = [r for r in rows if 0 not in r["document_roles"]]
    assert len(full) == 1 and full[0]["document_roles"] == [1, 2, 1, 2]  # no padding document when full
    x = stats.extra
    assert (x["pairs_dropped_too_long"], x["pairs_dropped_prompt_too_long"], x["pairs_packed"]) == (1, 1, 6)
    assert stats.tokens_dropped == 25 + 44 and stats.tokens_packed == 52 and x["padding_tokens"] == 8


def test_too_long_and_empty_pairs_are_counted_in_the_summary(tokenizer, tmp_path):
    rows = [
        *TEXT_PAIRS[:2],
        {"prompt": "x", "chosen": "", "rejected": " y"},
        {"prompt": "z", "chosen": " w", "rejected": "   "},
        {"prompt": " ".join(["the ring"] * 40), "chosen": " a", "rejected": " b"},
        {"prompt": "count", "chosen": " 1 2 3 4 5 6 7 8 9" * 3, "rejected": " 1 2 3 4 5 6 7 8 9" * 3},
    ]
    src = _write(tmp_path / "mixed.jsonl", rows)
    logs: list[str] = []
    prep = prepare_preference_dataset(
        [src],
        tokenizer=tokenizer,
        seq_len=64,
        output=tmp_path / "out",
        cache_dir=tmp_path / "hf",
        log=logs.append,
    )
    x = read_stats(prep.path)["extra"]
    assert x["pairs_read"] == 6 and x["pairs_packed"] == 2
    assert x["pairs_dropped_empty_completion"] == 2
    assert x["pairs_dropped_prompt_too_long"] == 1 and x["pairs_dropped_too_long"] == 1
    assert "2 with an empty completion" in logs[-1] and "1 longer than --seq-len" in logs[-1]
    with pytest.raises(ValueError, match="no preference pair to train on"):
        prepare_preference_dataset(
            [src],
            tokenizer=tokenizer,
            seq_len=8,
            output=tmp_path / "o8",
            cache_dir=tmp_path / "hf",
            log=lambda _: None,
        )


def test_collate_roles_index_and_row_index_single_process(tokenizer):
    rows = [
        r
        for b in pack_preference_pairs(
            [[_pair(5, 2, 3, 1), _pair(6, 1, 1, 1), _pair(7, 3, 2, 4)]], 24, pad_id=0
        )
        for r in b.to_pylist()
    ]
    assert len(rows) == 1
    batch = collate_rows(rows, mesh=None, document_masking=True, row_indices=[17])
    row = rows[0]
    assert batch["row_index"] == [17] and batch["document_roles"] == [row["document_roles"]]
    assert all(type(k) is int for k in batch["document_roles"][0])
    index = batch["document_index"]
    assert index.dtype == torch.int64 and index.shape == (1, 24)
    want = [d for d, n in enumerate(row["document_lengths"]) for _ in range(n)]
    assert index[0].tolist() == want
    # the targets are the completions: labels[t-1] = ids[t] exactly where loss_mask[t] (no document start is one)
    assert int((batch["labels"] != IGNORE_INDEX).sum()) == sum(row["loss_mask"])
    plain = collate_rows(
        [{k: row[k] for k in ("input_ids", "document_lengths", "first_position")}],
        mesh=None,
        document_masking=True,
    )
    assert not {"document_roles", "document_index", "row_index"} & set(plain)


def _shard_worker(rows: list[dict], ulysses: int, ring: int, layout: str, dp: int) -> dict:
    from tests.mesh_cache import cached_sp_mesh
    from usp.parallel import gather_sequence, local_token_indices

    mesh = cached_sp_mesh(ulysses, ring, layout, dp)
    ids = list(range(100, 100 + len(rows)))
    full = collate_rows(rows, mesh=None, document_masking=True, row_indices=ids)
    part = collate_rows(rows, mesh=mesh, document_masking=True, row_indices=ids)
    cu = part["cu_seqlens"]
    seq_len = full["input_ids"].size(1)
    idx = local_token_indices(seq_len, ring, ulysses, mesh.ring_rank, mesh.ulysses_rank, layout, cu)
    out = {"local": part["document_index"].size(1) == seq_len // (ulysses * ring)}
    for key in ("input_ids", "labels", "position_ids", "document_index"):
        out[key] = bool(torch.equal(gather_sequence(part[key], mesh, dim=1, cu_seqlens=cu), full[key]))
        out[f"{key}_at_idx"] = bool(torch.equal(part[key], full[key][:, idx]))  # same positions as the labels
    out["roles"] = (
        part["document_roles"] == full["document_roles"] == [list(r["document_roles"]) for r in rows]
    )
    out["row_index"] = part["row_index"] == ids
    return out


@pytest.mark.parametrize(
    "ulysses, ring, layout, dp, batch",
    [(2, 2, "balanced", 1, 1), (2, 2, "zigzag", 1, 2), (2, 1, "zigzag", 2, 2), (1, 2, "contiguous", 2, 1)],
)
def test_document_index_is_sharded_like_the_labels_world4(dist_pools, ulysses, ring, layout, dp, batch):
    rng = np.random.default_rng(3)
    pairs = [_pair(10 + k, *rng.integers(1, 6, size=3).tolist()) for k in range(12)]
    rows = [r for b in pack_preference_pairs([pairs], 48, pad_id=0) for r in b.to_pylist()][:batch]
    assert len(rows) == batch and all(len(r["document_roles"]) > 3 for r in rows)
    results = dist_pools(4).run(_shard_worker, rows, ulysses, ring, layout, dp)
    for res in results:
        assert all(res.values()), res


def test_loader_on_the_fly_row_index_and_format_checks(tokenizer, tmp_path):
    cache = tmp_path / "cache"
    kw = dict(tokenizer=tokenizer, seq_len=128, mesh=None, micro_batch_size=2, seed=0)
    train, _ = build_dataloaders(
        DataConfig(build_tiny_corpus=True, format="preference"), cache_dir=cache, **kw
    )
    (entry,) = list((cache / "packed").iterdir())
    assert entry.name.startswith("preference-seq128-")
    b = next(iter(train))
    assert b["row_index"] == train.sample_ids(0)
    for j, i in enumerate(b["row_index"]):
        row = train.dataset[i]
        assert b["document_roles"][j] == row["document_roles"].tolist()
        lengths = row["document_lengths"].tolist()
        assert b["document_index"][j].tolist() == [d for d, n in enumerate(lengths) for _ in range(n)]
        assert int((b["labels"][j] != IGNORE_INDEX).sum()) == int(row["loss_mask"].sum()) > 0
    stats = read_stats(entry)["extra"]
    assert stats["pairs_packed"] > 0 and stats["pairs_read"] == 400
    for fmt in ("text", "chat"):
        with pytest.raises(
            ValueError, match=rf"holds preference pairs.*data.format={fmt}.*data.format=preference"
        ):
            build_dataloaders(
                DataConfig(prepared_path=str(entry), format=fmt), cache_dir=tmp_path / "c2", **kw
            )
    text, _ = build_dataloaders(DataConfig(build_tiny_corpus=True), cache_dir=tmp_path / "ct", **kw)
    assert "document_roles" not in next(iter(text)) and "row_index" in next(iter(text))
    (text_entry,) = list((tmp_path / "ct" / "packed").iterdir())
    with pytest.raises(
        ValueError, match="data.format=preference but .* has no document_roles.*--format preference"
    ):
        build_dataloaders(
            DataConfig(prepared_path=str(text_entry), format="preference"), cache_dir=tmp_path / "c3", **kw
        )


def test_preparation_key_covers_format_and_fields(tokenizer, tmp_path):
    src = _write(tmp_path / "p.jsonl", TEXT_PAIRS)
    args = ([src], tokenizer, 64)
    rest = (None, 0, False, None)
    pref = preference_preparation_key(*args, PreferenceOptions(), *rest)
    assert pref != chat_preparation_key(*args, ChatOptions(messages_field="prompt"), *rest)
    assert pref != preference_preparation_key(*args, PreferenceOptions(rejected_field="bad"), *rest)
    assert pref != preference_preparation_key(*args, PreferenceOptions(chat_template="chatml"), *rest)
    assert pref != preference_preparation_key(*args, PreferenceOptions(add_bos=False), *rest)
    assert pref == preference_preparation_key(*args, PreferenceOptions(), *rest)


def test_config_checks_for_preference():
    cfg = TrainConfig()
    cfg.model.path, cfg.data.build_tiny_corpus, cfg.data.format = "/x", True, "preference"
    validate_choices(cfg)
    cfg.data.document_masking = False
    with pytest.raises(ValueError, match="data.format=preference .* needs data.document_masking=true"):
        validate_choices(cfg)
    cfg.data.document_masking, cfg.data.loss_on = True, "assistant"
    with pytest.raises(ValueError, match="data.loss_on=assistant does not apply to data.format=preference"):
        validate_choices(cfg)


def test_cli_end_to_end(tok_dir, tmp_path, capsys):
    rows = [{"question": p["prompt"], "good": p["chosen"], "bad": p["rejected"]} for p in TEXT_PAIRS]
    src = _write(tmp_path / "pairs.jsonl", rows)
    out = tmp_path / "out"
    argv = ["--format", "preference", "--input", src, "--tokenizer", str(tok_dir), "--seq-len", "64"]
    fields = ["--prompt-field", "question", "--chosen-field", "good", "--rejected-field", "bad"]
    assert prepare_main([*argv, *fields, "--cache-dir", str(tmp_path / "hf"), "--output", str(out)]) == 0
    assert "usp-prepare-data --format preference: 6 pairs read" in capsys.readouterr().out
    ds = datasets.load_from_disk(str(out))
    assert set(ds.column_names) == {
        "input_ids",
        "document_lengths",
        "first_position",
        "loss_mask",
        "document_roles",
    }
    stats = read_stats(out)
    x = stats["extra"]
    assert x["pairs_packed"] == 6 and x["preference"]["chosen_field"] == "good" and stats["rows"] == len(ds)
    for row in ds:
        _check_layout(row, 64, 0)
    # chat rows with --chat-template, and a missing field: one error line naming it
    chat = _write(
        tmp_path / "chat.jsonl",
        [{"prompt": [{"role": "user", "content": "hi"}], "chosen": "yo", "rejected": "no"}],
    )
    assert (
        prepare_main(
            [*argv[:3], chat, *argv[4:], "--chat-template", "tiny_chatml", "--output", str(tmp_path / "o2")]
        )
        == 0
    )
    assert read_stats(tmp_path / "o2")["extra"]["pairs_chat_form"] == 1
    bad = _write(tmp_path / "bad.jsonl", [{"prompt": "a", "chosen": "b"}])
    capsys.readouterr()
    assert prepare_main([*argv[:3], bad, *argv[4:], "--output", str(tmp_path / "o3")]) != 0
    assert "row 0: the 'rejected' field (rejected) is missing" in capsys.readouterr().err


def _random_pair(
    gen: np.random.Generator, prompt: int, chosen: int, rejected: int, differ_at: int | None = None
):
    """A pair of random ids sharing its prompt (but for token ``differ_at`` of the rejected sequence's)."""
    p = gen.integers(3, 60, prompt).astype(np.int32)
    c = np.concatenate([p, gen.integers(3, 60, chosen).astype(np.int32)])
    r = np.concatenate([p, gen.integers(3, 60, rejected).astype(np.int32)])
    if differ_at is not None:
        r[differ_at] = 61 if r[differ_at] != 61 else 62
    masks = [np.r_[np.zeros(prompt, np.uint8), np.ones(n, np.uint8)] for n in (chosen, rejected)]
    return (c, masks[0], r, masks[1])


def test_shared_prompt_packing_lays_the_prompt_out_once():
    """``--shared-prompt``: ``prompt + chosen``, then the prompt's last token + ``rejected`` linked to the rest
    of the prompt; labels, targets and positions of every token as in the two-sequence layout; fewer tokens."""
    gen = np.random.default_rng(0)
    # a long prompt, a one-token prompt (nothing to share), a prompt whose rejected copy differs at token 2
    pairs = [_random_pair(gen, 9, 3, 4), _random_pair(gen, 1, 2, 2), _random_pair(gen, 6, 2, 3, differ_at=2)]
    shared_stats, plain_stats = PackStats(seq_len=64), PackStats(seq_len=64)
    (shared,) = [
        r
        for b in pack_preference_pairs([pairs], 64, pad_id=0, stats=shared_stats, shared_prompt=True)
        for r in b.to_pylist()
    ]
    (plain,) = [
        r for b in pack_preference_pairs([pairs], 64, pad_id=0, stats=plain_stats) for r in b.to_pylist()
    ]
    assert "shared_prefix" not in plain and shared["document_roles"] == plain["document_roles"]
    saved = 8 + 0 + 1
    assert (
        shared_stats.extra["prompt_tokens_shared"] == saved and plain_stats.extra["prompt_tokens_shared"] == 0
    )
    assert shared_stats.tokens_packed == plain_stats.tokens_packed - saved
    assert shared_stats.extra["target_tokens"] == plain_stats.extra["target_tokens"]
    links = [n for n, role in zip(shared["shared_prefix"], shared["document_roles"]) if role == 2]
    chosen_lengths = [n for n, role in zip(shared["document_lengths"], shared["document_roles"]) if role == 1]
    assert sorted(zip(chosen_lengths, links)) == [(3, 0), (8, 1), (12, 8)]  # best-fit order: by size
    a = collate_rows([shared], mesh=None, document_masking=True)
    b = collate_rows([plain], mesh=None, document_masking=True)
    assert a["shared_prefix"].tolist() == shared["shared_prefix"] and "shared_prefix" not in b
    # token by token: the shared row's tokens are the plain row's without each rejected copy's linked prefix
    keep, start = [], 0
    for d, (n, role) in enumerate(zip(plain["document_lengths"], plain["document_roles"])):
        if role:  # the pairs (the padding differs in length)
            keep += list(range(start + shared["shared_prefix"][d], start + n))
        start += n
    for key in ("input_ids", "labels", "position_ids"):
        assert a[key][0, : len(keep)].tolist() == b[key][0, keep].tolist(), key
    assert int((a["labels"] != IGNORE_INDEX).sum()) == int((b["labels"] != IGNORE_INDEX).sum()) == 16


def test_shared_prompt_preparation_and_the_loader_check(tokenizer, tmp_path):
    src = _write(tmp_path / "pairs.jsonl", TEXT_PAIRS)
    logs: list[str] = []
    prep = prepare_preference_dataset(
        [src],
        tokenizer=tokenizer,
        seq_len=64,
        output=tmp_path / "out",
        options=PreferenceOptions(shared_prompt=True),
        cache_dir=tmp_path / "hf",
        log=logs.append,
    )
    ds = datasets.load_from_disk(str(prep.path))
    assert ds.column_names[-1] == "shared_prefix" and ds.features["shared_prefix"].feature.dtype == "int32"
    x = read_stats(prep.path)["extra"]
    # BOS + the prompt, less its last token, once per pair (the empty prompt: BOS alone, nothing shared)
    want = sum(len(_ids(tokenizer, p["prompt"])) for p in TEXT_PAIRS)
    assert x["prompt_tokens_shared"] == want > 0 and "laid out once" in logs[-1]
    assert x["target_tokens"] == sum(sum(r["loss_mask"]) for r in ds)
    kw = dict(
        tokenizer=tokenizer, seq_len=64, mesh=None, micro_batch_size=1, seed=0, cache_dir=tmp_path / "c"
    )
    cfg = DataConfig(prepared_path=str(prep.path), format="preference")
    with pytest.raises(ValueError, match="prepared with --shared-prompt.*trainer.dpo.shared_prompt=true"):
        build_dataloaders(cfg, **kw)
    train, _ = build_dataloaders(cfg, shared_prompt=True, **kw)
    assert "shared_prefix" in next(iter(train))
    plain = prepare_preference_dataset(
        [src],
        tokenizer=tokenizer,
        seq_len=64,
        output=tmp_path / "plain",
        cache_dir=tmp_path / "hf",
        log=lambda _: None,
    )
    with pytest.raises(
        ValueError, match="trainer.dpo.shared_prompt=true but .* each prompt twice.*--shared-prompt"
    ):
        build_dataloaders(
            DataConfig(prepared_path=str(plain.path), format="preference"), shared_prompt=True, **kw
        )
