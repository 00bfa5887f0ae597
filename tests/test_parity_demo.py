"""``benchmarks/perf/parity_demo.py`` at its test size: the demo's training command for ddp and
adpsgd at ddp's rate and at the rule's rate, 2 processes, 2 batches of 1 epoch on the tiny
corpus. Checks the effective rates the record states against what the runs logged, that each
run's log is kept next to the JSON, the dev and test WERs, and that a second call skips the
runs already recorded.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from testbed.launch import ROOT, base_env
from tests.recipes.asr_corpus import needs_espeak, tiny_corpus_dir

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess, needs_espeak]


@pytest.mark.timeout(1800)
def test_parity_demo_quick(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    data = tiny_corpus_dir(tmp_path_factory)
    out = tmp_path / "parity.json"
    cmd = [sys.executable, "-m", "benchmarks.perf.parity_demo", "--quick", "--strategies", "ddp",
           "adpsgd", "--seeds", "7", "--devices", "2", "--data", str(data), "--out", str(out),
           "--runs-dir", str(tmp_path / "runs"), "--allow-dirty"]
    result = subprocess.run(cmd, cwd=ROOT, env=base_env(), text=True, capture_output=True,
                            timeout=1700)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rec = json.loads(out.read_text())
    runs = {r["name"]: r for r in rec["runs"]}
    base = rec["base_lr"]
    assert {n: r["lr"] for n, r in runs.items()} == {
        "ddp_ddprate_seed7": base, "ddp_rulerate_seed7": pytest.approx(base * 2 ** 0.5),
        "adpsgd_ddprate_seed7": base, "adpsgd_rulerate_seed7": pytest.approx(base * 2 ** 0.5)}
    for name, r in runs.items():
        log = out.parent / r["log"]
        assert log.is_file() and log.parent.name == "parity.json.logs", name
        assert r["exit_code"] == 0 and r["test_wer"] is not None, name
        assert len(r["dev_wer"]) == 1 and r["dev_wer"][0] >= 0, name
        assert "--seed_everything=7" in r["command"], name
    # the gossip run at the rule's rate logged the rule's factor; at ddp's rate it did not
    assert "peak learning rate" in (out.parent / runs["adpsgd_rulerate_seed7"]["log"]).read_text()
    assert "peak learning rate" not in (out.parent / runs["adpsgd_ddprate_seed7"]["log"]
                                        ).read_text()
    again = subprocess.run(cmd, cwd=ROOT, env=base_env(), text=True, capture_output=True,
                           timeout=300)
    assert again.returncode == 0 and "[parity" not in again.stdout  # nothing left to run
    assert json.loads(out.read_text())["runs"] == rec["runs"]
