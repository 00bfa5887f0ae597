"""Exit statuses that tell the truth (issue 48): no process of a fit dies of ``SIGABRT`` at exit
(``terminate called without an active exception``), and a finished fit is never restarted.

The abort is made to happen on purpose (``tests/scripts/exit_abort.py``): a gossip wait of rank
0 is abandoned on rank 1, and rank 1 ends that wait while rank 0's interpreter finalizes. Before
:mod:`lightning_gossip.liveness.at_exit` rank 0 died of ``SIGABRT`` in 3 of 3 launches (exit -6);
now it ends with its program's status, what it wrote complete.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from testbed.launch import ROOT, base_env, free_port, launch_processes, parse_events
from tests.test_faults import restart_command

SCRIPT = ROOT / "tests/scripts/exit_abort.py"


@pytest.mark.multiprocess
@pytest.mark.parametrize("mode", ["src", "any", "src-raise", "any-raise"])
def test_a_wait_ending_during_finalization_does_not_abort_the_process(tmp_path: Path,
                                                                      mode: str) -> None:
    """``src``: the abandoned wait is a receive from rank 1, whose connection closes during rank
    0's finalization; the ``atexit`` handler released the group first (the thread ended, the
    interpreter finalized: ``exit_path``). ``any``: a receive from any source, which rank 1
    completes by sending; the handler cannot end it, so rank 0 leaves by the last resort
    (``os._exit`` after flushing: no finalization). Either way rank 0's status is its program's
    (0, or 1 when it raised), its log line and checkpoint are complete, and rank 1 ends with
    0."""
    port = str(free_port())
    commands = [([sys.executable, str(SCRIPT), str(tmp_path), mode],
                 base_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(r),
                          WORLD_SIZE="2")) for r in range(2)]
    launched = launch_processes(commands, 120)
    out = launched.stdout[-6000:]
    assert not launched.timed_out, out
    assert "terminate called" not in launched.stdout, out
    assert launched.returncodes == [1 if mode.endswith("-raise") else 0, 0], (
        launched.returncodes, out)
    if mode.endswith("-raise"):
        assert "RuntimeError: rank 0 fails at its end (on purpose)" in launched.stdout, out
    finalized = (tmp_path / "exit_path").exists()
    assert finalized == mode.startswith("src"), out
    assert (tmp_path / "rank0.log").read_text() == "the last line of rank 0's log\n"
    ckpt = torch.load(tmp_path / "rank0.ckpt")
    assert torch.equal(ckpt["weights"], torch.arange(1000.0))


@pytest.mark.multiprocess
@pytest.mark.parametrize("strategy", ["adpsgd", "dpsgd"])
def test_a_finished_fit_is_not_restarted_by_torchrun(tmp_path: Path, strategy: str) -> None:
    """``torchrun --max-restarts 2``: a fit that finished on every rank is not started again
    (torchrun restarts the whole group when a worker's status is not 0, an abort at exit
    included): every rank started training once, in round 0, finished there, and torchrun
    ends with 0."""
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"strategy": strategy, "samples": 256, "epochs": 2,
                                "checkpoint_dir": str(tmp_path / "ckpt"),
                                "heartbeat_timeout": 10.0}))
    launched = launch_processes([restart_command(ROOT / "tests/scripts/restart_ranks.py", spec,
                                                 max_restarts=2)], 600)
    text = launched.stdout
    assert not launched.timed_out, text[-8000:]
    events = parse_events(text)  # (two workers' lines may share a line of torchrun's output)
    starts = sorted((e["rank"], e["restart"]) for e in events if e["event"] == "start")
    done = sorted((e["rank"], e["restart"]) for e in events if e["event"] == "done")
    assert starts == [(0, 0), (1, 0)] and done == [(0, 0), (1, 0)], text[-8000:]
    assert launched.returncodes == [0], text[-8000:]
    assert "terminate called" not in text, text[-8000:]


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(1800)
def test_the_exit_soak_short_form(tmp_path: Path) -> None:
    """``make test-slow``: one fit of each kind of ``testbed.exit_soak`` (elastic losses flat
    and hierarchical, plain fits under ``srun``, ``torchrun --max-restarts 2`` and Lightning's
    launcher, a rank that raises), seeded: every process ends with the status its outcome
    gives it, no abort at exit, no hang, no orphan."""
    import random

    from testbed.exit_soak import KINDS, one_fit

    rng = random.Random(48)
    fits = [one_fit(tmp_path / f"fit{i}", kind, rng) for i, kind in enumerate(KINDS)]
    failing = [f for f in fits if not f["statuses_ok"]]
    assert not failing, failing
