"""Heartbeats on real processes: a slow peer is tolerated, a failed or frozen one is named."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from lightning_gossip.errors import GossipTimeout, NonFiniteFromPeer, PeerSilent
from lightning_gossip.liveness import DOWN, Heartbeat, wait_for_peers
from testbed.launch import ROOT, free_port, run_torchrun
from tests.scripts import liveness_ranks


@pytest.mark.multiprocess
def test_slow_peer_tolerated_failed_and_frozen_peers_named():
    out = run_torchrun(ROOT / "tests/scripts/liveness_ranks.py", nprocs=3, timeout=300).stdout
    lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
    assert lines, out[-6000:]
    result = json.loads(lines[0][len("RESULT "):])
    # the late message arrived: a live but slow rank is no false alarm
    assert result["slow_sum"] == 4.0
    assert result["slow_s"] >= liveness_ranks.SLOW_SEND_S - 0.5
    ranks, message, seconds = result["left"]
    assert ranks == [1]
    assert "rank 0 receiving the replica of rank 1" in message
    assert "rank(s) 1 failed with an error" in message
    ranks, message, seconds = result["frozen"]
    assert ranks == [2], message
    assert "rank 0 receiving the replica of rank 2" in message
    assert "rank(s) 2 sent no heartbeat" in message
    # named after about the heartbeat timeout, far below the 120 s wait limit
    assert seconds < liveness_ranks.HB_TIMEOUT + 30
    print(f"frozen rank named after {seconds:.1f} s (heartbeat_timeout "
          f"{liveness_ranks.HB_TIMEOUT} s); failed rank named after {result['left'][2]:.2f} s")


def test_unreachable_store_is_reported_as_silence():
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, 2, is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=5))
    client = dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=timedelta(seconds=5))
    beat = Heartbeat(client, 1, 2, timeout=1.0, store_host=0)
    assert beat.silent([0]) == []  # first read starts the clock
    del server  # the host of the store goes away
    with pytest.raises(PeerSilent, match="store hosted by rank 0 is unreachable") as info:
        for _ in range(50):
            beat.silent([0])
            time.sleep(0.1)
    assert info.value.ranks == (0,)


STORE_HOST = """
import sys, time
from datetime import timedelta
import torch.distributed as dist
store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), 2, is_master=True,
                      wait_for_workers=False, timeout=timedelta(seconds=60))
print("ready", flush=True)
time.sleep(600)
"""


def _wait_stopped(pid: int, limit_s: float = 10.0) -> None:
    """Until the kernel shows ``pid`` stopped (state T): on a loaded machine SIGSTOP takes
    effect when the process is next scheduled, and a read sent before that is answered."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "T":
                return
        time.sleep(0.01)
    raise AssertionError(f"process {pid} not stopped {limit_s:g} s after SIGSTOP")


def test_frozen_store_host_is_reported_within_the_heartbeat_timeout():
    """A frozen (SIGSTOP) store host keeps its connections open and never answers: a TCPStore
    client waits on it with no deadline (a fuzz run hung so, rank 0 frozen under Lightning's
    launcher). Reads and the failure mark are bounded by the heartbeat's own limits."""
    port = free_port()
    host = subprocess.Popen([sys.executable, "-c", STORE_HOST, str(port)],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert host.stdout is not None and host.stdout.readline().strip() == "ready"
        client = dist.TCPStore("127.0.0.1", port, 2, is_master=False,
                               timeout=timedelta(seconds=60))
        beat = Heartbeat(client, 1, 2, timeout=2.0, store_host=0)
        assert beat.silent([0]) == []
        assert not beat.store_unreachable
        os.kill(host.pid, signal.SIGSTOP)
        _wait_stopped(host.pid)
        t0 = time.monotonic()
        with pytest.raises(PeerSilent, match="store hosted by rank 0 is unreachable") as info:
            beat.silent([0])
        assert info.value.ranks == (0,)
        assert "no answer from the store within 2 s" in str(info.value)
        t1 = time.monotonic()
        # the failure mark is not even tried: the store is known to be unreachable (a fuzz
        # run spent 10 s on the mark and 6 s joining the stuck beating thread)
        assert beat.store_unreachable
        beat.leave(failed=True)
        print(f"frozen store host reported after {t1 - t0:.1f} s; leave gave up after "
              f"{time.monotonic() - t1:.1f} s")
    finally:
        host.kill()
        host.wait()


def test_left_rank_is_seen_at_once_and_counts_move():
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, 1, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=5))
    a = Heartbeat(store, 0, 2, timeout=30.0, interval=0.2)
    b = Heartbeat(store, 1, 2, timeout=30.0, interval=0.2)
    b.start()
    assert b.running and a.silent([1]) == []
    time.sleep(0.5)
    assert a.silent([1]) == []
    b.leave(failed=True)
    assert not b.running
    assert a.silent([1]) == [1]  # no need to wait for the 30 s timeout
    assert "rank(s) 1 failed with an error" in a.describe([1])
    assert int(store.add("lightning_gossip/heartbeat/0/1", 0)) >= DOWN
    b.start()  # the same process in a later fit: beating again, no longer counted as gone
    assert a.silent([1]) == [] and int(store.add("lightning_gossip/heartbeat/0/1", 0)) < DOWN
    b.stop()


def test_blame_returns_at_once_for_errors_that_name_their_culprit():
    """Only a failure that names no rank (a broken connection) is worth watching the heartbeats
    for; a NaN from a peer names it, and waiting there delayed a fuzz run's end by 18 s."""
    from lightning_gossip.liveness.waits import blame

    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, 1, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=5))
    me = Heartbeat(store, 0, 3, timeout=30.0, interval=0.4)
    peers = [Heartbeat(store, r, 3, timeout=30.0, interval=0.4) for r in (1, 2)]
    for beat in peers:
        beat.start()
    try:
        for error in (NonFiniteFromPeer(2, 0), PeerSilent("rank(s) 2 left", [2])):
            t0 = time.monotonic()
            assert blame(error, [1, 2], me, "a round") is error
            assert time.monotonic() - t0 < 0.1
        t0 = time.monotonic()  # a broken connection, every peer alive: looks, then gives up
        broken = GossipTimeout("a round failed: Read error [127.0.0.1]:1234")
        assert blame(broken, [1, 2], me, "a round") is broken
        assert time.monotonic() - t0 >= 3.5 * 0.4 - 0.1
        peers[1].leave(failed=True)  # rank 2 fails: named at once
        found = blame(broken, [1, 2], me, "a round")
        assert isinstance(found, PeerSilent) and found.ranks == (2,) and found.__cause__ is broken
    finally:
        for beat in peers:
            beat.stop()


def test_arguments_are_checked():
    with pytest.raises(ValueError, match="heartbeat timeout must be positive"):
        Heartbeat(None, 0, 2, timeout=0)


def test_plain_wait_without_heartbeat_completes():
    class Done:
        def is_completed(self):
            return True

        def wait(self, timeout=None):
            return True

    assert wait_for_peers([Done()], [1], None, timedelta(seconds=1), "nothing")


@pytest.mark.multiprocess
def test_killed_rank_behind_a_broken_connection_is_named():
    """A killed rank (no error, no mark) breaks the connections of a collective at once, and
    gloo's error names an address, not a rank (a fuzz run ended so, "waiting on rank(s) 1, 2"):
    the waiting ranks look at the heartbeats and name the rank that stopped beating."""
    from testbed.launch import base_env, launch_processes

    port = str(free_port())
    script = str(ROOT / "tests/scripts/killed_rank_blame.py")
    commands = [([sys.executable, script], base_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                                                    WORLD_SIZE="3", RANK=str(r)))
                for r in range(3)]
    launched = launch_processes(commands, timeout=240)
    assert not launched.timed_out, launched.stdout[-6000:]
    results = [json.loads(ln[len("RESULT "):]) for ln in launched.stdout.splitlines()
               if ln.startswith("RESULT ")]
    assert len(results) == 2, launched.stdout[-6000:]  # rank 2 is dead
    for result in results:
        assert result["error"] == "PeerSilent", result
        # the killed rank is named as silent; the other survivor may be named too, as having
        # failed with an error (it did, naming rank 2, and left while this one looked)
        assert 2 in result["ranks"], result
        assert "rank(s) 2 sent no heartbeat" in result["message"], result
        print(f"killed rank named after {result['seconds']:.1f} s")
