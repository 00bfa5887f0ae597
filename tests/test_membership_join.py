"""A process joins a running fit's groups (``lightning_gossip.elastic.membership``, the mechanism of
elastic joins): 4 ranks started one process each as ``srun`` starts tasks, ranks 2 and 3 leave
(rank 2's loss found while the survivors gather), the survivors go on as (0, 1); a newcomer
with rank 3's environment asks for the slot, is admitted with slot 2 still free, and all three
build the next generation's groups by name (the newcomer's default group is the first, its
members numbered from 0, every group's rank map in slots). One launch
(``tests/scripts/membership_join.py``)."""

from __future__ import annotations

import json
import sys

import pytest

from testbed.launch import ROOT, base_env, free_port, launch_processes

pytestmark = pytest.mark.multiprocess
SCRIPT = ROOT / "tests" / "scripts" / "membership_join.py"


@pytest.fixture(scope="module")
def results() -> dict[int, dict]:
    port = str(free_port())
    common = {"WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
    commands = [([sys.executable, str(SCRIPT)], base_env(RANK=str(r), **common))
                for r in range(4)]
    commands.append(([sys.executable, str(SCRIPT)], base_env(RANK="3", JOINER="1", **common)))
    launched = launch_processes(commands, timeout=240)
    assert not launched.timed_out, launched.stdout[-8000:]
    out: dict[int, dict] = {}
    for line in launched.stdout.splitlines():
        if line.startswith("RESULT "):
            rec = json.loads(line[len("RESULT "):])
            out[rec["rank"]] = rec
    assert sorted(out) == [0, 1, 3], launched.stdout[-8000:]
    return out


def test_survivors_agree_and_build_groups_by_name(results: dict[int, dict]) -> None:
    for r in (0, 1):
        rec = results[r]
        assert rec["first"] == 0 + 1 + 2 + 3
        assert rec["after_loss"] == [0, 1]  # rank 2 dropped while they gathered
        assert rec["survivors_sum"] == 0 + 1


def test_newcomer_is_admitted_with_a_slot_free_and_shares_the_groups(
        results: dict[int, dict]) -> None:
    for r in (0, 1, 3):
        rec = results[r]
        assert rec["after_join"] == [0, 1, 3]
        assert rec["generation"] == 2
        assert rec["joined_sum"] == 10 + 11 + 13
        assert rec["data_sum"] == 0 + 1 + 3
        assert rec["from_3"] == 33.0  # a broadcast from slot 3, the newcomer's
    # a member that polled after another had decided sees the started generation, no request
    asked = [results[r]["asked"] for r in (0, 1)]
    assert [3] in asked and all(a in ([3], []) for a in asked), asked
    joiner = results[3]
    assert joiner["default_is_group"] and joiner["world"] == 3
    assert joiner["default_rank"] == 2 and joiner["default_slots"] == [0, 1, 3]
    assert joiner["received"] == 42.0  # sent to slot 3 over a named group
