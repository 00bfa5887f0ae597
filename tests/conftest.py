"""Shared fixtures: one launch per world size runs every strategy case of that size."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.cases import all_cases, launch

WORLD_GROUP = "world_run"  # the xdist group of every test that reads a world_run launch

# Rank scripts, not tests: never imported by pytest (``--doctest-modules`` would run them).
collect_ignore = ["scripts"]


@pytest.fixture(scope="session")
def world_run(tmp_path_factory) -> Callable[[int], Path]:
    """``world_run(n)`` launches the cases for world size ``n`` once and returns their folder."""
    done: dict[int, Path] = {}

    def get(world: int) -> Path:
        if world not in done:
            tmp = tmp_path_factory.mktemp(f"world{world}")
            launch(tmp, all_cases(world), nprocs=world)
            done[world] = tmp
        return done[world]

    return get


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups
def pytest_collection_modifyitems(config, items) -> None:
    """Marks that follow from what a test uses, and the groups of a parallel run.

    * A test that uses ``world_run`` launches processes: it is marked ``multiprocess`` here, so
      ``-m "not multiprocess"`` (``make test-fast``) leaves it out even if its mark was
      forgotten.
    * ``make test`` runs on pytest-xdist workers with ``--dist loadgroup``: every test gets an
      ``xdist_group``, its file (module- and session-scoped fixtures, such as a module's one
      launch, then run once), except the ``world_run`` tests of all files, which share one
      group so that each world size is still launched once. The ``world_run`` group, the
      longest, is put first so that it starts at once.
    * Tests marked ``slow`` (the fuzz subset, soak runs, benchmark smoke runs) are deselected by
      the ``-m "not slow"`` in ``pyproject.toml``'s ``addopts``; ``make test-slow``
      (``-m slow``) runs them.
    """
    for item in items:
        shared = "world_run" in getattr(item, "fixturenames", ())
        if shared:
            item.add_marker(pytest.mark.multiprocess)
        item.add_marker(pytest.mark.xdist_group(WORLD_GROUP if shared
                                                else item.nodeid.split("::")[0]))
    items.sort(key=lambda item: "world_run" not in getattr(item, "fixturenames", ()))
