"""The race's bytes per node and step (``benchmarks.race.worker.bytes_between``), a pure function.

Each node's meter marks ``(steps, tx bytes, tx bytes during evaluation)``; the race reports the
link bytes of all nodes over all nodes' optimizer steps, so an ``adpsgd`` case whose fast node
took more steps is not averaged as if every node had stepped equally.
"""

from __future__ import annotations

from benchmarks.race.worker import bytes_between


def test_equal_steps_give_each_node_s_rate() -> None:
    nodes = [{"start": (0, 0, 0), "end": (10, 1_000, 0)},
             {"start": (0, 0, 0), "end": (10, 3_000, 0)}]
    assert bytes_between(nodes, "start", "end") == 200.0


def test_unequal_steps_are_weighted_by_steps() -> None:
    # fast node: 30 steps, 3,000 bytes; slow node: 10 steps, 2,000 bytes (its requests are
    # served by the fast node, its few steps each exchange more): 5,000 / 40, not (100 + 200) / 2
    nodes = [{"start": (0, 0, 0), "end": (30, 3_000, 0)},
             {"start": (0, 0, 0), "end": (10, 2_000, 0)}]
    assert bytes_between(nodes, "start", "end") == 125.0


def test_evaluation_bytes_are_left_out_and_missing_marks_give_none() -> None:
    nodes = [{"start": (5, 100, 10), "end": (15, 1_600, 510)}]
    assert bytes_between(nodes, "start", "end") == 100.0  # (1500 - 500) / 10
    assert bytes_between(nodes, "start", "warmup") is None
    assert bytes_between([{"start": (5, 0, 0), "end": (5, 10, 0)}], "start", "end") is None
