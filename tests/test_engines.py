"""The engines without Lightning: docs/engines.md's example runs, and imports no Lightning."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from testbed.launch import ROOT, base_env, check, run_torchrun

ASYNC_EXAMPLE = ROOT / "docs" / "examples" / "adpsgd_plain_loop.py"
SYNC_EXAMPLE = ROOT / "docs" / "examples" / "dpsgd_plain_loop.py"
DRIVER = ROOT / "tests" / "scripts" / "engine_examples.py"


def test_engine_names_import_no_lightning() -> None:
    code = ("import sys; from lightning_gossip import AsyncGossip, FlatState, Pairing, SyncGossip; "
            "import lightning_gossip.sync_gossip, lightning_gossip.async_gossip; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'lightning', "
            "'pytorch_lightning', 'torch'}))")
    out = subprocess.run([sys.executable, "-c", code], env=base_env(), capture_output=True,
                         text=True, timeout=300, check=True).stdout
    assert out.strip() == "['torch']"


def _rows(out: str, engine: str) -> list[dict]:
    # The two ranks share one stdout pipe: a row may share its line with another rank's
    # output, so decode every object that starts with '{"rank"' wherever it is.
    decoder = json.JSONDecoder()
    rows = [decoder.raw_decode(out, m.start())[0] for m in re.finditer(r'\{"rank"', out)]
    mine = sorted((r for r in rows if r["engine"] == engine), key=lambda r: r["rank"])
    assert [r["rank"] for r in mine] == [0, 1], out[-4000:]
    return mine


@pytest.mark.multiprocess
def test_plain_pytorch_loop_examples_train_with_both_engines() -> None:
    """Both examples of docs/engines.md in one launch of 2 ranks (tests/scripts/
    engine_examples.py runs each file as ``__main__``)."""
    out = check(run_torchrun(DRIVER, str(ASYNC_EXAMPLE), str(SYNC_EXAMPLE), nprocs=2,
                             timeout=400))
    for engine in ("AsyncGossip", "SyncGossip"):
        rows = _rows(out, engine)
        a, b = (r["consensus_loss"] for r in rows)
        assert a == b, engine  # both ranks evaluated the same exact average, bit for bit
        assert len(a) == 4 and a[-1] < 0.05 * a[0], (engine, a)  # 3 epochs: it learned
        assert all(r["exchanges"] > 0 and r["steps"] == 3 * 64 for r in rows), rows
    for r in _rows(out, "SyncGossip"):  # one round per step, one message (2 ranks: 1 peer)
        assert r["exchanges"] == r["steps"]
        assert r["sent_bytes"] == r["steps"] * 4 * (8 * 32 + 32 + 32 + 1)
