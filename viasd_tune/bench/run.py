"""One bench run: select the prompts, load the models once, run every method interleaved, score, report."""

from __future__ import annotations

import datetime as dt
import os
import platform
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from .. import prompts
from ..config import model_drafter
from ..errors import UserError
from . import methods as bm
from .contention import load_average
from .report import write_reports
from .scoring import score_greedy_agreement, summarise, task_accuracy
from .settings import BenchSettings, command_line

if TYPE_CHECKING:
    import torch

    from .. import models


@dataclass
class PromptSelection:
    items: list[prompts.Prompt]
    calibration_ids: int  # distinct calibration ids over all profiles
    dropped: list[str]  # ids removed from the bench pool because a profile was tuned on them


def select_prompts(s: BenchSettings, profiles: list[bm.BenchProfile]) -> PromptSelection:
    """Load, filter, drop every profile's calibration prompts, then sample stratified by task group: no prompt a
    profile was tuned on can flatter it, and MT-bench's eight categories count as the one group they are."""
    items = prompts.load_prompts(s.data, field=s.data_field, categories=s.categories)
    calib = {pid for b in profiles for pid in b.data["calibration"]["prompt_ids"]}
    dropped = [p.id for p in items if p.id in calib]
    items = [p for p in items if p.id not in calib]
    if not items:
        raise UserError(
            f"no prompts left in {s.data!r} after dropping the {len(dropped)} the profiles were calibrated on; "
            "bench on other data or other categories"
        )
    sample = prompts.sample_prompts(items, s.prompts, s.seed, key=prompts.prompt_task_group)
    return PromptSelection(sample, len(calib), dropped)


def load_models(
    s: BenchSettings, profiles: list[bm.BenchProfile]
) -> tuple[models.LoadedModel, models.LoadedModel | None]:
    """Target and draft, loaded once for every method (profiles reuse them)."""
    from .. import models

    needs_draft = [
        b.name
        for b in profiles
        if any(
            model_drafter(c["drafter"]) == "model" and c.get("mode") != "ar"
            for c in [b.data, *b.data.get("routes", {}).get("configurations", [])]
        )
    ]
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


def machine_info(device: torch.device) -> dict:
    """The host, with its matrix ISA: speed ratios compare only between hosts with the same one."""
    import torch
    import transformers

    from .. import host

    info = {
        "matrix_isa": host.matrix_isa(str(device)),
        "cpu": host.cpu_name(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "platform": platform.platform(),
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    load = load_average()
    if load is not None:
        info["load_average_at_start"] = load
    return info


def code_version() -> dict:
    """viasd-tune's version and, from a git checkout, its revision (marked when viasd_tune/ has local edits)."""
    from ..profile import package_versions

    out = {"viasd_tune": package_versions()["viasd_tune"], "git": None}
    package = Path(__file__).resolve().parent.parent
    if not (package.parent / ".git").exists():  # an installed copy: a repository above it is someone else's
        return out
    try:
        head = subprocess.run(
            ["git", "-C", str(package), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        if head.returncode == 0 and head.stdout.strip():
            dirty = subprocess.run(
                ["git", "-C", str(package), "status", "--porcelain", "--", "."],
                capture_output=True,
                text=True,
                timeout=10,
            ).stdout.strip()
            out["git"] = head.stdout.strip() + (" + uncommitted changes in viasd_tune/" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return out


def _params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def run_bench(s: BenchSettings, default_model: str | None = None) -> dict:
    """Run the benchmark and write DIR/bench.{json,md,html}; returns the result (also what bench.json holds).

    Without ``s.model`` the target is the first profile's, else ``default_model``.
    """
    from .. import kernels, models

    s.validate()
    started = dt.datetime.now(dt.timezone.utc)
    t_start = time.perf_counter()
    profiles = bm.load_profiles(s.profiles)
    if not s.model:
        s.model = profiles[0].data["target"]["name"] if profiles else default_model
        if not s.model:
            raise UserError("no target model: pass --model (or a --profile, whose target is used)")
    routes = {b.name: b.configurations for b in profiles}
    names, skipped = bm.plan_methods(
        s.methods, bool(s.draft), [b.name for b in profiles], routes, tree=s.tree_nodes is not None
    )
    selection = select_prompts(s, profiles)
    items = selection.items

    if s.threads:
        import torch

        torch.set_num_threads(s.threads)
    t0 = time.perf_counter()
    target, draft = load_models(s, profiles)
    load_s = time.perf_counter() - t0
    gamma, gamma_source = bm.resolve_gamma(s.gamma, profiles)
    eos = models.eos_ids(target.model, target.tokenizer)
    methods = bm.build_methods(names, target, draft, profiles, gamma, eos, s.draft_confidence, s.tree_nodes)
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
    # ours on oneDNN-packed bf16 weights where load packed them; the HF methods always on PyTorch's own kernels
    machine["linear_kernels"] = "onednn-packed" if kernels.is_packed(target.model) else "stock"

    runner = bm.Runner(
        target, draft, eos, wait_idle=s.wait_idle, foreign_max=s.foreign_max, retries=s.retries
    )
    try:
        records = bm.run_interleaved(
            runner,
            methods,
            encoded,
            repeats=s.repeats,
            max_new_tokens=s.max_new_tokens,
            warmup_tokens=s.warmup_tokens,
            progress=s.progress,
            categories=[p.category for p in items],
        )
    finally:
        runner.close()
    wall_s = time.perf_counter() - t_start
    load_end = load_average()

    greedy = score_greedy_agreement(target.model, encoded, {m: records[m][0] for m in names}, s.progress)
    tok = target.tokenizer
    texts = {
        m: [tok.decode(records[m][0][i]["ids"], skip_special_tokens=True) for i in range(len(items))]
        for m in names
    }
    accuracy = task_accuracy(items, texts)
    summary = summarise(records, items, greedy, accuracy, s.foreign_max)

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
        g = prompts.prompt_task_group(p)
        group_sizes[g] = group_sizes.get(g, 0) + 1
    result = {
        "meta": {
            "command": command_line(s),
            "started_utc": started.isoformat(timespec="seconds"),
            "wall_s": wall_s,
            "load_s": load_s,
            "machine": machine,
            "load_average_at_end": load_end,
            "code": code_version(),
            "model": s.model,
            "draft": s.draft,
            "target_fingerprint": target.fingerprint,
            "target_params": _params(target.model),
            "draft_params": _params(draft.model) if draft else None,
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
            "draft_confidence": s.draft_confidence,
            "tree_nodes": s.tree_nodes,
            "eos_ids": sorted(eos),
            "methods": names,
            "skipped_methods": skipped,
            "profiles": {b.name: b.path for b in profiles},
            "calibration_ids": selection.calibration_ids,
            "calibration_dropped": selection.dropped,
            "group_sizes": dict(sorted(group_sizes.items())),
            "reference": "hf greedy output of the first repeat",
            "contention": {"wait_idle": s.wait_idle, "foreign_max": s.foreign_max, "retries": s.retries},
            "notes": notes,
        },
        "methods": {
            m: {"description": methods[m].description, "settings": methods[m].settings} for m in names
        },
        "prompts": [
            {
                "id": p.id,
                "category": p.category,
                "task_group": prompts.prompt_task_group(p),
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
