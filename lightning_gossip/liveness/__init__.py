"""Liveness: every rank beats in the c10d store, and every wait on a peer watches those beats.

A gossip wait can only end three ways: the message arrives, the configured ``timeout`` passes
(30 minutes by default), or the peer is found to be dead. :class:`Heartbeat` makes the third
one fast and specific. A background thread of every rank increments a counter
``heartbeat/<rank>`` in the store that the process group already has, every ``interval``
seconds. A rank that waits on peers (:func:`wait_for_peers`) polls its works and, every so often,
reads the peers' counters; a counter that has not moved for ``timeout`` seconds (as measured on
the *reader's* clock, so clocks need not agree) means the peer is frozen, killed or cut off, and
the wait fails with :class:`~lightning_gossip.errors.PeerSilent` naming it and what was being
waited for.

A rank that is merely slow (a long validation, a checkpoint write, a data stall) keeps beating:
the beat comes from its own thread, not from its training loop. When the store itself becomes
unreachable (its host process, rank 0 under Lightning's launcher, has died or is frozen), the
reader fails with the same error type, naming the host.

A rank that fails with an exception calls :meth:`Heartbeat.leave` (``failed=True``): its counter
jumps by :data:`DOWN`, and every rank that waits on it fails at its next check instead of after
``timeout`` seconds. :meth:`Heartbeat.connect` opens dedicated store clients (one for the beating
thread, one for readers) whose operations time out after ``timeout`` seconds, so that neither a
frozen store host nor a busy shared client can block a wait for longer.

Example (inside an initialised process group)::

    beat = Heartbeat(default_store(), rank, world_size, timeout=60.0)
    beat.start()
    works = [dist.irecv(buf, src=peer, group=side_group)]
    wait_for_peers(works, [peer], beat, timeout=timedelta(minutes=30),
                   what=f"rank {rank} receiving the replica of rank {peer}")
    beat.stop()
"""

from __future__ import annotations

from lightning_gossip.liveness.at_exit import track
from lightning_gossip.liveness.collectives import keep_alive_at_exit, watched_collective
from lightning_gossip.liveness.heartbeat import DOWN, Heartbeat, current
from lightning_gossip.liveness.waits import GRACE_S as GRACE_S  # used by the strategies
from lightning_gossip.liveness.waits import wait_for_peers

__all__ = ["DOWN", "Heartbeat", "current", "keep_alive_at_exit", "track", "wait_for_peers",
           "watched_collective"]
