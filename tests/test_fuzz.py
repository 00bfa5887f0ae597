"""A seeded 10-run subset of the fuzz harness (``benchmarks/fuzz.py``; the full run is opt-in)."""

from __future__ import annotations

import json

import pytest

from benchmarks import fuzz


def test_draws_are_seeded_and_varied():
    specs = [fuzz.draw(1, i, max_world=3) for i in range(10)]
    assert specs == [fuzz.draw(1, i, max_world=3) for i in range(10)]
    assert {s["strategy"] for s in specs} == {"dpsgd", "adpsgd"}
    assert all(2 <= s["devices"] <= 3 for s in specs)
    assert all(s["samples"] % 2 == 1 for s in specs)  # never splits evenly


@pytest.mark.multiprocess
@pytest.mark.timeout(7200)  # 10 launches of 1-3 minutes each, more on a loaded machine
def test_seeded_subset_never_hangs_and_names_the_culprit(tmp_path):
    out = tmp_path / "fuzz.json"
    status = fuzz.main(["--runs", "10", "--seed", "1", "--max-world", "3", "--out", str(out)])
    result = json.loads(out.read_text())
    bad = [r for r in result["runs"] if r["verdict"] not in fuzz.GOOD]
    assert status == 0 and not bad, json.dumps(bad, indent=1)[-8000:]
