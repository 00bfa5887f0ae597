"""Shared fixtures: one launch per world size runs every strategy case of that size."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.cases import all_cases, launch

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


def pytest_collection_modifyitems(config, items) -> None:
    """Tests marked ``slow`` (soak runs, extra strategies) run only with ``LG_SLOW=1``.

    A test that uses ``world_run`` launches processes: it is marked ``multiprocess`` here, so
    ``-m "not multiprocess"`` (``make test-fast``) leaves it out even if its mark was forgotten.
    """
    for item in items:
        if "world_run" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.multiprocess)
    if os.environ.get("LG_SLOW") == "1":
        return
    skip = pytest.mark.skip(reason="slow: set LG_SLOW=1 to run")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
