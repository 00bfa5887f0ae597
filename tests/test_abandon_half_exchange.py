"""What an AD-PSGD exchange between two survivors can lose when a loss elsewhere stops their
engines (issue 48; ``docs/faults.md``, "What is lost"): the bound, on real gloo processes.

:meth:`AsyncGossip.abandon` gives an exchange whose snapshots are on the wire
:data:`~lightning_gossip.async_gossip.engine.FINISH_GRACE_S` to complete, so that both partners
apply their deltas (which cancel: the sum of the replicas is conserved). An exchange still on
the wire after the grace is left: its partner, if it completes its side later, applies its half
alone. Each rank is in at most one exchange at a time and an abandoned engine starts no other,
so each survivor can leave at most one exchange that way, and what it costs the survivors' sum
is exactly its partner's half: half the difference of the two snapshots.

Rank 0 (active) and rank 1 (passive) stand for two survivors of a loss elsewhere. Rank 1's
gossip thread is listening for rank 0's request when rank 0 freezes its process (``SIGSTOP``),
then leaves a snapshot: its thread sends the request (rank 1's receive was posted, so the
message lands in rank 1's socket) and posts its side of the exchange, which rank 1 cannot
answer while frozen. Rank 0 then abandons its engine, as survivors do when they find a loss.

* ``held``: rank 1 is resumed (``SIGCONT``) only once ``abandon()`` returned, past the grace:
  rank 0 left the exchange unapplied, rank 1 completes its side (rank 0's posted send and
  receive are still pending in gloo) and applies its half. The survivors' sum is off by exactly
  that half, ``(x0 - x1) / 2`` (no update was made before the exchange, so the snapshots are the
  initial replicas): the bound, attained.
* ``in_grace``: rank 1 is resumed while ``abandon()`` waits in its grace (made long here, so
  that no machine's load can end it first): both apply their halves and the sum is conserved.

Then, in both cases, the survivors go on with a new engine over new groups (as after a loss),
with known local updates: their exchanges conserve the sum, so it stays off by what the
abandoned exchange left and nothing else.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from lightning_gossip.async_gossip import AsyncGossip
from lightning_gossip.async_gossip import engine as engine_module
from lightning_gossip.pairing import Pairing
from tests.scripts.engine_ranks import spawn_ranks
from tests.test_async_gossip_unit import _replica

pytestmark = pytest.mark.multiprocess

TIMEOUT = timedelta(seconds=60)
CASES = ("held", "in_grace")
STEPS_AFTER = 3
#: rank 0's thread in the exchange, its side posted (the posted marker and the snapshot): waiting
#: for rank 1's marker, or past it for the snapshot
EXCHANGING = ("rank 1 to post its side of the exchange of snapshots",
              "the exchange of snapshots with rank 1")


def _state(pid: int) -> str:
    """The process's state letter (``T``: stopped)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat[stat.rindex(")") + 2]


def _until(predicate, what: str, within_s: float = 60.0) -> None:
    deadline = time.monotonic() + within_s
    while not predicate():
        assert time.monotonic() < deadline, f"not within {within_s:g} s: {what}"
        time.sleep(0.01)


def _engine(flat, rank: int, control, data) -> AsyncGossip:
    return AsyncGossip(flat, rank, Pairing("ring", 2), control_group=control, data_group=data,
                       timeout=TIMEOUT, max_staleness=None)


def half_exchange(rank: int, world: int, case: str) -> dict:
    """One case on ranks 0 and 1 (see the module docstring)."""
    assert world == 2
    pids: list = [None, None]
    dist.all_gather_object(pids, os.getpid())
    groups = [dist.new_group(backend="gloo", timeout=TIMEOUT) for _ in range(4)]
    _, flat = _replica(rank)
    x0 = flat.pack().clone()
    engine = _engine(flat, rank, *groups[:2])
    engine.start()
    engine.before_step(0)
    shared = engine._shared
    if rank == 1:  # its thread listens for rank 0's request (the receive is posted)
        _until(lambda: shared.waiting_on.startswith("a request or BYE from rank(s) 0"),
               "rank 1's thread waits for a request")
    dist.barrier()
    if rank == 0:
        os.kill(pids[1], signal.SIGSTOP)
        _until(lambda: _state(pids[1]) == "T", "rank 1 stopped")
        engine.after_step(0)  # a snapshot: the thread asks rank 1 and waits in the exchange
        _until(lambda: shared.waiting_on in EXCHANGING, "rank 0 in the exchange")
        if case == "held":
            engine.abandon()  # the grace passes with rank 1 frozen: the exchange is left
            os.kill(pids[1], signal.SIGCONT)
        else:
            engine_module.FINISH_GRACE_S = 600.0  # (read by abandon(); this process only)
            stopping = threading.Thread(target=engine.abandon)
            stopping.start()
            _until(lambda: shared.stop_requested, "rank 0's abandon asked the thread to stop")
            os.kill(pids[1], signal.SIGCONT)
            stopping.join()
    else:  # (frozen in here) rank 1 completes its side once resumed, then abandons too
        _until(lambda: engine.stats.exchanges == 1, "rank 1's exchange")
        engine.abandon()
    abandoned = engine.stats.exchanges
    dist.barrier()
    # the survivors go on: a new engine over new groups, known local updates
    update = torch.linspace(0.1, 1.0, flat.numel) * (rank + 1)
    added = torch.zeros(flat.numel)
    new = _engine(flat, rank, *groups[2:])
    new.start()
    for t in range(STEPS_AFTER):
        new.before_step(t)
        flat.add_(update)
        added += update
        new.after_step(t)
    new.quiesce()
    new.close()
    return {"x0": x0.tolist(), "x": flat.pack().tolist(), "added": added.tolist(),
            "abandoned": abandoned, "after": new.stats.exchanges}


def half_exchange_cases(rank: int, world: int) -> dict:
    """Every case in one launch."""
    return {case: half_exchange(rank, world, case) for case in CASES}


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    return spawn_ranks(half_exchange_cases, 2, Path(tmp_path_factory.mktemp("half")))


@pytest.mark.parametrize("case", CASES)
def test_an_exchange_left_after_the_grace_costs_one_half_at_most(results, case):
    r0, r1 = results[0][case], results[1][case]
    x0 = [torch.tensor(r["x0"]) for r in (r0, r1)]
    x = [torch.tensor(r["x"]) for r in (r0, r1)]
    added = [torch.tensor(r["added"]) for r in (r0, r1)]
    assert float((x0[0] - x0[1]).abs().max()) > 1.0  # far apart: a lost half shows
    assert r1["abandoned"] == 1  # rank 1 completed its side of the exchange in both cases
    assert r0["after"] >= 1 and r1["after"] >= 1  # the new engines exchanged
    off = x[0] + x[1] - (x0[0] + x0[1] + added[0] + added[1])
    if case == "held":
        assert r0["abandoned"] == 0  # rank 0 left it after the grace
        # exactly rank 1's half of that exchange: half the difference of the two snapshots
        torch.testing.assert_close(off, (x0[0] - x0[1]) / 2, rtol=0, atol=1e-5)
    else:
        assert r0["abandoned"] == 1  # completed within the grace: both halves applied
        torch.testing.assert_close(off, torch.zeros_like(off), rtol=0, atol=1e-5)
