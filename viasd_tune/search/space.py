"""Search spaces, the file format: what the tuner may vary, as a YAML file validated against :data:`SCHEMA`
and loaded into a :class:`SearchSpace`. How a trial's params map onto a decoding configuration over a space is
``params.py``.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path
from typing import Any

import jsonschema
import yaml

from ..config import (
    DRAFTERS,
    GAMMA_MAX,
    KL_KINDS,
    TREE_NODES_MAX,
    TREE_SIZINGS,
    TREE_SOURCES,
    applies,
    model_drafter,
    where_applies,
)
from ..errors import UserError
from ..profile import schema_problem

SUBLAYERS = ("attn", "mlp")
ENCODINGS = ("budget", "per_sublayer")
SHIPPED = ("default", "smoke", "model-draft", "lookup")


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

_WHOLE_RANGE = {  # a tree source's depth or width: whole numbers from low to high
    "type": "object",
    "required": ["low", "high"],
    "additionalProperties": False,
    "properties": {
        "low": {"type": "integer", "minimum": 1, "maximum": GAMMA_MAX},
        "high": {"type": "integer", "minimum": 1, "maximum": GAMMA_MAX},
    },
}

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
        "tree": {
            "type": "object",
            "additionalProperties": False,
            "required": ["nodes"],
            "properties": {
                "nodes": {
                    "type": "array",
                    "minItems": 1,
                    "uniqueItems": True,
                    "items": {"type": "integer", "minimum": 1, "maximum": TREE_NODES_MAX},
                },
                "sizing": {
                    "type": "array",
                    "minItems": 1,
                    "uniqueItems": True,
                    "items": {"enum": list(TREE_SIZINGS)},
                },
                **{
                    source: {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {"depth": _WHOLE_RANGE, "width": _WHOLE_RANGE},
                    }
                    for source in TREE_SOURCES
                },
            },
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
class TreeSpec:
    """Token trees to try (mode sd): node budgets (1: a chain), how a tree is sized each round (``tree_sizing``),
    and each source's depth and width as whole ranges ``(low, high)`` (None: the configuration's default, not
    searched)."""

    nodes: tuple[int, ...]
    sizing: tuple[str, ...] = ("fixed",)  # tree_sizing's choices for budgets above 1
    lookup_depth: tuple[int, int] | None = None
    lookup_width: tuple[int, int] | None = None
    recycle_depth: tuple[int, int] | None = None
    recycle_width: tuple[int, int] | None = None
    model_depth: tuple[int, int] | None = None
    model_width: tuple[int, int] | None = None


@dataclass(frozen=True)
class FloatRange:
    """A float interval to search; ``log`` samples it on a log scale (needs ``low > 0``)."""

    low: float
    high: float
    log: bool = False

    def mid(self) -> float:
        """The centre a sampler sees: geometric on a log scale, arithmetic otherwise."""
        return math.sqrt(self.low * self.high) if self.log else (self.low + self.high) / 2


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
    tree: TreeSpec | None = None  # token trees for the tree drafters; None: chains only

    @property
    def max_block(self) -> int:
        """The largest verify block a trial's round makes: γ drafts, or a token tree's nodes, and the pending token
        (the cost model measures the target's block-cost curve up to it)."""
        return max(max(self.gamma), max(self.tree.nodes) if self.tree else 0) + 1

    @property
    def slim_tier(self) -> bool:
        """False when the space skips nothing (``skip.budget.max: 0``): a slim verifier without skipping is the
        full target run twice, so such a space searches plain SD only (drafters, γ, confidence), e.g. for a
        routed profile on a target too small to skip layers."""
        return not (
            self.skip.encoding == "budget" and self.skip.budget is not None and self.skip.budget.high == 0
        )


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
    tree = _tree(data["tree"], source) if "tree" in data else None
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
        tree=tree,
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


def _tree(data: dict[str, Any], source: str) -> TreeSpec:
    """The ``tree`` key (schema-valid) as a :class:`TreeSpec`."""
    ranges: dict[str, tuple[int, int]] = {}
    for name in TREE_SOURCES:
        for what, r in data.get(name, {}).items():
            if r["low"] > r["high"]:
                raise UserError(
                    f"search space {source}: $.tree.{name}.{what}: low {r['low']} > high {r['high']}; swap or fix them"
                )
            ranges[f"{name}_{what}"] = (int(r["low"]), int(r["high"]))
    return TreeSpec(
        nodes=tuple(int(n) for n in data["nodes"]), sizing=tuple(data.get("sizing", ("fixed",))), **ranges
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


def space_signature(space: SearchSpace, num_layers: int) -> str:
    """Stable sha256 of the space content and the layer count (not the file name), so a study can refuse to
    continue under a different space (the engine that scores trials is pinned beside it: ``engine_fingerprint``)."""
    content = asdict(space)
    del content["source"]
    # An optional key left at its default is left out, so a study made before the key existed still resumes.
    for f in fields(SearchSpace):
        if f.default is not MISSING and content[f.name] == f.default:
            del content[f.name]
    payload = {"space": content, "num_layers": num_layers}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()
