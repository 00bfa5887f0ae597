"""The wheel on its own (``make test-wheel``, ``scripts/test_wheel.sh``), in ``make test`` so
that CI runs it: the wheel is built, installed with the pinned dependency set into a new virtual
environment outside the repository, and run from a directory outside it without ``PYTHONPATH``:
``lightning-gossip --help`` and a 2-rank torchrun fit under each strategy
(``scripts/wheel_fit.py``)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from testbed.launch import ROOT, base_env

pytestmark = pytest.mark.multiprocess


def test_wheel_installs_and_fits_without_the_checkout(tmp_path: Path) -> None:
    env = base_env(WHEEL_WORK=str(tmp_path))
    env.pop("PYTHONPATH", None)
    out = subprocess.run(["bash", str(ROOT / "scripts" / "test_wheel.sh")], env=env,
                         capture_output=True, text=True, timeout=1500, cwd=ROOT)
    log = out.stdout[-6000:] + out.stderr[-6000:]
    assert out.returncode == 0, log
    assert "[test-wheel] passed" in out.stdout, log
    assert {f"WHEEL-OK {r}" for r in (0, 1)} <= set(
        " ".join(w.split()[:2]) for w in out.stdout.split("\n") if w.startswith("WHEEL-OK")), log
