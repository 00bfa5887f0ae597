"""R in every race record (issue 47): its measurement (``benchmarks/race/comm_compute.py``) runs
on real ranks and gives every rank the same, consistent figures (no timing is asserted: only
that R is the transfer over the step, the replica 2 bytes a parameter, the send with its
acknowledgement at least the one-way time); on the emulated cluster the race records it
(``tests/test_race_smoke.py``)."""

from __future__ import annotations

import pytest

from benchmarks.race import comm_compute
from testbed.launch import ROOT, run_torchrun

SCRIPT = ROOT / "tests" / "scripts" / "comm_compute_ranks.py"


@pytest.mark.multiprocess
@pytest.mark.parametrize("procs", [1, 2])
def test_r_is_measured_the_same_on_every_rank(procs: int) -> None:
    result = run_torchrun(SCRIPT, str(procs), nprocs=procs, nnodes=2, timeout=240)
    assert result.returncode == 0, result.stdout[-4000:]
    assert f"OK procs={procs}" in result.stdout, result.stdout[-4000:]


def test_a_record_s_r_is_the_ratio_of_the_medians() -> None:
    launches = [{"replica_bytes": 4_900_000, "replica_transfer_s": t, "compute_step_s": c}
                for t, c in ((0.20, 0.36), (0.21, 0.35), (0.19, 0.40))]
    combined = comm_compute.combine([*launches, None, {"replica_transfer_s": None}])
    assert combined is not None and combined["launches"] == 3
    assert (combined["replica_transfer_s"], combined["compute_step_s"]) == (0.2, 0.36)
    assert combined["comm_compute_ratio"] == round(0.2 / 0.36, 3)
    assert comm_compute.combine([None]) is None
