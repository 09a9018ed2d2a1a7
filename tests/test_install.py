"""The install the README gives and CI runs: one lock, used by both, that satisfies pyproject.toml's ranges."""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

if sys.version_info >= (3, 11):
    import tomllib
else:  # the test extra installs it there
    import tomli as tomllib

ROOT = Path(__file__).parents[1]


def _bash_blocks(section: str) -> list[str]:
    """The ```bash blocks of one README section (from its heading to the next ``## ``)."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    body = text.split(f"## {section}\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```bash\n(.*?)```", body, re.S)


def _commands(script: str) -> list[str]:
    """Shell commands, one per line or ``&&`` link, comments and blank lines dropped, pip's ``-q`` ignored."""
    out = []
    for line in script.replace("\\\n", " ").splitlines():
        line = line.split(" #", 1)[0].strip()
        if line and not line.startswith("#"):
            for command in line.split("&&"):
                words = shlex.split(command)
                out.append(" ".join(w for w in words if not (words[0] == "pip" and w == "-q")))
    return out


def _lock() -> dict[str, Version]:
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            req = Requirement(line)
            (spec,) = req.specifier  # exact pins only
            assert spec.operator == "==", line
            pins[canonicalize_name(req.name)] = Version(spec.version)
    return pins


def test_readme_has_two_setup_commands_and_ci_runs_them() -> None:
    install, tests = _bash_blocks("Set up (fresh machine)")  # exactly two commands for a new user
    install, tests = _commands(install), _commands(tests)
    assert install[:2] == ["python3 -m venv .venv", ". .venv/bin/activate"]  # a fresh environment
    pip = [c for c in install if c.startswith("pip ")]
    assert pip == ["pip install torch==2.13.0", "pip install -c constraints.txt -e .[test]"]
    assert install[-1].startswith("viasd-tune search")
    assert tests == ["python -m pytest -q"]

    ci = _commands((ROOT / ".ci" / "run").read_text())
    assert "python3 -m venv $venv" in ci and ". $venv/bin/activate" in ci  # its own fresh environment
    assert [c for c in ci if c.startswith("pip install")] == pip  # the README's install, from the same lock
    assert ci[-1] == tests[0]  # and then exactly the README's test command


def test_the_lock_satisfies_pyproject() -> None:
    """Every requirement of the package and its test extra is pinned, inside pyproject's range."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    lock = _lock()
    wanted = [Requirement(r) for r in project["dependencies"] + project["optional-dependencies"]["test"]]
    for req in wanted:
        if req.marker is not None and not req.marker.evaluate():
            continue  # not for this Python
        name = canonicalize_name(req.name)
        assert name in lock, f"{req.name} is not in constraints.txt"
        assert req.specifier.contains(lock[name], prereleases=True), (
            f"constraints.txt: {name}=={lock[name]} vs {req}"
        )
    assert canonicalize_name(project["name"]) not in lock  # the project itself is installed from the tree
