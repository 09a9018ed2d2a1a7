"""The search: an Optuna study over skip sets, thresholds, KL direction, γ and drafter, scored on calibration
prompts, then the fastest feasible measured trial (acceptance breaking near-ties) re-measured on held-out prompts and exported.

Before the study, one calibration pass scores every sub-layer by what skipping it alone changes and the study
is seeded with skip sets built from those scores (``importance.py``). Per trial: replay (cheap, see
``replay.py``) estimates fidelity, acceptance and a modelled speedup; a trial whose estimated fidelity is clearly
below ``--min-fidelity``, or that could not enter the measured feasible front, keeps those estimates
(``measured=False``); the others are confirmed by real three-tier decoding, interleaved prompt by prompt with
the target's own AR decoding, and the measured numbers become the objectives. ``--trials`` counts those real
decodes: many replayed trials, few decoded ones.
"""

from __future__ import annotations

import collections
import logging
import math
import numbers
import os
import socket
import statistics
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import optuna
from tqdm.auto import tqdm

from .. import host, models, prompts
from ..config import DecodeConfig
from ..credentials import check_storage, redact, scrub
from ..decoding.decoder import Decoder
from ..errors import UserError
from ..fidelity import agreement, greedy_agreement
from ..fsutil import check_outputs_spare_inputs
from ..profile import calibration_fingerprint
from ..routing import install_skipping, num_layers
from ..rule import prompt_features
from . import costmodel, importance, replay
from . import space as spaces
from .export import export_study
from .storage import env_seconds, make_storage, open_study, sqlite_file

log = logging.getLogger(__name__)
ESTIMATE_MARGIN = 0.03  # trials estimated this far below min fidelity are not worth decoding for real
FRONT_SLACK = 0.1  # a replayed trial is decoded unless a measured feasible one beats it by this much on both
REPLAYS_PER_DECODE = 20  # at most this many finished trials per real decode asked for (--trials), then stop
MIN_REPLAYS = 100
# Stop once this many finished trials in a row were screened out: the sampler keeps proposing what the measured
# front already beats. A replay costs seconds to half a minute on a CPU, so without this the default search
# (nothing on SmolLM2 beats prompt lookup) spent 40 min replaying 240 dominated trials.
STALE_REPLAYS = 25
# Replayed and measured tier shares (direct / slim / full) of a decoded trial may differ by this much: batched
# and incremental forwards round apart in bf16, and a lossy run leaves the reference the replay follows. The
# study records it with how many decoded trials stayed within it (``replay_check``).
REPLAY_TOLERANCE = 0.05


@dataclass
class SearchSettings:
    model: str
    draft: str | None = None
    data: str = "builtin"
    data_field: str | None = None
    categories: list[str] | None = None
    prompts: int | None = 12
    held_out: float = 0.25
    chat: str = "auto"
    trials: int = 20
    out: str = "artifacts/search"
    storage: str | None = None
    study_name: str | None = None
    space: str = "default"
    min_fidelity: float = 0.95
    max_new_tokens: int = 48
    timeout: float | None = None
    seed: int = 0
    device: str = "auto"
    dtype: str = "auto"
    trust_remote_code: bool = False
    progress: bool = True
    worker: bool = False  # only run trials; the process that started the workers exports

    def __post_init__(self) -> None:
        """Every setting checked here, before any folder, study or model exists (flags and Python alike)."""
        for name in ("model", "data", "out", "space"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise UserError(f"{name} must be a non-empty string (got {getattr(self, name)!r})")
        _whole("prompts", self.prompts, 1, MAX_PROMPTS, "--prompts", allow_none=True)
        _whole("trials", self.trials, 1, MAX_TRIALS, "--trials")
        _whole("max_new_tokens", self.max_new_tokens, 1, MAX_NEW_TOKENS, "--max-new-tokens")
        _whole("seed", self.seed, 0, 2**32 - 1, "--seed")
        held = _number("held_out", self.held_out, "--held-out")
        if not 0 <= held < 1:
            raise UserError(f"held_out (--held-out) must be in [0, 1) (got {held}); it is the share kept out")
        fid = _number("min_fidelity", self.min_fidelity, "--min-fidelity")
        if not 0 < fid <= 1:
            raise UserError(f"--min-fidelity must be in (0, 1] (got {fid})")
        if self.timeout is not None:
            t = _number("timeout", self.timeout, "--timeout")
            if not t > 0:
                raise UserError(
                    f"--timeout must be a number of seconds > 0 (got {t}); leave it out for no time limit"
                )
        if self.chat not in ("auto", "on", "off"):
            raise UserError(f"chat (--chat) must be auto, on or off (got {self.chat!r})")
        out = Path(self.out)
        if out.exists() and not out.is_dir():
            raise UserError(f"--out {out} is a file, not a folder; pass a folder for the search's outputs")
        if self.storage is not None:
            check_storage(self.storage)
        if self.study_name is not None and (
            not isinstance(self.study_name, str) or not self.study_name.strip()
        ):
            raise UserError(f"--study-name must be a non-empty name (got {self.study_name!r})")
        prompts.check_source(self.data, self.data_field)
        self._check_outputs_spare_inputs()

    def _check_outputs_spare_inputs(self) -> None:
        """The files the search writes into ``out`` must not be its data, space or study database."""
        out = Path(self.out)
        written = [(f"--out's {name}", out / name) for name in ("profile.json", "dashboard.html")]
        if self.storage is None:
            written.append(("--out's study.db", out / "study.db"))
        read = [
            ("--data", prompts.data_file(self.data)),
            ("--space", spaces.space_file(self.space)),
            ("--storage", sqlite_file(self.storage) if self.storage else None),
        ]
        check_outputs_spare_inputs(written, read, folders=[("--out's pareto/", out / "pareto")])


MAX_PROMPTS = 100_000
MAX_TRIALS = 100_000
MAX_NEW_TOKENS = 1_000_000  # bounds against typos; the model's context length is checked once it loads


def _whole(name: str, value, low: int, high: int, flag: str, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise UserError(f"{name} ({flag}) must be a whole number (got {value!r})")
    if not low <= value <= high:
        raise UserError(f"{name} ({flag}) must be from {low} to {high} (got {value})")


def _number(name: str, value, flag: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise UserError(f"{name} ({flag}) must be a finite number (got {value!r})")
    return float(value)


@dataclass
class Measurement:
    speedup: float
    fidelity: float  # greedy agreement: share of emitted tokens the target would have picked (fidelity.py)
    agreement: float  # position-wise agreement with the target's decoded greedy output
    exact: float
    acceptance: float
    tier_shares: dict
    tier_time_s: dict
    tokens_per_s: float
    ar_tokens_per_s: float
    # Seconds per emitted token on each prompt, for the configuration and the baseline: a routed export labels
    # every calibration prompt with the configuration that served it fastest.
    prompt_s_per_token: list[float] = field(default_factory=list)
    base_prompt_s_per_token: list[float] = field(default_factory=list)


def measure(
    target,
    tokenizer,
    draft,
    config: DecodeConfig,
    refs: list[replay.Reference],
    max_new_tokens: int,
    flip: bool,
    baseline: DecodeConfig | None = None,
) -> Measurement:
    """Decode every prompt with ``config`` and with ``baseline`` (AR by default), interleaved; ratio of sums."""
    dec = Decoder(target, tokenizer, config, draft=draft)
    base = Decoder(target, tokenizer, baseline or DecodeConfig(mode="ar"), draft=draft)
    t_cfg = t_base = 0.0
    tokens = base_tokens = full_calls = slim_calls = 0
    n_layers = num_layers(target)
    fid, pos, exact = [], [], []
    tiers = dict.fromkeys(("direct", "slim", "full"), 0)
    times = dict.fromkeys(("draft", "slim", "full"), 0.0)
    per_prompt: list[float] = []
    base_per_prompt: list[float] = []
    for i, ref in enumerate(refs):
        order = [base, dec] if (i + flip) % 2 == 0 else [dec, base]  # alternate who goes first
        for d in order:
            r = d.generate(ref.prompt_ids, max_new_tokens=max_new_tokens)
            seconds = r.stats.wall_time_s / max(r.stats.new_tokens, 1)
            (base_per_prompt if d is base else per_prompt).append(seconds)
            if d is base:
                t_base += r.stats.wall_time_s
                base_tokens += r.stats.new_tokens
                continue
            s = r.stats
            t_cfg += s.wall_time_s
            tokens += s.new_tokens
            full_calls += s.full_calls
            slim_calls += s.slim_calls
            fid.append(greedy_agreement(target, ref.prompt_ids, r.token_ids))  # untimed
            pos.append(agreement(r.token_ids, ref.output))
            exact.append(float(r.token_ids == ref.output))
            for k in tiers:
                tiers[k] += getattr(s, f"tokens_{k}")
            for k in times:
                times[k] += getattr(s, f"{k}_time_s")
    # Speed compares time per token, so an early EOS on one side does not count as speed.
    speedup = (t_base / max(base_tokens, 1)) / (t_cfg / max(tokens, 1))
    return Measurement(
        speedup=speedup,
        fidelity=statistics.fmean(fid),
        agreement=statistics.fmean(pos),
        exact=statistics.fmean(exact),
        acceptance=replay.acceptance(tokens, full_calls, slim_calls, 1.0 - config.skip.fraction(n_layers)),
        tier_shares={k: v / max(tokens, 1) for k, v in tiers.items()},
        tier_time_s=times,
        tokens_per_s=tokens / t_cfg if t_cfg else 0.0,
        ar_tokens_per_s=base_tokens / t_base if t_base else 0.0,
        prompt_s_per_token=per_prompt,
        base_prompt_s_per_token=base_per_prompt,
    )


def _references(target, tokenizer, items, max_new_tokens: int, progress: bool) -> list[replay.Reference]:
    """The target's greedy output on every calibration prompt, decoded once."""
    dec = Decoder(target, tokenizer, DecodeConfig(mode="ar"))
    refs = []
    for p, ids in tqdm(items, desc="target outputs", disable=not progress, leave=False):
        r = dec.generate(ids, max_new_tokens=max_new_tokens)
        refs.append(replay.Reference(p.id, ids, r.token_ids, r.stats.wall_time_s))
    return refs


def run_search(s: SearchSettings) -> dict:
    """Run (or resume) a search and export its pick (held out); returns the export summary."""
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
    drafters = ["self", "lookup", "lookup+self"] + (["model", "lookup+model"] if draft else [])
    spaces.known_points(space, n_layers, drafters)  # the space fits this model and these drafters

    dev = target.model.device
    ctx = models.context_length(target.model)

    def encoded(items: list[prompts.Prompt]) -> list:
        ids = prompts.encode_all(target.tokenizer, items, s.chat, s.max_new_tokens, ctx, dev)
        return list(zip(items, ids, strict=True))

    calib_ids, held_ids = encoded(calib), encoded(held)
    out.mkdir(parents=True, exist_ok=True)
    study = open_study(opened or storage, study_name, s.seed, s.min_fidelity)
    install_skipping(target.model)

    signature = {
        "space": spaces.space_signature(space, n_layers),
        "target": target.fingerprint["source"].get("sha256") or target.fingerprint["vocab_sha256"],
        "calibration": calibration_fingerprint([(p.id, p.text) for p in calib]),
        "max_new_tokens": s.max_new_tokens,
    }
    old = study.user_attrs.get("signature")
    if old and old != signature:
        what = ", ".join(k for k in signature if old.get(k) != signature[k])
        raise UserError(
            f"study {study_name!r} already exists with a different {what}; pick a new --study-name or --out"
        )
    attrs = {
        "signature": signature,
        "num_layers": n_layers,
        "min_fidelity": s.min_fidelity,
        "target": s.model,
        "target_fingerprint": target.fingerprint,
        "draft": s.draft,
        "draft_fingerprint": draft.fingerprint if draft else None,
        "dtype": str(target.model.dtype).removeprefix("torch."),
        "device": dev.type,
        "matrix_isa": host.matrix_isa(
            str(dev)
        ),  # whoever created the study; each measured trial records its own
        "calibration": {
            "source": s.data,
            "prompt_ids": [p.id for p in calib],
            "fingerprint": signature["calibration"],
            "held_out_ids": [p.id for p in held],
            # What a routed profile's rule reads (viasd_tune.rule), per calibration prompt, so export needs no model.
            "features": [prompt_features(ids.tolist(), p.category) for p, ids in calib_ids],
        },
        "space_source": space.source,
        "max_new_tokens": s.max_new_tokens,
        "storage": redact(storage),
    }
    for k, v in attrs.items():
        study.set_user_attr(k, v)
    spaces.enqueue_known_points(study, space, n_layers, drafters)

    refs = _references(target.model, target.tokenizer, calib_ids, s.max_new_tokens, s.progress)
    cache = replay.ReplayCache(
        target.model,
        refs,
        draft.model if draft else None,
        max_new_tokens=s.max_new_tokens,
        eos=models.eos_ids(target.model, target.tokenizer),
        gamma_max=max(space.gamma),
    )
    cost = costmodel.fit(target.model, draft.model if draft else None, refs[0].prompt_ids)
    ar_model_time = sum(len(r.output) for r in refs) * cost.target_time(1, None)
    if space.slim_tier:  # scoring sub-layers takes minutes; a space that skips nothing needs no skip sets
        seed_skip_sets(study, target.model, refs, cost, space, n_layers, s.progress)

    def objective(trial: optuna.Trial) -> tuple[float, float]:
        cfg = spaces.suggest(trial, space, n_layers, drafters, num_layers(draft.model) if draft else None)
        est = replay.simulate(cache, cfg)
        modelled = ar_model_time / max(cost.price(est.calls, cfg.skip, cfg.draft_skip, cfg.drafter), 1e-9)
        trial.set_user_attr(
            "estimate", {"fidelity": est.fidelity, "acceptance": est.acceptance, "speedup_modelled": modelled}
        )
        trial.set_user_attr("speedup_modelled", modelled)
        screened = None
        if est.fidelity < s.min_fidelity - ESTIMATE_MARGIN:
            screened = "fidelity"
        elif not _reference_point(trial) and not could_enter_front(study, modelled, est.acceptance):
            screened = "dominated"
        if screened:
            trial.set_user_attr("measured", False)
            trial.set_user_attr("screened", screened)  # why it was not decoded for real
            trial.set_user_attr("fidelity", est.fidelity)
            trial.set_user_attr("feasible", False)
            trial.set_constraint("fidelity", s.min_fidelity - est.fidelity)
            trial.set_user_attr("tier_shares", _shares(est))
            return modelled, est.acceptance
        m = measure(
            target.model,
            target.tokenizer,
            draft.model if draft else None,
            cfg,
            refs,
            s.max_new_tokens,
            flip=bool(trial.number % 2),
        )
        if not all(map(_finite, (m.speedup, m.fidelity, m.acceptance))):
            raise RuntimeError("non-finite measurement (the skip set may produce NaNs)")
        trial.set_user_attr("measured", True)
        trial.set_user_attr(
            "matrix_isa", host.matrix_isa(str(target.model.device))
        )  # speeds differ 3x across hosts
        trial.set_user_attr("fidelity", m.fidelity)
        trial.set_user_attr("agreement", m.agreement)
        trial.set_user_attr("exact_match", m.exact)
        trial.set_user_attr("feasible", m.fidelity >= s.min_fidelity)
        trial.set_constraint("fidelity", s.min_fidelity - m.fidelity)
        trial.set_user_attr("tier_shares", m.tier_shares)
        replayed = _shares(est)
        trial.set_user_attr("replayed_tier_shares", replayed)
        trial.set_user_attr("replay_exact", est.exact)  # lossless, or lossy without a wrongly settled token
        trial.set_user_attr("replay_gap", max(abs(replayed[k] - m.tier_shares[k]) for k in replayed))
        trial.set_user_attr("tier_time_s", m.tier_time_s)
        trial.set_user_attr("tokens_per_s", m.tokens_per_s)
        trial.set_user_attr("ar_tokens_per_s", m.ar_tokens_per_s)
        trial.set_user_attr("prompt_s_per_token", m.prompt_s_per_token)  # in calibration order
        trial.set_user_attr("ar_prompt_s_per_token", m.base_prompt_s_per_token)
        return m.speedup, m.acceptance

    _optimize(study, objective, s)
    if s.worker:
        return {}
    check = replay_check(study)
    study.set_user_attr("replay_check", check)
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
        hrefs = _references(target.model, target.tokenizer, held_ids, s.max_new_tokens, s.progress)
        m = measure(
            target.model,
            target.tokenizer,
            draft.model if draft else None,
            cfg,
            hrefs,
            s.max_new_tokens,
            False,
        )
        sd_cfg = DecodeConfig(
            mode="sd",
            gamma=cfg.gamma,
            drafter=cfg.drafter,
            draft_skip=cfg.draft_skip,
            lookup_min=cfg.lookup_min,
        )
        vs_sd = measure(
            target.model,
            target.tokenizer,
            draft.model if draft else None,
            cfg,
            hrefs,
            s.max_new_tokens,
            True,
            baseline=sd_cfg,
        )
        return {
            "speedup_measured": m.speedup,
            "speedup_vs_sd": vs_sd.speedup,
            "acceptance": m.acceptance,
            "fidelity": m.fidelity,
            "agreement": m.agreement,
            "exact_match": m.exact,
            "tier_shares": m.tier_shares,
            "tier_time_s": m.tier_time_s,
            "held_out_prompts": len(hrefs),
            "tokens_per_s": m.tokens_per_s,
            "ar_tokens_per_s": m.ar_tokens_per_s,
        }

    return export_study(study, out, evaluate=evaluate_held_out)


def _finite(x: float) -> bool:
    return x == x and abs(x) != float("inf")


def seed_skip_sets(
    study: optuna.Study,
    target,
    refs: list[replay.Reference],
    cost: costmodel.CostModel,
    space: spaces.SearchSpace,
    n_layers: int,
    progress: bool,
) -> importance.Importance:
    """Score the sub-layers once per study (kept in the study's user attr, so a resume or another worker reuses
    them) and enqueue the skip sets built from the scores."""
    stored = study.user_attrs.get(importance.ATTR)
    if stored:
        imp = importance.Importance.from_dict(stored)
    else:
        imp = importance.measure(target, refs, cost, space, progress=progress)
        study.set_user_attr(importance.ATTR, imp.to_dict())
    n = importance.enqueue_seeds(study, space, n_layers, imp)
    log.info("enqueued %d skip sets built from layer importance", n)
    return imp


def _reference_point(trial: optuna.Trial) -> bool:
    """The enqueued baselines (no skip, plain SD per drafter) are always decoded: every study measures them."""
    fixed = trial.storage.get_trial_system_attrs(trial._trial_id).get("fixed_params") or {}
    return "escalate_all" in fixed


def could_enter_front(study: optuna.Study, modelled: float, acceptance: float) -> bool:
    """Whether a replayed trial might join the measured feasible Pareto front, so that decoding it for real is
    worth its cost. Its modelled speedup is put on the measured scale by the median measured/modelled ratio of
    the measured trials, and it is ruled out only when a measured feasible trial beats it by ``FRONT_SLACK`` on
    both objectives (the replay and the cost model are approximations)."""
    TS = optuna.trial.TrialState
    measured = [
        t
        for t in study.get_trials(deepcopy=False, states=(TS.COMPLETE,))
        if t.user_attrs.get("measured") and t.user_attrs.get("feasible")
    ]
    ratios = [
        t.values[0] / t.user_attrs["speedup_modelled"]
        for t in measured
        if _finite(t.user_attrs.get("speedup_modelled", math.nan)) and t.user_attrs["speedup_modelled"] > 0
    ]
    predicted = modelled * (statistics.median(ratios) if ratios else 1.0)
    return not any(
        t.values[0] >= predicted * (1 + FRONT_SLACK) and t.values[1] >= acceptance * (1 + FRONT_SLACK)
        for t in measured
    )


POLL_S = 0.5  # how often a worker with nothing to start re-reads the study


def _guarded(objective):
    """The objective, recording who ran each trial and why one failed: an exception (or NaN objectives) fails
    that trial with ``fail_reason`` in its user attrs and the search goes on; Ctrl-C fails the running trial
    with its reason too (not left RUNNING) and then stops the search."""

    def run(trial: optuna.Trial) -> tuple[float, float]:
        # which machine and process ran it: says whose trials a dead worker left behind
        trial.set_user_attr("worker", f"{socket.gethostname()}:{os.getpid()}")
        try:
            values = objective(trial)
            host.release_memory()
            trial.set_user_attr("memory_gb", dict(zip(("resident", "peak"), host.memory_gb(), strict=True)))
            if not all(map(_finite, values)):
                raise RuntimeError(f"non-finite objective values {values}")
            return values
        except KeyboardInterrupt:
            trial.set_user_attr("fail_reason", "interrupted (Ctrl-C / SIGINT)")
            raise
        except Exception as e:
            reason = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"[:500]
            reason = scrub(reason, [getattr(trial.storage, "url", None)])  # stored in the study: no password
            trial.set_user_attr("fail_reason", reason)
            log.warning("trial %d failed: %s", trial.number, reason, exc_info=log.isEnabledFor(logging.INFO))
            raise

    return run


def _reason(last: list[optuna.trial.FrozenTrial]) -> str:
    return last[0].user_attrs.get("fail_reason", "?") if last else "taken over by another worker"


def _shares(est: replay.Estimate) -> dict[str, float]:
    return {k: t / max(est.tokens, 1) for k, t in zip(("direct", "slim", "full"), est.tiers, strict=True)}


def replay_check(study: optuna.Study) -> dict:
    """How well the replay's tier shares matched real decoding on the decoded trials (``REPLAY_TOLERANCE``)."""
    gaps = [
        t.user_attrs["replay_gap"]
        for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
        if "replay_gap" in t.user_attrs
    ]
    return {
        "tolerance": REPLAY_TOLERANCE,
        "trials": len(gaps),
        "within": sum(g <= REPLAY_TOLERANCE for g in gaps),
        "max_gap": max(gaps, default=0.0),
    }


def _screened_in_a_row(trials: list[optuna.trial.FrozenTrial]) -> int:
    """How many of the latest finished trials, counting back from the newest, were replayed and not decoded."""
    n = 0
    for t in sorted(trials, key=lambda t: t.number, reverse=True):
        if t.state != optuna.trial.TrialState.COMPLETE:
            continue
        if t.user_attrs.get("measured"):
            break
        n += 1
    return n


def _patience(trials: list[optuna.trial.FrozenTrial]) -> float:
    """How long to wait for other workers' running trials when nothing changes: a live worker's trial ends
    within a few trial durations, a dead one's goes stale within the grace period; one killed before its
    first heartbeat does neither and must not hold this worker forever."""
    spans = [
        (t.datetime_complete - t.datetime_start).total_seconds()
        for t in trials
        if t.datetime_complete and t.datetime_start
    ]
    return env_seconds("VIASD_GRACE_PERIOD", 90) + 60 + 3 * max(spans, default=0.0)


def _optimize(study: optuna.Study, objective, s: SearchSettings) -> None:
    """Run trials until the study holds ``s.trials`` decoded ones (measured: replayed trials that were not worth
    decoding do not count), counting every worker's, or until timeout, or until ``REPLAYS_PER_DECODE`` finished
    trials per decode asked for (at least ``MIN_REPLAYS``) found too few worth decoding, or once the last
    ``STALE_REPLAYS`` finished trials were all screened out.

    One trial per ``study.optimize`` call, so each start re-reads the study: a trial another worker is running
    counts as on its way (no overshoot); a trial whose worker died is failed once its heartbeat is stale and
    re-queued (storage.RetryStaleTrial), and such a retry is run even past the count, the study owes
    it; a worker with nothing left to start waits for the others' running trials, so none is left RUNNING and
    the exporting process sees every result. Failed trials do not count, so they are replaced.
    """
    TS = optuna.trial.TrialState
    debug = log.isEnabledFor(logging.INFO)
    optuna.logging.set_verbosity(optuna.logging.WARNING if debug else optuna.logging.ERROR)  # we log failures
    bar = tqdm(total=s.trials, desc="decoded", disable=not s.progress, unit="trial")
    max_finished = max(MIN_REPLAYS, REPLAYS_PER_DECODE * s.trials)
    start, ran, failed_in_a_row, last = time.time(), 0, 0, []
    progress, idle_since = None, time.time()
    guarded = _guarded(objective)
    try:
        while True:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                optuna.storages.fail_stale_trials(study)  # a dead worker's trial → FAIL + a WAITING retry
            trials = study.get_trials(deepcopy=False)
            n = collections.Counter(t.state for t in trials)
            finished, running = n[TS.COMPLETE] + n[TS.PRUNED], n[TS.RUNNING]
            done = sum(1 for t in trials if t.state == TS.COMPLETE and t.user_attrs.get("measured"))
            retry = any(t.state == TS.WAITING and "failed_trial" in t.system_attrs for t in trials)
            if (done, running, len(trials)) != progress:
                progress, idle_since = (done, running, len(trials)), time.time()
            best = [
                t.values[0]
                for t in trials
                if t.state == TS.COMPLETE and t.user_attrs.get("feasible") and t.user_attrs.get("measured")
            ]
            bar.n = min(done, s.trials)
            bar.set_postfix(
                replayed=finished, best_speedup=f"{max(best):.2f}x" if best else "-", refresh=False
            )
            bar.refresh()
            if s.timeout is not None and time.time() - start >= s.timeout:
                break
            stale = _screened_in_a_row(trials)
            more = done + running < s.trials and finished + running < max_finished and stale < STALE_REPLAYS
            if more or retry:
                last.clear()
                try:
                    study.optimize(
                        guarded, n_trials=1, catch=(Exception,), callbacks=[lambda _, t: last.append(t)]
                    )
                except (optuna.exceptions.UpdateFinishedTrialError, ValueError) as e:
                    # This worker stalled past the grace period, so another one failed its trial as stale
                    # and re-queued it; the retry carries the work, this result is dropped.
                    if isinstance(e, ValueError) and not str(e).startswith("Cannot tell a"):
                        raise
                    log.warning("a trial of this worker was taken over by another (heartbeat stale)")
                ran += 1
                failed_in_a_row = failed_in_a_row + 1 if not last or last[0].state == TS.FAIL else 0
                if failed_in_a_row >= max(s.trials, 3):
                    raise UserError(
                        f"the last {failed_in_a_row} trials all failed (last: {_reason(last)}); "
                        "each failed trial's fail_reason user attr says why, --debug shows tracebacks"
                    )
            elif running and time.time() - idle_since < _patience(trials):
                time.sleep(POLL_S)  # the last trials are other workers'; wait so none is left RUNNING
            else:
                if running:
                    log.warning("not waiting longer for %d trial(s) RUNNING without progress", running)
                break
    except KeyboardInterrupt:
        bar.close()  # so the message does not land inside the progress bar
        log.warning(
            "interrupted: finished trials stay in study %r; re-run the same command to resume, or run "
            "`viasd-tune export` for the best profile so far",
            study.study_name,
        )
        raise
    finally:
        bar.close()
    if ran == 0 and done >= s.trials:
        log.warning("study already has %d decoded trials; exporting", done)
    elif done < s.trials and stale >= STALE_REPLAYS:
        log.warning(
            "stopped: the last %d replayed trials could not enter the measured front; %d of --trials %d were "
            "worth decoding for real",
            stale,
            done,
            s.trials,
        )
    elif done < s.trials and finished >= max_finished:
        log.warning(
            "stopped after %d replayed trials: only %d were worth decoding for real (--trials %d)",
            finished,
            done,
            s.trials,
        )
    log.info("search ran %.0f s", time.time() - start)
