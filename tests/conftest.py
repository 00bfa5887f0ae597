"""Shared fixtures: one launch per process layout runs every strategy case of that layout.
Without torchaudio, the modules that import the ASR recipe skip (below). The order in which
``make test``'s workers take the files, and the optional record of every test's time
(``LG_TEST_TIMES``), are set here too."""

from __future__ import annotations

import ast
import fcntl
import importlib.util
import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.shared_runs import LAYOUTS, launch_layout

# Rank scripts, not tests: never imported by pytest (``--doctest-modules`` would run them).
collect_ignore = ["scripts"]

# -- without torchaudio (it has no release for the newest torch: ``make test-latest``) ------------
NO_TORCHAUDIO = importlib.util.find_spec("torchaudio") is None
TORCHAUDIO_REASON = ("torchaudio is not installed (its last release, 2.11, pins its own torch; "
                     "`make test-latest` runs without it): the ASR recipe needs it")
_NEEDS_TORCHAUDIO = ("torchaudio", "recipes.asr", "tests.recipes.asr_corpus")


def imports_torchaudio(path: Path) -> bool:
    """Whether the module at ``path`` imports torchaudio, the ASR recipe or the tests' ASR
    corpus at its top level (importing it then fails without torchaudio)."""
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [node.module]
        else:
            continue
        if any(n == m or n.startswith(m + ".") for n in names for m in _NEEDS_TORCHAUDIO):
            return True
    return False


class _SkippedModule(pytest.Module):
    """A module that imports the ASR recipe, skipped at collection (it would import torchaudio)."""

    def _getobj(self):  # noqa: ANN202 - pytest's hook
        pytest.skip(TORCHAUDIO_REASON, allow_module_level=True)


@pytest.hookimpl(wrapper=True)
def pytest_collect_file(file_path: Path, parent: pytest.Collector):  # noqa: ANN201 - a wrapper
    """Without torchaudio, a module that imports the ASR recipe is one skipped node, in place
    of its test module and of the doctest module ``--doctest-modules`` makes of it (both would
    fail to import)."""
    collected = yield
    if (NO_TORCHAUDIO and collected and file_path.suffix == ".py"
            and imports_torchaudio(file_path)):
        return [_SkippedModule.from_parent(parent, path=file_path)]
    return collected


@pytest.fixture(scope="session")
def shared_run(tmp_path_factory) -> Callable[[str], Path]:
    """``shared_run(key)`` launches the cases of ``tests.shared_runs.LAYOUTS[key]`` once and
    returns their folder.

    Once per test run, also under pytest-xdist (``make test``): every worker has a session of
    its own, so the launch goes to the folder all workers share (the parent of the workers'
    base temporary folders), under a file lock; the first worker that needs a layout launches
    it, the others wait for the lock and read the same results. A launch that failed is not
    repeated: the tests that need it fail with its error.
    """
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    done: dict[str, Path] = {}

    def get(key: str) -> Path:
        if key not in LAYOUTS:
            raise KeyError(f"no shared launch {key!r}: one of {sorted(LAYOUTS)}")
        if key not in done:
            folder = root / f"shared_{key}"
            with open(root / f"shared_{key}.lock", "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
                if (folder / "error").exists():
                    raise AssertionError((folder / "error").read_text())
                if not (folder / "launched").exists():
                    folder.mkdir(exist_ok=True)
                    try:
                        launch_layout(key, folder)
                    except BaseException as e:
                        (folder / "error").write_text(f"shared launch {key} failed: {e}")
                        raise
                    (folder / "launched").touch()
            done[key] = folder
        return done[key]

    return get


@pytest.fixture(scope="session")
def world_run(shared_run) -> Callable[[int], Path]:
    """``world_run(n)``: the folder of the shared launch with ``n`` ranks (1 to 5)."""
    return lambda world: shared_run(f"world{world}")


#: The test files that took longest in ``make test`` (their tests' setup, call and teardown
#: times summed; measured as tests/README.md says), in the order the workers take them: the
#: longest first. ``test_elastic.py`` stays one file: its tests start processes late (a
#: replacement, a late rank) that must join a running fit, and beside another elastic launch
#: under load they came too late (all such cases failed once when the file was split in three).
#: Then the files that use a shared launch, then the other files that launch processes, then
#: the rest, which fill the end of the run.
LONGEST_FIRST = (
    "test_elastic.py",
    "test_faults.py",
    "test_communication_budget.py",
    "test_features.py",
    "test_hot_path.py",
    "test_faults_frozen.py",
    "test_recipes_resume.py",
    "test_multinode_user.py",
    "test_async_gossip_unit.py",
    "test_hierarchical_adpsgd.py",
    "test_remedies.py",
    "test_liveness_monitor.py",
)


def _file_order(items) -> dict[Path, tuple[int, int]]:
    """Each file's place in the run: its index in :data:`LONGEST_FIRST`, or after them: 0 if a
    test of it uses a shared launch, 1 if one launches processes (``multiprocess``), else 2."""
    order: dict[Path, tuple[int, int]] = {}
    for item in items:
        path = Path(str(item.path))
        if path.name in LONGEST_FIRST:
            kind = (LONGEST_FIRST.index(path.name), 0)
        elif "shared_run" in getattr(item, "fixturenames", ()):
            kind = (len(LONGEST_FIRST), 0)
        elif item.get_closest_marker("multiprocess") is not None:
            kind = (len(LONGEST_FIRST), 1)
        else:
            kind = (len(LONGEST_FIRST), 2)
        order[path] = min(order.get(path, kind), kind)
    return order


def pytest_collection_modifyitems(config, items) -> None:
    """A test that uses ``shared_run`` (or ``world_run``) launches processes: it is marked
    ``multiprocess`` here, so ``-m "not multiprocess"`` (``make test-fast``) leaves it out even
    if its mark was forgotten.

    The files are ordered for ``make test`` (pytest-xdist, ``--dist loadfile``: all tests of a
    file on one worker, so a module's fixtures run once; ``--no-loadscope-reorder``: the
    workers take the files in collection order): :func:`_file_order`, the longest first; the
    tests of a file stay together (in one process, ``TEST_WORKERS=0``, a module's fixtures
    then run once too). Within a file the tests that use a shared launch come first (a launch
    another worker has begun is then waited for early).

    Tests marked ``slow`` (the fuzz subset, soak runs, benchmark smoke runs) are deselected by
    the ``-m "not slow"`` in ``pyproject.toml``'s ``addopts``; ``make test-slow`` (``-m slow``)
    runs them.

    Without torchaudio, the recipe tests' cases that run the ASR recipe (an ``asr`` in their
    name) skip.
    """
    if NO_TORCHAUDIO:
        for item in items:
            if "tests/recipes/" in item.nodeid and "asr" in item.nodeid.split("::")[-1]:
                item.add_marker(pytest.mark.skip(reason=TORCHAUDIO_REASON))
    for item in items:
        if "shared_run" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.multiprocess)
    order, first = _file_order(items), {}
    for i, item in enumerate(items):
        first.setdefault(Path(str(item.path)), i)
    items.sort(key=lambda item: (order[Path(str(item.path))], first[Path(str(item.path))],
                                 "shared_run" not in getattr(item, "fixturenames", ())))


# -- LG_TEST_TIMES=FILE: one JSON line per test phase (testbed/suite_times.py reads them) ----------
def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """With ``LG_TEST_TIMES`` set, append ``{"nodeid", "when", "start", "stop", "duration",
    "worker", "outcome"}`` for each setup, call and teardown to that file (in the controller
    only under pytest-xdist: the workers' reports reach it with the worker that ran them)."""
    path = os.environ.get("LG_TEST_TIMES")
    if not path or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    node = getattr(report, "node", None)
    worker = node.gateway.id if node is not None else "main"
    line = {"nodeid": report.nodeid, "when": report.when, "start": report.start,
            "stop": report.stop, "duration": report.duration, "worker": worker,
            "outcome": report.outcome}
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(line) + "\n")
