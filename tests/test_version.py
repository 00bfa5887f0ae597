"""One version: ``pyproject.toml``, ``lightning_gossip.__version__`` and the CHANGELOG agree.

The newest released section of CHANGELOG.md (the first ``## [x.y.z]`` after ``[Unreleased]``)
must be the version the package says it is, so a release bumps all three together.
"""

from __future__ import annotations

import re
from pathlib import Path

import lightning_gossip

ROOT = Path(__file__).resolve().parents[1]


def _pyproject_version() -> str:
    """``version`` of the ``[project]`` table (a regex: ``tomllib`` needs Python 3.11)."""
    text = (ROOT / "pyproject.toml").read_text()
    table = re.search(r"^\[project\]\n(.*?)(?=^\[|\Z)", text, re.M | re.S)
    assert table is not None, "pyproject.toml has no [project] table"
    match = re.search(r'^version\s*=\s*"([^"]+)"', table.group(1), re.M)
    assert match is not None, "pyproject.toml's [project] has no version"
    return match.group(1)


def _changelog_sections() -> list[str]:
    """The names of CHANGELOG.md's ``## [...]`` sections, top first."""
    return re.findall(r"^## \[([^\]]+)\]", (ROOT / "CHANGELOG.md").read_text(), re.M)


def test_package_version_is_pyprojects() -> None:
    assert lightning_gossip.__version__ == _pyproject_version()


def test_changelog_newest_release_is_the_package_version() -> None:
    sections = _changelog_sections()
    assert sections[0] == "Unreleased", sections
    released = [name for name in sections if name != "Unreleased"]
    assert released and released[0] == lightning_gossip.__version__, sections
