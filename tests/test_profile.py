"""Profiles: schema + semantic validation, atomic writes, one-line errors, URL redaction."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from viasd_tune import fsutil, profile
from viasd_tune.errors import UserError
from viasd_tune.profile import (
    SCHEMA_VERSION,
    calibration_fingerprint,
    load_profile,
    load_schema,
    package_versions,
    redact_url,
    validate_profile,
    write_profile,
)

HEX = "ab" * 32


def _fingerprint(num_layers: int = 30) -> dict[str, Any]:
    return {
        "architecture": "LlamaForCausalLM",
        "model_type": "llama",
        "num_layers": num_layers,
        "hidden_size": 576,
        "vocab_size": 49152,
        "vocab_sha256": HEX,
        "source": {"kind": "packaged", "sha256": HEX, "path": "/cache/SmolLM2-135M-Instruct.Q4_1.gguf"},
    }


def make_profile() -> dict[str, Any]:
    prompts = [("p1", "def add(a, b):"), ("p2", "Write a haiku.")]
    return {
        "schema_version": SCHEMA_VERSION,
        "target": {"name": "qwen2.5-coder-1.5b", "fingerprint": _fingerprint(28)},
        "draft": {"kind": "model", "name": "qwen2.5-coder-0.5b", "fingerprint": _fingerprint(24)},
        "routing": {"skip_attn": [3, 7, 11], "skip_mlp": [5]},
        "thresholds": {"tau_accept": 0.1, "tau_escalate": 0.6, "kl": "js"},
        "gamma": 4,
        "drafter": "model",
        "dtype": "bfloat16",
        "device": "cpu",
        "metrics": {
            "speedup_measured": 1.42,
            "speedup_modelled": 1.55,
            "speedup_vs_sd": None,
            "acceptance": 0.71,
            "fidelity": 0.98,
            "tier_shares": {"direct": 0.6, "slim": 0.3, "full": 0.1},
            "held_out_prompts": 40,
            "extra_metric_is_allowed": 1,
        },
        "calibration": {
            "source": "builtin:mixed",
            "prompt_ids": [p for p, _ in prompts],
            "fingerprint": calibration_fingerprint(prompts),
        },
        "provenance": {
            "study": "viasd-qwen",
            "trial": 17,
            "storage": "postgresql://tuner:***@db/optuna",
            "versions": package_versions(),
            "created_at": "2025-01-02T03:04:05+00:00",
        },
    }


def assert_one_line(exc: pytest.ExceptionInfo[UserError]) -> str:
    msg = str(exc.value)
    assert msg and "\n" not in msg
    return msg


def test_schema_is_valid_draft_2020_12() -> None:
    jsonschema.Draft202012Validator.check_schema(load_schema())


def test_example_profile_is_valid() -> None:
    p = make_profile()
    assert validate_profile(p) is p


def test_self_drafter_profile_is_valid() -> None:
    p = make_profile()
    p["draft"] = {"kind": "self", "name": None, "fingerprint": None, "skip_attn": [1, 2], "skip_mlp": []}
    p["drafter"] = "self"
    validate_profile(p)


def test_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "profile.json"
    p = make_profile()
    write_profile(path, p)
    text = path.read_text()
    assert text.endswith("}\n")
    assert list(json.loads(text)) == list(p)  # key order preserved (sort_keys=False)
    assert load_profile(path) == p
    assert load_profile(str(path)) == p
    assert load_profile(p) == p
    assert [f.name for f in path.parent.iterdir()] == ["profile.json"]  # no temp files left


def test_failed_write_keeps_old_file_and_leaves_no_temp(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "profile.json"
    write_profile(path, make_profile())
    before = path.read_bytes()

    def boom(*_a: object, **_k: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(fsutil.os, "replace", boom)
    changed = make_profile()
    changed["gamma"] = 9
    with pytest.raises(OSError, match="disk full"):
        write_profile(path, changed)
    assert path.read_bytes() == before
    assert [f.name for f in tmp_path.iterdir()] == ["profile.json"]


def test_failed_serialisation_keeps_old_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "profile.json"
    write_profile(path, make_profile())
    before = path.read_bytes()

    def boom(*_a: object, **_k: object) -> str:
        raise RuntimeError("interrupted")

    monkeypatch.setattr(profile.json, "dumps", boom)
    with pytest.raises(RuntimeError):
        write_profile(path, make_profile())
    assert path.read_bytes() == before


def test_atomic_write_text_creates_parents(tmp_path: Path) -> None:
    target = tmp_path / "a" / "b" / "x.txt"
    fsutil.atomic_write_text(target, "héllo")
    fsutil.atomic_write_bytes(target.with_suffix(".bin"), b"\x00\x01")
    assert target.read_text(encoding="utf-8") == "héllo"
    assert target.with_suffix(".bin").read_bytes() == b"\x00\x01"
    assert sorted(os.listdir(target.parent)) == ["x.bin", "x.txt"]
    assert target.stat().st_mode & 0o777 == 0o666 & ~fsutil._UMASK  # not NamedTemporaryFile's 0600


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("{not json}", "line 1, column 2"),
        ('{\n  "schema_version": 1,\n  "target": {', "line 3"),  # truncated
        ("", "line 1, column 1"),
    ],
)
def test_malformed_json(tmp_path: Path, text: str, needle: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(UserError) as exc:
        load_profile(path)
    msg = assert_one_line(exc)
    assert "bad.json" in msg and needle in msg


def test_truncated_real_profile(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    write_profile(path, make_profile())
    path.write_text(path.read_text()[:300])
    with pytest.raises(UserError) as exc:
        load_profile(path)
    assert "malformed JSON" in assert_one_line(exc)


def test_nan_rejected(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    path.write_text(json.dumps(make_profile()).replace("0.98", "NaN"))
    with pytest.raises(UserError) as exc:
        load_profile(path)
    assert "NaN" in assert_one_line(exc)
    p = make_profile()
    p["metrics"]["fidelity"] = float("inf")
    with pytest.raises(UserError, match=r"\$\.metrics\.fidelity"):
        validate_profile(p)


def test_non_object_json(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    path.write_text("[1, 2]")
    with pytest.raises(UserError) as exc:
        load_profile(path)
    assert "JSON object" in assert_one_line(exc)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(UserError) as exc:
        load_profile(tmp_path / "nope.json")
    assert "does not exist" in assert_one_line(exc)


def test_newer_schema_version() -> None:
    p = make_profile()
    p["schema_version"] = SCHEMA_VERSION + 1
    p["brand_new_field"] = {}  # would also fail the schema; the version message must win
    with pytest.raises(UserError) as exc:
        validate_profile(p)
    assert assert_one_line(exc) == (
        f"profile schema version {SCHEMA_VERSION + 1} is newer than this viasd-tune supports (1); upgrade viasd-tune"
    )


def test_newer_schema_version_from_file(tmp_path: Path) -> None:
    path = tmp_path / "future.json"
    path.write_text(json.dumps({"schema_version": 7}))
    with pytest.raises(UserError, match=r"^future\.json: profile schema version 7 is newer"):
        load_profile(path)


def _set(p: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    for key in parents:
        p = p[key]
    p[leaf] = value


@pytest.mark.parametrize(
    ("field", "value", "path"),
    [
        ("thresholds.tau_accept", 0.9, "$.thresholds"),  # > tau_escalate
        ("thresholds.tau_accept", -0.1, "$.thresholds.tau_accept"),
        ("thresholds.tau_escalate", -1, "$.thresholds.tau_escalate"),
        ("gamma", 0, "$.gamma"),
        ("gamma", 2.5, "$.gamma"),
        ("thresholds.kl", "hellinger", "$.thresholds.kl"),
        ("routing.skip_attn", [3, 28], "$.routing.skip_attn"),  # target has 28 layers
        ("routing.skip_mlp", [5, 2], "$.routing.skip_mlp"),  # unsorted
        ("routing.skip_mlp", [2, 2], "$.routing.skip_mlp"),  # duplicate
        ("routing.skip_mlp", [-1], "$.routing.skip_mlp[0]"),
        ("unknown_key", 1, "$"),
        ("dtype", "float64", "$.dtype"),
        ("drafter", "self", "$.drafter"),  # disagrees with draft.kind
        ("draft.skip_attn", [24], "$.draft.skip_attn"),  # the draft model has 24 layers
        ("draft.name", None, "$.draft.name"),
        ("draft.fingerprint", {"architecture": "x"}, "$.draft.fingerprint"),  # a model drafter needs a name
        ("target.fingerprint.vocab_sha256", "xyz", "$.target.fingerprint.vocab_sha256"),
        ("target.fingerprint.source.kind", "ftp", "$.target.fingerprint.source.kind"),
        ("metrics.acceptance", -0.5, "$.metrics.acceptance"),
        ("provenance.created_at", "yesterday", "$.provenance.created_at"),
        ("provenance.storage", "postgresql://tuner:hunter2@db/optuna", "$.provenance.storage"),
    ],
)
def test_invalid_field(field: str, value: Any, path: str) -> None:
    p = make_profile()
    _set(p, field, value)
    with pytest.raises(UserError) as exc:
        validate_profile(p)
    msg = assert_one_line(exc)
    assert f"invalid profile at {path}:" in msg
    assert "hunter2" not in msg


def test_missing_required_and_file_origin(tmp_path: Path) -> None:
    p = make_profile()
    del p["metrics"]["tier_shares"]
    path = tmp_path / "p.json"
    path.write_text(json.dumps(p))
    with pytest.raises(UserError) as exc:
        load_profile(path)
    msg = assert_one_line(exc)
    assert msg.startswith("p.json: invalid profile at $.metrics:") and "tier_shares" in msg


def test_write_refuses_invalid(tmp_path: Path) -> None:
    p = make_profile()
    p["gamma"] = 0
    with pytest.raises(UserError):
        write_profile(tmp_path / "p.json", p)
    assert not (tmp_path / "p.json").exists()


def test_self_draft_skip_out_of_range() -> None:
    p = make_profile()
    p["draft"] = {"kind": "self", "name": None, "fingerprint": None, "skip_attn": [40]}
    p["drafter"] = "self"
    with pytest.raises(UserError, match=r"\$\.draft\.skip_attn: layer 40 is out of range"):
        validate_profile(p)


def test_input_not_mutated() -> None:
    p = make_profile()
    before = copy.deepcopy(p)
    validate_profile(p)
    assert p == before


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("postgresql://user:secret@host/db", "postgresql://user:***@host/db"),
        (
            "postgresql+psycopg2://user:secret@host:5432/db?sslmode=require",
            "postgresql+psycopg2://user:***@host:5432/db?sslmode=require",
        ),
        ("mysql://u:p@ss@host/db", "mysql://u:***@host/db"),  # unescaped '@' in the password
        ("postgresql://u:pa/ss@host/db", "postgresql://u:***@host/db"),  # unescaped '/' in the password
        ("postgresql://:secret@host/db", "postgresql://:***@host/db"),
        ("postgresql://user:secret@[::1]:5432/db", "postgresql://user:***@[::1]:5432/db"),
        ("postgresql://host/db?user=u&password=secret", "postgresql://host/db?user=u&password=***"),
        ("postgresql://user@host/db", "postgresql://user@host/db"),
        ("postgresql://user:***@host/db", "postgresql://user:***@host/db"),
        ("sqlite:///study.db", "sqlite:///study.db"),
        ("sqlite:////abs/path/study.db", "sqlite:////abs/path/study.db"),
        ("study.db", "study.db"),
    ],
)
def test_redact_url(url: str, expected: str) -> None:
    assert redact_url(url) == expected


def test_package_versions_and_fingerprint() -> None:
    versions = package_versions()
    assert set(versions) == {"torch", "transformers", "optuna", "viasd_tune"}
    assert all(isinstance(v, str) and v for v in versions.values())
    a = calibration_fingerprint([("a", "bc")])
    assert len(a) == 64 and a == calibration_fingerprint([("a", "bc")])
    assert a != calibration_fingerprint([("ab", "c")])  # no separator collisions
    assert a != calibration_fingerprint([("a", "bd")])


@pytest.mark.parametrize("spec", ["packaged", "hub", "gguf", "local"])
def test_every_source_kind_the_loader_records_validates(spec, tmp_path, monkeypatch):
    """The fingerprint's source is whatever models._resolve_source returns; the schema must accept each kind
    (a packaged source once carried a `name` the schema refused, failing the export at the end of a search)."""
    from viasd_tune import fetch, models

    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    monkeypatch.setattr(fetch, "fetch_packaged", lambda name: gguf)
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "model.safetensors").write_bytes(b"w")
    arg = {"packaged": "smollm2-135m", "hub": "org/model", "gguf": str(gguf), "local": str(tmp_path / "dir")}[
        spec
    ]
    _, source = models._resolve_source(arg)
    profile = make_profile()
    profile["target"]["fingerprint"]["source"] = source
    validate_profile(profile)
