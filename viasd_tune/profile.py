"""Routing profiles: the versioned JSON a tuning run exports and a serving run loads.

A profile is plain data checked against a JSON Schema shipped in the package, plus the few cross-field rules a
schema cannot express. Loading never executes anything (no pickle, no eval), so a profile from elsewhere is safe
to open; every problem surfaces as a one-line :class:`UserError` naming the JSON path to fix.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import math
import os
from importlib import resources
from pathlib import Path
from typing import Any

import jsonschema
from jsonschema.exceptions import best_match

from viasd_tune.config import DecodeConfig, model_drafter
from viasd_tune.credentials import redact
from viasd_tune.errors import UserError
from viasd_tune.fsutil import atomic_write_text, check_output_file
from viasd_tune.rule import validate_rule

SCHEMA_VERSION = 1
_SCHEMA_FILE = "profile.schema.json"


@functools.lru_cache(maxsize=1)
def load_schema() -> dict[str, Any]:
    """The profile JSON Schema, read from package data so it works from a wheel or a zip."""
    text = resources.files("viasd_tune").joinpath("schemas", _SCHEMA_FILE).read_text(encoding="utf-8")
    return json.loads(text)


@functools.lru_cache(maxsize=1)
def _validator() -> jsonschema.Draft202012Validator:
    return jsonschema.Draft202012Validator(load_schema())


def _short(text: str, limit: int = 200) -> str:
    """One line, bounded length: schema messages can embed a whole sub-object's repr."""
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _brief(value: Any) -> str:
    """A value as a message names it: short values as they are, long ones by their kind and size."""
    text = repr(value)
    if len(text) <= 60:
        return text
    if isinstance(value, list):
        return f"a list of {len(value)} items"
    if isinstance(value, dict):
        return f"an object with {len(value)} keys"
    return text[:57] + "..."


_BOUNDS = ("maxItems", "minItems", "maxLength", "minLength", "maximum", "minimum", "exclusiveMaximum",
           "exclusiveMinimum", "maxProperties", "minProperties")  # fmt: skip


def schema_problem(error: jsonschema.ValidationError) -> str:
    """A JSON Schema error as one short line that keeps its reason: jsonschema starts its messages with the
    value's repr (``[...200 nodes...] is too long``), so cutting the message short cut the reason off."""
    message = " ".join(error.message.split())
    text = repr(error.instance)
    message = message.replace(text, _brief(error.instance)) if text in message else _short(message)
    if error.validator in _BOUNDS:
        message += f" ({error.validator} {error.validator_value})"
    return message


def _where(origin: str) -> str:
    return f"{origin}: " if origin else ""


def _fail(origin: str, path: str, problem: str) -> UserError:
    return UserError(_short(f"{_where(origin)}invalid profile at {path}: {problem}", 400))


MAX_PROFILE_BYTES = 1 << 20  # an exported profile is a few kB
MAX_PROFILE_DEPTH = 32  # its deepest value is 4 levels down
_TOO_DEEP = (
    f"the profile nests deeper than {MAX_PROFILE_DEPTH} levels; a profile is a flat record, re-export it"
)


def _too_deep(value: Any, limit: int) -> bool:
    """Whether ``value`` nests more than ``limit`` containers deep (iterative: no recursion limit to hit)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            if depth > limit:
                return True
            stack.extend((v, depth + 1) for v in (item.values() if isinstance(item, dict) else item))
    return False


def validate_profile(profile: dict[str, Any], origin: str = "") -> dict[str, Any]:
    """Check ``profile`` against the schema and the cross-field rules; return it unchanged if valid.

    ``origin`` (e.g. the file name) prefixes the message so the user knows which file to edit.
    The version check runs first so a profile from a newer viasd-tune gets "upgrade" advice instead of a
    confusing schema error about fields this version does not know.
    """
    if _too_deep(profile, MAX_PROFILE_DEPTH):
        raise UserError(f"{_where(origin)}{_TOO_DEEP}")
    version = profile.get("schema_version") if isinstance(profile, dict) else None
    if isinstance(version, int) and not isinstance(version, bool) and version > SCHEMA_VERSION:
        raise UserError(
            f"{_where(origin)}profile schema version {version} is newer than this viasd-tune supports "
            f"({SCHEMA_VERSION}); upgrade viasd-tune"
        )
    error = best_match(_validator().iter_errors(profile))
    if error is not None:
        raise _fail(origin, error.json_path, f"{schema_problem(error)}; fix that field (see {_SCHEMA_FILE})")
    _check_semantics(profile, origin)
    return profile


def _check_semantics(profile: dict[str, Any], origin: str) -> None:
    """Rules that span fields or that JSON Schema cannot say (order, finiteness, secrets)."""
    bad = _first_non_finite(profile, "$")
    if bad:
        raise _fail(origin, bad, "NaN/Infinity is not valid JSON; use a finite number")

    th = profile["thresholds"]
    if th["tau_accept"] > th["tau_escalate"]:
        raise _fail(
            origin,
            "$.thresholds",
            f"tau_accept ({th['tau_accept']}) > tau_escalate ({th['tau_escalate']}); "
            "tau_accept must not exceed tau_escalate",
        )

    if profile["drafter"] != profile["draft"]["kind"]:
        raise _fail(
            origin,
            "$.drafter",
            f"'{profile['drafter']}' differs from draft.kind '{profile['draft']['kind']}'",
        )

    draft = profile["draft"]
    for key in ("skip_attn", "skip_mlp"):
        if key in draft and model_drafter(draft["kind"]) is None:
            raise _fail(
                origin,
                f"$.draft.{key}",
                f"drafter '{draft['kind']}' runs no model, so it skips no layers; remove it or set draft.kind to "
                "'self' or 'model'",
            )

    # The self-draft skips the target's layers; a skip set on a separate draft model indexes the draft's.
    draft_model = model_drafter(draft["kind"]) == "model"
    for section in ("routing", "draft"):
        role = "draft" if section == "draft" and draft_model else "target"
        num_layers = profile[role]["fingerprint"]["num_layers"]
        for key in ("skip_attn", "skip_mlp"):
            layers = profile[section].get(key, [])
            path = f"$.{section}.{key}"
            if layers != sorted(layers):
                raise _fail(origin, path, f"{layers} is not sorted; list layer indices in ascending order")
            if layers and layers[-1] >= num_layers:
                raise _fail(
                    origin,
                    path,
                    f"layer {layers[-1]} is out of range; the {role} has {num_layers} layers (0..{num_layers - 1})",
                )

    try:  # the values' own rules and where each applies, as for flags and the Python API
        DecodeConfig.from_profile(profile)
    except UserError as e:
        raise UserError(f"{_where(origin)}invalid profile: {e}") from None

    if "routes" in profile:
        _check_routes(profile, origin)

    storage = profile["provenance"]["storage"]
    if redact_url(storage) != storage:
        raise _fail(origin, "$.provenance.storage", "contains a password; store redact_url(storage) instead")


def decoding_keys() -> frozenset[str]:
    """The profile fields that make up one decoding configuration (what each of a routed profile's
    configurations holds besides its name)."""
    return frozenset(DecodeConfig(mode="ar", drafter="lookup").to_profile())


def configuration_profile(profile: dict[str, Any], k: int) -> dict[str, Any]:
    """Configuration ``k`` of a routed profile as a single-configuration profile: the profile's models, dtype
    and evidence with that configuration's decoding fields (the draft model's name/fingerprint stay the
    profile's). Validation and serving both read a configuration through this, so it is checked exactly as a
    single profile is."""
    conf = profile["routes"]["configurations"][k]
    keys = decoding_keys()
    base = {key: v for key, v in profile.items() if key not in keys and key != "routes"}
    draft = {
        "name": profile["draft"]["name"],
        "fingerprint": profile["draft"]["fingerprint"],
        **conf["draft"],
    }
    return {**base, **{key: v for key, v in conf.items() if key != "name"}, "draft": draft}


def _check_routes(profile: dict[str, Any], origin: str) -> None:
    configurations = profile["routes"]["configurations"]
    allowed = decoding_keys() | {"name"}
    names = [c["name"] for c in configurations]
    for k, conf in enumerate(configurations):
        path = f"$.routes.configurations[{k}]"
        extra = sorted(set(conf) - allowed)
        if extra:
            raise _fail(
                origin,
                path,
                f"unknown field(s) {', '.join(extra)}; a configuration holds {', '.join(sorted(allowed))}",
            )
        if names.count(conf["name"]) > 1:
            raise _fail(
                origin, f"{path}.name", f"{conf['name']!r} names two configurations; give each its own name"
            )
        validate_profile(configuration_profile(profile, k), origin=f"{_where(origin)}{path}".rstrip(": "))
    try:
        validate_rule(profile["routes"]["rule"], len(configurations))
    except UserError as e:
        raise UserError(f"{_where(origin)}{e}") from None


def _first_non_finite(value: Any, path: str) -> str | None:
    """JSON path of the first NaN/Infinity: Python's json accepts them, the schema's ``minimum`` does not catch them."""
    if isinstance(value, float):
        return None if math.isfinite(value) else path
    if isinstance(value, dict):
        items: Any = ((f"{path}.{k}", v) for k, v in value.items())
    elif isinstance(value, list):
        items = ((f"{path}[{i}]", v) for i, v in enumerate(value))
    else:
        return None
    for sub_path, sub in items:
        found = _first_non_finite(sub, sub_path)
        if found:
            return found
    return None


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not valid JSON")


def load_profile(source: str | os.PathLike[str] | dict[str, Any]) -> dict[str, Any]:
    """Load and validate a profile from a path (or validate an already-parsed dict)."""
    if isinstance(source, dict):
        return validate_profile(source)
    path = Path(source)
    try:
        if path.stat().st_size > MAX_PROFILE_BYTES:
            raise UserError(
                f"{path.name} is {path.stat().st_size} bytes; a profile is a few kB (at most "
                f"{MAX_PROFILE_BYTES}): pass the profile.json a search exported"
            )
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UserError(f"profile file {path} does not exist; check the path or export one first") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"cannot read profile {path}: {_short(str(exc))}; pass a UTF-8 JSON file") from None
    try:
        profile = json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as exc:
        raise UserError(
            f"{path.name}: malformed JSON at line {exc.lineno}, column {exc.colno}: {exc.msg}; "
            "fix the file or re-export the profile"
        ) from None
    except ValueError as exc:
        raise UserError(f"{path.name}: {exc}; use finite numbers") from None
    except RecursionError:
        raise UserError(f"{path.name}: {_TOO_DEEP}") from None
    if not isinstance(profile, dict):
        raise UserError(f"{path.name}: a profile must be a JSON object, got {type(profile).__name__}")
    return validate_profile(profile, origin=path.name)


def write_profile(path: str | os.PathLike[str], profile: dict[str, Any]) -> None:
    """Validate, then write atomically so an interrupted export never leaves a half profile behind."""
    check_output_file(path)
    validate_profile(profile, origin=Path(path).name)
    atomic_write_text(path, json.dumps(profile, indent=2, sort_keys=False, allow_nan=False) + "\n")


def redact_url(url: str) -> str:
    """Storage URL with its credentials replaced by ``***``, safe to print or store in a profile (see
    :func:`viasd_tune.credentials.redact`, the one redaction every command uses)."""
    return redact(url)


def package_versions() -> dict[str, str]:
    """Versions recorded in provenance, so a profile says which code produced it."""
    versions = {}
    for key, dist in (
        ("torch", "torch"),
        ("transformers", "transformers"),
        ("optuna", "optuna"),
        ("viasd_tune", "viasd-tune"),
    ):
        try:
            versions[key] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            versions[key] = "unknown"
    if versions["viasd_tune"] == "unknown":  # running from a checkout without `pip install -e .`
        from viasd_tune import __version__

        versions["viasd_tune"] = __version__
    return versions


def calibration_fingerprint(ids_and_texts: list[tuple[str, str]]) -> str:
    """sha256 hex of the calibration prompts (ids and texts, in order).

    JSON-encoding the pairs makes the digest unambiguous (no separator collisions between ids and texts), so two
    profiles with the same fingerprint were tuned on exactly the same prompts.
    """
    payload = json.dumps(
        [[str(i), str(t)] for i, t in ids_and_texts], ensure_ascii=False, separators=(",", ":")
    )
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()
