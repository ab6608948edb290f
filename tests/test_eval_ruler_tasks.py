"""eval=ruler's prompts and scores, without a model: every generator fits the requested token length, puts
its needles / variables / words where the task says, its references follow from the prompt text alone, and
fixed seeds give identical prompts; the string-match scorers on a table of hits, misses and partial answers;
the effective length; the chat template (ruler and passkey); bad settings."""

from __future__ import annotations

import re
from collections import Counter

import pytest

from usp.config import RULER_TASKS, EvalConfig
from usp.eval.ruler.fit import PromptBuilder
from usp.eval.ruler.haystack import NOISE, Haystack
from usp.eval.ruler.scoring import (
    clean_prediction,
    effective_length,
    score,
    stopped,
    string_match_all,
    string_match_part,
    summarize,
)
from usp.eval.ruler.tasks import TASKS, insert_at_depths
from usp.tiny import build_tiny_tokenizer

LENGTHS = [2048, 3000]
# tokens a prompt may fall short of its length: under one haystack unit (a word; a UUID word; 3 list entries)
SLACK = {"niah_multikey_3": 24, "niah_single_3": 24, "cwe": 32, "fwe": 32}
CHAT = (
    "{% for m in messages %}<|user|>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_tiny_tokenizer(tmp_path_factory.mktemp("ruler-tok"))


def _cfg(**ruler) -> EvalConfig:
    cfg = EvalConfig(task="ruler")
    for k, v in ruler.items():
        setattr(cfg.ruler, k, v)
    return cfg


@pytest.fixture(scope="module")
def samples(tokenizer):
    builder = PromptBuilder(tokenizer, _cfg())
    return {(t, n, i): builder.build(t, n, i) for t in RULER_TASKS for n in LENGTHS for i in range(3)}


def _context(prompt: str) -> str:
    return prompt.split("\n")[1]  # instructions \n context \n question


def _derive(task: str, prompt: str) -> list[str]:
    """The answers, from the prompt text alone (what a reader of the prompt would answer)."""
    if task.startswith("niah"):
        noun = "uuids" if task in ("niah_single_3", "niah_multikey_3") else "numbers"
        query = re.search(
            rf"What are all the special magic {noun} for (.+) mentioned in the text above\?", prompt
        )[1]
        keys = [k.strip() for k in re.split(r", and |, ", query)]
        return [
            v
            for k in keys
            for v in re.findall(rf"special magic {noun} for {re.escape(k)} is: (\S+)\.", prompt)
        ]
    if task == "vt":
        value = re.search(r"assigned the value (\d+) in the text above", prompt)[1]
        holds = {value}
        pairs = re.findall(r"VAR ([A-Z]{5}) = (VAR [A-Z]{5}|\d+)\.", prompt)
        changed = True
        while changed:
            changed = False
            for name, rhs in pairs:
                if name not in holds and rhs.removeprefix("VAR ") in holds:
                    holds.add(name)
                    changed = True
        return sorted(holds - {value})
    if task == "cwe":
        words = re.findall(r"\d+\. ([a-z]+)", _context(prompt))
        counts = Counter(words).most_common()
        assert counts[9][1] > counts[10][1], counts[:12]  # the top 10 are unambiguous
        return [w for w, _ in counts[:10]]
    assert task == "fwe"
    counts = Counter(_context(prompt).split()).most_common()
    assert counts[2][1] > counts[3][1], counts[:5]
    return [w for w, _ in counts[:3]]


@pytest.mark.parametrize("task", RULER_TASKS)
def test_generator_fits_the_length_and_its_answers_follow_from_the_prompt(tokenizer, samples, task):
    for n in LENGTHS:
        for i in range(3):
            s = samples[task, n, i]
            ids = tokenizer(s.prompt, add_special_tokens=False)["input_ids"]
            assert s.input_ids == [tokenizer.bos_token_id, *ids]  # the exact text, BOS in front
            assert n - SLACK.get(task, 8) <= len(s.input_ids) <= n, (task, n, i, len(s.input_ids))
            assert sorted(_derive(task, s.prompt)) == sorted(s.references), (task, n, i)
            assert s.max_new_tokens == TASKS[task][0].max_new_tokens
    prompts = {samples[task, n, i].prompt for n in LENGTHS for i in range(3)}
    assert len(prompts) == 6  # every sample is its own draw


@pytest.mark.parametrize("task", [t for t in RULER_TASKS if t.startswith("niah")])
def test_needles_are_where_the_task_says(samples, task):
    noun = "uuids" if task in ("niah_single_3", "niah_multikey_3") else "numbers"
    keys, values, asked = {
        "niah_multikey_1": (4, 1, 1),
        "niah_multivalue": (1, 4, 1),
        "niah_multiquery": (4, 1, 4),
    }.get(task, (1, 1, 1))
    for (t, _, _), s in samples.items():
        if t != task:
            continue
        context = _context(s.prompt)
        needles = re.findall(rf"One of the special magic {noun} for (\S+) is: (\S+)\.", context)
        assert len(s.references) == values * asked
        if task in (
            "niah_multikey_2",
            "niah_multikey_3",
        ):  # a haystack of distractor needles, all keys distinct
            assert len(needles) > 10 and len({k for k, _ in needles}) == len(needles)
            rest = re.sub(rf" ?One of the special magic {noun} for \S+ is: \S+\.", "", context).split()
            assert len(rest) <= 9  # nothing but needles (the last distractor may be cut short)
        else:
            assert len(needles) == keys * values, (task, needles)
            rest = re.sub(rf" ?One of the special magic {noun} for \S+ is: \S+\.", "", context).split()
            if TASKS[task][0].haystack == "noise":
                assert set(rest) <= set(NOISE.split()), set(rest) - set(NOISE.split())
            else:  # essay-like prose, not noise
                assert len(set(rest)) > 50 and not set(rest) <= set(NOISE.split())
        for ref in s.references:
            assert context.count(ref) == 1


def test_vt_chain_in_order_in_noise(samples):
    for (t, _, _), s in samples.items():
        if t != "vt":
            continue
        context = _context(s.prompt)
        chain = re.findall(r"VAR ([A-Z]{5}) = (VAR [A-Z]{5}|\d+)\.", context)
        assert len(chain) == 5 and [name for name, _ in chain] == s.references
        assert chain[0][1].isdigit() and all(
            rhs == f"VAR {prev}" for (_, rhs), (prev, _) in zip(chain[1:], chain)
        )
        rest = re.sub(r" ?VAR [A-Z]{5} = (VAR [A-Z]{5}|\d+)\.", "", context).split()
        assert set(rest) <= set(NOISE.split())


def test_insert_at_depths_puts_needles_at_their_depth_on_sentence_ends():
    units = ("a b c. " * 40).split()  # 120 words, sentences of 3
    text = insert_at_depths(units, [(0.0, "N0"), (0.5, "N1"), (1.0, "N2")])
    words = text.split()
    assert words[0] == "N0" and words[-1] == "N2"
    assert (
        words.index("N1") == 61 and words[60] == "c."
    )  # 0.5 x 120 = 60 words before it, after a sentence end
    text = insert_at_depths(units, [(0.51, "X")])  # round(61.2) = 61 -> back to the sentence end at 60
    assert text.split().index("X") == 60
    assert insert_at_depths(["w"] * 10, [(0.5, "X")], snap=False).split().index("X") == 5


def test_fixed_seeds_give_identical_prompts_in_any_build_order(tokenizer, samples):
    again = PromptBuilder(tokenizer, _cfg())
    for key in [("cwe", 3000, 2), ("niah_multikey_2", 2048, 1), ("fwe", 2048, 0), ("vt", 3000, 1)]:
        s = again.build(*key)  # a fresh builder, out of order (as a dp replica builds its share)
        assert (s.prompt, s.input_ids, s.references) == (
            samples[key].prompt,
            samples[key].input_ids,
            samples[key].references,
        )
    other = PromptBuilder(tokenizer, _cfg(seed=1)).build("niah_single_2", 2048, 0)
    assert other.prompt != samples["niah_single_2", 2048, 0].prompt


def test_user_haystack_files_replace_the_essay(tokenizer, tmp_path):
    (tmp_path / "hay").mkdir()
    (tmp_path / "hay" / "a.txt").write_text("Zebras graze on the wide plain near the river. " * 30)
    (tmp_path / "hay" / "b.md").write_text("Quokkas smile in the morning sun. " * 30)
    builder = PromptBuilder(tokenizer, _cfg(haystack=str(tmp_path / "hay")))
    s = builder.build("niah_single_2", 2048, 0)
    rest = set(
        re.sub(r" ?One of the special magic numbers for \S+ is: \S+\.", "", _context(s.prompt)).split()
    )
    assert {"Zebras", "Quokkas"} <= rest and rest <= set(
        ("Zebras graze on the wide plain near the river. Quokkas smile in the morning sun.").split()
    )
    assert set(_context(builder.build("niah_single_1", 2048, 0).prompt).split()) & set(
        NOISE.split()
    )  # noise stays


def test_essay_haystack_is_deterministic_and_endless():
    a, b = Haystack("essay", seed=3), Haystack("essay", seed=3)
    assert a.words(50) == b.words(10_000)[:50] and len(a.words(20_000)) == 20_000
    assert Haystack("essay", seed=4).words(50) != a.words(50)


def test_chat_template_wraps_ruler_and_passkey_prompts(tokenizer):
    from usp.eval.chat import chat_frame
    from usp.eval.passkey import ANSWER_PREFIX, build_prompt

    tokenizer.chat_template = CHAT
    try:
        cfg = _cfg()
        cfg.chat_template = True
        s = PromptBuilder(tokenizer, cfg).build("niah_single_1", 2048, 0)
        assert s.prompt.startswith("<|user|>Some special magic numbers")
        assert re.search(
            r"mentioned in the text above\?</s><\|assistant\|>The special magic numbers for \S+ mentioned "
            r"in the text above are$",
            s.prompt,
        )
        assert s.input_ids == tokenizer(s.prompt, add_special_tokens=False)["input_ids"]
        assert 2048 - 8 <= len(s.input_ids) <= 2048
        frame = chat_frame(tokenizer)
        ids = build_prompt(tokenizer, 300, 0.5, "48213", frame)
        text = tokenizer.decode(ids)
        assert len(ids) == 300
        assert text.startswith("<|user|>A secret number") and text.endswith(
            f"?</s><|assistant|>{ANSWER_PREFIX}"
        )
        assert build_prompt(tokenizer, 300, 0.5, "48213") == build_prompt(tokenizer, 300, 0.5, "48213", None)
    finally:
        tokenizer.chat_template = None
    with pytest.raises(ValueError, match="eval.chat_template=true, but the tokenizer has no chat template"):
        PromptBuilder(tokenizer, cfg)


def test_bad_ruler_settings_name_the_setting(tokenizer, tmp_path):
    from usp.eval.ruler.run import check_ruler_settings, prepare_ruler

    for fields, pattern in [
        ({"tasks": ["niah_single_9"]}, r"eval.ruler.tasks=.*unknown \['niah_single_9'\].*choose among"),
        ({"tasks": []}, r"eval.ruler.tasks=\[\]: empty"),
        ({"samples": 0}, r"eval.ruler.samples=0 is invalid"),
        ({"threshold": 0.0}, r"eval.ruler.threshold=0.0 must be in"),
    ]:
        with pytest.raises(ValueError, match=pattern):
            check_ruler_settings(_cfg(**fields))
    with pytest.raises(ValueError, match=r"eval.ruler.haystack=.*missing.*does not exist"):
        prepare_ruler(tokenizer, [2048], _cfg(haystack=str(tmp_path / "missing")))
    (tmp_path / "short.txt").write_text("too short")
    with pytest.raises(ValueError, match=r"eval.ruler.haystack=.*holds 2 words"):
        prepare_ruler(tokenizer, [2048], _cfg(haystack=str(tmp_path / "short.txt")))
    with pytest.raises(
        ValueError, match=r"eval.lengths: 512 tokens cannot hold a cwe prompt \(at least \d+ tokens"
    ):
        prepare_ruler(tokenizer, [512, 4096], _cfg(tasks=["niah_single_1", "cwe"]))


# --- scores -----------------------------------------------------------------------------------------------
REFS = {
    "niah_single_1": ["4817265"],
    "niah_single_2": ["1234567"],
    "niah_single_3": ["0f8c6d1e-5a2b-4c3d-9e8f-7a6b5c4d3e2f"],
    "niah_multikey_1": ["7654321"],
    "niah_multikey_2": ["2468024"],
    "niah_multikey_3": ["a1b2c3d4-0000-4000-8000-123456789abc"],
    "niah_multivalue": ["1111111", "2222222", "3333333", "4444444"],
    "niah_multiquery": ["5555555", "6666666", "7777777", "8888888"],
    "vt": ["ABCDE", "FGHIJ", "KLMNO", "PQRST", "UVWXY"],
    "cwe": ["tamo", "kelu", "rivado", "semi", "pova", "lizu", "dako", "mune", "zeta", "gorbi"],
    "fwe": ["bafo", "kimu", "sola"],
}


@pytest.mark.parametrize("task", RULER_TASKS)
def test_scorer_table(task):
    refs = REFS[task]
    assert score(task, " " + ", ".join(refs) + ".", refs) == 1.0  # every reference
    assert (
        score(task, "The answer is " + " and ".join(r.upper() for r in refs), refs) == 1.0
    )  # case-insensitive
    assert score(task, "I do not know.", refs) == 0.0
    assert score(task, "", refs) == 0.0
    if len(refs) > 1:
        assert score(task, " ".join(refs[:2]), refs) == pytest.approx(2 / len(refs))  # partial
        assert score(task, refs[-1] + " " + refs[-1], refs) == pytest.approx(
            1 / len(refs)
        )  # repeats count once
    else:
        assert score(task, refs[0][:-1], refs) == 0.0  # a cut-off value is a miss


def test_match_part_and_prediction_cleaning():
    assert string_match_part("Paris or Lyon", ["lyon", "marseille"]) == 1.0
    assert string_match_part("Nice", ["lyon", "marseille"]) == 0.0
    assert string_match_all("lyon", ["lyon", "marseille"]) == 0.5
    assert clean_prediction("\n\n 4817265.\n\nQuestion: what is 1234567?") == "4817265."
    assert (
        clean_prediction(":\n\n* 4817265\n* 4817265\n\nNext") == ":\n\n* 4817265\n* 4817265"
    )  # ":" opens the answer
    assert stopped("\n\n 48\n\n") and not stopped(":\n\n* 48") and not stopped("\n\n")
    assert clean_prediction("1. tamo\n2. kelu\x07") == "1. tamo\n2. kelu"


def test_means_and_effective_length():
    trials = [
        {"task": t, "length": n, "score": s}
        for t, n, s in [
            ("a", 1024, 1.0),
            ("a", 1024, 0.5),
            ("b", 1024, 1.0),
            ("a", 2048, 0.5),
            ("b", 2048, 1.0),
            ("a", 4096, 0.0),
            ("b", 4096, 1.0),
            ("a", 8192, 1.0),
            ("b", 8192, 1.0),
        ]
    ]
    table, mean = summarize(trials, ["a", "b"], [1024, 2048, 4096, 8192])
    assert table["a"] == {"1024": 0.75, "2048": 0.5, "4096": 0.0, "8192": 1.0}
    assert mean == {"1024": 0.875, "2048": 0.75, "4096": 0.5, "8192": 1.0}
    # bar 0.85 x 0.875 = 0.744: 2048 passes, 4096 fails, so 8192 does not count (the mean must *stay* above)
    assert effective_length(mean, 0.85) == (2048, pytest.approx(0.74375))
    assert effective_length(mean, 0.5)[0] == 8192
    assert effective_length({"1024": 0.0, "2048": 0.0}, 0.85) == (None, 0.0)
