"""Output files: atomic writes, so an interrupted run never leaves a half-written profile or checkpoint behind,
and the checks that an output path is writable and is none of the command's inputs."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path


def check_output_file(path: str | os.PathLike[str], flag: str = "--out") -> Path:
    """Refuse, in one line and before any work, an output file path that is a folder or lies under a file."""
    from .errors import UserError

    target = Path(path)
    if str(path) == "" or target.is_dir():
        raise UserError(f"{flag} {str(path)!r} is a folder (or empty); pass a file path such as profile.json")
    for parent in target.parents:
        if parent.exists():
            if not parent.is_dir():
                raise UserError(f"{flag} {path}: {parent} is a file, not a folder; pick another path")
            break
    return target


def same_file(a: str | os.PathLike[str], b: str | os.PathLike[str]) -> bool:
    """Whether two spellings name one file: the same inode where both exist (symlinks, hard links, ``..``,
    relative vs absolute), else the same path once symlinks and ``..`` are resolved."""
    pa, pb = Path(a), Path(b)
    try:
        if pa.exists() and pb.exists():
            return os.path.samefile(pa, pb)
        return os.path.normcase(pa.resolve()) == os.path.normcase(pb.resolve())
    except (OSError, RuntimeError):  # a symlink loop: it cannot be written through either
        return False


def within(path: str | os.PathLike[str], folder: str | os.PathLike[str]) -> bool:
    """Whether ``path`` lies inside ``folder`` once both are resolved."""
    try:
        return Path(path).resolve().is_relative_to(Path(folder).resolve())
    except (OSError, RuntimeError):
        return False


PathPairs = Sequence[
    tuple[str, "str | os.PathLike[str] | None"]
]  # (what it is: a flag or a file's role, path)


def check_outputs_spare_inputs(outputs: PathPairs, inputs: PathPairs, folders: PathPairs = ()) -> None:
    """Refuse, in one line and before anything is written, an output that is one of the command's input files
    under any spelling (``outputs``/``inputs``: ``(what, path)`` pairs, ``None`` paths skipped), or an input
    inside an output folder a command fills with files of its own naming (``folders``)."""
    from .errors import UserError

    for in_what, inp in inputs:
        if inp is None:
            continue
        for out_what, out in outputs:
            if out is not None and same_file(out, inp):
                raise UserError(
                    f"{out_what} {out} is the same file as {in_what} {inp}; writing it would destroy that input, "
                    "so pick another output path"
                )
        for out_what, folder in folders:
            if folder is not None and within(inp, folder):
                raise UserError(
                    f"{in_what} {inp} lies in {folder}, which {out_what} fills with files of its own; move the "
                    "input or pick another output folder"
                )


# Read once at import (os.umask can only be read by setting it, which is not thread safe later on).
_UMASK = os.umask(0o022)
os.umask(_UMASK)


def default_mode(fd: int) -> None:
    """Give a temp file the permissions a plain ``open()`` would: NamedTemporaryFile creates it 0600."""
    os.fchmod(fd, 0o666 & ~_UMASK)


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """Write ``data`` to ``path`` via a temp file in the same directory and ``os.replace``.

    The temp file lives next to the target so the final rename stays on one file system (and is therefore
    atomic); it is fsynced first so a crash after the rename cannot expose an empty file.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp_name = None
    try:
        with tempfile.NamedTemporaryFile(
            delete=False, dir=target.parent, prefix=f".{target.name}.", suffix=".tmp"
        ) as tmp:
            tmp_name = tmp.name
            tmp.write(data)
            tmp.flush()
            default_mode(tmp.fileno())
            os.fsync(tmp.fileno())
        os.replace(tmp_name, target)
    except BaseException:
        if tmp_name is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp_name)
        raise


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    """Write ``text`` as UTF-8 atomically (see :func:`atomic_write_bytes`)."""
    atomic_write_bytes(path, text.encode("utf-8"))
