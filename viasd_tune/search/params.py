"""An Optuna trial's params ↔ a :class:`~viasd_tune.config.DecodeConfig`, over a search space (``space.py``).

One walk, :func:`_decode`, names every param once, says when it applies and what a reference point sets it to,
and builds the configuration from the values it gets. :func:`suggest` runs it on a trial (the sampler picks);
:func:`known_points` runs it with fixed values and collects the params that the reference trials are enqueued
with. A new param is one more line in the walk. The names are stable: studies store them, so they can be
resumed, compared and plotted.

τ_escalate = 0 (plain speculative decoding: every token goes to the full target) is outside the log range of
``tau_escalate`` and Optuna 5 refuses 0 for a log distribution even as an enqueued value. So it is an explicit
boolean param, ``escalate_all``, and only reference points have it (a free boolean would spend about half of
every random/TPE warm-up on it): when True the trial is plain SD and the params that only matter for VIA-SD
(``kl``, thresholds, skip set) are not suggested, so samplers never see values that had no effect.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import optuna

from ..config import HYBRIDS, RECYCLE_DRAFTERS, TREE_SOURCES, DecodeConfig, model_drafter
from ..errors import UserError
from ..routing import SkipSet
from .records import TrialRecord
from .space import SUBLAYERS, FloatRange, SearchSpace

# The params' names (a study stores them; renaming one orphans the params of every study made before).
DRAFTER = "drafter"
GAMMA = "gamma"
LOOKUP_MIN = "lookup_min"
SELF_SKIP_FRAC = "self_skip_frac"
DRAFT_MODEL_SKIP_FRAC = "draft_model_skip_frac"
DRAFT_CONFIDENCE = "draft_confidence"
ESCALATE_ALL = "escalate_all"
KL = "kl"
TAU_ESCALATE = "tau_escalate"
TAU_ACCEPT_RATIO = "tau_accept_ratio"
SKIP_FRAC = "skip_frac"  # budget encoding: the share of eligible sub-layers skipped ...
RECHECK = "recheck"
TREE_NODES = "tree_nodes"  # token trees (issue 33): the node budget, how each round sizes it, and per source ...
TREE_SIZING = "tree_sizing"


def tree_shape(source: str, what: str) -> str:
    """... its depth or width (the DecodeConfig field's name: ``tree_lookup_depth`` …)."""
    return f"tree_{source}_{what}"


def skip_score(layer: int, kind: str) -> str:
    """Budget encoding: ... the highest-scored ones."""
    return f"score_{kind}_{layer}"


def skip_switch(layer: int, kind: str) -> str:
    """Per-sublayer encoding: one switch per eligible sub-layer."""
    return f"skip_{kind}_{layer}"


HF_CONFIDENCE = 0.4  # transformers' default assistant_confidence_threshold
_SCORES = FloatRange(0.0, 1.0)


class _Ask(Protocol):
    """Where the walk gets param values from. ``reference`` is the value a reference point takes (``None``:
    left to the sampler even there)."""

    reference_point: bool  # an enqueued reference point: it may hold escalate_all

    def choice(self, name: str, choices: Sequence[Any], reference: Any) -> Any: ...
    def number(self, name: str, bounds: FloatRange, reference: float | None) -> float: ...
    def whole(self, name: str, low: int, high: int, reference: int) -> int: ...


class _FromTrial:
    """The trial's sampler (or its enqueued values) picks."""

    def __init__(self, trial: optuna.trial.BaseTrial) -> None:
        self.trial = trial
        self.reference_point = TrialRecord.read(trial).reference

    def choice(self, name: str, choices: Sequence[Any], reference: Any) -> Any:
        return self.trial.suggest_categorical(name, list(choices))

    def number(self, name: str, bounds: FloatRange, reference: float | None) -> float:
        return self.trial.suggest_float(name, bounds.low, bounds.high, log=bounds.log)

    def whole(self, name: str, low: int, high: int, reference: int) -> int:
        return self.trial.suggest_int(name, low, high)


class _Reference:
    """A reference point: each param at its reference value unless ``fixed`` names it; ``params`` collects
    what is to be enqueued (a param left to the sampler takes a stand-in here and is not collected)."""

    reference_point = True

    def __init__(self, fixed: dict[str, Any]) -> None:
        self.fixed, self.params = fixed, {}

    def _take(self, name: str, reference: Any, stand_in: Any) -> Any:
        value = self.fixed.get(name, reference)
        if value is None:
            return stand_in
        self.params[name] = value
        return value

    def choice(self, name: str, choices: Sequence[Any], reference: Any) -> Any:
        return self._take(name, reference, choices[0])

    def number(self, name: str, bounds: FloatRange, reference: float | None) -> float:
        return self._take(name, reference, bounds.mid())

    def whole(self, name: str, low: int, high: int, reference: int) -> int:
        return self._take(name, reference, low)


# ---------------------------------------------------------------- the walk


def _decode(
    ask: _Ask, space: SearchSpace, num_layers: int, drafters: list[str], draft_layers: int | None
) -> DecodeConfig:
    """Every param in one place, in the order a trial suggests them: each is asked only where it has an
    effect (``draft_confidence`` for model drafters, prompt lookup has no confidence; ``recheck`` for VIA-SD
    with a slim tier, plain SD is lossless already)."""
    choices = _available(space, drafters)
    layers = _eligible_layers(space, num_layers)
    drafter = ask.choice(DRAFTER, choices, reference=choices[0])
    mid_gamma = min((g for g in space.gamma if g >= 4), default=max(space.gamma))
    gamma = ask.choice(GAMMA, space.gamma, reference=mid_gamma)
    lookup_min = 1
    if drafter in HYBRIDS and space.lookup_min is not None:
        lookup_min = ask.whole(LOOKUP_MIN, *space.lookup_min, reference=space.lookup_min[0])
    draft_skip = SkipSet()
    if model_drafter(drafter) == "self":
        fraction = space.self_draft_skip_fraction
        assert fraction is not None  # the schema requires it when drafter lists self
        frac = ask.number(SELF_SKIP_FRAC, fraction, reference=fraction.mid())
        count = round(frac * len(layers))
        skipped = evenly_spaced_skip(num_layers, count, space.skip.protect_first, space.skip.protect_last)
        draft_skip = SkipSet.of(skipped, skipped)
    fraction = space.draft_model_skip_fraction
    if model_drafter(drafter) == "model" and fraction is not None and draft_layers is not None:
        frac = ask.number(DRAFT_MODEL_SKIP_FRAC, fraction, reference=fraction.low)  # the draft model as it is
        draft_skip = _draft_model_skip(space, frac, draft_layers)
    confidence = 0.0 if model_drafter(drafter) is None else _confidence(ask, space)  # lookup, recycling: none
    tree = _tree(ask, space, drafter)
    is_tree = tree.get(TREE_NODES, 1) > 1 or drafter in RECYCLE_DRAFTERS  # VIA-SD verifies chains only
    plain = is_tree or (ask.reference_point and ask.choice(ESCALATE_ALL, (False, True), reference=True))
    if plain or not space.slim_tier:
        # Plain SD (what VIA-SD with tau_escalate 0 is, token for token), run and exported as mode sd: the
        # engine's SD round, and a profile that says what it is (no kl, thresholds or skip set: SD has none).
        return DecodeConfig(
            mode="sd",
            gamma=gamma,
            drafter=drafter,
            draft_skip=draft_skip,
            draft_confidence=confidence,
            lookup_min=lookup_min,
            **tree,
        )
    kl = ask.choice(KL, space.kl, reference=space.kl[0])
    tau_escalate = ask.number(TAU_ESCALATE, space.tau_escalate, reference=space.tau_escalate.mid())
    ratio = ask.number(TAU_ACCEPT_RATIO, space.tau_accept_ratio, reference=space.tau_accept_ratio.mid())
    skipped = _skip(ask, space, layers)
    recheck = (
        space.recheck[0] if len(space.recheck) == 1 else ask.choice(RECHECK, space.recheck, space.recheck[0])
    )
    return DecodeConfig(
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


def _tree(ask: _Ask, space: SearchSpace, drafter: str) -> dict[str, int | str]:
    """The token tree's DecodeConfig fields (none for a space without ``tree`` or for the self-draft, whose
    rounds are chains): the node budget, its sizing (budgets above 1), then each source's depth and width. A chain
    (budget 1) of a recycling drafter still takes each source's depth; widths only matter to a tree."""
    spec = space.tree
    if spec is None or model_drafter(drafter) == "self":
        return {}
    # Reference points: a chain drafter's stays today's chain; a recycling drafter's is the first tree listed.
    tree = next((n for n in spec.nodes if n > 1), spec.nodes[0])
    reference = 1 if 1 in spec.nodes and drafter not in RECYCLE_DRAFTERS else tree
    nodes = spec.nodes[0] if len(spec.nodes) == 1 else ask.choice(TREE_NODES, spec.nodes, reference=reference)
    out = {TREE_NODES: nodes}
    if nodes <= 1 and drafter not in RECYCLE_DRAFTERS:
        return out  # a plain chain: the sources' shapes have no effect
    if nodes > 1:
        sizing = spec.sizing
        out[TREE_SIZING] = (
            sizing[0] if len(sizing) == 1 else ask.choice(TREE_SIZING, sizing, reference=sizing[0])
        )
    for source in (s for s in TREE_SOURCES if s in drafter.split("+")):
        for what in ("depth", "width") if nodes > 1 else ("depth",):
            bounds = getattr(spec, f"{source}_{what}")
            if bounds is not None:
                name = tree_shape(source, what)
                default = min(max(getattr(DecodeConfig, name), bounds[0]), bounds[1])
                out[name] = (
                    bounds[0] if bounds[0] == bounds[1] else ask.whole(name, *bounds, reference=default)
                )
    return out


def _confidence(ask: _Ask, space: SearchSpace) -> float:
    choices = space.draft_confidence
    if isinstance(choices, FloatRange):
        return ask.number(DRAFT_CONFIDENCE, choices, reference=choices.mid())
    return choices[0] if len(choices) == 1 else ask.choice(DRAFT_CONFIDENCE, choices, reference=choices[0])


def _skip(ask: _Ask, space: SearchSpace, layers: range) -> list[tuple[int, str]]:
    """The (layer, kind) sub-layers the slim verifier skips; a reference point skips the fewest it may."""
    slots = _slots(space, layers)
    if space.skip.encoding == "per_sublayer":
        return [(i, k) for i, k in slots if ask.choice(skip_switch(i, k), (False, True), reference=False)]
    budget = space.skip.budget
    assert budget is not None  # the schema requires it for this encoding
    frac = ask.number(SKIP_FRAC, budget, reference=budget.low)
    # Scores are suggested even when nothing is skipped, so every trial has the same params (samplers that
    # model the joint space only use params all trials share); a reference point leaves them to the sampler.
    scores = {(i, k): ask.number(skip_score(i, k), _SCORES, reference=None) for i, k in slots}
    ranked = sorted(slots, key=lambda s: (-scores[s], s[0], SUBLAYERS.index(s[1])))
    return ranked[: round(frac * len(slots))]


# ---------------------------------------------------------------- trials and reference points


def suggest(
    trial: optuna.trial.BaseTrial,
    space: SearchSpace,
    num_layers: int,
    drafters: list[str],
    draft_layers: int | None = None,
) -> DecodeConfig:
    """Sample one configuration, also recorded as the trial's ``config`` (:class:`TrialRecord`) so dashboards
    and exports need not re-decode. ``draft_layers``: the separate draft model's layer count, for the space's
    ``draft_model`` skip set (``None``: no draft model, none applied)."""
    cfg = _decode(_FromTrial(trial), space, num_layers, drafters, draft_layers)
    TrialRecord(config=cfg.to_dict()).write(trial)
    return cfg


def known_points(space: SearchSpace, num_layers: int, drafters: list[str]) -> list[dict[str, Any]]:
    """Params of the reference trials: VIA-SD with the least skipping the space allows (0 in the shipped
    spaces) and mid thresholds, then plain SD once per available drafter, and the draft model as HF assisted
    generation runs it (where the space allows other than the plain-SD point). Runs the baselines early so every
    study can be compared, and so a cheap drafter's plain SD (prompt lookup costs no forward) is always measured
    even when the space lists a slower drafter first."""
    available = _available(space, drafters)

    def point(fixed: dict[str, Any]) -> dict[str, Any]:
        ask = _Reference(fixed)
        # A reference point records the draft model's skip fraction, not the skip set it makes of the draft
        # model's layers, so any depth stands in for the draft model's.
        _decode(ask, space, num_layers, drafters, draft_layers=0)
        return ask.params

    # VIA-SD verifies chains: its reference takes the first chain drafter, as a chain.
    chains = [d for d in available if d not in RECYCLE_DRAFTERS]
    tree = space.tree
    via = space.slim_tier and bool(chains) and (tree is None or 1 in tree.nodes)
    no_skip = point({ESCALATE_ALL: False, DRAFTER: chains[0], TREE_NODES: 1}) if via else None
    plains = [point({DRAFTER: d}) for d in available]
    assisted = point(_assisted_like(space)) if "model" in available else None
    return (
        ([no_skip] if no_skip else []) + plains + ([assisted] if assisted and assisted not in plains else [])
    )


def _assisted_like(space: SearchSpace) -> dict[str, Any]:
    """Plain SD with the draft model as HF assisted generation drafts by default: long drafts (the space's
    largest γ) cut where the draft's confidence falls below 0.4. That is the bar a profile must beat, and the
    mid-γ reference misses it where the draft is reliably right (on math, HF's default ran 1.5x AR on the Qwen
    pair where γ 4 ran 1.2x)."""
    choices = space.draft_confidence
    if isinstance(choices, FloatRange):
        confidence = min(max(HF_CONFIDENCE, choices.low), choices.high)
    else:
        confidence = min(choices, key=lambda c: abs(c - HF_CONFIDENCE))
    chain = {TREE_NODES: 1} if space.tree is not None and 1 in space.tree.nodes else {}  # HF drafts chains
    return {DRAFTER: "model", GAMMA: max(space.gamma), DRAFT_CONFIDENCE: confidence, **chain}


def enqueue_known_points(
    study: optuna.Study, space: SearchSpace, num_layers: int, drafters: list[str]
) -> None:
    """Enqueue the no-skip and plain-SD reference trials; a resumed study does not get them twice.

    Only a reference trial that is waiting, running or finished counts as already there: one that failed
    (Ctrl-C, a crash) is enqueued again, so the baselines are always measured. (Optuna's ``skip_if_exists``
    counts failed trials too.)"""
    TS = optuna.trial.TrialState
    live = study.get_trials(deepcopy=False, states=(TS.WAITING, TS.RUNNING, TS.COMPLETE, TS.PRUNED))
    have = [TrialRecord.read(t).enqueued for t in live] + [t.params for t in live]
    for params in known_points(space, num_layers, drafters):
        if params not in have:
            enqueue(study, params)


def enqueue(study: optuna.Study, params: dict[str, Any]) -> None:
    """Enqueue a trial with these params, recorded as its ``enqueued`` (so it is known as a reference point)."""
    study.enqueue_trial(params, user_attrs=TrialRecord(enqueued=params).attrs())


def skip_params(space: SearchSpace, num_layers: int, skip: SkipSet) -> dict[str, Any]:
    """The params :func:`suggest` decodes into exactly ``skip`` (an eligible set the space's budget allows),
    the other params left to the sampler; budget encoding: the matching fraction, and scores that rank the
    chosen sub-layers first. A chain where the space has trees: VIA-SD verifies chains, so a tree would leave the
    skip set unused."""
    tree = space.tree
    chain = {TREE_NODES: 1} if tree is not None and len(tree.nodes) > 1 and 1 in tree.nodes else {}
    slots = _slots(space, _eligible_layers(space, num_layers))
    chosen = [(i, k) for i, k in slots if i in getattr(skip, k)]
    if len(chosen) != len(skip.attn) + len(skip.mlp):
        raise ValueError(f"skip set {skip.to_dict()} names sub-layers the space {space.source} may not skip")
    if space.skip.encoding == "per_sublayer":
        return {**chain, **{skip_switch(i, k): (i, k) in chosen for i, k in slots}}
    assert space.skip.budget is not None
    frac = min(max(len(chosen) / len(slots), space.skip.budget.low), space.skip.budget.high)
    if round(frac * len(slots)) != len(chosen):
        raise ValueError(f"{len(chosen)} of {len(slots)} sub-layers is outside the space's skip budget")
    on = set(chosen)
    # The chosen sub-layers outscore the rest, so they are the round(frac * slots) ranked first.
    scores = {skip_score(i, k): 0.75 if (i, k) in on else 0.25 for i, k in slots}
    return {**chain, SKIP_FRAC: frac, **scores}


# ---------------------------------------------------------------- helpers


def evenly_spaced_skip(num_layers: int, count: int, protect_first: int, protect_last: int) -> list[int]:
    """``count`` layers spread evenly over the unprotected ones: a self-draft that keeps every depth region
    partly intact drafts better than one that drops a contiguous block. ``count`` is clamped to what
    exists."""
    layers = range(protect_first, num_layers - protect_last)
    count = max(0, min(count, len(layers)))
    return [layers[(2 * j + 1) * len(layers) // (2 * count)] for j in range(count)]


def eligible_slots(space: SearchSpace, num_layers: int) -> list[tuple[int, str]]:
    """The (layer, kind) sub-layers the space may skip in a ``num_layers``-layer model."""
    return _slots(space, _eligible_layers(space, num_layers))


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


def _draft_model_skip(space: SearchSpace, frac: float, draft_layers: int) -> SkipSet:
    """Whole layers of the separate draft model, evenly spaced, with the slim skip set's protected ends."""
    first, last = space.skip.protect_first, space.skip.protect_last
    eligible = max(0, draft_layers - first - last)
    skipped = evenly_spaced_skip(draft_layers, round(frac * eligible), first, last)
    return SkipSet.of(skipped, skipped)
