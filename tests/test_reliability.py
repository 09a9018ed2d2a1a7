"""Reliability: workers on one study (SQLite and a real PostgreSQL) with one killed mid-trial, Ctrl-C during a
search, a failing trial, and writes interrupted half-way."""

from __future__ import annotations

import glob
import json
import os
import pwd
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import optuna
import pytest
from test_profile import make_profile

from viasd_tune import fsutil
from viasd_tune.cli import main
from viasd_tune.dashboard import build_dashboard
from viasd_tune.profile import load_profile, write_profile
from viasd_tune.search import loop, replay, screen
from viasd_tune.search import objective as search_objective
from viasd_tune.search.run import SearchSettings, run_search
from viasd_tune.search.storage import make_storage, open_study

TS = optuna.trial.TrialState
REPO = Path(__file__).resolve().parents[1]
PASSWORD = "s3cret-pw"  # in the PostgreSQL URL (the test server trusts loopback, so it is never checked)

# `viasd-tune ARGS`, each trial held at its start (before its replay estimate is recorded) for TEST_TRIAL_DELAY
# seconds, and for as long as the file TEST_HOLD_FILE exists (marked by TEST_HOLD_FILE.held, which holds the held
# trial's number), so a test can signal a worker while it is surely mid-trial: a fixed delay alone raced (a loaded
# host let the trial move on between the test's look and its kill). The test takes the trial's number from the
# marker: a trial's "worker" attr names whoever wrote it last, which says nothing when two processes run one trial
# (what SQLite allowed, see test_workers_never_start_the_same_queued_trial).
SLOW_CLI = """
import os, signal, sys, time
# Ctrl-C raises KeyboardInterrupt even where the test runner was started in the background (a shell without job
# control starts it with SIGINT ignored, and the child would inherit that and finish instead of stopping).
signal.signal(signal.SIGINT, signal.default_int_handler)
from viasd_tune.search import params, replay
current = {}
_suggest = params.suggest
def suggest(trial, *args, **kwargs):
    current["trial"] = trial.number
    return _suggest(trial, *args, **kwargs)
params.suggest = suggest
_simulate = replay.simulate
_calls = []
def simulate(*args, **kwargs):
    _calls.append(1)
    if len(_calls) == 1:  # the search's first replay is its AR baseline, before any trial
        return _simulate(*args, **kwargs)
    end, hold = time.time() + float(os.environ["TEST_TRIAL_DELAY"]), os.environ.get("TEST_HOLD_FILE")
    while True:
        if hold and os.path.exists(hold):
            if not os.path.exists(hold + ".held"):  # a trial here now stays here: the test may signal
                with open(hold + ".held.tmp", "w") as f:
                    f.write(str(current.get("trial", -1)))
                os.replace(hold + ".held.tmp", hold + ".held")
        elif time.time() >= end:
            break
        time.sleep(0.05)
    return _simulate(*args, **kwargs)
replay.simulate = simulate
from viasd_tune.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _env(tmp: Path, delay: float, hold: Path | None) -> dict:
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",  # three workers on two cores
        "VIASD_HEARTBEAT_INTERVAL": "1",
        "VIASD_GRACE_PERIOD": "5",  # a dead worker's trial is retried 5 s after its last heartbeat
        "TEST_TRIAL_DELAY": str(delay),
        "TEST_HOLD_FILE": str(hold or ""),
        "HF_HUB_OFFLINE": "1",
        "VIASD_TUNE_CACHE": str(tmp / "cache"),
    }


def _search_argv(tiny_dirs, storage: str, name: str, out: Path, trials: int) -> list[str]:
    target, draft = tiny_dirs
    return [
        "search", "--model", target, "--draft", draft, "--dtype", "float32", "--device", "cpu",
        "--prompts", "4", "--trials", str(trials), "--space", "smoke", "--max-new-tokens", "8",
        "--min-fidelity", "0.05", "--storage", storage, "--study-name", name, "--out", str(out), "--no-progress",
    ]  # fmt: skip


def _start(argv: list[str], tmp: Path, tag: str, delay: float, hold: Path | None = None) -> subprocess.Popen:
    """``viasd-tune argv`` in a child whose trials are held at their start (see SLOW_CLI)."""
    log = (tmp / f"{tag}.log").open("w")
    return subprocess.Popen(
        [sys.executable, "-c", SLOW_CLI, *argv], cwd=tmp, env=_env(tmp, delay, hold), stdout=log, stderr=log
    )


def _log(tmp: Path, tag: str) -> str:
    return (tmp / f"{tag}.log").read_text()


def _trials(storage, name: str) -> list[optuna.trial.FrozenTrial]:
    try:
        return optuna.load_study(study_name=name, storage=storage).get_trials(deepcopy=False)
    except KeyError:  # not created yet
        return []


def _wait_trials(storage, name, proc, tmp, tag, ready, timeout=150.0) -> None:
    """Poll the study until ``ready(trials)`` holds; ``proc`` must stay alive meanwhile."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, f"{tag} ended early:\n{_log(tmp, tag)}"
        if ready(_trials(storage, name)):
            return
        time.sleep(0.1)
    raise AssertionError(f"{tag} never got there:\n{_log(tmp, tag)}")


def _wait_held(storage, name, proc, tmp, tag, hold: Path) -> optuna.trial.FrozenTrial:
    """The trial ``proc`` runs once it is held at its start by the file ``hold`` (which must exist): it stays there
    until the file goes, so a signal sent now surely lands mid-trial. Its number is the one the marker holds."""
    marker = Path(f"{hold}.held")
    _wait_trials(storage, name, proc, tmp, tag, lambda _: marker.exists())
    (held,) = [t for t in _trials(storage, name) if t.number == int(marker.read_text())]
    # Its own worker's, mid-trial. (RUNNING is not asserted: on a loaded host a starved worker's heartbeat can go
    # stale within the tests' 5 s grace period, and another worker fail it, while the process still holds it.)
    assert held.user_attrs["worker"].endswith(f":{proc.pid}") and "estimate" not in held.user_attrs
    # FAIL here: failed as stale while held. Shown with -s (the real stderr: the test's capsys takes stdout).
    print(f"held trial {held.number} was {held.state.name} when read", file=sys.__stderr__)
    return held


# ---------------------------------------------------------------------------------------------- PostgreSQL


def _pg_bin() -> Path | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(p.split("/")[4]))
    path = found[-1] if found else shutil.which("initdb")
    return Path(path).parent if path else None


@pytest.fixture(scope="module")
def postgres_url():
    """A throwaway PostgreSQL server on 127.0.0.1 (data and socket in a temp dir), or VIASD_TEST_POSTGRES_URL."""
    if os.environ.get("VIASD_TEST_POSTGRES_URL"):
        yield os.environ["VIASD_TEST_POSTGRES_URL"]
        return
    import psycopg2  # noqa: F401  (the test extra installs the client; only the server may be missing)

    bin_dir = _pg_bin()
    if bin_dir is None:
        pytest.skip("PostgreSQL server is not installed (Debian: apt-get install postgresql)")
    as_user: list[str] = []
    owner = None
    if os.geteuid() == 0:  # initdb and postgres refuse to run as root
        try:
            owner = pwd.getpwnam("postgres")
        except KeyError:
            pytest.skip("running as root and there is no 'postgres' user to run the server as")
        runuser = shutil.which("runuser")
        as_user = [runuser, "-u", "postgres", "--"] if runuser else ["su", "postgres", "-s", "/bin/sh", "-c"]
    base = Path(tempfile.mkdtemp(prefix="viasd-pg-"))  # not under pytest's tmp: that one is private to root
    if owner:
        os.chown(base, owner.pw_uid, owner.pw_gid)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    def pg(*args: str) -> None:
        cmd = [str(bin_dir / args[0]), *args[1:]]
        cmd = [*as_user, shlex.join(cmd)] if as_user[:1] == ["su"] else [*as_user, *cmd]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        log = (base / "server.log").read_text() if (base / "server.log").exists() else ""
        assert done.returncode == 0, f"{args[0]} failed: {done.stderr}\n{log}"

    data = base / "data"
    opts = f"-k {base} -p {port} -c listen_addresses=127.0.0.1 -c fsync=off -c full_page_writes=off"
    pg("initdb", "-D", str(data), "-A", "trust", "-U", "postgres", "-E", "UTF8", "--no-sync")
    pg("pg_ctl", "-D", str(data), "-l", str(base / "server.log"), "-w", "-o", opts, "start")
    try:
        yield f"postgresql://postgres:{PASSWORD}@127.0.0.1:{port}/postgres"
    finally:
        pg("pg_ctl", "-D", str(data), "-m", "immediate", "stop")
        shutil.rmtree(base, ignore_errors=True)


# ---------------------------------------------------------------------------------------------- tests


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_workers_share_a_study_and_survive_a_killed_one(backend, tiny_dirs, tmp_path, request, capsys):
    """3 worker processes on one study; one SIGKILLed mid-trial. Its trial is failed by the heartbeat check and
    re-run, the study reaches its count with every trial accounted for, and export writes a valid profile."""
    if backend == "sqlite":
        url = f"sqlite:///{tmp_path / 'study.db'}"
    else:
        url = request.getfixturevalue("postgres_url")
    name, trials = f"dist-{os.getpid()}-{time.time_ns()}", 6
    argv = [*_search_argv(tiny_dirs, url, name, tmp_path / "out", trials), "--worker"]
    # Every worker's first trial stays in its held start until the victim is killed: a survivor that ran ahead
    # (a loaded host starts the victim late) could otherwise finish the study within the grace period, before
    # any trial start looks for stale ones, and leave the victim's trial RUNNING. After the kill the survivors
    # run the 6 trials at 3 s each, so their third trial starts past the 5 s grace period.
    for i in range(3):
        (tmp_path / f"hold-w{i}").touch()
    procs = [_start(argv, tmp_path, f"w{i}", 3.0, tmp_path / f"hold-w{i}") for i in range(3)]
    try:
        storage = make_storage(url)  # also exercises postgresql:// → the installed driver
        killed = _wait_held(storage, name, procs[0], tmp_path, "w0", tmp_path / "hold-w0")
        procs[0].send_signal(signal.SIGKILL)
        procs[0].wait()
        for i in (1, 2):
            (tmp_path / f"hold-w{i}").unlink()
        for i, p in enumerate(procs[1:], 1):
            assert p.wait(timeout=240) == 0, _log(tmp_path, f"w{i}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    logs = "".join(_log(tmp_path, f"w{i}") for i in range(3))
    assert "Traceback" not in logs and PASSWORD not in logs

    study = optuna.load_study(study_name=name, storage=storage)
    all_trials = study.trials
    assert [t.number for t in all_trials] == list(range(len(all_trials)))  # no duplicate numbers
    assert not [t.number for t in all_trials if t.state == TS.RUNNING]
    assert sum(t.state == TS.COMPLETE for t in all_trials) >= trials
    assert all_trials[killed.number].state == TS.FAIL
    retries = [t for t in all_trials if t.system_attrs.get("failed_trial") == killed.number]
    assert len(retries) == 1 and retries[0].state == TS.COMPLETE
    assert retries[0].system_attrs["retry_history"] == [killed.number]
    assert retries[0].params == all_trials[killed.number].params
    for t in all_trials:  # every trial accounted for
        assert t.state in (TS.COMPLETE, TS.WAITING) or any(
            r.system_attrs.get("failed_trial") == t.number for r in all_trials
        ), (t.number, t.state, t.user_attrs.get("fail_reason"))
    assert len({t.user_attrs.get("worker") for t in all_trials}) >= 2  # the victim and a survivor
    assert PASSWORD not in json.dumps([study.user_attrs, *[t.user_attrs for t in all_trials]], default=str)

    capsys.readouterr()
    profile_path = tmp_path / "profile.json"
    assert main(["export", "--storage", url, "--study-name", name, "--out", str(profile_path)]) == 0
    printed = capsys.readouterr()
    assert PASSWORD not in printed.out + printed.err
    profile = load_profile(profile_path)  # schema-valid
    assert profile["provenance"]["study"] == name and PASSWORD not in profile_path.read_text()
    if backend == "postgresql":
        assert profile["provenance"]["storage"].startswith("postgresql://postgres:***@127.0.0.1:")


@pytest.mark.slow
def test_ctrl_c_keeps_finished_trials_and_a_failing_trial_fails_alone(
    tiny_dirs, tmp_path, monkeypatch, caplog
):
    """SIGINT mid-trial: exit 130, finished trials kept, the running one FAIL with its reason (not RUNNING), the
    best so far exports. Re-running resumes, and there a trial that raises, or measures NaN, fails alone."""
    out, trials = tmp_path / "run", 5
    url = f"sqlite:///{out / 'study.db'}"
    out.mkdir()
    proc = _start(
        _search_argv(tiny_dirs, url, "run", out, trials), tmp_path, "search", 1.0, tmp_path / "hold"
    )
    try:
        storage = make_storage(url)
        decoded = lambda ts: sum(t.state == TS.COMPLETE and t.user_attrs.get("measured") for t in ts)  # noqa: E731
        _wait_trials(storage, "run", proc, tmp_path, "search", lambda ts: decoded(ts) >= 2)  # export needs one
        (tmp_path / "hold").touch()
        hit = _wait_held(storage, "run", proc, tmp_path, "search", tmp_path / "hold")
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 130
    finally:
        if proc.poll() is None:
            proc.kill()
    err = _log(tmp_path, "search")
    assert "Traceback" not in err and "interrupted" in err and "re-run the same command to resume" in err
    before = optuna.load_study(study_name="run", storage=storage).trials
    assert not [t for t in before if t.state == TS.RUNNING]
    assert before[hit.number].state == TS.FAIL
    assert "interrupted" in before[hit.number].user_attrs["fail_reason"]
    kept = [t.number for t in before if t.state == TS.COMPLETE]
    assert len(kept) >= 2
    best = tmp_path / "best.json"
    assert main(["export", "--storage", url, "--study-name", "run", "--out", str(best)]) == 0
    load_profile(best)

    # Resume in this process, where one trial raises and another measures NaN: each fails with its reason.
    calls = {"simulate": 0, "measure": 0}
    simulate, measure = replay.simulate, search_objective.measure

    def flaky_simulate(*a, **k):
        calls["simulate"] += 1
        if calls["simulate"] == 2:  # the first is the search's AR baseline, replayed before any trial
            raise ZeroDivisionError("boom in replay")
        return simulate(*a, **k)

    def nan_measure(*a, **k):
        calls["measure"] += 1
        m = measure(*a, **k)
        if calls["measure"] == 1:
            m.speedup = float("nan")
        return m

    monkeypatch.setattr(replay, "simulate", flaky_simulate)
    monkeypatch.setattr(search_objective, "measure", nan_measure)
    # Decode every trial the replay lets through: this test is about failures, not the front screen.
    monkeypatch.setattr(screen, "could_enter_front", lambda *a: True)
    target, draft = tiny_dirs
    settings = SearchSettings(
        model=target, draft=draft, dtype="float32", device="cpu", prompts=4, trials=trials, space="smoke",
        max_new_tokens=8, min_fidelity=0.05, storage=url, study_name="run", out=str(out), progress=False,
    )  # fmt: skip
    summary = run_search(settings)
    assert load_profile(summary["profile"])["provenance"]["study"] == "run"
    after = optuna.load_study(study_name="run", storage=storage).trials
    assert [t.number for t in after if t.state == TS.COMPLETE][: len(kept)] == kept  # nothing lost
    assert sum(t.state == TS.COMPLETE and t.user_attrs["measured"] for t in after) == trials  # decoded ones
    assert not [t for t in after if t.state == TS.RUNNING]
    # failed in the resume: new trials, or ones waiting before it (the skip sets the study was seeded with)
    failed_before = {t.number for t in before if t.state == TS.FAIL}
    reasons = [
        t.user_attrs.get("fail_reason", "")
        for t in after
        if t.state == TS.FAIL and t.number not in failed_before
    ]
    assert len(reasons) == 2
    assert any("ZeroDivisionError: boom in replay" in r for r in reasons)
    assert any("non-finite" in r for r in reasons)
    assert sum("failed:" in r.getMessage() for r in caplog.records) == 2  # one warning line per failed trial


def _tiny_study() -> optuna.Study:
    study = optuna.create_study(directions=["maximize", "maximize"])
    study.optimize(lambda t: (t.suggest_float("x", 0.5, 2.0), 1.0), n_trials=3)
    return study


@pytest.mark.parametrize("what", ["profile", "dashboard"])
def test_a_write_interrupted_half_way_leaves_the_old_file(what, tmp_path, monkeypatch):
    """Ctrl-C after the bytes are written but before the rename: the old file stays whole, no temp file."""
    path = tmp_path / f"{what}.out"
    if what == "dashboard":
        study = _tiny_study()
        write = lambda: build_dashboard(study, path)  # noqa: E731
    else:
        write = lambda: write_profile(path, make_profile())  # noqa: E731
    write()
    before = path.read_bytes()

    def interrupted(fd):
        raise KeyboardInterrupt

    monkeypatch.setattr(fsutil.os, "fsync", interrupted)
    with pytest.raises(KeyboardInterrupt):
        write()
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == [path.name]


def test_a_stalled_worker_whose_trial_was_taken_over_carries_on(tmp_path, caplog):
    """A worker paused past the grace period finds its trial failed (and re-queued) by another: it drops that
    result and goes on instead of crashing on Optuna's UpdateFinishedTrialError."""
    study = open_study(f"sqlite:///{tmp_path / 'study.db'}", "s", seed=0, min_fidelity=0.5)
    calls = []

    def objective(trial):
        calls.append(trial.number)
        trial.set_user_attr("measured", True)  # decoded for real: what --trials counts
        if len(calls) == 1:  # what fail_stale_trials in another worker does to a stale trial
            study._storage.set_trial_state_values(trial._trial_id, state=TS.FAIL)
        return trial.suggest_float("x", 0.5, 2.0), 1.0

    loop.optimize(study, objective, SearchSettings(model="unused", trials=2, progress=False))
    assert [t.state for t in study.trials] == [TS.FAIL, TS.COMPLETE, TS.COMPLETE]
    assert any("taken over" in r.getMessage() for r in caplog.records)


def test_a_dead_workers_retry_starts_clean(tmp_path, monkeypatch):
    """Found while tracing issue 31 item 8: the retry of a trial failed as stale carried that trial's user attrs
    (Optuna's retry callback copies them): the dead worker's name, its config and any partial measurements, until
    the retry's own worker overwrote them (and a retry screened out by the replay kept the dead trial's
    measurements). The retry now holds the same params, retry history and enqueued params, nothing else."""
    from viasd_tune.search.records import TrialRecord
    from viasd_tune.search.storage import RetryStaleTrial

    monkeypatch.setenv("VIASD_HEARTBEAT_INTERVAL", "1")
    monkeypatch.setenv("VIASD_GRACE_PERIOD", "1")
    storage = make_storage(f"sqlite:///{tmp_path / 'study.db'}")
    study = optuna.create_study(storage=storage, directions=["maximize", "maximize"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trial = study.ask()
    trial.suggest_float("x", 0.0, 1.0)
    trial.set_user_attr("worker", "host:123")
    trial.set_user_attr("agreement", 0.5)  # a partial measurement of the dead trial
    trial.set_user_attr("enqueued", {"x": 0.5, "escalate_all": True})  # how it was queued: a reference point
    storage.record_heartbeat(trial._trial_id)
    time.sleep(3)  # past the 1 s grace period (SQLite's clock ticks in whole seconds)
    with warnings.catch_warnings():  # experimental API; and heartbeats outside Study.optimize, as a test
        warnings.simplefilter("ignore")
        optuna.storages.fail_stale_trials(study)
    dead, retry = study.trials
    assert dead.state == TS.FAIL and retry.state == TS.WAITING
    # what it was queued with stays (a reference point's retry is one too), what the dead run recorded goes
    assert retry.user_attrs == {"enqueued": {"x": 0.5, "escalate_all": True}} and retry.params == dead.params
    assert TrialRecord.read(retry).reference
    assert retry.system_attrs["failed_trial"] == 0 and retry.system_attrs["retry_history"] == [0]
    # a retry of the retry keeps the history; past max_retry none is queued
    callback = RetryStaleTrial(max_retry=2)
    callback(study, study.trials[1])
    again = study.trials[2].system_attrs
    assert again["retry_history"] == [0, 1] and again["failed_trial"] == 0
    callback(study, study.trials[2])
    assert len(study.trials) == 3


POP_QUEUED = """
import json, sys, time, warnings
import optuna
warnings.simplefilter("ignore")
from viasd_tune.search.storage import make_storage
study = optuna.load_study(study_name="q", storage=make_storage(sys.argv[1]))
while time.time() < float(sys.argv[3]):  # all start popping at once
    time.sleep(0.001)
popped = []
while (trial_id := study._pop_waiting_trial_id()) is not None:  # what Study.ask does to start a queued trial
    popped.append(trial_id)
json.dump(popped, open(sys.argv[2], "w"))
"""


@pytest.mark.slow
def test_workers_never_start_the_same_queued_trial(tmp_path):
    """Issue 31, item 8: on SQLite two workers could both start one queued (WAITING) trial: Optuna reads its state
    FOR UPDATE, which SQLite ignores, and pysqlite began the transaction only at the write. 4 processes popping 60
    queued trials started 8 to 12 of them twice; one of those, run by the killed worker and a survivor at once, was
    the killed worker's trial that ended COMPLETE. make_storage begins SQLite transactions IMMEDIATE."""
    url = f"sqlite:///{tmp_path / 'study.db'}"
    study = optuna.create_study(study_name="q", storage=make_storage(url))
    for x in range(60):
        study.enqueue_trial({"x": float(x)})
    start = str(time.time() + 10)  # after every process has imported and opened the storage
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    outs = [tmp_path / f"popped-{i}.json" for i in range(4)]
    procs = [subprocess.Popen([sys.executable, "-c", POP_QUEUED, url, str(o), start], env=env) for o in outs]
    for p in procs:
        assert p.wait(timeout=240) == 0
    popped = [t for o in outs for t in json.loads(o.read_text())]
    # each queued trial started exactly once
    assert sorted(popped) == sorted(t._trial_id for t in study.trials)
