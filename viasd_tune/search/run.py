"""The search: an Optuna study over skip sets, thresholds, KL direction, γ and drafter, scored on calibration
prompts, then the fastest feasible measured trial (acceptance breaking near-ties) re-measured on held-out prompts
and exported.

Before the study, one calibration pass scores every sub-layer by what skipping it alone changes and the study
is seeded with skip sets built from those scores (``importance.py``). Per trial (``objective.py``): replay
(cheap, ``replay.py``) estimates fidelity, acceptance and a modelled speedup; a trial whose estimated fidelity is
clearly below ``--min-fidelity``, or that could not enter the measured feasible front, keeps those estimates
(``measured=False``, ``screen.py``); the others are confirmed by real three-tier decoding, interleaved prompt by
prompt with the target's own AR decoding (``measure.py``), and the measured numbers become the objectives.
``--trials`` counts those real decodes: many replayed trials, few decoded ones (``loop.py``).
"""

from __future__ import annotations

import logging
from pathlib import Path

import optuna

from .. import host, models, prompts
from ..config import DecodeConfig
from ..credentials import redact
from ..decoding.fingerprint import engine_fingerprint
from ..errors import UserError
from ..profile import calibration_fingerprint
from ..routing import install_skipping, num_layers
from ..rule import prompt_features
from . import costmodel, importance, params, replay
from . import space as spaces
from .export import DashboardWriter, export_study
from .loop import optimize
from .measure import held_out, references
from .objective import Objective
from .records import StudyRecord
from .screen import replay_check
from .settings import SearchSettings
from .storage import make_storage, open_study, sqlite_file

__all__ = ["SearchSettings", "run_search", "seed_skip_sets"]
log = logging.getLogger(__name__)


def run_search(s: SearchSettings, dashboard: DashboardWriter | None = None) -> dict:
    """Run (or resume) a search and export its pick (held out), with the study's dashboard beside the profile
    when given its writer (``viasd_tune.dashboard.write_beside_profile``); returns the export summary."""
    # Everything that can refuse runs before the output folder or the study exists (a refused run leaves
    # nothing behind, so its corrected re-run is not refused as "a different space").
    out = Path(s.out)
    space = spaces.load_space(s.space)
    storage = s.storage or f"sqlite:///{(out / 'study.db').resolve()}"
    study_name = s.study_name or out.name

    items = prompts.load_prompts(s.data, field=s.data_field, categories=s.categories)
    # Stratified by task group, as the bench samples and reports: by raw category, Spec-Bench's eight MT-bench
    # categories would take 8 of every 13 prompts and leave the other groups one or two each.
    items = prompts.sample_prompts(items, s.prompts, s.seed, key=prompts.prompt_task_group)
    calib, held = prompts.split_calibration(items, s.held_out, s.seed)
    db = sqlite_file(storage)
    # A storage server is reached before the models load (fail fast); a new SQLite file waits for the checks.
    opened = make_storage(storage) if db is None or db.is_file() else None

    target = models.load(s.model, s.dtype, s.device, s.trust_remote_code)
    draft = None
    if s.draft:
        draft = models.load(s.draft, s.dtype, s.device, s.trust_remote_code)
        models.check_same_tokenizer(target, draft)
    n_layers = num_layers(target.model)
    drafters = ["self", "lookup", "lookup+self", "recycle", "lookup+recycle"]
    drafters += ["model", "lookup+model", "lookup+recycle+model"] if draft else []
    params.known_points(space, n_layers, drafters)  # the space fits this model and these drafters

    dev = target.model.device
    ctx = models.context_length(target.model)

    def encoded(items: list[prompts.Prompt]) -> list:
        ids = prompts.encode_all(target.tokenizer, items, s.chat, s.max_new_tokens, ctx, dev)
        return list(zip(items, ids, strict=True))

    calib_ids, held_ids = encoded(calib), encoded(held)
    out.mkdir(parents=True, exist_ok=True)
    study = open_study(opened or storage, study_name, s.seed, s.min_fidelity)
    install_skipping(target.model)
    _record_study(study, study_name, s, space, n_layers, target, draft, calib_ids, held, storage)
    params.enqueue_known_points(study, space, n_layers, drafters)

    refs = references(target.model, target.tokenizer, calib_ids, s.max_new_tokens, s.progress)
    cost = costmodel.fit(
        target.model, draft.model if draft else None, refs[0].prompt_ids, max_block=space.max_block
    )
    cache = replay.ReplayCache(
        target.model,
        refs,
        draft.model if draft else None,
        max_new_tokens=s.max_new_tokens,
        eos=models.eos_ids(target.model, target.tokenizer),
        cost=cost,
    )
    ar = replay.simulate(cache, DecodeConfig(mode="ar"))  # the baseline's modelled seconds per token
    ar_model_s_per_token = ar.time_s / max(ar.tokens, 1)
    if space.slim_tier:  # scoring sub-layers takes minutes; a space that skips nothing needs no skip sets
        seed_skip_sets(study, target.model, refs, cost, space, n_layers, s.progress)

    objective = Objective(
        study, s, space, n_layers, drafters, target, draft, refs, cache, cost, ar_model_s_per_token
    )
    optimize(study, objective, s)
    if s.worker:
        return {}
    check = replay_check(study)
    StudyRecord(replay_check=check).write(study)
    if check["trials"]:
        log.warning(
            "replay vs decoding: tier shares within %.2f on %d of %d decoded trials (largest gap %.3f)",
            check["tolerance"],
            check["within"],
            check["trials"],
            check["max_gap"],
        )

    def evaluate_held_out(cfg: DecodeConfig) -> dict:
        """Metrics for the exported profile on prompts the search never saw, vs AR and vs plain SD."""
        draft_model = draft.model if draft else None
        return held_out(
            target.model,
            target.tokenizer,
            draft_model,
            cfg,
            held_ids,
            s.max_new_tokens,
            s.progress,
            verify_cost=cost.verify_cost() if cfg.tree_sizing == "cost" else None,
        )

    return export_study(study, out, evaluate=evaluate_held_out, dashboard=dashboard)


def _record_study(
    study: optuna.Study,
    study_name: str,
    s: SearchSettings,
    space: spaces.SearchSpace,
    n_layers: int,
    target,
    draft,
    calib_ids: list,
    held: list[prompts.Prompt],
    storage: str,
) -> None:
    """Record how the study is set up, after checking that a study being resumed was set up the same way."""
    calib = [p for p, _ in calib_ids]
    signature = {
        "space": spaces.space_signature(space, n_layers),
        "engine": engine_fingerprint(),  # trials scored by another engine are not comparable
        "target": target.fingerprint["source"].get("sha256") or target.fingerprint["vocab_sha256"],
        "calibration": calibration_fingerprint([(p.id, p.text) for p in calib]),
        "max_new_tokens": s.max_new_tokens,
    }
    old = StudyRecord.read(study).signature
    if old and old != signature:
        what = ", ".join(k for k in signature if old.get(k) != signature[k])
        raise UserError(
            f"study {study_name!r} already exists with a different {what}; pick a new --study-name or --out"
        )
    dev = target.model.device
    StudyRecord(
        signature=signature,
        num_layers=n_layers,
        min_fidelity=s.min_fidelity,
        target=s.model,
        target_fingerprint=target.fingerprint,
        draft=s.draft,
        draft_fingerprint=draft.fingerprint if draft else None,
        dtype=str(target.model.dtype).removeprefix("torch."),
        device=dev.type,
        matrix_isa=host.matrix_isa(str(dev)),  # the study creator's; each decoded trial records its own
        calibration={
            "source": s.data,
            "prompt_ids": [p.id for p in calib],
            "fingerprint": signature["calibration"],
            "held_out_ids": [p.id for p in held],
            # What a routed profile's rule reads (viasd_tune.rule), per calibration prompt, so export needs no model.
            "features": [prompt_features(ids.tolist(), p.category) for p, ids in calib_ids],
        },
        space_source=space.source,
        max_new_tokens=s.max_new_tokens,
        storage=redact(storage),
    ).write(study)


def seed_skip_sets(
    study: optuna.Study,
    target,
    refs: list[replay.Reference],
    cost: costmodel.CostModel,
    space: spaces.SearchSpace,
    n_layers: int,
    progress: bool,
) -> importance.Importance:
    """Score the sub-layers once per study (kept in the study's record, so a resume or another worker reuses
    them) and enqueue the skip sets built from the scores."""
    stored = StudyRecord.read(study).layer_importance
    if stored:
        imp = importance.Importance.from_dict(stored)
    else:
        imp = importance.measure(target, refs, cost, space, progress=progress)
        StudyRecord(layer_importance=imp.to_dict()).write(study)
    n = importance.enqueue_seeds(study, space, n_layers, imp)
    log.info("enqueued %d skip sets built from layer importance", n)
    return imp
