"""Bad input through the command line: one clear line on stderr, exit code 2, no traceback (unless --debug),
nothing lost. Cases already covered elsewhere at this level (missing model path, skip index out of range,
tau_accept > tau_escalate, gamma < 1, unknown study) live in test_search.py."""

from __future__ import annotations

import json
import re
import shutil

import gguf
import huggingface_hub.constants
import numpy as np
import optuna
import pytest
from test_profile import make_profile

from viasd_tune.cli import main
from viasd_tune.errors import UserError


def fails_cleanly(capsys, argv: list[str], *needles: str) -> str:
    """Exit code 2 and one line on stderr: a refusal (``viasd-tune: error:``) or, for a value refused while the
    flags are parsed (a non-finite float), argparse's usage error (``viasd-tune <command>: error:``)."""
    try:
        rc = main(argv)
    except SystemExit as e:
        rc = e.code
    err = capsys.readouterr().err
    assert rc == 2, err
    one_line = err.count("\n") == 1 and "Traceback" not in err
    assert one_line and re.match(r"viasd-tune( \w+)?: error: ", err), err
    for needle in needles:
        assert needle in err, err
    return err


def gen(tiny_dirs, *extra: str) -> list[str]:
    target, draft = tiny_dirs
    return ["generate", "--model", target, "--draft", draft, "--dtype", "float32", "--prompt", "hi", *extra]


def search(tiny_dirs, out, *extra: str) -> list[str]:
    target, draft = tiny_dirs
    return [
        "search", "--model", target, "--draft", draft, "--dtype", "float32", "--device", "cpu", "--space", "smoke",
        "--trials", "2", "--max-new-tokens", "8", "--no-progress", "--out", str(out), *extra,
    ]  # fmt: skip


def test_hub_id_while_offline(capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # read at import time
    fails_cleanly(
        capsys, ["generate", "--model", "nobody/no-such-model", "--prompt", "hi"], "nobody/no-such-model"
    )


@pytest.mark.parametrize(
    "arch, needle",
    [("bert", "holds a 'bert' model; layer skipping supports llama"), (None, "not a readable GGUF")],
)
def test_gguf_of_an_unsupported_architecture(arch, needle, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("VIASD_TUNE_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "model.gguf"
    if arch:
        w = gguf.GGUFWriter(path, arch)
        w.add_block_count(2)
        w.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    else:
        path.write_bytes(b"not a gguf")
    fails_cleanly(capsys, ["generate", "--model", str(path), "--prompt", "hi"], needle)
    assert not (tmp_path / "cache").exists()  # refused before any conversion


def test_draft_with_another_tokenizer(tiny_dirs, tmp_path, capsys):
    other = tmp_path / "other"
    shutil.copytree(tiny_dirs[1], other)
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    vocab["a"], vocab["b"] = vocab["b"], vocab["a"]  # same size, different ids
    (other / "tokenizer.json").write_text(json.dumps(tok))
    fails_cleanly(capsys, gen((tiny_dirs[0], str(other))), "different tokenizers")


@pytest.mark.parametrize(
    "extra, needle",
    [
        (["--skip-attn", "0-3", "--skip-mlp", "0-3", "--tau-escalate", "1"], "every sub-layer"),
        (["--tau-accept", "-0.5", "--tau-escalate", "1"], "thresholds must be >= 0"),
        (["--tau-escalate", "-1"], "thresholds must be >= 0"),
        (["--prompt", "x" * 600], "exceeds the model's context length 512"),
    ],
    ids=["skip-everything", "negative-tau-accept", "negative-tau-escalate", "prompt-too-long"],
)
def test_bad_routing_or_prompt(tiny_dirs, capsys, extra, needle):
    fails_cleanly(capsys, gen(tiny_dirs, *extra), needle)


@pytest.mark.parametrize(
    "content, needle",
    [
        ("", "is empty"),
        ('{"prompt": "a"}\n{oops\n', "could not parse"),
        (
            json.dumps({"prompt": "x" * 600}) + "\n" + json.dumps({"prompt": "y"}) + "\n",
            "exceeds the context",
        ),
    ],
    ids=["empty", "malformed", "prompt-too-long"],
)
def test_bad_data_file(tiny_dirs, tmp_path, capsys, content, needle):
    data = tmp_path / "data.jsonl"
    data.write_text(content)
    fails_cleanly(capsys, search(tiny_dirs, tmp_path / "out", "--data", str(data), "--prompts", "2"), needle)


def _write(tmp_path, profile: dict | str):
    path = tmp_path / "profile.json"
    path.write_text(profile if isinstance(profile, str) else json.dumps(profile))
    return str(path)


def test_bad_profiles(tiny_dirs, tmp_path, capsys):
    text = json.dumps(make_profile(), indent=2)
    fails_cleanly(capsys, ["generate", "--profile", _write(tmp_path, text[: len(text) // 2]), "--prompt", "hi"],
                  "malformed JSON")  # fmt: skip
    fails_cleanly(
        capsys, ["generate", "--profile", _write(tmp_path, "{not json"), "--prompt", "hi"], "malformed"
    )
    future = {**make_profile(), "schema_version": 99}
    fails_cleanly(capsys, ["generate", "--profile", _write(tmp_path, future), "--prompt", "hi"],
                  "schema version 99 is newer", "upgrade viasd-tune")  # fmt: skip
    # a valid profile tuned on other weights: the loaded tiny target's fingerprint does not match (strict)
    other = make_profile()
    other["target"]["name"] = tiny_dirs[0]
    other.update(drafter="lookup", draft={"kind": "lookup", "name": None, "fingerprint": None})
    fails_cleanly(capsys, ["generate", "--profile", _write(tmp_path, other), "--prompt", "hi"],
                  "target model does not match the profile's fingerprint")  # fmt: skip


@pytest.mark.parametrize("command", ["search", "export"])
def test_unreachable_storage_hides_the_password(tiny_dirs, tmp_path, capsys, command):
    url = "postgresql://tuner:secret-pw@127.0.0.1:1/optuna"  # nothing listens on port 1
    if command == "search":
        argv = search(tiny_dirs, tmp_path / "out", "--storage", url)
    else:
        argv = ["export", "--storage", url, "--study-name", "s", "--out", str(tmp_path / "p.json")]
    err = fails_cleanly(capsys, argv, "cannot open Optuna storage postgresql://tuner:***@127.0.0.1:1/optuna")
    assert "secret-pw" not in err and not (tmp_path / "p.json").exists()


def test_export_from_a_missing_sqlite_file_creates_nothing(tmp_path, capsys):
    db = tmp_path / "typo.db"
    argv = ["export", "--storage", f"sqlite:///{db}", "--study-name", "s", "--out", str(tmp_path / "p.json")]
    fails_cleanly(capsys, argv, "no Optuna database at")
    assert not db.exists()


def test_bad_heartbeat_setting(tmp_path, capsys, monkeypatch):
    db = tmp_path / "study.db"
    optuna.create_study(storage=f"sqlite:///{db}", study_name="s")
    monkeypatch.setenv("VIASD_GRACE_PERIOD", "soon")
    argv = ["export", "--storage", f"sqlite:///{db}", "--study-name", "s", "--out", str(tmp_path / "p.json")]
    fails_cleanly(capsys, argv, "VIASD_GRACE_PERIOD='soon' must be a whole number of seconds")


def test_study_name_taken_by_another_search_space(tiny_dirs, tmp_path, capsys):
    out = tmp_path / "taken"
    out.mkdir()
    storage = f"sqlite:///{out / 'study.db'}"
    study = optuna.create_study(storage=storage, study_name="taken", directions=["maximize", "maximize"])
    signature = {"space": "0" * 64, "target": "t", "calibration": "c", "max_new_tokens": 8}
    study.set_user_attr("signature", signature)
    study.optimize(lambda t: (t.suggest_float("x", 0, 1), 1.0), n_trials=1)
    fails_cleanly(
        capsys,
        search(tiny_dirs, out, "--prompts", "4"),
        "study 'taken' already exists with a different space",
    )
    study = optuna.load_study(study_name="taken", storage=storage)  # nothing lost, nothing added
    assert len(study.trials) == 1 and study.user_attrs == {"signature": signature}


def test_debug_shows_the_traceback_instead():
    with pytest.raises(UserError, match="does not exist"):
        main(["--debug", "generate", "--model", "/no/such/model", "--prompt", "hi"])


def test_remote_code_is_off_unless_asked(tiny_dirs, capsys, monkeypatch):
    """Model code from the hub runs only with --trust-remote-code."""
    import transformers

    seen = []
    for cls in (transformers.AutoModelForCausalLM, transformers.AutoTokenizer):
        original = cls.from_pretrained

        def spy(*args, _original=original, **kwargs):
            seen.append(kwargs.get("trust_remote_code"))
            return _original(*args, **kwargs)

        monkeypatch.setattr(cls, "from_pretrained", spy)
    argv = ["generate", "--model", tiny_dirs[0], "--mode", "ar", "--prompt", "hi", "--max-new-tokens", "2"]
    assert main(argv) == 0 and seen == [False, False]
    seen.clear()
    assert main([*argv, "--trust-remote-code"]) == 0 and seen == [True, True]
