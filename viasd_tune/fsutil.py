"""Atomic file writes, so an interrupted run never leaves a half-written profile or checkpoint behind."""

from __future__ import annotations

import contextlib
import os
import tempfile
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
