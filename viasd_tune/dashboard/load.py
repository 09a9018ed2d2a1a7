"""Opening a study to draw: from an Optuna storage URL and study name, or from a search's output folder."""

from __future__ import annotations

import json
from pathlib import Path

import optuna
from optuna.trial import TrialState

from ..credentials import redact
from ..errors import UserError
from ..search.records import StudyRecord
from ..search.storage import make_storage, sqlite_file
from .page import build_dashboard


def _open_storage(storage: str) -> optuna.storages.BaseStorage:
    """The storage through search/storage.py, as search and export open it (one redaction, the driver choice,
    one-line errors)."""
    db = sqlite_file(storage)
    if db is not None and not db.is_file():  # SQLAlchemy would silently create an empty database there
        raise UserError(f"no Optuna database at {db}; check the path (a search writes <out>/study.db)")
    return make_storage(storage)


def _study_names(storage: optuna.storages.BaseStorage) -> list[str]:
    return sorted(s.study_name for s in storage.get_all_studies())


def _load(storage: optuna.storages.BaseStorage, study_name: str, where: str) -> optuna.Study:
    names = _study_names(storage)
    if study_name not in names:
        raise UserError(
            f"no study {study_name!r} in {where}; studies there: {', '.join(map(repr, names)) or 'none'}"
        )
    study = optuna.load_study(study_name=study_name, storage=storage)
    if not study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
        raise UserError(
            f"study {study_name!r} in {where} has no complete trial yet ({len(study.trials)} trials in all); "
            "run or resume the search first"
        )
    return study


def dashboard_from_storage(storage: str, study_name: str, out: str | Path) -> Path:
    """Load ``study_name`` from an Optuna storage URL and write its dashboard to ``out``."""
    study = _load(_open_storage(storage), study_name, redact(storage))
    return build_dashboard(study, out)


def _profile_study(out_dir: Path) -> tuple[str | None, int | None]:
    """Study name and trial from ``out_dir/profile.json``'s provenance, when the file is there and readable."""
    try:
        provenance = json.loads((out_dir / "profile.json").read_text(encoding="utf-8"))["provenance"]
    except (OSError, ValueError, KeyError, TypeError):
        return None, None
    name, trial = provenance.get("study"), provenance.get("trial")
    return (
        name if isinstance(name, str) else None,
        trial if isinstance(trial, int) and not isinstance(trial, bool) else None,
    )


def dashboard_from_out_dir(out_dir: str | Path, out: str | Path | None = None) -> Path:
    """The dashboard of a search output directory: ``<out_dir>/study.db``, its only study (or the one named in
    ``profile.json``'s provenance), written to ``out`` (default ``<out_dir>/dashboard.html``)."""
    out_dir = Path(out_dir)
    if not out_dir.is_dir():
        raise UserError(f"--out-dir {out_dir} is not a directory; give the folder a search wrote")
    db = out_dir / "study.db"
    if not db.is_file():
        raise UserError(
            f"no study.db in {out_dir}; give the folder a search wrote, or use --storage and --study-name"
        )
    storage = _open_storage(f"sqlite:///{db.resolve()}")
    named, profile_trial = _profile_study(out_dir)
    names = _study_names(storage)
    if named is None:
        if len(names) != 1:
            raise UserError(
                f"{db} holds {len(names)} studies ({', '.join(map(repr, names)) or 'none'}) and no profile.json "
                "names one; use --storage and --study-name"
            )
        named = names[0]
    study = _load(storage, named, str(db))
    exported = StudyRecord.read(study).exported_trial
    if not isinstance(exported, int) or isinstance(exported, bool):
        exported = profile_trial
    return build_dashboard(
        study, out if out is not None else out_dir / "dashboard.html", exported_trial=exported
    )
