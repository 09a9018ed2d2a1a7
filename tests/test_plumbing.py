"""The search's plumbing, one of each: the Pareto front (export and dashboard), the storage opener, and the
worker processes (started from settings, not from the command line)."""

from __future__ import annotations

import dataclasses
import json
import random
import subprocess
import sys

import optuna
import pytest

from viasd_tune.dashboard.points import trial_points
from viasd_tune.errors import UserError
from viasd_tune.search import storage, workers
from viasd_tune.search.front import pareto_front
from viasd_tune.search.run import SearchSettings

# ------------------------------------------------------------------------------------------------ front


def _trials(points):
    dist = {"a": optuna.distributions.FloatDistribution(0, 1)}
    return [
        optuna.trial.create_trial(values=list(v), params={"a": 0.5}, distributions=dist, user_attrs={"i": i})
        for i, v in enumerate(points)
    ]


def _brute_force(trials):
    def beats(b, a):
        return all(y >= x for x, y in zip(a.values, b.values, strict=True)) and b.values != a.values

    return [t for t in trials if not any(beats(o, t) for o in trials)]


@pytest.mark.parametrize("seed", range(20))
def test_front_is_the_non_dominated_set(seed):
    rng = random.Random(seed)
    grid = [0.5, 1.0, 1.5, 2.0]  # a coarse grid, so ties and duplicates occur
    trials = _trials([(rng.choice(grid), rng.choice(grid)) for _ in range(rng.randint(1, 12))])
    front = pareto_front(trials)
    assert sorted(t.user_attrs["i"] for t in front) == sorted(t.user_attrs["i"] for t in _brute_force(trials))
    assert [t.values[0] for t in front] == sorted(t.values[0] for t in front)


def test_identical_points_are_both_on_the_front_in_the_given_order():
    front = pareto_front(_trials([(1.0, 2.0), (0.5, 1.0), (1.0, 2.0)]))
    assert [t.user_attrs["i"] for t in front] == [0, 2]


def test_dashboard_marks_the_same_front_the_export_writes():
    rng = random.Random(3)
    trials = _trials([(rng.uniform(0.5, 1.5), rng.choice([1.0, 1.5, 2.0])) for _ in range(30)])
    points = trial_points(trials, None)  # no constraints recorded: every trial is feasible
    assert {p.number for p in points if p.pareto} == {t.number for t in pareto_front(trials)}


# ------------------------------------------------------------------------------------------------ storage


def test_storage_opener(tmp_path):
    url = f"sqlite:///{tmp_path / 'study.db'}"
    with pytest.raises(UserError, match="no Optuna database at"):
        storage.load_study(url, "s")
    assert not (tmp_path / "study.db").exists()
    created = storage.open_study(url, "s", seed=0, min_fidelity=0.9)
    assert created.directions == [optuna.study.StudyDirection.MAXIMIZE] * 2
    assert storage.open_study(url, "s", seed=0, min_fidelity=0.9)._study_id == created._study_id  # resumed
    assert storage.load_study(url, "s").study_name == "s"
    with pytest.raises(UserError) as e:
        storage.load_study(url, "other")
    assert "'other'" in str(e.value) and str(e.value).endswith(": s")  # the one asked for; the one there
    with pytest.raises(UserError) as e:
        storage.make_storage("notaurl")
    assert "'notaurl'" in str(e.value) and "sqlite:///" in str(e.value)  # the bad value, and a URL that works


# ------------------------------------------------------------------------------------------------ workers


class _FakeProcess:
    started: list[_FakeProcess] = []

    def __init__(self, argv, stdin=None, text=False):
        self.argv, self.written, self.closed, self.waited = argv, "", False, False
        self.stdin = self
        _FakeProcess.started.append(self)

    def write(self, text):
        self.written += text

    def close(self):
        self.closed = True

    def wait(self):
        self.waited = True


def test_run_workers_passes_settings_not_argv(tmp_path, monkeypatch):
    ran = []
    monkeypatch.setattr(workers, "run_search", lambda s, dashboard=None: ran.append(s) or {"summary": True})
    monkeypatch.setattr(subprocess, "Popen", _FakeProcess)
    monkeypatch.setattr(sys, "argv", ["something", "--else", "entirely"])  # not read
    _FakeProcess.started.clear()
    s = SearchSettings(
        model="m", draft="d", trials=5, out=str(tmp_path / "run"), categories=["qa"], timeout=9.5
    )
    assert workers.run_workers(s, 3) == {"summary": True}
    expected = dataclasses.replace(
        s, storage=f"sqlite:///{(tmp_path / 'run' / 'study.db').resolve()}", study_name="run"
    )
    assert ran == [expected]  # this process runs and exports
    assert len(_FakeProcess.started) == 2
    for p in _FakeProcess.started:
        assert p.argv == [sys.executable, "-m", "viasd_tune.search.workers"] and p.closed and p.waited
        assert SearchSettings(**json.loads(p.written)) == dataclasses.replace(
            expected, worker=True, progress=False
        )


def test_worker_main_reads_settings_from_stdin(monkeypatch, capsys):
    import io

    got = []
    s = SearchSettings(model="m", storage="sqlite:///x.db", study_name="x", worker=True, progress=False)
    monkeypatch.setattr(sys, "stdin", io.StringIO(json.dumps(dataclasses.asdict(s))))
    monkeypatch.setattr(workers, "run_search", got.append)
    assert workers.main() == 0 and got == [s]

    def refuse(_):
        raise UserError("bad thing; fix it")

    monkeypatch.setattr(sys, "stdin", io.StringIO(json.dumps(dataclasses.asdict(s))))
    monkeypatch.setattr(workers, "run_search", refuse)
    assert workers.main() == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.rstrip().endswith("bad thing; fix it")  # one line, the error's own


def test_n_jobs_below_one_is_refused(capsys):
    from viasd_tune.cli import main

    for n in ("0", "-2"):
        assert main(["search", "--n-jobs", n, "--out", "unused"]) == 2
        err = capsys.readouterr().err
        assert "--n-jobs must be at least 1" in err and err.count("\n") == 1
