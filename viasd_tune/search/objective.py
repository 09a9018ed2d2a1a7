"""The study's objective: a trial samples one configuration, replays it (cheap, ``replay.py``) for estimated
fidelity, acceptance and a modelled speedup, and is decoded for real only when the screen (``screen.py``) says it
could matter. Its :class:`~viasd_tune.search.records.TrialRecord` says which, and why; the objectives are the
measured speedup and acceptance, or the replay's estimates for a trial screened out."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import optuna

from .. import host
from ..config import DecodeConfig
from ..routing import num_layers
from . import costmodel, params, replay
from .measure import Measurement, measure
from .records import TrialRecord
from .screen import finite, screened_out, tier_shares
from .settings import SearchSettings
from .space import SearchSpace


@dataclass
class Objective:
    """Everything a trial needs, prepared once per search (``run.py``); called once per trial."""

    study: optuna.Study
    settings: SearchSettings
    space: SearchSpace
    n_layers: int
    drafters: list[str]  # the drafters this run can use (the draft model's only with a draft model)
    target: Any  # models.load()'s loaded target
    draft: Any | None  # and the draft model, if any
    refs: list[replay.Reference]  # the target's own greedy output per calibration prompt
    cache: replay.ReplayCache
    cost: costmodel.CostModel
    ar_model_s_per_token: float  # the replayed AR baseline's modelled seconds per token

    def __call__(self, trial: optuna.Trial) -> tuple[float, float]:
        s, draft = self.settings, self.draft
        draft_layers = num_layers(draft.model) if draft else None
        cfg = params.suggest(trial, self.space, self.n_layers, self.drafters, draft_layers)
        twin = self._measured_twin(cfg, trial.number)
        if twin is not None:
            return self._reuse(trial, twin)
        est = replay.simulate(self.cache, cfg)
        modelled = self.ar_model_s_per_token / max(est.time_s / max(est.tokens, 1), 1e-12)
        TrialRecord(
            estimate={"fidelity": est.fidelity, "acceptance": est.acceptance, "speedup_modelled": modelled},
            speedup_modelled=modelled,
        ).write(trial)
        screened = screened_out(self.study, trial, est.fidelity, modelled, est.acceptance, s.min_fidelity)
        if screened:
            TrialRecord(
                measured=False,
                screened=screened,
                fidelity=est.fidelity,
                feasible=False,
                tier_shares=tier_shares(est.tiers, est.tokens),
            ).write(trial)
            trial.set_constraint("fidelity", s.min_fidelity - est.fidelity)
            return modelled, est.acceptance
        m = self._measure(cfg, flip=bool(trial.number % 2))
        self._record_decoded(trial, m, replayed=tier_shares(est.tiers, est.tokens))
        return m.speedup, m.acceptance

    def _measured_twin(self, cfg: DecodeConfig, number: int) -> optuna.trial.FrozenTrial | None:
        """An earlier decoded trial that ran this same configuration (samplers propose one again, TPE often
        near its best): its measurement stands for this trial, as Optuna's FAQ does for duplicated params, so a
        search does not spend a decode (a minute on SmolLM2) re-measuring it."""
        done = self.study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
        for t in done:
            record = TrialRecord.read(t)
            original = t.number != number and record.measured and record.duplicate_of is None
            if original and record.config and record.decode_config() == cfg:
                return t
        return None

    def _reuse(self, trial: optuna.Trial, twin: optuna.trial.FrozenTrial) -> tuple[float, float]:
        """Record ``twin``'s measurement as this trial's (``duplicate_of`` says whose) and return its values; the
        replay-vs-decoding check counts the twin only."""
        record = TrialRecord.read(twin)
        replace(
            record,
            worker=None,
            memory_gb=None,
            enqueued=None,
            config=None,
            replayed_tier_shares=None,
            replay_exact=None,
            replay_gap=None,
            duplicate_of=twin.number,
        ).write(trial)
        trial.set_constraint("fidelity", self.settings.min_fidelity - (record.fidelity or 0.0))
        return twin.values[0], twin.values[1]

    def _measure(self, cfg: DecodeConfig, flip: bool) -> Measurement:
        target, draft, s = self.target, self.draft, self.settings
        m = measure(
            target.model,
            target.tokenizer,
            draft.model if draft else None,
            cfg,
            self.refs,
            s.max_new_tokens,
            flip=flip,
            verify_cost=self.cost.verify_cost() if cfg.tree_sizing == "cost" else None,
        )
        if not all(map(finite, (m.speedup, m.fidelity, m.acceptance))):
            raise RuntimeError("non-finite measurement (the skip set may produce NaNs)")
        return m

    def _record_decoded(self, trial: optuna.Trial, m: Measurement, replayed: dict[str, float]) -> None:
        min_fidelity = self.settings.min_fidelity
        TrialRecord(
            measured=True,
            matrix_isa=host.matrix_isa(str(self.target.model.device)),
            fidelity=m.fidelity,
            agreement=m.agreement,
            exact_match=m.exact,
            feasible=m.fidelity >= min_fidelity,
            tier_shares=m.tier_shares,
            replayed_tier_shares=replayed,
            replay_gap=max(abs(replayed[k] - m.tier_shares[k]) for k in replayed),
            tier_time_s=m.tier_time_s,
            tokens_per_s=m.tokens_per_s,
            ar_tokens_per_s=m.ar_tokens_per_s,
            prompt_s_per_token=m.prompt_s_per_token,
            ar_prompt_s_per_token=m.base_prompt_s_per_token,
        ).write(trial)
        trial.set_constraint("fidelity", min_fidelity - m.fidelity)
