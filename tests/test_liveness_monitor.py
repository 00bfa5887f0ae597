"""The liveness monitor: every rank notices a silent rank, also when nobody waits on it.

In-process heartbeats on a real ``TCPStore`` check what the monitor records and raises; one
launch of ``tests/scripts/fault_cases.py`` (4 ranks, adpsgd) freezes a rank that no other rank
waits on and checks that every other rank fails naming it before the epoch-end meeting.
"""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from lightning_gossip.errors import PeerSilent
from lightning_gossip.liveness import Heartbeat
from testbed.launch import free_port


def _store(world: int) -> tuple[dist.TCPStore, list[dist.TCPStore]]:
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, world, is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=10))
    clients = [dist.TCPStore("127.0.0.1", port, world, is_master=False,
                             timeout=timedelta(seconds=10)) for _ in range(world)]
    return server, clients


def _wait_found(beat: Heartbeat, limit_s: float = 30.0) -> tuple[int, ...]:
    """Poll ``beat.found`` until the monitor records something (``limit_s``: a hang guard)."""
    deadline = time.monotonic() + limit_s
    while not beat.found and time.monotonic() < deadline:
        time.sleep(0.05)
    return beat.found


def test_monitor_names_a_silent_rank_that_nobody_waits_on():
    server, clients = _store(3)
    beats = [Heartbeat(c, r, 3, timeout=2.0, interval=0.2) for r, c in enumerate(clients)]
    try:
        for b in beats:
            b.start()
        time.sleep(3.0)  # longer than the timeout: live ranks are not reported
        assert beats[0].found == () and beats[1].found == ()
        beats[0].check("rank 0 at step 3")  # nothing found: no error
        beats[2].stop()  # silent (no failure mark), as a frozen or killed rank
        for r in (0, 1):
            assert _wait_found(beats[r]) == (2,)
            with pytest.raises(PeerSilent) as info:
                beats[r].check(f"rank {r} at step 7")
            assert info.value.ranks == (2,)
            message = str(info.value)
            assert message.startswith(f"rank {r} at step 7: found by the liveness monitor: ")
            assert "rank(s) 2 sent no heartbeat for more than 2 s" in message
        # a new start (the next fit) forgets the finding
        beats[0].stop()
        beats[0].start()
        assert beats[0].found == ()
        beats[0].check("rank 0 at step 0")
    finally:
        for b in beats:
            b.stop()
    del server


def test_monitor_names_the_silent_rank_not_only_a_survivor_that_left_first():
    """Rank 1 fails (it named rank 2, say) a little before rank 0's clock for the frozen rank 2
    runs out: rank 0 names rank 2 too, instead of rank 1 alone."""
    server, clients = _store(3)
    beats = [Heartbeat(c, r, 3, timeout=2.0, interval=0.2) for r, c in enumerate(clients)]
    try:
        for b in beats:
            b.start()
        time.sleep(0.5)
        beats[2].stop()
        time.sleep(1.6)  # rank 2 is not silent for 2 s yet on rank 0's clock
        beats[1].leave(failed=True, linger_s=0.0)
        found = _wait_found(beats[0])
        assert 2 in found, found
        with pytest.raises(PeerSilent, match=r"rank\(s\) 2 sent no heartbeat"):
            beats[0].check("rank 0 at step 9")
    finally:
        for b in beats:
            b.stop()
    del server


def test_monitor_names_a_rank_that_left_after_an_error():
    server, clients = _store(2)
    beats = [Heartbeat(c, r, 2, timeout=30.0, interval=0.2) for r, c in enumerate(clients)]
    try:
        for b in beats:
            b.start()
        beats[1].leave(failed=True, linger_s=0.0)
        assert _wait_found(beats[0]) == (1,)  # long before the 30 s timeout
        with pytest.raises(PeerSilent, match=r"rank\(s\) 1 failed with an error and left"):
            beats[0].check("rank 0 at step 1")
    finally:
        for b in beats:
            b.stop()
    del server


def test_monitor_off():
    server, clients = _store(2)
    beats = [Heartbeat(c, r, 2, timeout=1.0, interval=0.1, monitor=False)
             for r, c in enumerate(clients)]
    try:
        for b in beats:
            b.start()
        beats[1].stop()
        assert beats[0].silent([1]) == []  # a wait's first read starts its clock
        time.sleep(2.5)
        assert beats[0].found == ()
        beats[0].check("rank 0")
        assert beats[0].silent([1]) == [1]  # the waits' own reads still see it
    finally:
        for b in beats:
            b.stop()
    del server


@pytest.mark.multiprocess
def test_every_rank_names_a_frozen_adpsgd_rank_that_nobody_waits_on(tmp_path):
    """4 ranks, adpsgd, ring pairing: rank 2 (active) is frozen early in a long epoch, between
    two exchanges. Actives 0 and 2 contact passives 1 and 3, so after the freeze no rank waits
    on rank 2 (the passives keep getting rank 0's requests). Before the liveness monitor it
    was noticed at the epoch-end meeting only; now every other rank fails naming it at a step
    boundary or a staleness wait, long before the epoch's end (the run's natural end)."""
    from tests.test_faults import run_case

    hb = 5.0
    spec = {"strategy": "adpsgd", "epochs": 1, "samples": 200_000, "heartbeat_timeout": hb,
            "timeout": 600, "fault": {"kind": "freeze_idle", "rank": 2, "step": 3},
            # a rank that exits ends the launch (Lightning's launcher stops the others): each
            # failed rank stays until the others have failed too (seen: one was stopped first)
            "await_peer_errors_s": 60, "await_errors_of": [0, 1, 3]}
    # a generous launch limit: 4 ranks took 7 minutes to start on 2 loaded cores
    events, survivors, text = run_case(tmp_path, "monitor-adpsgd", spec, "lightning", nprocs=4,
                                       timeout=900, frozen=2)
    assert not survivors, text[-8000:]
    assert ("fault", 2) in events, text[-8000:]
    fault = events[("fault", 2)]["time"]
    assert not any(kind == "done" for kind, _ in events), text[-8000:]
    for r in (0, 1, 3):
        assert ("error", r) in events, f"rank {r} printed no error\n{text[-8000:]}"
        message = events[("error", r)]["message"]
        assert "rank(s) 2 sent no heartbeat" in message, message
        assert "epoch-end meeting" not in message, message  # found before the meeting
    print("\nfrozen rank 2 (adpsgd, nobody waiting on it) named with heartbeat_timeout "
          f"{hb} s by: " + ", ".join(
              f"rank {r} after {events[('error', r)]['time'] - fault:.1f} s" for r in (0, 1, 3)))
