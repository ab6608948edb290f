"""Inputs as a user has them: saved DatasetDicts, a text column per source, lengths like 128K on every CLI."""

from __future__ import annotations

import argparse
import json

import datasets
import pytest

from usp.config import DataConfig, TrainConfig, validate_choices
from usp.data import load_text_sources
from usp.data.cli import build_parser
from usp.units import parse_seq_len


def test_saved_dataset_dict_uses_its_train_split(tmp_path):
    dd = datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_dict({"text": ["a b", "c d e"], "n": [1, 2]}),
            "test": datasets.Dataset.from_dict({"text": ["held out"], "n": [3]}),
        }
    )
    dd.save_to_disk(str(tmp_path / "dd"))
    logs: list[str] = []
    ds = load_text_sources([str(tmp_path / "dd")], log=logs.append)
    assert ds["text"] == ["a b", "c d e"] and ds.column_names == ["text"]
    assert any("train split" in m for m in logs)
    datasets.DatasetDict({"test": dd["test"]}).save_to_disk(str(tmp_path / "only_test"))
    with pytest.raises(ValueError, match="without a 'train' split .*'test'"):
        load_text_sources([str(tmp_path / "only_test")])


def test_one_text_field_per_input(tmp_path):
    a = tmp_path / "a.jsonl"
    a.write_text("".join(json.dumps({"body": t}) + "\n" for t in ["one", "two"]))
    b = tmp_path / "b.jsonl"
    b.write_text("".join(json.dumps({"content": t}) + "\n" for t in ["three"]))
    ds = load_text_sources([str(a), str(b)], text_field=["body", "content"])
    assert ds["text"] == ["one", "two", "three"]
    with pytest.raises(ValueError, match="has 3 entries for 2 inputs"):
        load_text_sources([str(a), str(b)], text_field=["body", "content", "x"])
    with pytest.raises(ValueError, match="no column 'body'"):
        load_text_sources([str(a), str(b)], text_field="body")


def test_text_field_list_is_checked_at_validation():
    cfg = TrainConfig(data=DataConfig(inputs=["a.jsonl", "b.jsonl"], text_field=["x", "y", "z"]))
    cfg.model.path = "/ckpt"
    with pytest.raises(ValueError, match="data.text_field"):
        validate_choices(cfg)


@pytest.mark.parametrize(
    "text, tokens", [("131072", 131072), ("128K", 131072), ("1M", 2**20), ("1.5M", 3 * 2**19), ("4k", 4096)]
)
def test_seq_len_accepts_binary_suffixes(text, tokens):
    assert parse_seq_len(text) == tokens
    args = build_parser().parse_args(["--input", "x", "--tokenizer", "t", "--output", "o", "--seq-len", text])
    assert args.seq_len == tokens


@pytest.mark.parametrize("text", ["128KB", "0", "-4", "1.1K", "long"])
def test_seq_len_rejects_what_is_not_a_whole_count(text):
    with pytest.raises(argparse.ArgumentTypeError):
        parse_seq_len(text)


def test_prepare_data_cli_takes_several_text_fields():
    args = build_parser().parse_args(
        [
            "--input",
            "a",
            "--input",
            "b",
            "--text-field",
            "body",
            "content",
            "--tokenizer",
            "t",
            "--output",
            "o",
            "--seq-len",
            "1K",
        ]
    )
    assert args.text_field == ["body", "content"] and args.seq_len == 1024
