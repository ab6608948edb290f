"""usp.real: the corpus builder (unit) and the SmolLM2-135M checkpoint built from its GGUF (``real`` tier)."""

from __future__ import annotations

import json

import pytest
import torch

from usp.real import SOURCE_FILE, build_text_corpus, main, stdlib_source_dir


def _write(root, name, text):
    path = root / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_corpus_writes_one_document_per_file(tmp_path):
    src = tmp_path / "src"
    _write(src, "a.py", "a" * 50)
    _write(src, "b.py", "b" * 10)  # below min_chars
    _write(src, "c.txt", "c" * 50)  # pattern mismatch
    _write(src, "sub/d.py", "d" * 50)  # not recursive
    (src / "e.py").write_bytes(b"\xff\xfe" * 40)  # not UTF-8
    corpus = build_text_corpus(tmp_path / "out", src, min_chars=20)
    rows = [json.loads(line) for line in corpus.train.read_text().splitlines()]
    assert rows == [{"text": "a" * 50, "path": "a.py"}]
    assert corpus.heldout is None and (corpus.train_docs, corpus.train_chars) == (1, 50)

    corpus = build_text_corpus(tmp_path / "out", src, min_chars=20, recursive=True)
    assert [json.loads(line)["path"] for line in corpus.train.read_text().splitlines()] == [
        "a.py",
        "sub/d.py",
    ]


def test_corpus_heldout_split_is_by_name_and_stable(tmp_path):
    src = tmp_path / "src"
    for i in range(60):
        _write(src, f"f{i:02d}.py", f"# file {i}\n" * 5)
    first = build_text_corpus(tmp_path / "one", src, min_chars=1, heldout_fraction=0.25)
    _write(src, "zz_new.py", "# new\n" * 5)
    second = build_text_corpus(tmp_path / "two", src, min_chars=1, heldout_fraction=0.25)

    def names(path):
        return {json.loads(line)["path"] for line in path.read_text().splitlines()}

    held = names(first.heldout)
    assert 5 <= len(held) <= 25 and not held & names(first.train)
    assert names(first.train) | held == {f"f{i:02d}.py" for i in range(60)}
    assert names(second.heldout) - {"zz_new.py"} == held  # adding a file moves no other file


def test_corpus_refuses_bad_input(tmp_path):
    with pytest.raises(ValueError, match="--source"):
        build_text_corpus(tmp_path / "out", tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="--pattern"):
        build_text_corpus(tmp_path / "out", tmp_path / "empty")
    with pytest.raises(ValueError, match="--heldout-fraction"):
        build_text_corpus(tmp_path / "out", tmp_path / "empty", heldout_fraction=1.0)


def test_stdlib_corpus_cli(tmp_path, capsys):
    assert main(["corpus", "--output", str(tmp_path), "--heldout-fraction", "0.1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split("\t")[0] for line in lines] == [
        str(tmp_path / "train.jsonl"),
        str(tmp_path / "heldout.jsonl"),
    ]
    paths = [json.loads(line)["path"] for line in (tmp_path / "train.jsonl").read_text().splitlines()]
    assert len(paths) > 100 and "os.py" in paths + [
        json.loads(line)["path"] for line in (tmp_path / "heldout.jsonl").read_text().splitlines()
    ]
    assert all((stdlib_source_dir() / p).is_file() for p in paths)


def test_cli_error_names_the_setting(tmp_path, capsys):
    assert main(["corpus", "--output", str(tmp_path), "--source", str(tmp_path / "none")]) == 2
    assert "python -m usp.real: error: --source" in capsys.readouterr().err


@pytest.mark.real
def test_smollm2_checkpoint_equals_the_gguf_model(smollm2_dir):
    """The saved fp32 safetensors checkpoint loads as a plain LlamaForCausalLM whose tensors and logits equal the
    model transformers dequantizes from the GGUF file (bit for bit: the same fp32 weights, the same kernels);
    the 4-layer cut (``num_layers=4``) holds the same tensors for the layers it keeps.

    The one slow part, loading the GGUF (about 30 s: transformers dequantizes every tensor, whatever the layer
    count asked for), is the claim itself. A cold cache adds the full build (about 35 s); the cut is taken from
    the full checkpoint, not from the GGUF again."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    from usp.real import smollm2_gguf_path

    path = smollm2_dir()
    config = json.loads((path / "config.json").read_text())
    assert "quantization_config" not in config
    assert (config["num_hidden_layers"], config["num_attention_heads"], config["num_key_value_heads"]) == (
        30,
        9,
        3,
    )
    assert json.loads((path / SOURCE_FILE).read_text())["num_layers"] == 30
    saved = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert type(saved) is LlamaForCausalLM and saved.lm_head.weight is saved.model.embed_tokens.weight
    gguf = smollm2_gguf_path()
    direct = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    ids = AutoTokenizer.from_pretrained(path)(
        "import os\nprint(os.getcwd())\n", return_tensors="pt"
    ).input_ids
    with torch.no_grad():
        torch.testing.assert_close(saved(ids).logits, direct(ids).logits, rtol=0, atol=0)
    want, got = direct.state_dict(), saved.state_dict()
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name

    short = smollm2_dir(num_layers=4)
    small = AutoModelForCausalLM.from_pretrained(short, dtype=torch.float32)
    assert small.config.num_hidden_layers == 4
    assert json.loads((short / SOURCE_FILE).read_text())["num_layers"] == 4
    kept = small.state_dict()
    assert sorted(kept) == sorted(
        n for n in got if not n.startswith("model.layers.") or int(n.split(".")[2]) < 4
    )
    for name, tensor in kept.items():
        assert torch.equal(tensor, got[name]), name


def test_compare_writes_the_table_and_the_plot(tmp_path, capsys):
    def run(name, ppls):
        buckets = [
            {"start": i * 1024, "end": (i + 1) * 1024 - (i == 1), "ppl": p} for i, p in enumerate(ppls)
        ]
        path = tmp_path / f"{name}.json"
        path.write_text(
            json.dumps({"ppl": {"result": {"lengths": {"2048": {"ppl": sum(ppls), "buckets": buckets}}}}})
        )
        return f"{name}={path}"

    png = tmp_path / "curves.png"
    assert (
        main(
            [
                "compare",
                run("before", [5.0, 50.0]),
                run("after", [4.5, 6.25]),
                "--length",
                "2048",
                "--plot",
                str(png),
            ]
        )
        == 0
    )
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "| run | 0-1K | 1-2K | all |"
    assert lines[2:] == ["| before | 5.00 | 50.00 | 55.00 |", "| after | 4.50 | 6.25 | 10.75 |"]
    assert png.stat().st_size > 1000
    assert main(["compare", run("x", [1.0, 1.0]), "--length", "4096"]) == 2
    assert "no ppl result at length 4096" in capsys.readouterr().err
