"""One self-contained HTML dashboard of a search study: Pareto front, skipped sub-layers, thresholds, where the
exported profile's tokens went, and Optuna's history and importance plots.

By job: ``points`` turns trials into plotted points, ``figures``, ``layer_maps`` and ``study_plots`` draw,
``page`` lays the figures out in one offline HTML file, ``load`` opens a study to draw. It reads only the
study's records (``search/records.py``), so it needs no model.
"""

from .load import dashboard_from_out_dir, dashboard_from_storage
from .page import FIG_ID_PREFIX, build_dashboard, write_beside_profile

__all__ = [
    "FIG_ID_PREFIX",
    "build_dashboard",
    "dashboard_from_out_dir",
    "dashboard_from_storage",
    "write_beside_profile",
]
