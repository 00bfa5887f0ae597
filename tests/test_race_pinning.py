"""The race's ``--pin-nodes``: which CPUs each emulated node gets (``race.node_cpus``, pure), and
that the command prefix really keeps a program and its children there (a real ``taskset``)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from benchmarks.race.driver import node_cpus, pin_prefix


def test_nodes_get_disjoint_cpus_covering_all() -> None:
    assert node_cpus(2, [0, 1]) == [[0], [1]]
    assert node_cpus(3, [0, 1, 2, 3, 4, 5, 6]) == [[0, 1, 2], [3, 4], [5, 6]]
    assert node_cpus(1, [2, 5]) == [[2, 5]]


def test_more_nodes_than_cpus_share_round_robin() -> None:
    assert node_cpus(4, [0, 1]) == [[0], [1], [0], [1]]
    assert node_cpus(3, [7]) == [[7], [7], [7]]


def test_bad_input_is_refused() -> None:
    with pytest.raises(ValueError, match="needs nodes >= 1 and some CPUs"):
        node_cpus(2, [])
    with pytest.raises(ValueError, match="needs nodes >= 1"):
        node_cpus(0, [0, 1])


def test_unpinned_prefix_is_empty() -> None:
    assert pin_prefix(None) == []


@pytest.mark.skipif(shutil.which("taskset") is None, reason="taskset (util-linux) not installed")
def test_prefix_pins_the_program_and_its_children() -> None:
    cpu = min(os.sched_getaffinity(0))
    child = "import os; print(sorted(os.sched_getaffinity(0)))"
    # the program starts a child of its own: the affinity is inherited, as torchrun's ranks are
    parent = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {child!r}])"
    out = subprocess.run([*pin_prefix([cpu]), sys.executable, "-c", parent],
                         capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == f"[{cpu}]"
