"""A rank that fails with its own error is named with that error by the peers that find it gone
(issue 48: the first run of the hierarchical ``dpsgd`` ASR accuracy command kept rank 5's error,
naming its node-mate 4 lost, but not rank 4's own).

A failing rank's traceback is printed only once its exception has left Lightning's
``on_exception``: after the strategy stopped its gossip, marked the rank gone in the store and
lingered there (``Heartbeat.leave``), seconds in all. A launcher that stops every task once one
exits with an error (``srun --kill-on-bad-exit``, a benchmark's harness, torchrun's agent) may
stop it in the meantime, since its peers exit within about a second of the mark; its error was
then nowhere. Now ``Resilience.on_exception`` first leaves the error in the store
(``Heartbeat.tell_error``) and the peers' ``PeerSilent`` repeats it.

Two real processes on one store: rank 1 fails in ``Resilience.on_exception`` (as the strategies
call it) and prints nothing; rank 0's liveness monitor finds it gone and names its error.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from lightning_gossip import _compat
from lightning_gossip.errors import PeerSilent
from lightning_gossip.liveness import Heartbeat
from lightning_gossip.strategies.resilience import Resilience
from tests.scripts.engine_ranks import spawn_ranks

ERROR = "user error on rank 1 at step 3"


def culprit(rank: int, world: int) -> dict:
    """Rank 1 fails with :data:`ERROR`; rank 0 reports what its monitor found."""
    beat = Heartbeat.connect(rank, world, 10.0, fallback=_compat.default_store())
    beat.start()
    if rank == 1:
        resilience = Resilience(watched=None, stop_gossip=lambda: None,
                                stop_heartbeat=lambda failed: beat.leave(failed, linger_s=0.0),
                                restart_position=lambda checkpoint: checkpoint)
        resilience.on_exception(ValueError(ERROR + "\n(a second line)"))
        return {}
    deadline = time.monotonic() + 60.0
    while not beat.has_finding:  # found as gone (its mark), not as silent
        assert time.monotonic() < deadline, "rank 0's monitor found nothing"
        time.sleep(0.05)
    try:
        beat.check("rank 0 at step 4")
    except PeerSilent as e:
        return {"ranks": list(e.ranks), "message": str(e)}
    finally:
        beat.stop()
    return {"message": None}


@pytest.mark.multiprocess
def test_the_peers_repeat_the_error_of_a_rank_that_failed(tmp_path: Path) -> None:
    found = spawn_ranks(culprit, 2, tmp_path, timeout=120.0)[0]
    assert found["ranks"] == [1]
    assert (f"rank(s) 1 failed with an error and left the run (rank 1: ValueError: {ERROR} "
            "(a second line))") in found["message"], found["message"]
