"""A rank frozen (``SIGSTOP``) on real processes is named by the ranks that wait on it, after
about ``heartbeat_timeout``, and nothing is left behind: in a training step, just before a sync
point, in a watched collective. Launches of ``tests/scripts/fault_cases.py`` as in
``tests/test_faults.py`` (its helpers); times are printed (``-s``), never asserted.
"""

from __future__ import annotations

import pytest

from testbed.launch import base_env, free_port, launch_processes, torchrun_command
from tests.test_faults import launcher_status, run_case

pytestmark = pytest.mark.multiprocess


@pytest.mark.parametrize("strategy,launcher", [("adpsgd", "torchrun"), ("dpsgd", "lightning")])
def test_frozen_rank_is_named(tmp_path, strategy, launcher):
    """A rank frozen with SIGSTOP is named by every rank that waits on it, after about
    ``heartbeat_timeout``, far below ``timeout``."""
    hb = 5.0
    spec = {"strategy": strategy, "epochs": 1000, "samples": 64, "heartbeat_timeout": hb,
            "timeout": 600, "fault": {"kind": "freeze", "rank": 2, "step": 3}}
    events, survivors, text = run_case(tmp_path, f"freeze-{strategy}-{launcher}", spec,
                                       launcher, nprocs=3, frozen=2)
    assert not survivors, text[-8000:]
    assert launcher_status(tmp_path, f"freeze-{strategy}-{launcher}") == [1], text[-8000:]
    fault = events[("fault", 2)]["time"]
    named = []
    for r in (0, 1):
        if ("error", r) not in events:
            continue  # killed by its launcher once another rank failed
        message = events[("error", r)]["message"]
        if "rank(s) 2" in message:
            named.append((r, events[("error", r)]["time"] - fault))
    assert named, text[-8000:]
    print(f"\nfrozen rank 2 ({strategy}, {launcher}) named with heartbeat_timeout {hb} s by: "
          + ", ".join(f"rank {r} after {s:.1f} s" for r, s in named))


SYNC_POINT_CASES = [("adpsgd", "torchrun", "on_train_end"),
                    ("dpsgd", "lightning", "on_validation_start")]


@pytest.mark.parametrize("strategy,launcher,hook", SYNC_POINT_CASES)
def test_rank_frozen_before_a_sync_point_is_named(tmp_path, strategy, launcher, hook):
    """A rank frozen just before a sync point (the final average, the consensus evaluation)
    leaves its peer in a collective of the whole world: the peer names it after about
    ``heartbeat_timeout`` (the fuzz harness once saw this wait run to the 600 s ``timeout``)."""
    hb = 5.0
    spec = {"strategy": strategy, "epochs": 2, "samples": 32, "heartbeat_timeout": hb,
            "timeout": 600, "val_batches": 2,
            "fault": {"kind": "freeze", "rank": 1, "hook": hook}}
    events, survivors, text = run_case(tmp_path, f"sync-{strategy}-{hook}", spec, launcher,
                                       nprocs=2, frozen=1)
    assert not survivors, text[-8000:]
    assert launcher_status(tmp_path, f"sync-{strategy}-{hook}") == [1], text[-8000:]
    assert ("fault", 1) in events and ("error", 0) in events, text[-8000:]
    message = events[("error", 0)]["message"]
    assert "rank(s) 1 sent no heartbeat" in message, message
    assert "averaging the replicas" in message, message
    after = events[("error", 0)]["time"] - events[("fault", 1)]["time"]
    print(f"\nrank 1 frozen in {hook} ({strategy}, {launcher}): rank 0 named it after "
          f"{after:.1f} s: {message}")



WATCHED_RANK = """
import os, signal, time
from datetime import timedelta
import torch, torch.distributed as dist
from lightning_gossip.errors import PeerSilent
from lightning_gossip.liveness import Heartbeat, watched_collective
rank = int(os.environ["RANK"])
dist.init_process_group("gloo")
beat = Heartbeat.connect(rank, 2, timeout=3.0)
beat.start()
dist.barrier()
if rank == 1:
    os.kill(os.getpid(), signal.SIGSTOP)
t0 = time.monotonic()
try:
    watched_collective(dist.all_reduce, torch.ones(3), timeout=timedelta(seconds=300),
                       what="rank 0 averaging the replicas")
except PeerSilent as e:
    print(f"NAMED {list(e.ranks)} after {time.monotonic() - t0:.1f} s: {e}", flush=True)
    os._exit(3)
"""


def test_watched_collective_names_a_frozen_rank(tmp_path):
    """A collective where all ranks meet (the sync points: evaluation, checkpoint, final
    average), run through ``liveness.watched_collective``: a frozen rank is named after about
    ``heartbeat_timeout`` (3 s here) instead of the collective's ``timeout`` (300 s)."""
    script = tmp_path / "watched.py"
    script.write_text(WATCHED_RANK)
    cmd = torchrun_command(script, nprocs=2, port=free_port())
    launched = launch_processes([(cmd, base_env())], 300, reap_stopped=True)
    text = launched.stdout
    assert not launched.timed_out, text[-8000:]
    named = [line for line in text.splitlines() if "NAMED" in line]
    assert named and "NAMED [1]" in named[0], text[-8000:]
    assert "rank 0 averaging the replicas: rank(s) 1 sent no heartbeat" in named[0], named
    print("\n" + named[0])
