"""Ending an epoch together: a slower claimant leaves the last units to those who finish first.

With the shared cursor (:mod:`~lightning_gossip.cursor`) a faster learner takes more of
each epoch, but every learner claims its units ahead of computing them (Lightning's fetcher
holds the next batch, a loader's workers more), so when the counter runs out a slow learner
can still have its current unit and a claimed one to compute while every other learner waits
for it at the epoch's end, where the gossip phase's quiesce and Lightning's epoch end meet
every rank. :class:`EndBalance` removes that wait: every claimant publishes its pace (seconds
between its claims) in the store; a claimant that finds the epoch's remaining units would all
be finished sooner by the others (:func:`should_claim`, a list schedule of the remaining units
over every claimant's pace and units in hand) stops claiming for the epoch and leaves them.

No unit is ever left unclaimed: a claimant that stops counts itself on an atomic counter of the
epoch, and the one whose stop would make every claimant stopped takes the units instead.

Example (one claimant alone on a local store: nobody to leave the units to, so it takes)::

    >>> import torch.distributed as dist
    >>> EndBalance(dist.HashStore(), "run", claimant=0, claimants=1).take(epoch=0, left=1)
    True
"""

from __future__ import annotations

import heapq
import statistics
import time
from collections import deque
from collections.abc import Callable, Sequence

import torch.distributed as dist

from lightning_gossip.liveness.heartbeat import store_call

__all__ = ["EndBalance", "should_claim"]


def should_claim(left: int, mine: float, others: Sequence[float], ahead: int = 1) -> bool:
    """Whether this claimant should take one of the ``left`` units of an epoch.

    The remaining units are scheduled greedily, each to the claimant that would finish it
    first (optimal for equal units on claimants of different speeds): this claimant, which has
    ``ahead`` claimed units still to compute at ``mine`` seconds each, takes one if at least one
    unit would go to it. Every other claimant (``others``: their seconds per unit) is taken to
    be half-way through a unit with ``ahead`` more in hand. Ties go to this claimant.

    >>> should_claim(1, 0.35, [0.35])         # equal paces: take the last unit
    True
    >>> should_claim(2, 0.7, [0.35])          # twice as slow: the fast one ends sooner alone
    False
    >>> should_claim(3, 0.7, [0.35])
    True
    >>> should_claim(1, 0.35, [0.35] * 7)     # 8 equal claimants: still take
    True
    >>> should_claim(5, 1.0, [])              # nobody else
    True
    """
    if left <= 0:
        return False
    if not others:
        return True
    finish = (ahead + 1) * mine
    # the other claimants' completion times of further units, soonest first
    queue = [((ahead + 1.5) * p, p) for p in others]
    heapq.heapify(queue)
    for _ in range(left):
        done, pace = queue[0]
        if finish <= done:
            return True
        heapq.heapreplace(queue, (done + pace, pace))
    return False


class EndBalance:
    """One claimant's pace and its decision near an epoch's end (see the module docstring).

    Args:
        store: the c10d store every claimant shares.
        key: a name unique to the run and loader (the same on every rank).
        claimant: this claimant's index (a rank, or a node that claims as one).
        claimants: how many claim on the same counter.
        ahead: units a claimant holds before computing them (1 under Lightning's fetcher, plus
            a loader's ``num_workers * prefetch_factor``).
        clock: seconds, monotonic (for tests).
    """

    WINDOW = 5
    """The pace is the median of this many intervals between consecutive claims."""

    MAX_RATIO = 4
    """The others' paces are read only where a claimant up to this many times slower than the
    fastest could stop (``left <= MAX_RATIO * (ahead + 1) * claimants``); a slower one still
    stops, later."""

    def __init__(self, store: dist.Store, key: str, claimant: int, claimants: int,
                 ahead: int = 1, clock: Callable[[], float] = time.monotonic) -> None:
        if not 0 <= claimant < claimants:
            raise ValueError(f"claimant {claimant} is not one of {claimants} claimants")
        if ahead < 0:
            raise ValueError(f"ahead must be >= 0, got {ahead}")
        self.store, self.key, self.ahead, self.clock = store, key, int(ahead), clock
        self.claimant, self.claimants = int(claimant), int(claimants)
        self._intervals: deque[float] = deque(maxlen=self.WINDOW)
        self._last = (-1, 0, 0.0)  # the last claim's epoch, index in it, time
        self._mine = f"{key}/pace/{claimant}"
        self._others = [f"{key}/pace/{c}" for c in range(claimants) if c != claimant]
        #: epochs in which this claimant left the last units to the others
        self.left_early: list[int] = []

    @property
    def pace(self) -> float | None:
        """This claimant's seconds per unit: the median interval between its claims, within
        an epoch and past its first ``ahead + 1`` claims (``None`` before there is one)."""
        return statistics.median(self._intervals) if self._intervals else None

    def take(self, epoch: int, left: int) -> bool:
        """Whether to claim one of the ``left`` units of ``epoch`` now; ``False``: this claimant
        claims nothing more in ``epoch``. Records the claim's time (a claim follows ``True``)."""
        now = self.clock()
        last_epoch, last_index, last_time = self._last
        index = last_index + 1 if last_epoch == epoch else 0
        if index > self.ahead:  # (an epoch's first ahead + 1 claims come at once)
            self._intervals.append(now - last_time)
        self._last = (epoch, index, now)
        pace = self.pace
        if left <= 0 or pace is None or not self._others:
            return left > 0
        what = f"publishing this claimant's pace (epoch {epoch})"
        store_call(lambda: self.store.set(self._mine, repr(pace)), what)
        if left > self.MAX_RATIO * (self.ahead + 1) * self.claimants:
            return True
        if not store_call(lambda: self.store.check(self._others), what):
            return True  # not every claimant has a pace yet
        others = [float(v) for v in store_call(lambda: self.store.multi_get(self._others), what)]
        if should_claim(left, pace, others, self.ahead):
            return True
        stopped = f"{self.key}/epoch{epoch}/stopped"
        if int(store_call(lambda: self.store.add(stopped, 1), what)) >= self.claimants:
            return True  # every other claimant has stopped: the units are this one's
        self.left_early.append(epoch)
        return False
