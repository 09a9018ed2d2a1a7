"""Storage strings carry passwords: the one place that hides them, wherever a storage string goes.

- :func:`redact`: the storage string safe to print or store. Anything before the last ``@`` is a credential,
  whatever the scheme or its absence (``tuner:pw@host``, ``postgresql//u:pw@host``, ``postgresql:/u:pw@host``);
  only a well-formed ``scheme://user:password@`` keeps its user name.
- :func:`check_storage`: refuses, before any driver sees it, a string that is not a storage URL or whose
  credentials hold an unescaped ``@`` or ``/`` (drivers split such a URL elsewhere and quote the rest of the
  password as a host name in their errors).
- :func:`scrub`: any text (an error, a log line, a driver message) with every spelling of the secret hidden;
  :class:`ScrubFilter` does it for every log record a handler emits.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from urllib.parse import unquote

from .errors import UserError

MASK = "***"
# A scheme and the user name of a well-formed URL; the password is everything after the user's ':' up to the
# LAST '@' (greedy: an unescaped '@', '/' or '#' inside it is hidden too).
_WELL_FORMED = re.compile(
    r"^(?P<scheme>[A-Za-z][A-Za-z0-9+.\-]*://)(?P<user>[^:/?#@]*)(?P<password>:.*)?$", re.S
)
_QUERY_PASSWORD = re.compile(r"([?&]password=)([^&#]*)", re.IGNORECASE)
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*://")
MIN_SCRUBBED = 4  # shorter secrets cannot be told apart from ordinary text; hiding them would garble messages


def redact(storage: str) -> str:
    """``storage`` with its credentials replaced by ``***``: ``postgresql://u:pw@h/db`` -> ``postgresql://u:***@h/db``,
    ``u:pw@h/db`` -> ``***@h/db``, ``...?password=pw`` -> ``...?password=***``. SQLite URLs and plain paths
    come back unchanged (a SQLite URL holds no credentials, and its path may hold an ``@``)."""
    text = str(storage)
    if text.lower().startswith("sqlite:"):
        return text
    text = _QUERY_PASSWORD.sub(rf"\1{MASK}", text)
    at = text.rfind("@")
    if at < 0:
        return text
    head, tail = text[:at], text[at:]
    m = _WELL_FORMED.match(head)
    if m is None:
        return MASK + tail
    return m["scheme"] + m["user"] + (f":{MASK}" if m["password"] is not None else "") + tail


def secret_spellings(storage: str) -> list[str]:
    """Every spelling of the secret parts of ``storage`` that text might quote: the whole string, the credentials
    before the last ``@`` (as typed and percent-decoded) and a query password."""
    text = str(storage)
    if not text or text.lower().startswith("sqlite:"):
        return []
    found = [text]
    at = text.rfind("@")
    if at >= 0:
        userinfo = _SCHEME.sub("", text[:at])
        password = userinfo.split(":", 1)[1] if ":" in userinfo else userinfo
        # and its pieces: a driver that splits a malformed URL quotes them as a host or a database name
        found += [userinfo, password, unquote(password), *re.split(r"[@/:]", password)]
    found += [unquote(m[2]) for m in _QUERY_PASSWORD.finditer(text)] + [
        m[2] for m in _QUERY_PASSWORD.finditer(text)
    ]
    return sorted({s for s in found if len(s) >= MIN_SCRUBBED and s != MASK}, key=len, reverse=True)


def scrub(text: str, storages: Iterable[str | None]) -> str:
    """``text`` with every spelling of the storages' secrets hidden (the whole storage string becomes its
    :func:`redact` form, a bare password ``***``)."""
    for storage in storages:
        if not storage:
            continue
        for secret in secret_spellings(storage):
            text = text.replace(secret, redact(storage) if secret == storage else MASK)
    return text


class ScrubFilter(logging.Filter):
    """Hides the storages' secrets in every record a handler emits (message and arguments, already merged)."""

    def __init__(self, storages: Iterable[str | None]):
        super().__init__()
        self.storages = [s for s in storages if s]

    def filter(self, record: logging.LogRecord) -> bool:
        if self.storages:
            message = record.getMessage()
            clean = scrub(message, self.storages)
            if clean != message:
                record.msg, record.args = clean, ()
        return True


def check_storage(storage: object, flag: str = "--storage") -> str:
    """The storage string, refused in one line (that never shows its password) unless it is ``scheme://...``
    with credentials a driver will read as typed: an ``@`` or ``/`` inside the user name or password must be
    percent-encoded (``%40``, ``%2F``)."""
    if not isinstance(storage, str) or not _SCHEME.match(storage):
        raise UserError(
            f"{flag} {redact(str(storage))!r} is not a storage URL; use sqlite:///path/to/study.db or "
            "postgresql://user@host/db"
        )
    if storage.lower().startswith("sqlite:"):
        return storage
    rest = _SCHEME.sub("", storage)
    at = rest.rfind("@")
    if at >= 0 and ("@" in rest[:at] or "/" in rest[:at]):
        raise UserError(
            f"{flag} {redact(storage)}: the user name or password holds an unescaped '@' or '/'; "
            "percent-encode it (@ as %40, / as %2F), e.g. postgresql://user:p%40ss@host/db"
        )
    return storage
