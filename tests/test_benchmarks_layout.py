"""The layout of ``testbed/`` and ``benchmarks/``, read from the source (nothing is imported).

* Nothing in ``benchmarks/``, ``testbed/`` or ``tests/`` edits the import path (``sys.path``)
  or waives the import-order rule (``E402``): every import is a plain import of a package of
  the repository root, and every script runs as a module (``python -m benchmarks.perf.x``).
* Every folder of Python files under ``benchmarks/`` and ``testbed/`` is a package.
* No import cycle among the modules of ``benchmarks`` and ``testbed``, function-level imports
  included (``benchmarks/gpu/check.py`` and ``gpu_checks.py`` once imported each other).
* ``testbed`` (what the tests and the benchmarks run on) imports nothing from ``benchmarks``
  or ``tests``; the library imports neither ``benchmarks`` nor ``testbed``.
* No module of the repository is imported under a one-letter name in ``benchmarks`` or
  ``testbed`` (``S`` once meant ``straggling`` in two files and ``slurm_cluster`` in a third).
* The wheel ships neither: setuptools finds only ``lightning_gossip*`` and ``recipes*``.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.test_import_graph import find_cycle

REPO = Path(__file__).resolve().parents[1]
LAYOUT = ("benchmarks", "testbed")
FIRST_PARTY = ("benchmarks", "testbed", "tests", "lightning_gossip", "recipes")
#: the import-path edits and waivers looked for (built so that this file does not match itself)
PATH_EDIT = re.compile(r"\bsys\s*\.\s*path\s*(\.\s*(insert|append|extend)\b|\+?=[^=])")
WAIVER = re.compile(r"noqa:[^\n]*\b" + "E4" + "02")


def python_files(*tops: str) -> list[Path]:
    """The ``.py`` files under the repository folders ``tops``."""
    return sorted(p for top in tops for p in (REPO / top).rglob("*.py"))


def module_name(path: Path) -> str:
    """The dotted name of the module at ``path`` (a package by its ``__init__.py``)."""
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in python_files(*LAYOUT)}


def imports(path: Path) -> Iterator[tuple[ast.Import | ast.ImportFrom, str]]:
    """Every import statement of ``path``, function bodies included, with each module it
    names: ``from a.b import c`` names ``a.b.c`` where that is a module of :data:`MODULES`,
    else ``a.b``; relative imports are resolved against the module's package."""
    tree = ast.parse(path.read_text(), str(path))
    package = module_name(path).rsplit(".", 1)[0] if path.name != "__init__.py" \
        else module_name(path)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:
                full = f"{base}.{alias.name}"
                yield node, full if full in MODULES else base


def top(name: str) -> str:
    """The top-level package of the dotted ``name``."""
    return name.split(".", 1)[0]


def test_no_import_path_edits_or_import_order_waivers() -> None:
    """``sys.path`` untouched and no ``E402`` waiver in benchmarks/, testbed/, tests/ (their
    code strings included: a rank script written at run time counts too)."""
    found = []
    for path in python_files(*LAYOUT, "tests"):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if PATH_EDIT.search(line) or WAIVER.search(line):
                found.append(f"{path.relative_to(REPO)}:{n}: {line.strip()}")
    assert found == []


def test_every_folder_of_modules_is_a_package() -> None:
    folders = {p.parent for p in python_files(*LAYOUT)}
    assert sorted(str(f.relative_to(REPO)) for f in folders
                  if not (f / "__init__.py").exists()) == []


def test_the_packages_are_found() -> None:
    """The self-check of this file: the graph below is built from the real modules."""
    for name in ("testbed.launch", "testbed.cluster_net", "testbed.slurm_cluster",
                 "testbed.fuzz", "testbed.emergency_fuzz", "benchmarks.common.harness",
                 "benchmarks.race.driver", "benchmarks.race.worker", "benchmarks.gpu.check",
                 "benchmarks.gpu.cases", "benchmarks.perf.step_time"):
        assert name in MODULES, name
    edges = {(module_name(p), named) for p in MODULES.values() for _, named in imports(p)}
    assert ("benchmarks.gpu.check", "benchmarks.gpu.cases") in edges  # a function-level import
    assert ("benchmarks.common.harness", "testbed.launch") in edges


def test_find_cycle_finds_one() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_no_import_cycle_among_benchmarks_and_testbed() -> None:
    graph = {name: {named for _, named in imports(path) if named in MODULES and named != name}
             for name, path in MODULES.items()}
    assert find_cycle(graph) is None


@pytest.mark.parametrize(("importer", "forbidden"), [
    ("testbed", ("benchmarks", "tests")),
    ("lightning_gossip", ("benchmarks", "testbed", "tests")),
])
def test_dependencies_point_one_way(importer: str, forbidden: tuple[str, ...]) -> None:
    """tests -> benchmarks -> testbed -> lightning_gossip, never back."""
    found = [f"{p.relative_to(REPO)}:{node.lineno} imports {named}"
             for p in python_files(importer) for node, named in imports(p)
             if top(named) in forbidden]
    assert found == []


def test_no_one_letter_names_for_the_repository_modules() -> None:
    found = []
    for path in python_files(*LAYOUT):
        for node, named in imports(path):
            for alias in node.names:
                if alias.asname and len(alias.asname) == 1 and top(named) in FIRST_PARTY:
                    found.append(f"{path.relative_to(REPO)}:{node.lineno}: {alias.name} as "
                                 f"{alias.asname}")
    assert found == []


def test_the_wheel_ships_neither() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    include = config["tool"]["setuptools"]["packages"]["find"]["include"]
    assert not [pattern for pattern in include
                if any(re.fullmatch(pattern.replace("*", ".*"), name) for name in LAYOUT)]
