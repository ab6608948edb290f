"""Data preparation in one process: sources, tokenization, packing, ``usp-prepare-data``, bad inputs."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import datasets
import numpy as np
import pytest
import torch

from usp.data import (
    IGNORE_INDEX,
    LengthShaping,
    PackStats,
    load_text_sources,
    pack_documents,
    prepare_dataset,
    read_stats,
    row_labels,
    row_positions,
)
from usp.data.cli import main as prepare_main
from usp.data.sources import weighted_counts
from usp.tiny import build_tiny_tokenizer, tiny_corpus_texts


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_tiny_tokenizer(tmp_path_factory.mktemp("tok") / "tok")


def _write_jsonl(path: Path, texts: list[str], field: str = "text") -> Path:
    path.write_text("".join(json.dumps({field: t, "id": i}) + "\n" for i, t in enumerate(texts)))
    return path


def _reference_stream(tokenizer, texts: list[str]) -> list[list[int]]:
    """Independent single-process tokenization: [BOS] + tokens + [EOS] per non-empty document."""
    docs = []
    for t in texts:
        if t.strip():
            ids = tokenizer(t, add_special_tokens=False)["input_ids"]
            docs.append([tokenizer.bos_token_id, *ids, tokenizer.eos_token_id])
    return docs


def _expected_rows(docs: list[list[int]], seq_len: int):
    """Cut the document stream every seq_len tokens; per row: tokens, piece lengths, first position."""
    stream = [(tok, d, p) for d, doc in enumerate(docs) for p, tok in enumerate(doc)]
    rows = []
    for r in range(len(stream) // seq_len):
        part = stream[r * seq_len : (r + 1) * seq_len]
        lengths = []
        for i, (_, d, _) in enumerate(part):
            if i == 0 or d != part[i - 1][1]:
                lengths.append(0)
            lengths[-1] += 1
        rows.append(([t for t, _, _ in part], lengths, part[0][2]))
    return rows, len(stream) - len(rows) * seq_len


def _windows(docs: list[list[int]], window: int):
    for i in range(0, len(docs), window):
        chunk = docs[i : i + window]
        yield np.array([t for d in chunk for t in d], dtype=np.int32), np.array([len(d) for d in chunk])


@pytest.mark.parametrize("window", [1, 5, 1000])
def test_pack_documents_matches_reference_cut(window):
    rng = np.random.default_rng(0)
    # lengths include documents several rows long and single tokens
    docs = [rng.integers(0, 1000, size=int(n)).tolist() for n in rng.choice([1, 3, 17, 40, 150], size=60)]
    seq_len = 32
    stats = PackStats(seq_len=seq_len)
    batches = list(pack_documents(_windows(docs, window), seq_len, stats=stats))
    table = datasets.Dataset.from_dict(
        {
            k: sum((b.column(k).to_pylist() for b in batches), [])
            for k in ("input_ids", "document_lengths", "first_position")
        }
    )
    expected, tail = _expected_rows(docs, seq_len)
    assert len(table) == len(expected) == stats.rows
    for row, (ids, lengths, first) in zip(table, expected):
        assert row["input_ids"] == ids
        assert row["document_lengths"] == lengths
        assert sum(row["document_lengths"]) == seq_len
        assert row["first_position"] == first
    assert stats.tokens_dropped == tail
    assert stats.tokens_in == sum(map(len, docs)) == stats.tokens_packed + tail
    assert stats.documents_split == sum(1 for _, _, first in expected if first > 0)


def test_row_labels_and_positions_by_hand():
    ids = torch.arange(10, 20)
    lengths = [3, 4, 3]  # first piece continues a document whose first 5 tokens were in the previous row
    labels = row_labels(ids, lengths, document_masking=True)
    assert labels.tolist() == [11, 12, -100, 14, 15, 16, -100, 18, 19, -100]
    assert row_labels(ids, lengths, document_masking=False).tolist() == list(range(11, 20)) + [IGNORE_INDEX]
    assert row_positions(10, lengths, 5, True).tolist() == [5, 6, 7, 0, 1, 2, 3, 0, 1, 2]
    assert row_positions(10, lengths, 5, False).tolist() == list(range(10))


def test_usp_prepare_data_cli_on_jsonl(tmp_path, tokenizer, capsys):
    texts = tiny_corpus_texts(60, seed=3)
    texts[4] = "   "  # an empty document: skipped and counted
    texts[7] = " ".join(str(i) for i in range(300))  # longer than a row: split, never dropped
    tok_dir = tmp_path / "tok"
    tokenizer.save_pretrained(str(tok_dir))
    src = _write_jsonl(tmp_path / "corpus.jsonl", texts, field="body")
    out = tmp_path / "prepared"
    seq_len = 48
    rc = prepare_main(
        [
            "--input",
            str(src),
            "--text-field",
            "body",
            "--tokenizer",
            str(tok_dir),
            "--seq-len",
            str(seq_len),
            "--output",
            str(out),
            "--num-proc",
            "2",
            "--cache-dir",
            str(tmp_path / "hf"),
        ]
    )
    assert rc == 0
    printed = capsys.readouterr().out
    assert "tokens/s" in printed and "tail tokens dropped" in printed
    ds = datasets.load_from_disk(str(out))
    docs = _reference_stream(tokenizer, texts)
    expected, tail = _expected_rows(docs, seq_len)
    assert len(ds) == len(expected)
    for row, (ids, lengths, first) in zip(ds, expected):
        assert len(row["input_ids"]) == seq_len and sum(row["document_lengths"]) == seq_len
        assert (row["input_ids"], row["document_lengths"], row["first_position"]) == (ids, lengths, first)
    stats = read_stats(out)
    assert stats["tokens_dropped"] == tail and stats["extra"]["documents_empty"] == 1
    assert stats["documents_split"] >= 300 // seq_len
    assert not list(tmp_path.glob(".prepared.work-*"))  # the work dir is cleaned up
    # never overwrite silently; --overwrite replaces a previous output only
    assert (
        prepare_main(
            [
                "--input",
                str(src),
                "--text-field",
                "body",
                "--tokenizer",
                str(tok_dir),
                "--seq-len",
                "48",
                "--output",
                str(out),
            ]
        )
        == 2
    )
    assert "already exists" in capsys.readouterr().err
    # a length that does not suit the training layout, before any work
    assert (
        prepare_main(
            [
                "--input",
                "/missing.jsonl",
                "--tokenizer",
                str(tok_dir),
                "--seq-len",
                "30",
                "--ring-degree",
                "2",
                "--ulysses-degree",
                "2",
                "--output",
                str(tmp_path / "x"),
            ]
        )
        == 2
    )
    assert "--seq-len 24 or 32" in capsys.readouterr().err


def test_sources_formats_concat_and_weighted_mix(tmp_path, tokenizer):
    a = _write_jsonl(tmp_path / "a.jsonl", [f"alpha {i}" for i in range(30)])
    datasets.Dataset.from_dict({"text": [f"beta {i}" for i in range(10)], "x": list(range(10))}).to_parquet(
        str(tmp_path / "b.parquet")
    )
    (tmp_path / "docs").mkdir()
    for i in range(3):  # one text file = one document, lines kept together
        (tmp_path / "docs" / f"{i}.txt").write_text(f"gamma {i}\nsecond line\n")
    inputs = [str(a), str(tmp_path / "b.parquet"), str(tmp_path / "docs" / "*.txt")]
    cache = tmp_path / "hf"
    cat = load_text_sources(inputs, cache_dir=cache)
    assert cat.column_names == ["text"] and len(cat) == 43
    assert sorted(t for t in cat["text"] if t.startswith("gamma")) == [
        f"gamma {i}\nsecond line\n" for i in range(3)
    ]
    usage: list = []
    mix1 = load_text_sources(inputs, weights=[0.2, 0.6, 0.2], seed=7, cache_dir=cache, usage=usage)
    mix2 = load_text_sources(inputs, weights=[0.2, 0.6, 0.2], seed=7, cache_dir=cache)
    mix3 = load_text_sources(inputs, weights=[0.2, 0.6, 0.2], seed=8, cache_dir=cache)
    assert mix1["text"] == mix2["text"] and mix1["text"] != mix3["text"]
    # the mix is the largest one without repeats: gamma (3 docs at 0.2) bounds it to 15 = 3 + 9 + 3
    assert len(mix1) == len(set(mix1["text"])) == 15 and set(mix1["text"]) <= set(cat["text"])
    assert [sum(t.startswith(k) for t in mix1["text"]) for k in ("alpha", "beta", "gamma")] == [3, 9, 3]
    assert [(u["used"], u["unused"]) for u in usage] == [(3, 27), (9, 1), (3, 0)]
    stream = load_text_sources(inputs, weights=[0.2, 0.6, 0.2], seed=7, cache_dir=cache, streaming=True)
    assert isinstance(stream, datasets.IterableDataset) and next(iter(stream))["text"]


def test_streaming_prepares_the_same_rows(tmp_path, tokenizer):
    src = _write_jsonl(tmp_path / "c.jsonl", tiny_corpus_texts(40, seed=5))
    kw = dict(tokenizer=tokenizer, seq_len=40, cache_dir=tmp_path / "hf", log=lambda _: None)
    a = prepare_dataset([str(src)], output=tmp_path / "a", **kw)
    b = prepare_dataset([str(src)], output=tmp_path / "b", streaming=True, **kw)
    assert a.stats.rows == b.stats.rows > 0 and a.stats.tokens_dropped == b.stats.tokens_dropped
    assert datasets.load_from_disk(str(a.path))[:] == datasets.load_from_disk(str(b.path))[:]


def test_long_document_upsampling_and_length_filter(tmp_path, tokenizer):
    texts = ["short doc"] * 20 + [" ".join(["long"] * 80)] * 4
    src = _write_jsonl(tmp_path / "c.jsonl", texts)
    docs = _reference_stream(tokenizer, texts)
    long_len, short_len = len(docs[-1]), len(docs[0])
    shaping = LengthShaping(min_doc_tokens=short_len + 1, long_doc_threshold=long_len, long_doc_factor=3.0)
    res = prepare_dataset(
        [str(src)],
        tokenizer=tokenizer,
        seq_len=16,
        output=tmp_path / "o",
        shaping=shaping,
        cache_dir=tmp_path / "hf",
        log=lambda _: None,
    )
    s = res.stats
    assert s.documents_filtered == 20 and s.documents_upsampled == 8
    assert s.tokens_in == 12 * long_len == s.tokens_packed + s.tokens_dropped


def test_bad_inputs_raise_clear_errors(tmp_path, tokenizer, monkeypatch):
    kw = dict(tokenizer=tokenizer, seq_len=32, cache_dir=tmp_path / "hf", log=lambda _: None)
    with pytest.raises(ValueError, match=r"'/nonexistent/x.jsonl' does not exist"):
        prepare_dataset(["/nonexistent/x.jsonl"], output=tmp_path / "o1", **kw)
    src = _write_jsonl(tmp_path / "c.jsonl", ["hello world"] * 5, field="content")
    with pytest.raises(ValueError, match=r"no column 'text'.*--text-field"):
        prepare_dataset([str(src)], output=tmp_path / "o2", **kw)
    (tmp_path / "zero.jsonl").write_text("")
    with pytest.raises(ValueError, match=r"zero.jsonl' is empty \(0 bytes\)"):
        prepare_dataset([str(tmp_path / "zero.jsonl")], output=tmp_path / "o0", **kw)
    empty = _write_jsonl(tmp_path / "e.jsonl", ["", "  "])
    with pytest.raises(ValueError, match="no non-empty documents"):
        prepare_dataset([str(empty)], output=tmp_path / "o3", **kw)
    small = _write_jsonl(tmp_path / "s.jsonl", ["hi"])
    with pytest.raises(ValueError, match=r"only \d+ tokens.*--seq-len"):
        prepare_dataset([str(small)], output=tmp_path / "o4", **kw)
    with pytest.raises(ValueError, match="one weight per input"):
        prepare_dataset([str(small)], output=tmp_path / "o5", weights=[0.5, 0.5], **kw)
    no_eos = copy.deepcopy(tokenizer)
    no_eos.eos_token = None
    with pytest.raises(ValueError, match="no EOS token"):
        prepare_dataset([str(small)], output=tmp_path / "o6", **{**kw, "tokenizer": no_eos})
    occupied = tmp_path / "occupied"
    occupied.mkdir()
    (occupied / "mine.txt").write_text("user data")
    with pytest.raises(ValueError, match="already exists"):
        prepare_dataset([str(src)], output=occupied, text_field="content", **kw)
    with pytest.raises(ValueError, match="not a usp-prepare-data output"):
        prepare_dataset([str(src)], output=occupied, text_field="content", overwrite=True, **kw)
    assert (occupied / "mine.txt").read_text() == "user data"

    def offline(*args, **kwargs):
        raise ConnectionError("offline")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(ValueError, match=r"cannot load hub dataset 'owner/corpus'"):
        prepare_dataset(["owner/corpus"], output=tmp_path / "o7", **kw)


def test_hub_name_goes_to_load_dataset_with_cache_dir(tmp_path, monkeypatch):
    calls = []

    def fake(name, config=None, *, split, cache_dir, streaming):
        calls.append((name, config, split, cache_dir, streaming))
        return datasets.Dataset.from_dict({"body": ["a", "b"], "meta": [1, 2]})

    monkeypatch.setattr(datasets, "load_dataset", fake)
    ds = load_text_sources(["owner/corpus:en"], text_field="body", cache_dir=tmp_path / "hf")
    assert calls == [("owner/corpus", "en", "train", str(tmp_path / "hf"), False)]
    assert ds.column_names == ["text"] and ds["text"] == ["a", "b"]


def test_conf_data_options_match_data_config():
    from omegaconf import OmegaConf

    from usp.config import DataConfig

    files = sorted((Path(__file__).parents[1] / "conf" / "data").glob("*.yaml"))
    assert {f.stem for f in files} >= {"tiny", "jsonl", "prepared"}
    for f in files:
        keys = set(OmegaConf.load(f).keys())
        assert keys == set(DataConfig.__dataclass_fields__), f.name
        OmegaConf.merge(OmegaConf.structured(DataConfig), OmegaConf.load(f))  # types agree with the schema


def test_weighted_mix_never_multiplies_the_corpus(tmp_path):
    """--weights 0.95 0.05 on two equal sources: at most the corpus, no document twice (was 19x the docs)."""
    a = _write_jsonl(tmp_path / "a.jsonl", [f"alpha {i}" for i in range(140)])
    b = _write_jsonl(tmp_path / "b.jsonl", [f"beta {i}" for i in range(140)])
    usage: list = []
    logs: list[str] = []
    mix = load_text_sources(
        [str(a), str(b)],
        weights=[0.95, 0.05],
        seed=1,
        cache_dir=tmp_path / "hf",
        usage=usage,
        log=logs.append,
    )
    assert len(mix) == len(set(mix["text"])) == 147  # all 140 alpha + floor(140 / 0.95 * 0.05) = 7 beta
    assert [(u["used"], u["unused"]) for u in usage] == [(140, 0), (7, 133)]
    assert any("7 of 140 documents used, 133 unused" in m for m in logs)
    assert weighted_counts([700, 700], [0.95, 0.05]) == [700, 36]
    assert weighted_counts([10, 10, 10], [1, 0, 1]) == [10, 0, 10]
    assert weighted_counts([5, 1000], [0.5, 0.5]) == [5, 5]
    # streams stop at the first exhausted source rather than repeating the others
    stream = load_text_sources(
        [str(a), str(b)], weights=[0.95, 0.05], seed=1, cache_dir=tmp_path / "hf", streaming=True
    )
    texts = [r["text"] for r in stream]
    assert len(texts) == len(set(texts)) <= 280


def test_hub_download_directory_takes_train_data_only(tmp_path, tokenizer):
    """A hub snapshot (README.md, .gitattributes, .cache/, data/train-*.parquet, data/test-*.parquet) loads."""
    root = tmp_path / "snapshot"
    (root / "data").mkdir(parents=True)
    (root / ".cache" / "huggingface").mkdir(parents=True)
    (root / "README.md").write_text("---\nlicense: mit\n---\n# A dataset card\n")
    (root / ".gitattributes").write_text("*.parquet filter=lfs\n")
    (root / ".cache" / "huggingface" / "x.json").write_text("{}")
    (root / "data" / "notes.md").write_text("not a document")
    for split, n in (("train", 6), ("test", 2)):
        datasets.Dataset.from_dict({"text": [f"{split} {i}" for i in range(n)]}).to_parquet(
            str(root / "data" / f"{split}-00000-of-00001.parquet")
        )
    logs: list[str] = []
    ds = load_text_sources([str(root)], cache_dir=tmp_path / "hf", log=logs.append)
    assert sorted(ds["text"]) == [f"train {i}" for i in range(6)]
    assert any("only the train split" in m and "'test'" in m for m in logs)
    assert any("README.md" in m for m in logs)
    # split folders work the same way; a folder of markdown documents alone is still a corpus
    (tmp_path / "split" / "train").mkdir(parents=True)
    (tmp_path / "split" / "validation").mkdir()
    _write_jsonl(tmp_path / "split" / "train" / "a.jsonl", ["kept"])
    _write_jsonl(tmp_path / "split" / "validation" / "a.jsonl", ["held out"])
    assert load_text_sources([str(tmp_path / "split")], cache_dir=tmp_path / "hf")["text"] == ["kept"]
    (tmp_path / "md").mkdir()
    for i in range(2):
        (tmp_path / "md" / f"{i}.md").write_text(f"doc {i}")
    assert sorted(load_text_sources([str(tmp_path / "md")], cache_dir=tmp_path / "hf")["text"]) == [
        "doc 0",
        "doc 1",
    ]


def test_output_that_appears_while_preparing_is_never_deleted(tmp_path, tokenizer, monkeypatch):
    """Two preparations of one path: the later one uses the first's output (same settings) or steps aside."""
    import usp.data.prepare as prepare_mod

    src = _write_jsonl(tmp_path / "c.jsonl", tiny_corpus_texts(40, seed=5))
    out = tmp_path / "out"
    kw = dict(tokenizer=tokenizer, cache_dir=tmp_path / "hf", log=lambda _: None)
    real_tokenize = prepare_mod.tokenize_documents

    def other_process_first(seq_len: int):
        def tokenize(*args, **kwargs):  # after our start-up check, another run publishes the same output
            monkeypatch.setattr(prepare_mod, "tokenize_documents", real_tokenize)
            prepare_dataset([str(src)], output=out, seq_len=seq_len, **kw)
            (out / "reader-was-here").write_text("")  # a marker: gone if `out` were replaced
            monkeypatch.setattr(prepare_mod, "tokenize_documents", tokenize)
            return real_tokenize(*args, **kwargs)

        monkeypatch.setattr(prepare_mod, "tokenize_documents", tokenize)

    other_process_first(seq_len=40)
    res = prepare_dataset([str(src)], output=out, seq_len=40, **kw)
    assert res.path == out and (out / "reader-was-here").exists() and res.stats.rows > 0
    assert not list(tmp_path.glob(".out.work-*")) and not list(tmp_path.glob("out.usp-*"))
    shutil.rmtree(out)
    other_process_first(seq_len=32)  # a different preparation appeared: left alone, ours kept beside it
    with pytest.raises(ValueError, match=r"appeared while preparing.*left untouched.*out\.usp-"):
        prepare_dataset([str(src)], output=out, seq_len=40, **kw)
    assert (out / "reader-was-here").exists() and read_stats(out)["seq_len"] == 32
    (kept,) = tmp_path.glob("out.usp-*")
    assert read_stats(kept)["seq_len"] == 40 and datasets.load_from_disk(str(kept)).num_rows > 0
    assert not list(tmp_path.glob(".out.work-*"))


def test_intermediate_files_are_deleted_before_the_final_copy(tmp_path, tokenizer, monkeypatch):
    """Peak disk: the tokenized documents are gone when save_to_disk copies the packed rows."""
    seen: list[list[str]] = []
    real_save = datasets.Dataset.save_to_disk

    def save(self, path, *args, **kwargs):
        seen.append(sorted(p.name for p in Path(path).parent.iterdir()))
        return real_save(self, path, *args, **kwargs)

    monkeypatch.setattr(datasets.Dataset, "save_to_disk", save)
    src = _write_jsonl(tmp_path / "c.jsonl", tiny_corpus_texts(40, seed=5))
    res = prepare_dataset(
        [str(src)],
        tokenizer=tokenizer,
        seq_len=40,
        output=tmp_path / "o",
        num_proc=2,
        cache_dir=tmp_path / "hf",
        log=lambda _: None,
    )
    assert seen == [["packed.arrow"]]
    extra = read_stats(res.path)["extra"]
    assert extra["tokenizer_identity"]["vocab_size"] == len(tokenizer)
    assert 0 < extra["max_token_id"] < len(tokenizer)


def test_overwrite_keeps_the_previous_output_until_the_new_one_is_in_place(tmp_path, tokenizer, monkeypatch):
    """--overwrite: if the new rows cannot be moved into place, the previous prepared dataset is still there."""
    import usp.atomic as atomic

    src = _write_jsonl(tmp_path / "c.jsonl", tiny_corpus_texts(40, seed=5))
    out = tmp_path / "out"
    kw = dict(tokenizer=tokenizer, output=out, cache_dir=tmp_path / "hf", log=lambda _: None)
    prepare_dataset([str(src)], seq_len=32, **kw)
    real = atomic.os.replace

    def refuse_new_rows(src_path, dst_path):
        if Path(dst_path) == out and ".work-" in str(src_path):
            raise OSError("rename refused (simulated)")
        return real(src_path, dst_path)

    monkeypatch.setattr(atomic.os, "replace", refuse_new_rows)
    with pytest.raises(OSError, match="rename refused"):
        prepare_dataset([str(src)], seq_len=40, overwrite=True, **kw)
    monkeypatch.undo()
    assert read_stats(out)["seq_len"] == 32 and datasets.load_from_disk(str(out)).num_rows > 0
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "hf") == ["c.jsonl", "out"]
    prepare_dataset([str(src)], seq_len=40, overwrite=True, **kw)
    assert read_stats(out)["seq_len"] == 40
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "hf") == ["c.jsonl", "out"]
