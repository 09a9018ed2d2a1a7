"""The typed trial and study records: what is written reads back, records written at different moments compose,
and the studies kept in benchmarks/results/ (written before the records existed) still read, export and draw."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import optuna
import pytest

from viasd_tune.dashboard import build_dashboard
from viasd_tune.search.export import build_profile, pick_trial
from viasd_tune.search.records import StudyRecord, TrialRecord

ROOT = Path(__file__).resolve().parents[1]
OLD_STUDIES = sorted((ROOT / "benchmarks" / "results").glob("*.db"))

optuna.logging.set_verbosity(optuna.logging.WARNING)


def _full(cls):
    """A record with every field set to a distinct JSON value of its kind."""
    values = {}
    for i, f in enumerate(dataclasses.fields(cls)):
        kind = str(f.type)
        if f.name == "held_out":
            values[f.name] = {3: {"speedup_measured": 1.5}, 12: {"speedup_measured": 0.9}}
        elif kind.startswith("bool"):
            values[f.name] = bool(i % 2)
        elif kind.startswith("int"):
            values[f.name] = i
        elif kind.startswith("float"):
            values[f.name] = i + 0.5
        elif kind.startswith("str"):
            values[f.name] = f"value {i}"
        elif kind.startswith("list"):
            values[f.name] = [i, i + 0.25]
        else:
            assert kind.startswith("dict"), (f.name, kind)
            values[f.name] = {"key": i}
    return cls(**values)


def test_a_trial_record_reads_back_what_was_written():
    study = optuna.create_study()
    trial = study.ask()
    record = _full(TrialRecord)
    record.write(trial)
    assert TrialRecord.read(trial) == record
    study.tell(trial, 1.0)
    assert TrialRecord.read(study.trials[0]) == record
    assert set(study.trials[0].user_attrs) == {f.name for f in dataclasses.fields(TrialRecord)}


def test_records_written_at_different_moments_compose():
    trial = optuna.create_study().ask()
    TrialRecord(worker="host:1").write(trial)
    TrialRecord(measured=False, fidelity=0.5).write(trial)
    TrialRecord(fidelity=0.75).write(trial)  # a later value replaces an earlier one
    assert TrialRecord.read(trial) == TrialRecord(worker="host:1", measured=False, fidelity=0.75)
    assert set(trial.user_attrs) == {"worker", "measured", "fidelity"}  # unset fields are not written


def test_a_study_record_reads_back_with_held_out_metrics_per_trial():
    study = optuna.create_study()
    record = _full(StudyRecord)
    record.write(study)
    assert StudyRecord.read(study) == record
    assert {"held_out:3", "held_out:12"} <= set(study.user_attrs)  # the layout exports have always read
    StudyRecord(held_out={5: {"speedup_measured": 2.0}}).write(study)
    assert set(StudyRecord.read(study).held_out) == {3, 5, 12}


def test_an_enqueued_plain_sd_point_is_a_reference_and_a_seed_is_not():
    study = optuna.create_study()
    for params in ({"drafter": "lookup", "escalate_all": True}, {"skip_frac": 0.1}):
        study.enqueue_trial(params, user_attrs=TrialRecord(enqueued=params).attrs())
    reference, seed, sampled = study.ask(), study.ask(), study.ask()
    assert TrialRecord.read(reference).reference
    assert TrialRecord.read(seed).enqueued == {"skip_frac": 0.1} and not TrialRecord.read(seed).reference
    assert TrialRecord.read(sampled) == TrialRecord()


@pytest.mark.parametrize("db", OLD_STUDIES, ids=lambda p: p.stem)
def test_old_studies_still_read_export_and_draw(db, tmp_path):
    """Every attribute these studies hold is a record field, and the export and the dashboard read them."""
    assert OLD_STUDIES, "benchmarks/results/ holds the studies this test reads"
    copy = tmp_path / db.name
    shutil.copy(db, copy)  # Optuna may write to a database it opens
    url = f"sqlite:///{copy}"
    (summary,) = optuna.get_all_study_summaries(url)
    study = optuna.load_study(study_name=summary.study_name, storage=url)
    trial_fields = {f.name for f in dataclasses.fields(TrialRecord)}
    study_fields = {f.name for f in dataclasses.fields(StudyRecord)}
    for t in study.trials:
        assert set(t.user_attrs) <= trial_fields, t.number
    assert {k.split(":")[0] if k.startswith("held_out:") else k for k in study.user_attrs} <= study_fields
    record = StudyRecord.read(study)
    chosen = pick_trial(study, "auto")
    profile = build_profile(study, chosen, record.held_out.get(chosen.number))
    assert profile["provenance"]["trial"] == chosen.number == record.exported_trial
    assert profile["metrics"]["speedup_measured"] == record.held_out[chosen.number]["speedup_measured"]
    assert profile["target"]["name"] == record.target and profile["dtype"] == record.dtype
    page = build_dashboard(study, tmp_path / "dashboard.html").read_text(encoding="utf-8")
    assert f"trial #{chosen.number}" in page and record.target in page
