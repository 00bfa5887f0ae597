"""Shared fixtures: one launch per world size runs every strategy case of that size."""

from __future__ import annotations

import fcntl
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.cases import all_cases, launch

# Rank scripts, not tests: never imported by pytest (``--doctest-modules`` would run them).
collect_ignore = ["scripts"]


@pytest.fixture(scope="session")
def world_run(tmp_path_factory) -> Callable[[int], Path]:
    """``world_run(n)`` launches the cases for world size ``n`` once and returns their folder.

    Once per test run, also under pytest-xdist (``make test``): every worker has a session of
    its own, so the launch goes to the folder all workers share (the parent of the workers'
    base temporary folders), under a file lock; the first worker that needs world size ``n``
    launches it, the others wait for the lock and read the same results.
    """
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    done: dict[int, Path] = {}

    def get(world: int) -> Path:
        if world not in done:
            folder = root / f"world_run{world}"
            with open(root / f"world_run{world}.lock", "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
                if not (folder / "launched").exists():
                    folder.mkdir(exist_ok=True)
                    launch(folder, all_cases(world), nprocs=world)
                    (folder / "launched").touch()
            done[world] = folder
        return done[world]

    return get


def pytest_collection_modifyitems(config, items) -> None:
    """A test that uses ``world_run`` launches processes: it is marked ``multiprocess`` here, so
    ``-m "not multiprocess"`` (``make test-fast``) leaves it out even if its mark was forgotten.

    Those tests are also put first: under pytest-xdist (``make test``: ``--dist loadfile``, all
    tests of a file on one worker, so a module's fixtures run once) their files then start at
    once, and the longest launches begin first.

    Tests marked ``slow`` (the fuzz subset, soak runs, benchmark smoke runs) are deselected by
    the ``-m "not slow"`` in ``pyproject.toml``'s ``addopts``; ``make test-slow`` (``-m slow``)
    runs them.
    """
    for item in items:
        if "world_run" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.multiprocess)
    items.sort(key=lambda item: "world_run" not in getattr(item, "fixturenames", ()))
