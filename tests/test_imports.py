"""The package's import architecture, checked by import-linter with the contracts in pyproject.toml
([tool.importlinter]): modules import only from the layers below them (the pipeline), and no modules import each
other, at any depth. Function-level imports count too: they hide a dependency from Python, not from a reader."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINT = (
    "import sys; from importlinter.cli import lint_imports; "
    "sys.exit(lint_imports(config_filename='pyproject.toml', no_cache=True, no_logo=True))"
)


def lint(root: Path) -> tuple[int, set[str]]:
    """import-linter over the package under ``root`` with ``root``'s contracts: its exit status and the names
    of the contracts it reports broken."""
    env = {**os.environ, "PYTHONPATH": str(root), "COLUMNS": "1000"}  # one line per contract
    done = subprocess.run([sys.executable, "-c", LINT], cwd=root, env=env, capture_output=True, text=True)
    broken = set(re.findall(r"^(.+?) BROKEN$", done.stdout, flags=re.MULTILINE))
    return done.returncode, broken


def test_the_package_keeps_its_import_contracts():
    code, broken = lint(ROOT)
    assert (code, broken) == (0, set())


@pytest.fixture(scope="module")
def contracts() -> dict[str, str]:
    """Contract id -> name, as pyproject.toml declares them."""
    from importlinter.api import read_configuration

    config = read_configuration(str(ROOT / "pyproject.toml"))
    return {c["id"]: c["name"] for c in config["contracts_options"]}


UPWARD_IN_A_FUNCTION = "def _up():\n    from .dashboard import build_dashboard\n"


@pytest.mark.parametrize(
    ("module", "line", "contract"),
    [
        ("routing.py", UPWARD_IN_A_FUNCTION, "layers"),
        (
            "search/export.py",
            "from ..dashboard import build_dashboard\n",
            "layers",
        ),  # the search above the page
        ("search/records.py", "from . import screen\n", "search"),  # records below what reads them
        ("decoding/common.py", "from . import sd\n", "acyclic"),  # sd imports common: a cycle in one layer
    ],
)
def test_the_contracts_catch_an_upward_import_and_a_cycle(tmp_path, contracts, module, line, contract):
    """The same check on a copy of the package with one import added: the contract it breaks says so."""
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    shutil.copytree(
        ROOT / "viasd_tune", tmp_path / "viasd_tune", ignore=shutil.ignore_patterns("__pycache__")
    )
    path = tmp_path / "viasd_tune" / module
    path.write_text(path.read_text(encoding="utf-8") + "\n" + line, encoding="utf-8")
    code, broken = lint(tmp_path)
    assert code != 0 and contracts[contract] in broken
