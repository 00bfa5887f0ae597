"""Decent-DP, the race's closest gossip peer (``benchmarks/race/decentdp_case.py``), does what
it claims in the race's set-up, on 2 faked nodes of 2 real ranks (gloo, loopback): its mixing
keeps the replicas' mean exactly and brings them to it (rate 0, replicas made different), and
its decentralized Adam trains (``tests/scripts/decentdp_ranks.py``). The link bytes it sends
are checked in the race itself (``driver.hook_check``, against ``decentdp_case.expected_ratio``).

Skipped where the ``race`` extra (``decent-dp``) is not installed.
"""

from __future__ import annotations

import pytest

from benchmarks.race import decentdp_case
from testbed.launch import ROOT, run_torchrun

SCRIPT = ROOT / "tests" / "scripts" / "decentdp_ranks.py"

pytestmark = pytest.mark.skipif(decentdp_case.unavailable() is not None,
                                reason="decent-dp (the race and dev extras) is not installed")


@pytest.mark.multiprocess
@pytest.mark.parametrize("topology", ["alternating-exp-ring", "ring"])
def test_decentdp_mixes_exactly_and_trains(topology: str) -> None:
    result = run_torchrun(SCRIPT, topology, nprocs=2, nnodes=2, timeout=300)
    assert result.returncode == 0, result.stdout[-4000:]
    assert f"OK topology={topology}" in result.stdout, result.stdout[-4000:]
