"""The one way to open Optuna storage: :func:`make_storage` (heartbeats, driver choice, one-line errors that
never show a password), :func:`open_study` (create or resume a search's study) and :func:`load_study` (an
existing study, for ``export``)."""

from __future__ import annotations

import os
import time
import warnings
from pathlib import Path

import optuna

from ..credentials import check_storage, redact, scrub
from ..errors import UserError
from .records import TrialRecord


def open_study(storage, name: str, seed: int, min_fidelity: float) -> optuna.Study:
    """Create or resume a two-objective study (speedup, acceptance) with fidelity as a constraint (each trial
    records it with ``trial.set_constraint``; the bound itself is the study's user attr ``min_fidelity``).
    ``storage``: a URL, or a storage :func:`make_storage` already opened."""
    sampler = optuna.samplers.TPESampler(seed=seed, multivariate=True)  # reads trial.set_constraint values
    url = storage if isinstance(storage, str) else getattr(storage, "url", "")
    try:
        return optuna.create_study(
            storage=make_storage(storage) if isinstance(storage, str) else storage,
            study_name=name,
            directions=["maximize", "maximize"],
            sampler=sampler,
            load_if_exists=True,
        )
    except (optuna.exceptions.StorageInternalError, ImportError, ValueError) as e:
        first = scrub((str(e).splitlines() or [type(e).__name__])[0], [url])
        raise UserError(f"cannot open Optuna storage {redact(url)}: {first}") from None


def make_storage(url: str):
    """RDB storage with heartbeats, so a trial whose worker died is failed and retried, not RUNNING forever.

    ``VIASD_HEARTBEAT_INTERVAL`` / ``VIASD_GRACE_PERIOD`` (seconds) override the 30 s / 90 s defaults: a
    dead worker's trial is retried ``grace`` seconds after its last heartbeat, so tests use a few seconds.
    """
    check_storage(url)  # before any driver sees it
    from optuna.storages import RDBStorage

    interval, grace = env_seconds("VIASD_HEARTBEAT_INTERVAL", 30), env_seconds("VIASD_GRACE_PERIOD", 90)

    sqlite = url.startswith("sqlite")
    # pysqlite: no implicit BEGIN (SQLAlchemy's recipe; _lock_on_begin emits ours) and a patient busy wait.
    engine_kwargs = {"connect_args": {"isolation_level": None, "timeout": SQLITE_BUSY_S}} if sqlite else {}

    def connect() -> RDBStorage:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            storage = RDBStorage(
                _with_driver(url),
                heartbeat_interval=interval,
                grace_period=grace,
                heartbeat_stale_trial_callback=RetryStaleTrial(max_retry=2),
                engine_kwargs=engine_kwargs or {"pool_pre_ping": True},
            )
        if sqlite:
            _lock_on_begin(storage.engine)
        return storage

    try:
        try:
            return connect()
        except ImportError:
            raise
        except Exception:
            time.sleep(1.0)  # N workers started at once on an empty database race to create its tables
            return connect()
    except Exception as e:  # sqlalchemy raises many types for an unreachable server or a bad URL
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        if isinstance(e, ImportError):
            first = (
                "its database driver is not installed (for PostgreSQL: pip install 'viasd-tune[postgres]')"
            )
        # Driver messages can quote the URL, and so its password: never print that.
        first = scrub(first, [url, _with_driver(url)])
        raise UserError(f"cannot open Optuna storage {redact(url)}: {first}") from None


SQLITE_BUSY_S = 60  # how long a SQLite transaction waits for another process's to finish


def _lock_on_begin(engine) -> None:
    """Start every SQLite transaction with ``BEGIN IMMEDIATE``, so it holds the write lock from its first read.

    Optuna starts a queued (WAITING) trial by reading its state ``FOR UPDATE`` and setting it RUNNING. SQLite has
    no row locks, and pysqlite begins a transaction only at its first write, so two workers could both read
    WAITING and both start the same trial (4 processes popping 60 queued trials started 8 to 12 of them twice):
    the search's reference points and seeded skip sets ran twice, and a trial one worker was running (and died in)
    was completed by the other. Serialised transactions make that read-then-write atomic."""
    from sqlalchemy import event

    event.listen(engine, "begin", lambda conn: conn.exec_driver_sql("BEGIN IMMEDIATE"))


class RetryStaleTrial:
    """Re-queue a trial whose worker died (its heartbeat went stale) with the same params, as Optuna's
    ``RetryHeartbeatStaleTrialCallback`` does (same ``failed_trial`` / ``retry_history`` system attrs, at most
    ``max_retry`` retries), but without what the dead run recorded: Optuna copies every user attr, so a retry
    showed the dead worker's name and whatever partial results it had recorded until its own worker overwrote
    them, and a retry screened out by the replay kept the dead trial's measurements. What the trial was queued
    with (``TrialRecord.enqueued``) is kept: it makes a reference point one, and a retry must run the same
    configuration (without it a plain-SD reference point's retry sampled a VIA-SD configuration)."""

    def __init__(self, max_retry: int):
        self.max_retry = max_retry

    def __call__(self, study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
        system_attrs = {"failed_trial": trial.number, "retry_history": [], **trial.system_attrs}
        system_attrs["retry_history"] = [*system_attrs["retry_history"], trial.number]
        if len(system_attrs["retry_history"]) > self.max_retry:
            return
        retry = optuna.trial.create_trial(
            state=optuna.trial.TrialState.WAITING,
            params=trial.params,
            distributions=trial.distributions,
            system_attrs=system_attrs,
            user_attrs=TrialRecord(enqueued=TrialRecord.read(trial).enqueued).attrs(),
        )
        study.add_trial(retry)


def _with_driver(url: str) -> str:
    """SQLAlchemy 2.1 maps a bare ``postgresql://`` to psycopg 3; use psycopg2 (our ``postgres`` extra) when
    only that one is installed, so the URL a user copies from the README works either way."""
    import importlib.util

    bare = url.startswith("postgresql://")
    if bare and importlib.util.find_spec("psycopg") is None and importlib.util.find_spec("psycopg2"):
        return "postgresql+psycopg2://" + url.removeprefix("postgresql://")
    return url


def env_seconds(name: str, default: int) -> int:
    value = os.environ.get(name, "")
    if not value:
        return default
    if not value.isdigit() or int(value) < 1:
        raise UserError(f"{name}={value!r} must be a whole number of seconds >= 1")
    return int(value)


def sqlite_file(url: str) -> Path | None:
    """The database file of a ``sqlite:///`` URL (``None`` for in-memory or other back ends)."""
    if not url.startswith("sqlite:///"):
        return None
    path = url.removeprefix("sqlite:///").split("?", 1)[0]
    return None if path in ("", ":memory:") else Path(path)


def load_study(url: str, name: str) -> optuna.Study:
    """An existing study; a missing SQLite file or study name is a one-line error, and nothing is created."""
    db = sqlite_file(url)
    if db is not None and not db.is_file():  # SQLAlchemy would create an empty one there
        raise UserError(f"no Optuna database at {db}; check the path (a search writes <out>/study.db)")
    storage = make_storage(url)
    try:
        return optuna.load_study(study_name=name, storage=storage)
    except KeyError:
        names = [s.study_name for s in optuna.get_all_study_summaries(storage)]
        raise UserError(
            f"no study {name!r} in that storage; studies there: {', '.join(names) or 'none'}"
        ) from None
