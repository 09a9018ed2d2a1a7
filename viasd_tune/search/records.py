"""What a search study stores beside Optuna's own params and objectives: :class:`TrialRecord` per trial and
:class:`StudyRecord` per study. Each is written by its ``write`` and read back by its ``read`` and nothing else
touches the attribute names, so a misspelt attribute is an ``AttributeError`` in the code, not a "-" in the
dashboard.

Both are stored as Optuna user attributes, one per field under the field's name (JSON values): the layout every
study has had, so old studies (``benchmarks/results/*.db``) read back unchanged. A field left ``None`` is not
written, so records written at different moments of a trial compose; a field a study lacks (written before the
field existed, or a trial that failed first) reads back as ``None``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

import optuna

from ..config import DecodeConfig

TIERS = ("direct", "slim", "full")  # keys of tier_shares: which tier emitted a token
TIMED_TIERS = ("draft", "slim", "full")  # keys of tier_time_s: which tier spent the time
_HELD_OUT = "held_out:"  # a study attribute per exported trial: held_out:<number>


def _attrs(record: Any) -> dict[str, Any]:
    return {f.name: v for f in fields(record) if (v := getattr(record, f.name)) is not None}


@dataclass
class TrialRecord:
    """One trial's record. Every field is optional: which ones a trial has depends on how far it got."""

    # Every trial: who ran it (says whose trials a dead worker left behind) and how it ended.
    worker: str | None = None  # "host:pid"
    memory_gb: dict[str, float] | None = None  # the process's "resident" and "peak" memory after the trial
    fail_reason: str | None = None  # one line: why the trial failed (or "interrupted ...")
    # Params it was enqueued with (reference points and importance seeds); None for a sampled trial.
    enqueued: dict[str, Any] | None = None
    config: dict[str, Any] | None = None  # DecodeConfig.to_dict() of the configuration it ran
    # Every trial that ran its objective: the replay's estimate, and whether it was decoded for real.
    estimate: dict[str, float] | None = None  # replayed "fidelity", "acceptance", "speedup_modelled"
    speedup_modelled: float | None = None
    measured: bool | None = None  # False: replayed only, the objectives are the replay's estimate
    screened: str | None = None  # why it was not decoded: "fidelity" (estimate too low), "dominated", "slow"
    duplicate_of: int | None = None  # it ran the configuration of that decoded trial, whose measurement it reuses
    fidelity: float | None = None  # greedy agreement (fidelity.py); the replay's estimate when not measured
    feasible: bool | None = None  # fidelity >= the study's min_fidelity (always False when screened)
    tier_shares: dict[str, float] | None = None  # TIERS -> share of emitted tokens
    # Decoded trials only.
    matrix_isa: str | None = None  # the host's matrix ISA: speeds differ 3x across hosts
    agreement: float | None = None  # position-wise agreement with the target's greedy output
    exact_match: float | None = None  # share of prompts decoded exactly as the target does
    replayed_tier_shares: dict[str, float] | None = None  # the replay's tier shares beside the measured ones
    replay_exact: bool | None = None  # studies before the replay ran the engine: it stayed on the reference
    replay_gap: float | None = None  # largest |replayed - measured| tier share
    tier_time_s: dict[str, float] | None = None  # TIMED_TIERS -> seconds
    tokens_per_s: float | None = None
    ar_tokens_per_s: float | None = None
    # Seconds per emitted token per calibration prompt (in calibration order), of the configuration and of the
    # AR run interleaved with it: a routed export labels each prompt with the configuration that served it best.
    prompt_s_per_token: list[float] | None = None
    ar_prompt_s_per_token: list[float] | None = None

    def attrs(self) -> dict[str, Any]:
        """The fields that are set, as user attributes (for :meth:`optuna.Study.enqueue_trial`)."""
        return _attrs(self)

    def write(self, trial: optuna.trial.BaseTrial) -> None:
        """Store the fields that are set on ``trial`` (the others keep what the trial already has)."""
        for key, value in self.attrs().items():
            trial.set_user_attr(key, value)

    @classmethod
    def read(cls, trial: optuna.trial.BaseTrial | optuna.trial.FrozenTrial) -> TrialRecord:
        """The record of a running or finished trial; attributes it does not know are left out."""
        stored = trial.user_attrs
        return cls(**{f.name: stored.get(f.name) for f in fields(cls)})

    def decode_config(self) -> DecodeConfig:
        """The configuration the trial ran (every trial that reached its objective has one)."""
        if self.config is None:
            raise ValueError("this trial recorded no configuration (it failed before its objective ran)")
        return DecodeConfig.from_dict(self.config)

    @property
    def reference(self) -> bool:
        """An enqueued reference point (no skip, or plain SD): always decoded, every study measures them."""
        return "escalate_all" in (self.enqueued or {})


@dataclass
class StudyRecord:
    """What the search records about the whole study: how it was set up, then what it learnt and exported."""

    # Written when the search starts (or resumes).
    signature: dict[str, Any] | None = None  # what a resume must match: space, target, calibration, tokens
    num_layers: int | None = None
    min_fidelity: float | None = None
    target: str | None = None
    target_fingerprint: dict[str, Any] | None = None
    draft: str | None = None
    draft_fingerprint: dict[str, Any] | None = None
    dtype: str | None = None
    device: str | None = None
    matrix_isa: str | None = None  # the host that created the study; each decoded trial records its own
    # source, prompt_ids, fingerprint, held_out_ids, and features (per calibration prompt, for routed exports)
    calibration: dict[str, Any] | None = None
    space_source: str | None = None
    max_new_tokens: int | None = None
    storage: str | None = None  # the storage URL, password redacted
    # Written later.
    layer_importance: dict[str, Any] | None = None  # importance.Importance.to_dict()
    replay_check: dict[str, Any] | None = None  # how replayed tier shares matched decoding (replay_check())
    exported_trial: int | None = None
    # trial number -> metrics of that trial on the held-out prompts (finished trials are read-only in Optuna)
    held_out: dict[int, dict[str, Any]] = field(default_factory=dict)

    def write(self, study: optuna.Study) -> None:
        """Store the fields that are set on ``study`` (the others keep what the study already has)."""
        attrs = _attrs(self)
        for number, metrics in attrs.pop("held_out").items():
            attrs[f"{_HELD_OUT}{number}"] = metrics
        for key, value in attrs.items():
            study.set_user_attr(key, value)

    @classmethod
    def read(cls, study: optuna.Study) -> StudyRecord:
        stored = study.user_attrs
        held = {
            int(key.removeprefix(_HELD_OUT)): value
            for key, value in stored.items()
            if key.startswith(_HELD_OUT) and key.removeprefix(_HELD_OUT).isdigit()
        }
        known = {f.name: stored.get(f.name) for f in fields(cls) if f.name != "held_out"}
        return cls(**known, held_out=held)
