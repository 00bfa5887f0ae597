"""A seeded 10-run subset of the fuzz harness (``testbed/fuzz.py``; the full run is opt-in)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from testbed import fuzz


def test_draws_are_seeded_and_varied():
    specs = [fuzz.draw(1, i, max_world=3) for i in range(10)]
    assert specs == [fuzz.draw(1, i, max_world=3) for i in range(10)]
    assert {s["strategy"] for s in specs} == {"dpsgd", "adpsgd"}
    assert all(2 <= s["devices"] <= 3 for s in specs)
    assert all(s["samples"] % 2 == 1 for s in specs)  # never splits evenly


def test_a_launch_with_only_frozen_processes_left_is_recognised():
    """Rank 0 frozen under Lightning's launcher is the launcher itself: once every other rank
    ended, only stopped processes are left and the harness ends the launch."""
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert not fuzz._only_frozen_left([sleeper.pid])  # running (sleeping)
        os.kill(sleeper.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while not fuzz._only_frozen_left([sleeper.pid]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert fuzz._only_frozen_left([sleeper.pid])
        assert not fuzz._only_frozen_left([sleeper.pid, os.getpid()])  # one still runs
    finally:
        sleeper.kill()
        sleeper.wait()
    assert not fuzz._only_frozen_left([sleeper.pid])  # gone


@pytest.mark.slow  # 7 minutes: make test-slow; tests/test_faults.py covers every fault kind
@pytest.mark.multiprocess
@pytest.mark.timeout(7200)  # 10 launches of 1-3 minutes each, more on a loaded machine
def test_seeded_subset_never_hangs_and_names_the_culprit(tmp_path):
    out = tmp_path / "fuzz.json"
    status = fuzz.main(["--runs", "10", "--seed", "1", "--max-world", "3", "--out", str(out)])
    result = json.loads(out.read_text())
    bad = [r for r in result["runs"] if r["verdict"] not in fuzz.GOOD]
    assert status == 0 and not bad, json.dumps(bad, indent=1)[-8000:]
