"""The engines without Lightning: docs/engines.md's example runs, and imports no Lightning."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from benchmarks.launch import ROOT, base_env, check, run_torchrun

EXAMPLE = ROOT / "docs" / "examples" / "adpsgd_plain_loop.py"


def test_engine_names_import_no_lightning() -> None:
    code = ("import sys; from lightning_gossip import AsyncGossip, FlatState, Pairing, SyncGossip; "
            "import lightning_gossip.sync_gossip, lightning_gossip.async_gossip; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'lightning', "
            "'pytorch_lightning', 'torch'}))")
    out = subprocess.run([sys.executable, "-c", code], env=base_env(), capture_output=True,
                         text=True, timeout=300, check=True).stdout
    assert out.strip() == "['torch']"


@pytest.mark.multiprocess
def test_plain_pytorch_loop_example_trains_with_async_gossip() -> None:
    out = check(run_torchrun(EXAMPLE, nprocs=2, timeout=300))
    rows = [json.loads(line) for line in out.splitlines() if line.startswith('{"rank"')]
    assert sorted(r["rank"] for r in rows) == [0, 1], out[-4000:]
    a, b = (r["consensus_loss"] for r in sorted(rows, key=lambda r: r["rank"]))
    assert a == b  # both ranks evaluated the same exact average, bit for bit
    assert len(a) == 4 and a[-1] < 0.05 * a[0]  # 3 epochs: the average model learned
    assert all(r["exchanges"] > 0 and r["steps"] == 3 * 64 for r in rows)
