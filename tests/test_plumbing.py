"""The search's plumbing, one of each: the storage opener."""

from __future__ import annotations

import optuna
import pytest

from viasd_tune.errors import UserError
from viasd_tune.search import storage

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
    with pytest.raises(UserError, match="no study 'other' in that storage; studies there: s"):
        storage.load_study(url, "other")
    with pytest.raises(UserError, match="'notaurl' is not a storage URL; use sqlite:///"):
        storage.make_storage("notaurl")
