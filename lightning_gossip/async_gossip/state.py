"""What the training thread and the gossip thread of one rank share, and how they wait.

One lock (a condition variable) guards everything shared: the :class:`PhaseClock`, the
:class:`DeltaMailbox`, the :class:`StreamHandoff` events, the stop flag, the gossip thread's
error and the :class:`GossipStats`. The training thread waits with a deadline
(:meth:`SharedState.wait_for`): it raises :class:`~lightning_gossip.exchange.GossipTimeout` or
the gossip thread's error. The gossip thread idles without one (the training thread may be
computing for a long time) until it is asked to stop (:meth:`SharedState.idle_until`).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

from lightning_gossip.async_gossip.cuda_handoff import StreamHandoff
from lightning_gossip.async_gossip.mailbox import DeltaMailbox
from lightning_gossip.async_gossip.phases import PhaseClock
from lightning_gossip.errors import GossipTimeout

__all__ = ["GossipStats", "SharedState"]

POLL_S = 0.05  # seconds between checks of the stop flag while the gossip thread idles


@dataclass
class GossipStats:
    """Counters a run can report (per rank).

    Attributes:
        exchanges: pairwise averages this rank took part in (gossip thread, under the lock).
        steps: step boundaries seen (training thread).
        staleness_waits: times the training thread waited for gossip to catch up
            (``max_staleness``; training thread).
        staleness_wait_s: seconds spent in those waits (training thread).
        sent_bytes: snapshot payload this rank sent (its shard, in the wire dtype; without the
            control messages and the node's all-gather) (gossip thread, under the lock).
        exchange_s: seconds of those exchanges on the wire, summed (each from the moment both
            sides had posted it to holding the partner's snapshot, mixed: see
            :mod:`~lightning_gossip.async_gossip.loops`) (gossip thread, under the lock).
        peer_wait_s: seconds those exchanges waited, summed, after this rank had posted its
            side, for the partner to post its own (a passive serving its other actives first,
            a thread slow to wake): kept out of ``exchange_s`` (gossip thread, under the lock).
    """

    exchanges: int = 0
    steps: int = 0
    staleness_waits: int = 0
    staleness_wait_s: float = 0.0
    sent_bytes: int = 0
    exchange_s: float = 0.0
    peer_wait_s: float = 0.0


class SharedState:
    """The lock and everything it guards, for one rank.

    Args:
        rank: this rank (for error messages).
        mailbox: the delta and snapshot buffers.
        timeout: the training thread's limit for every wait.

    Attributes:
        cv: the condition variable (lock) that guards every field below and those of
            ``clock``, ``mailbox`` and ``handoff``; notified on every change.
        clock: the :class:`PhaseClock`.
        mailbox: the :class:`DeltaMailbox`.
        handoff: the :class:`StreamHandoff` (CUDA events).
        stats: the :class:`GossipStats`.
        stop_requested: set by the training thread (:meth:`request_stop`); the gossip thread
            returns at its next idle moment.
        stop_after: (monotonic seconds) from when an exchange already posted may be abandoned
            too (:meth:`request_stop`'s ``finish_s``; ``inf`` while no stop was asked for).
        error: the exception that ended the gossip thread (written by it, once).
        waiting_on: what the gossip thread waits for now, naming the rank(s) (written by it;
            read for error messages only).
        liveness: called with ``what`` about once a second while the training thread waits
            (:meth:`wait_for`); raises when the liveness monitor found a silent rank (the
            engine sets it to :meth:`~lightning_gossip.liveness.Heartbeat.check`). ``None``:
            no check.
    """

    def __init__(self, rank: int, mailbox: DeltaMailbox, timeout: timedelta) -> None:
        self.rank = rank
        self.timeout = timeout
        self.cv = threading.Condition()
        self.clock = PhaseClock()
        self.mailbox = mailbox
        self.handoff = StreamHandoff(mailbox.view.device)
        self.stats = GossipStats()
        self.stop_requested = False
        self.stop_after = math.inf
        self.error: BaseException | None = None
        self.waiting_on = "nothing (idle)"
        self.liveness: Callable[[str], None] | None = None

    # -- training thread (call with ``cv`` held) -------------------------------------------------
    def raise_if_failed(self) -> None:
        """Re-raise the gossip thread's error in the calling (training) thread."""
        if self.error is not None:
            raise RuntimeError(
                f"rank {self.rank}: the gossip thread failed: {self.error}"
            ) from self.error

    def wait_for(self, predicate: Callable[[], bool], what: str, count: bool = False) -> None:
        """Wait on ``cv`` until ``predicate()``; raise on the thread's error or on timeout.

        With ``count``, a wait that was needed is added to the staleness counters.
        """
        if predicate():
            return
        start = time.monotonic()
        deadline = start + self.timeout.total_seconds()
        while not predicate():
            self.raise_if_failed()
            if self.liveness is not None:
                self.liveness(what)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise GossipTimeout(
                    f"rank {self.rank}: {what} took longer than {self.timeout}; the gossip "
                    f"thread is waiting for {self.waiting_on}")
            self.cv.wait(min(remaining, 1.0))
        if count:
            self.stats.staleness_waits += 1
            self.stats.staleness_wait_s += time.monotonic() - start

    def request_stop(self, finish_s: float = 0.0) -> None:
        """Ask the gossip thread to return (takes ``cv`` itself). ``finish_s``: an exchange
        whose snapshots are already on the wire may take this many seconds more to complete
        (both sides then apply their deltas); a wait for a control message is left at once. A
        later call may shorten it, never lengthen it."""
        with self.cv:
            self.stop_requested = True
            self.stop_after = min(self.stop_after, time.monotonic() + finish_s)
            self.cv.notify_all()

    def exchange_abandoned(self) -> bool:
        """Whether an exchange in flight is to be left (its wait's ``should_stop``): a stop was
        asked for and its ``finish_s`` passed. Read without the lock (one float)."""
        return self.stop_requested and time.monotonic() >= self.stop_after

    # -- gossip thread -------------------------------------------------------------------------
    def idle_until(self, predicate: Callable[[], bool]) -> bool:
        """Wait (no deadline) until ``predicate()``; False when asked to stop (takes ``cv``)."""
        with self.cv:
            while not predicate():
                if self.stop_requested:
                    return False
                self.cv.wait(POLL_S)
            return not self.stop_requested

    def fail(self, error: BaseException) -> None:
        """Record the error that ended the gossip thread and wake the training thread."""
        with self.cv:
            self.error = error
            self.cv.notify_all()
