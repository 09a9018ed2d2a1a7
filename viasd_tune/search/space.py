"""Search spaces: what the tuner may vary (a validated YAML file) and how an Optuna trial's params decode into
a :class:`~viasd_tune.config.DecodeConfig` (:func:`suggest`, the one mapping from params). Param names are stable and readable so studies can be resumed, compared and plotted.

τ_escalate = 0 (plain speculative decoding: every token goes to the full target) is outside the log range of
``tau_escalate`` and Optuna 5 refuses 0 for a log distribution even as an enqueued value. So it is an explicit
boolean param, ``escalate_all``: when True the trial is plain SD and the params that only matter for VIA-SD
(``kl``, thresholds, skip set) are not suggested, so samplers never see values that had no effect.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path
from typing import Any

import jsonschema
import optuna
import yaml

from ..config import (
    DRAFTERS,
    GAMMA_MAX,
    HYBRIDS,
    KL_KINDS,
    DecodeConfig,
    applies,
    model_drafter,
    where_applies,
)
from ..errors import UserError
from ..profile import schema_problem
from ..routing import SkipSet

SUBLAYERS = ("attn", "mlp")
ENCODINGS = ("budget", "per_sublayer")
SHIPPED = ("default", "smoke", "model-draft", "lookup")
# Bump when the params -> DecodeConfig mapping changes, so a study made with the old mapping is refused.
DECODING_VERSION = 2  # 2: a round drafts at most what max_new_tokens leaves (common.draft_budget)


def _range_schema(maximum: float | None = None) -> dict[str, Any]:
    bound: dict[str, Any] = {"type": "number", "minimum": 0}
    if maximum is not None:
        bound["maximum"] = maximum
    return {
        "type": "object",
        "required": ["low", "high"],
        "additionalProperties": False,
        "properties": {"low": bound, "high": bound, "log": {"type": "boolean"}},
    }


def _names_schema(choices: tuple[str, ...]) -> dict[str, Any]:
    return {"type": "array", "minItems": 1, "uniqueItems": True, "items": {"enum": list(choices)}}


_FRACTION = {"type": "number", "minimum": 0, "maximum": 1}
_CONFIDENCE = {"type": "number", "minimum": 0, "exclusiveMaximum": 1}  # DecodeConfig.draft_confidence's range
_LOOKUP_MIN = {"type": "integer", "minimum": 1, "maximum": GAMMA_MAX}

SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "additionalProperties": False,
    "required": ["version", "skip", "tau_escalate", "tau_accept_ratio", "kl", "gamma", "drafter"],
    "properties": {
        "version": {"const": 1},
        "skip": {
            "type": "object",
            "additionalProperties": False,
            "required": ["encoding", "sublayers", "protect_first", "protect_last"],
            "properties": {
                "encoding": {"enum": list(ENCODINGS)},
                "sublayers": _names_schema(SUBLAYERS),
                "protect_first": {"type": "integer", "minimum": 0},
                "protect_last": {"type": "integer", "minimum": 0},
                "budget": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["min", "max"],
                    "properties": {"min": _FRACTION, "max": _FRACTION},
                },
            },
            "if": {"required": ["encoding"], "properties": {"encoding": {"const": "budget"}}},
            "then": {"required": ["budget"]},
        },
        "tau_escalate": _range_schema(),
        "tau_accept_ratio": _range_schema(maximum=1),
        "kl": _names_schema(KL_KINDS),
        "gamma": {
            "type": "array",
            "minItems": 1,
            "uniqueItems": True,
            "items": {"type": "integer", "minimum": 1, "maximum": GAMMA_MAX},
        },
        "drafter": _names_schema(DRAFTERS),
        "self_draft": {
            "type": "object",
            "additionalProperties": False,
            "required": ["skip_fraction"],
            "properties": {"skip_fraction": _range_schema(maximum=1)},
        },
        "draft_model": {
            "type": "object",
            "additionalProperties": False,
            "required": ["skip_fraction"],
            "properties": {"skip_fraction": _range_schema(maximum=1)},
        },
        "recheck": {"type": "array", "minItems": 1, "uniqueItems": True, "items": {"type": "boolean"}},
        "draft_confidence": {
            "oneOf": [
                {
                    "type": "object",
                    "required": ["low", "high"],
                    "additionalProperties": False,
                    "properties": {"low": _CONFIDENCE, "high": _CONFIDENCE},
                },
                {"type": "array", "minItems": 1, "uniqueItems": True, "items": _CONFIDENCE},
                _CONFIDENCE,
            ]
        },
        "lookup_min": {
            "type": "object",
            "required": ["low", "high"],
            "additionalProperties": False,
            "properties": {"low": _LOOKUP_MIN, "high": _LOOKUP_MIN},
        },
    },
    "if": {
        "required": ["drafter"],
        "properties": {"drafter": {"type": "array", "contains": {"enum": ["self", "lookup+self"]}}},
    },
    "then": {"required": ["self_draft"]},
}

_WHY_REQUIRED = {
    "budget": " (needed by skip.encoding: budget)",
    "self_draft": " (needed because drafter lists 'self' or 'lookup+self')",
}


@dataclass(frozen=True)
class FloatRange:
    """A float interval to search; ``log`` samples it on a log scale (needs ``low > 0``)."""

    low: float
    high: float
    log: bool = False

    def mid(self) -> float:
        """The centre a sampler sees: geometric on a log scale, arithmetic otherwise."""
        return math.sqrt(self.low * self.high) if self.log else (self.low + self.high) / 2

    def suggest(self, trial: optuna.trial.BaseTrial, name: str) -> float:
        return trial.suggest_float(name, self.low, self.high, log=self.log)


@dataclass(frozen=True)
class SkipSpec:
    """Which sub-layers the slim verifier may skip and how a trial encodes the choice."""

    encoding: str  # budget | per_sublayer
    sublayers: tuple[str, ...]  # in SUBLAYERS order
    protect_first: int
    protect_last: int
    budget: FloatRange | None  # skip fraction range; only used by the budget encoding


@dataclass(frozen=True)
class SearchSpace:
    """A validated search space; ``source`` names the file so errors and reports can point at it."""

    version: int
    skip: SkipSpec
    tau_escalate: FloatRange
    tau_accept_ratio: FloatRange
    kl: tuple[str, ...]
    gamma: tuple[int, ...]
    drafter: tuple[str, ...]
    self_draft_skip_fraction: FloatRange | None
    source: str
    # Optional keys (absent: the value every trial got before they existed).
    recheck: tuple[bool, ...] = (False,)
    draft_confidence: FloatRange | tuple[float, ...] = (0.0,)  # a range, or choices (0: off)
    draft_model_skip_fraction: FloatRange | None = None  # a skip set for the separate draft model
    # The hybrid drafters' lookup_min as an integer range (low, high); None: 1, not searched.
    lookup_min: tuple[int, int] | None = None

    @property
    def slim_tier(self) -> bool:
        """False when the space skips nothing (``skip.budget.max: 0``): a slim verifier without skipping is the
        full target run twice, so such a space searches plain SD only (drafters, γ, confidence), e.g. for a
        routed profile on a target too small to skip layers."""
        return not (self.skip.encoding == "budget" and self.skip.budget is not None and self.skip.budget.high == 0)


# ---------------------------------------------------------------- loading


def shipped_space_file(name: str) -> Path:
    """A shipped space's YAML file. ``search_spaces/`` beside the package is the one source: a source checkout or
    an editable install reads it there; a built wheel carries it as ``viasd_tune/spaces/`` (setup.py copies it
    in at build time)."""
    package = Path(__file__).resolve().parents[1]  # viasd_tune/
    for folder in (package.parent / "search_spaces", package / "spaces"):
        if (folder / f"{name}.yaml").is_file():
            return folder / f"{name}.yaml"
    raise UserError(
        f"search space {name}: its file is missing from {package.parent / 'search_spaces'} and "
        f"{package / 'spaces'}; reinstall viasd-tune"
    )


def space_file(name_or_path: str) -> Path | None:
    """The YAML file ``--space`` names, or ``None`` for a shipped space's name."""
    path_like = any(c in name_or_path for c in "/\\") or name_or_path.endswith((".yaml", ".yml"))
    return Path(name_or_path) if path_like else None


def load_space(name_or_path: str) -> SearchSpace:
    """Load a shipped space ("default", "smoke") or a YAML file; validated here so that a bad edit
    fails at once, not hours into a study."""
    if space_file(name_or_path) is None:
        if name_or_path not in SHIPPED:
            raise UserError(
                f"search space {name_or_path}: not a shipped space ({', '.join(SHIPPED)}) nor a .yaml path; "
                "pick one of those or pass the path of a YAML file"
            )
        path = shipped_space_file(name_or_path)
        source, text = str(path), path.read_text(encoding="utf-8")
    else:
        source = name_or_path
        try:
            text = Path(name_or_path).read_text(encoding="utf-8")
        except FileNotFoundError:
            raise UserError(
                f"search space {source}: file not found; pass an existing YAML file or one of: "
                f"{', '.join(SHIPPED)}"
            ) from None
        except (OSError, UnicodeDecodeError) as e:
            raise UserError(
                f"search space {source}: cannot read it ({e}); pass a readable UTF-8 YAML file"
            ) from None
    return _parse(text, source)


MAX_SPACE_BYTES = 1 << 20  # a space is a page of YAML
MAX_SPACE_NODES = 10_000  # values after YAML aliases are expanded (a space has about a hundred)


def _too_big(data: Any, limit: int) -> bool:
    """Whether ``data`` holds more than ``limit`` values counted as a tree, i.e. with every alias expanded
    (iterative and bounded, so an alias bomb or a self-referencing anchor is refused at once)."""
    stack, seen = [data], 0
    while stack:
        item = stack.pop()
        seen += 1
        if seen > limit:
            return True
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, (list, tuple, set)):
            stack.extend(item)
    return False


def _parse(text: str, source: str) -> SearchSpace:
    if len(text) > MAX_SPACE_BYTES:
        raise UserError(
            f"search space {source}: {len(text)} characters; a space is a page of YAML (at most "
            f"{MAX_SPACE_BYTES}), start from the shipped default.yaml"
        )
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1} column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e)
        raise UserError(
            f"search space {source}: invalid YAML{where}: {_one_line(problem)}; fix the syntax"
        ) from None
    if data is None:
        raise UserError(f"search space {source}: $: the file is empty; start from the shipped default.yaml")
    if _too_big(data, MAX_SPACE_NODES):
        raise UserError(
            f"search space {source}: $: expands to more than {MAX_SPACE_NODES} values (nested YAML aliases?); "
            "write the space out plainly, as in the shipped default.yaml"
        )
    error = jsonschema.exceptions.best_match(jsonschema.Draft202012Validator(SCHEMA).iter_errors(data))
    if error is not None:
        raise UserError(f"search space {source}: {error.json_path}: {_explain(error)}")

    def frange(d: dict[str, Any], path: str) -> FloatRange:
        r = FloatRange(float(d["low"]), float(d["high"]), bool(d.get("log", False)))
        for key in ("low", "high"):
            if not math.isfinite(getattr(r, key)):
                raise UserError(
                    f"search space {source}: {path}.{key}: {getattr(r, key)} is not a finite number; "
                    "give a number such as 0.5"
                )
        if r.low > r.high:
            raise UserError(f"search space {source}: {path}: low {r.low} > high {r.high}; swap or fix them")
        if r.log and r.low <= 0:
            raise UserError(
                f"search space {source}: {path}.low: must be > 0 when log is true; raise it or drop log"
            )
        return r

    skip = data["skip"]
    budget = None
    if "budget" in skip:
        budget = FloatRange(float(skip["budget"]["min"]), float(skip["budget"]["max"]))
        if not (math.isfinite(budget.low) and math.isfinite(budget.high)):
            raise UserError(
                f"search space {source}: $.skip.budget: min and max must be finite numbers in [0, 1]"
            )
        if budget.low > budget.high:
            raise UserError(
                f"search space {source}: $.skip.budget: min {budget.low} > max {budget.high}; "
                "swap or fix them"
            )
    self_draft, draft_model = data.get("self_draft"), data.get("draft_model")
    confidence: FloatRange | tuple[float, ...] = (0.0,)
    if isinstance(data.get("draft_confidence"), dict):
        confidence = frange(data["draft_confidence"], "$.draft_confidence")
    elif "draft_confidence" in data:
        raw = data["draft_confidence"]
        confidence = tuple(float(c) for c in (raw if isinstance(raw, list) else [raw]))
        if not all(math.isfinite(c) for c in confidence):
            raise UserError(
                f"search space {source}: $.draft_confidence: every value must be a finite number in [0, 1); "
                "write e.g. [0.0, 0.4] or {low: 0.0, high: 0.6}"
            )
    lookup_min = None
    if "lookup_min" in data:
        lookup_min = (int(data["lookup_min"]["low"]), int(data["lookup_min"]["high"]))
        if lookup_min[0] > lookup_min[1]:
            raise UserError(
                f"search space {source}: $.lookup_min: low {lookup_min[0]} > high {lookup_min[1]}; swap or fix them"
            )
    space = SearchSpace(
        version=data["version"],
        skip=SkipSpec(
            encoding=skip["encoding"],
            sublayers=tuple(k for k in SUBLAYERS if k in skip["sublayers"]),
            protect_first=skip["protect_first"],
            protect_last=skip["protect_last"],
            budget=budget,
        ),
        tau_escalate=frange(data["tau_escalate"], "$.tau_escalate"),
        tau_accept_ratio=frange(data["tau_accept_ratio"], "$.tau_accept_ratio"),
        kl=tuple(data["kl"]),
        gamma=tuple(int(g) for g in data["gamma"]),
        drafter=tuple(data["drafter"]),
        self_draft_skip_fraction=(
            frange(self_draft["skip_fraction"], "$.self_draft.skip_fraction") if self_draft else None
        ),
        source=source,
        recheck=tuple(data.get("recheck", [False])),
        draft_confidence=confidence,
        draft_model_skip_fraction=(
            frange(draft_model["skip_fraction"], "$.draft_model.skip_fraction") if draft_model else None
        ),
        lookup_min=lookup_min,
    )
    _check_applicable(space, data)
    return space


# Optional keys of a space -> the DecodeConfig field they set, and which drafters they serve (None: any).
_KEY_FIELDS = {
    "recheck": ("recheck", None),
    "draft_confidence": ("draft_confidence", None),
    "lookup_min": ("lookup_min", None),
    "self_draft": ("draft_skip", "self"),
    "draft_model": ("draft_skip", "model"),
}


def _check_applicable(space: SearchSpace, data: dict[str, Any]) -> None:
    """An optional key no trial of this space can use (``lookup_min`` without a hybrid drafter, ``recheck``
    without a slim tier, ...) is refused, by the table :func:`viasd_tune.config.applies` derives from
    DecodeConfig, as a flag that does nothing is."""
    modes = ("sd", "viasd") if space.slim_tier else ("sd",)
    for key, (name, runs) in _KEY_FIELDS.items():
        if key not in data or (key == "recheck" and not any(space.recheck)):
            continue
        if (
            key == "draft_confidence"
            and isinstance(space.draft_confidence, tuple)
            and not any(space.draft_confidence)
        ):
            continue
        drafters = [d for d in space.drafter if runs is None or model_drafter(d) == runs]
        if not any(applies(name, m, d) for m in modes for d in drafters):
            why = (
                where_applies(name, modes[-1])
                if drafters
                else f"it sets the skip set of drafter {runs} / lookup+{runs}, which drafter does not list"
            )
            raise UserError(
                f"search space {space.source}: $.{key} does nothing with drafter {list(space.drafter)}"
                f"{'' if space.slim_tier else ' and no slim tier'}: {why}; remove it or list such a drafter"
            )


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _explain(error: jsonschema.ValidationError) -> str:
    """A schema error as one line that also says how to fix it."""
    if error.validator == "additionalProperties":
        allowed = list(error.schema.get("properties", {}))
        unknown = sorted(set(error.instance) - set(allowed))
        keys = f"key {unknown[0]!r}" if len(unknown) == 1 else f"keys {', '.join(map(repr, unknown))}"
        return f"unknown {keys}; remove or rename it (allowed: {', '.join(allowed)})"
    if error.validator == "required":
        missing = next(k for k in error.validator_value if k not in error.instance)
        return (
            f"missing key '{missing}'{_WHY_REQUIRED.get(missing, '')}; add it (see the shipped default.yaml)"
        )
    return f"{schema_problem(error)}; see the comments in the shipped default.yaml"


# ---------------------------------------------------------------- decoding trials


def evenly_spaced_skip(num_layers: int, count: int, protect_first: int, protect_last: int) -> list[int]:
    """``count`` layers spread evenly over the unprotected ones: a self-draft that keeps every depth region
    partly intact drafts better than one that drops a contiguous block. ``count`` is clamped to what
    exists."""
    layers = range(protect_first, num_layers - protect_last)
    count = max(0, min(count, len(layers)))
    return [layers[(2 * j + 1) * len(layers) // (2 * count)] for j in range(count)]


def _eligible_layers(space: SearchSpace, num_layers: int) -> range:
    layers = range(space.skip.protect_first, num_layers - space.skip.protect_last)
    if not layers:
        raise UserError(
            f"search space {space.source}: $.skip: protect_first {space.skip.protect_first} + protect_last "
            f"{space.skip.protect_last} leave no skippable layer in this {num_layers}-layer model; lower them"
        )
    return layers


def _available(space: SearchSpace, drafters: list[str]) -> list[str]:
    choices = [d for d in space.drafter if d in drafters]
    if not choices:
        raise UserError(
            f"search space {space.source}: $.drafter: none of {list(space.drafter)} is available in this run "
            f"(available: {list(drafters)}); add one of those to drafter or provide what the others need"
        )
    return choices


def _slots(space: SearchSpace, layers: range) -> list[tuple[int, str]]:
    return [(layer, kind) for layer in layers for kind in space.skip.sublayers]


def _suggest_skip(trial: optuna.trial.BaseTrial, space: SearchSpace, layers: range) -> list[tuple[int, str]]:
    """The (layer, kind) sub-layers the slim verifier skips."""
    slots = _slots(space, layers)
    if space.skip.encoding == "per_sublayer":
        return [(i, k) for i, k in slots if trial.suggest_categorical(f"skip_{k}_{i}", [False, True])]
    assert space.skip.budget is not None  # the schema requires it for this encoding
    frac = space.skip.budget.suggest(trial, "skip_frac")
    # Scores are suggested even when nothing is skipped, so every trial has the same params (samplers that
    # model the joint space only use params all trials share).
    scores = {(i, k): trial.suggest_float(f"score_{k}_{i}", 0.0, 1.0) for i, k in slots}
    ranked = sorted(slots, key=lambda s: (-scores[s], s[0], SUBLAYERS.index(s[1])))
    return ranked[: round(frac * len(slots))]


def _draft_model_skip(space: SearchSpace, frac: float, draft_layers: int) -> SkipSet:
    """Whole layers of the separate draft model, evenly spaced, with the slim skip set's protected ends."""
    first, last = space.skip.protect_first, space.skip.protect_last
    eligible = max(0, draft_layers - first - last)
    skipped = evenly_spaced_skip(draft_layers, round(frac * eligible), first, last)
    return SkipSet.of(skipped, skipped)


def _suggest_confidence(trial: optuna.trial.BaseTrial, space: SearchSpace) -> float:
    choices = space.draft_confidence
    if isinstance(choices, FloatRange):
        return choices.suggest(trial, "draft_confidence")
    return choices[0] if len(choices) == 1 else trial.suggest_categorical("draft_confidence", list(choices))


def suggest(
    trial: optuna.trial.BaseTrial,
    space: SearchSpace,
    num_layers: int,
    drafters: list[str],
    draft_layers: int | None = None,
) -> DecodeConfig:
    """Sample one VIA-SD configuration; also stored as user attr "config" (:meth:`DecodeConfig.to_dict`) so
    dashboards and exports need not re-decode. ``tau_escalate == 0`` is plain SD. ``draft_layers``: the separate
    draft model's layer count, for the space's ``draft_model`` skip set (``None``: no draft model, none applied).

    A param is only suggested where it has an effect: ``draft_confidence`` for model drafters (prompt lookup has
    no confidence), ``recheck`` for VIA-SD with a slim tier (plain SD is lossless already)."""
    choices = _available(space, drafters)
    layers = _eligible_layers(space, num_layers)
    drafter = trial.suggest_categorical("drafter", choices)
    gamma = trial.suggest_categorical("gamma", list(space.gamma))
    draft_skip = SkipSet()
    lookup_min = 1
    if drafter in HYBRIDS and space.lookup_min is not None:
        lookup_min = trial.suggest_int("lookup_min", *space.lookup_min)
    if model_drafter(drafter) == "self":
        assert space.self_draft_skip_fraction is not None  # the schema requires it when drafter lists self
        frac = space.self_draft_skip_fraction.suggest(trial, "self_skip_frac")
        skipped_layers = evenly_spaced_skip(
            num_layers, round(frac * len(layers)), space.skip.protect_first, space.skip.protect_last
        )
        draft_skip = SkipSet.of(skipped_layers, skipped_layers)
    if (
        model_drafter(drafter) == "model"
        and space.draft_model_skip_fraction is not None
        and draft_layers is not None
    ):
        frac = space.draft_model_skip_fraction.suggest(trial, "draft_model_skip_frac")
        draft_skip = _draft_model_skip(space, frac, draft_layers)
    confidence = 0.0 if drafter == "lookup" else _suggest_confidence(trial, space)
    if _enqueued_escalate_all(trial) or not space.slim_tier:
        # Plain SD (what VIA-SD with tau_escalate 0 is, token for token), run and exported as mode sd: the
        # engine's SD round, and a profile that says what it is (no kl, thresholds or skip set: SD has none).
        cfg = DecodeConfig(
            mode="sd",
            gamma=gamma,
            drafter=drafter,
            draft_skip=draft_skip,
            draft_confidence=confidence,
            lookup_min=lookup_min,
        )
    else:
        kl = trial.suggest_categorical("kl", list(space.kl))
        tau_escalate = space.tau_escalate.suggest(trial, "tau_escalate")
        ratio = space.tau_accept_ratio.suggest(trial, "tau_accept_ratio")
        skipped = _suggest_skip(trial, space, layers)
        recheck = (
            space.recheck[0]
            if len(space.recheck) == 1
            else trial.suggest_categorical("recheck", list(space.recheck))
        )
        cfg = DecodeConfig(
            mode="viasd",
            gamma=gamma,
            drafter=drafter,
            skip=SkipSet.of((i for i, k in skipped if k == "attn"), (i for i, k in skipped if k == "mlp")),
            draft_skip=draft_skip,
            tau_accept=ratio * tau_escalate,
            tau_escalate=tau_escalate,
            kl=kl,
            recheck=recheck,
            draft_confidence=confidence,
            lookup_min=lookup_min,
        )
    trial.set_user_attr("config", cfg.to_dict())
    return cfg


def _enqueued_escalate_all(trial: optuna.trial.BaseTrial) -> bool:
    """Plain SD (τ_escalate = 0) is a reference point we enqueue, not a region to sample: a free boolean would
    spend about half of every random/TPE warm-up on it. So the parameter exists only in enqueued trials."""
    fixed: dict[str, Any] = {}
    if isinstance(trial, optuna.trial.FixedTrial):
        fixed = trial.params
    elif isinstance(trial, optuna.trial.Trial):
        fixed = trial.storage.get_trial_system_attrs(trial._trial_id).get("fixed_params", {})
    return "escalate_all" in fixed and trial.suggest_categorical("escalate_all", [False, True])


def known_points(space: SearchSpace, num_layers: int, drafters: list[str]) -> list[dict[str, Any]]:
    """Params of the reference trials: VIA-SD with the least skipping the space allows (0 in the shipped
    spaces) and mid thresholds, then plain SD once per available drafter, and the draft model as HF assisted
    generation runs it (where the space allows other than the plain-SD point). Runs the baselines early so every
    study can be compared, and so a cheap drafter's plain SD (prompt lookup costs no forward) is always measured
    even when the space lists a slower drafter first."""
    layers = _eligible_layers(space, num_layers)
    available = _available(space, drafters)
    gamma = min((g for g in space.gamma if g >= 4), default=max(space.gamma))

    def draft(drafter: str) -> dict[str, Any]:
        params: dict[str, Any] = {"drafter": drafter, "gamma": gamma}
        if drafter in HYBRIDS and space.lookup_min is not None:
            params["lookup_min"] = space.lookup_min[0]
        if model_drafter(drafter) == "self":
            assert space.self_draft_skip_fraction is not None
            params["self_skip_frac"] = space.self_draft_skip_fraction.mid()
        if model_drafter(drafter) == "model" and space.draft_model_skip_fraction is not None:
            params["draft_model_skip_frac"] = space.draft_model_skip_fraction.low  # the draft model as it is
        if drafter != "lookup":
            if isinstance(space.draft_confidence, FloatRange):
                params["draft_confidence"] = space.draft_confidence.mid()
            elif len(space.draft_confidence) > 1:
                params["draft_confidence"] = space.draft_confidence[0]
        return params

    if space.skip.encoding == "per_sublayer":
        skip: dict[str, Any] = {f"skip_{k}_{i}": False for i, k in _slots(space, layers)}
    else:
        assert space.skip.budget is not None
        skip = {"skip_frac": space.skip.budget.low}
    no_skip = {
        **draft(available[0]),
        "escalate_all": False,
        "kl": space.kl[0],
        "tau_escalate": space.tau_escalate.mid(),
        "tau_accept_ratio": space.tau_accept_ratio.mid(),
        **skip,
        **({"recheck": space.recheck[0]} if len(space.recheck) > 1 else {}),
    }
    plains = [{**draft(d), "escalate_all": True} for d in available]
    assisted = _assisted_like(space, available, draft)
    return ([no_skip] if space.slim_tier else []) + plains + ([assisted] if assisted and assisted not in plains else [])


HF_CONFIDENCE = 0.4  # transformers' default assistant_confidence_threshold


def _assisted_like(space: SearchSpace, available: list[str], draft) -> dict[str, Any] | None:
    """Plain SD with the draft model as HF assisted generation drafts by default: long drafts (the space's
    largest γ) cut where the draft's confidence falls below 0.4. That is the bar a profile must beat, and the
    mid-γ reference misses it where the draft is reliably right (on math, HF's default ran 1.5x AR on the Qwen
    pair where γ 4 ran 1.2x)."""
    if "model" not in available:
        return None
    params = {**draft("model"), "gamma": max(space.gamma), "escalate_all": True}
    choices = space.draft_confidence
    if isinstance(choices, FloatRange):
        params["draft_confidence"] = min(max(HF_CONFIDENCE, choices.low), choices.high)
    elif len(choices) > 1:
        params["draft_confidence"] = min(choices, key=lambda c: abs(c - HF_CONFIDENCE))
    return params


def enqueue_known_points(
    study: optuna.Study, space: SearchSpace, num_layers: int, drafters: list[str]
) -> None:
    """Enqueue the no-skip and plain-SD reference trials; a resumed study does not get them twice.

    Only a reference trial that is waiting, running or finished counts as already there: one that failed
    (Ctrl-C, a crash) is enqueued again, so the baselines are always measured. (Optuna's ``skip_if_exists``
    counts failed trials too.)"""
    TS = optuna.trial.TrialState
    live = study.get_trials(deepcopy=False, states=(TS.WAITING, TS.RUNNING, TS.COMPLETE, TS.PRUNED))
    have = [t.system_attrs.get("fixed_params") for t in live] + [t.params for t in live]
    for params in known_points(space, num_layers, drafters):
        if params not in have:
            study.enqueue_trial(params)


def space_signature(space: SearchSpace, num_layers: int) -> str:
    """Stable sha256 of the space content, the layer count and the decoding version (not the file name),
    so a study can refuse to continue under a different space."""
    content = asdict(space)
    del content["source"]
    # An optional key left at its default is left out, so a study made before the key existed still resumes.
    for f in fields(SearchSpace):
        if f.default is not MISSING and content[f.name] == f.default:
            del content[f.name]
    payload = {"space": content, "num_layers": num_layers, "decoding_version": DECODING_VERSION}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()
