"""Elastic shared cursor: a lost rank's claimed but unfinished units go back to the survivors.

With the shared cursor (:mod:`~lightning_gossip.cursor.claims`) the ranks of an ``adpsgd`` fit
draw the units of an epoch (chunks of samples, or whole batches) through an atomic counter in
the c10d store. When a rank dies mid-epoch, the units it had claimed but not trained yet (the
loader's prefetch, the batch in flight) would be missing from the epoch. :class:`ClaimLedger`
keeps, in the store, which units each rank claimed (in claim order) and how many of them it
finished (units are trained in claim order), so that the survivors can push the lost rank's
unfinished units onto the epoch's *returned* queue, from which any rank takes them before it
claims on the counter again: every unit is still trained once per epoch among the live ranks.

**The end of an epoch.** A rank whose counter is exhausted must not leave the epoch while a
rank that may still die holds unfinished claims, so it waits (:meth:`ClaimLedger.wait_at_end`)
until every live rank has reached the end too (the ranks meet at the epoch end anyway), or
until returned units appear (it takes one and trains it). ``on_wait`` (the strategy's
heartbeat check) runs at every poll: when it finds a rank lost, the survivors' recovery calls
:meth:`~ClaimLedger.return_units` and narrows ``live``. A rank that takes a returned unit
leaves the end (its arrival is withdrawn before it takes) and arrives again when it next finds
the counter exhausted.

**What is not covered.** A rank's arrival means it has *claimed* its last unit, not trained it
(the loader prefetches): a rank lost after every live rank has arrived loses its last claimed,
untrained units for that epoch (the others have left it). So does a rank that dies between
claiming on the counter and recording the claim (two store calls in a row). A unit the lost
rank trained but did not yet count as finished is trained again. A rank found lost that is
merely frozen and comes back would train its claims a second time. A node that claims as one
(hierarchical, :class:`~lightning_gossip.cursor.claims.Claims` with a node layout) is one
claimant here, its leader (local rank 0): its units are the node's claims, and a lost node's go
back whole. Two settings of the ledger change how such a node claims: ``lockstep`` (its
``on_wait`` is a node collective, hierarchical ``dpsgd``'s gossip-only round: the node's other
ranks make each call in step with the leader) and ``incarnation`` (the generation that admitted
this process: a rejoined node's claim keys are its own, not its earlier processes').

Store keys, under ``key``: ``epoch{e}/claims/{rank}`` (the claimed units, appended ``"u,"``),
``epoch{e}/finished/{rank}`` (a counter), ``epoch{e}/returned_by/{lost}`` (elects the one
survivor that pushes), ``epoch{e}/returned/{lost}`` (the pushed list, JSON),
``epoch{e}/returned`` and ``epoch{e}/returned_count`` (the queue and its length),
``epoch{e}/taken/{position}`` (one counter per queue position) and ``epoch{e}/arrived/{rank}``.

Example (two ranks on a local store; rank 1 dies holding units 1 and 2)::

    >>> import torch.distributed as dist
    >>> store, live = dist.HashStore(), [0, 1]
    >>> r0 = ClaimLedger(store, "run", 0, lambda: live)
    >>> r1 = ClaimLedger(store, "run", 1, lambda: live)
    >>> for unit in (0, 1, 2):
    ...     r1.record_claim(0, unit)
    >>> r1.record_finished(0)  # unit 0 trained; rank 1 is lost now
    >>> live.remove(1)
    >>> r0.return_units(0, lost=1), r0.return_units(0, lost=1)  # pushed once
    ([1, 2], [1, 2])
    >>> r0.take_returned(0), r0.take_returned(0), r0.take_returned(0)
    (1, 2, None)
    >>> r0.wait_at_end(0) is None  # every live rank has arrived, nothing left to take
    True
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch.distributed as dist

from lightning_gossip.liveness.heartbeat import store_call

__all__ = ["ClaimLedger"]


def _units(raw: bytes) -> list[int]:
    """The units of an appended ``"u,u,..."`` record."""
    return [int(u) for u in raw.decode().split(",") if u]


class ClaimLedger:
    """Which units of an epoch each rank claimed and how many it finished, in the store, so a
    lost rank's unfinished units go back to the cursor (elastic adpsgd).

    Args:
        store: the c10d store all ranks share.
        key: a name unique to the run and loader (the same on every rank).
        rank: this rank.
        live: the ranks still in the run (this one included); the strategy narrows it when a
            rank is found lost.
        on_wait: called at every poll of :meth:`wait_at_end` (the strategy checks the
            heartbeat there and, on a loss, runs the survivors' recovery).
        poll_s: seconds between polls of :meth:`wait_at_end` and :meth:`return_units`.
        timeout: seconds :meth:`wait_at_end` (and a survivor waiting for another's push in
            :meth:`return_units`) waits before :class:`TimeoutError`.
        lockstep: ``on_wait`` is a collective of this rank's node: a node that claims as one
            makes each call on every one of its ranks, in step with its leader
            (:class:`~lightning_gossip.cursor.claims.Claims`).
        incarnation: the generation that admitted this process (0: it started the fit); a
            node's claim keys are named by it.

    Every store call goes through :func:`~lightning_gossip.liveness.heartbeat.store_call`
    (bounded while a heartbeat runs), as the claims do.
    """

    def __init__(self, store: dist.Store, key: str, rank: int, live: Callable[[], Sequence[int]],
                 *, on_wait: Callable[[], None] = lambda: None, poll_s: float = 0.05,
                 timeout: float = 1800.0, lockstep: bool = False, incarnation: int = 0) -> None:
        self.store = store
        self.key = key
        self.rank = int(rank)
        self.live = live
        self.on_wait = on_wait
        self.poll_s = float(poll_s)
        self.timeout = float(timeout)
        self.lockstep = bool(lockstep)
        self.incarnation = int(incarnation)
        self._tried: dict[int, int] = {}  # epoch -> queue positions this rank tried to take
        #: the epoch this rank trains (:meth:`open`); the end of no other one is waited at
        self.opened: int | None = None
        #: the epoch at whose end this rank has arrived (``None``: none, or withdrawn)
        self.arrived: int | None = None

    def _key(self, epoch: int, *parts: object) -> str:
        return "/".join([self.key, f"epoch{epoch}", *map(str, parts)])

    def _call(self, operation: Callable[[], Any], what: str) -> Any:
        return store_call(operation, f"{what} (rank {self.rank})")

    def record_claim(self, epoch: int, unit: int) -> None:
        """This rank took ``unit`` of ``epoch`` (after its earlier claims)."""
        mine = self._key(epoch, "claims", self.rank)
        self._call(lambda: self.store.append(mine, f"{int(unit)},"), "recording a claim")

    def record_finished(self, epoch: int) -> None:
        """This rank trained one more of its claimed units of ``epoch`` (the next in claim
        order)."""
        mine = self._key(epoch, "finished", self.rank)
        self._call(lambda: self.store.add(mine, 1), "recording a finished unit")

    def forget(self, epoch: int) -> None:
        """Delete this rank's records of ``epoch`` (its claims, count and arrival) from the
        store, which otherwise keeps every epoch's (the claims of an epoch take a few bytes
        per unit). Only for an epoch that every rank has left: call it for ``e - 2`` at the
        start of epoch ``e`` (a rank can only start ``e`` once every live rank has reached the
        end of ``e - 1``, so all of them have left ``e - 2``). The returned queue's keys (only
        written on a loss) stay."""
        for part in ("claims", "finished", "arrived"):
            mine = self._key(epoch, part, self.rank)
            self._call(lambda k=mine: self.store.delete_key(k), "forgetting an epoch's claims")
        self._tried.pop(epoch, None)

    def claimed(self, epoch: int, rank: int) -> list[int]:
        """The units of ``epoch`` that ``rank`` claimed, in claim order."""
        theirs = self._key(epoch, "claims", rank)
        what = f"reading rank {rank}'s claims"
        if not self._call(lambda: self.store.check([theirs]), what):
            return []
        return _units(self._call(lambda: self.store.get(theirs), what))

    def finished(self, epoch: int, rank: int) -> int:
        """How many of its claimed units of ``epoch`` ``rank`` has trained."""
        theirs = self._key(epoch, "finished", rank)
        return int(self._call(lambda: self.store.add(theirs, 0), f"reading rank {rank}'s count"))

    def unfinished(self, epoch: int, rank: int) -> list[int]:
        """``rank``'s claimed units of ``epoch`` less the first :meth:`finished` of them."""
        claimed = self.claimed(epoch, rank)
        return claimed[self.finished(epoch, rank):]

    def returned(self, epoch: int) -> list[int]:
        """Every unit of ``epoch`` pushed back so far (taken or not), in queue order."""
        queue = self._key(epoch, "returned")
        what = "reading the returned units"
        if not self._call(lambda: self.store.check([queue]), what):
            return []
        return _units(self._call(lambda: self.store.get(queue), what))

    def return_units(self, epoch: int, lost: int) -> list[int]:
        """Push ``lost``'s unfinished units of ``epoch`` onto the returned queue, once.

        Every survivor calls it after the loss: the first to call (an atomic counter in the
        store) pushes, the others wait for its record. All return the list pushed; calling it
        again returns the same list.
        """
        record = self._key(epoch, "returned", lost)
        what = f"returning rank {lost}'s units of epoch {epoch}"
        elect = self._key(epoch, "returned_by", lost)
        if int(self._call(lambda: self.store.add(elect, 1), what)) == 1:
            units = self.unfinished(epoch, lost)
            if units:
                queue, count = self._key(epoch, "returned"), self._key(epoch, "returned_count")
                text = "".join(f"{u}," for u in units)
                self._call(lambda: self.store.append(queue, text), what)
                # the count after the content: a rank that sees it can read the units
                self._call(lambda: self.store.add(count, len(units)), what)
            self._call(lambda: self.store.set(record, json.dumps(units)), what)
            return units
        deadline = time.monotonic() + self.timeout
        while not self._call(lambda: self.store.check([record]), what):
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank {self.rank}: the survivor that returns rank {lost}'s "
                                   f"units of epoch {epoch} did not push them within "
                                   f"{self.timeout:g} s")
            time.sleep(self.poll_s)
        return [int(u) for u in json.loads(self._call(lambda: self.store.get(record), what))]

    def _pushed(self, epoch: int) -> int:
        count = self._key(epoch, "returned_count")
        return int(self._call(lambda: self.store.add(count, 0), "reading the returned units"))

    def take_returned(self, epoch: int) -> int | None:
        """Take the next returned unit of ``epoch`` that no rank has taken (atomically: one
        counter per queue position); ``None`` when none is left."""
        tried = self._tried.get(epoch, 0)
        pushed = self._pushed(epoch)
        if tried >= pushed:
            return None
        queue = self.returned(epoch)
        while tried < pushed:
            position, tried = tried, tried + 1
            self._tried[epoch] = tried
            taken = self._key(epoch, "taken", position)
            if int(self._call(lambda k=taken: self.store.add(k, 1), "taking a returned unit")) == 1:
                return queue[position]
        return None

    def open(self, epoch: int) -> None:
        """This rank began training ``epoch`` (its epoch-start hook). Lightning draws an epoch's
        first batch as it sets the loader up, before that hook: a rank that finds the units all
        taken there (fewer left than ranks) arrives at the end without waiting, since its peers
        meet it at the epoch's start first (:meth:`wait_at_end`)."""
        self.opened = epoch

    def wait_at_end(self, epoch: int,
                    on_wait: Callable[[], None] | None = None) -> int | None:
        """This rank found ``epoch``'s counter exhausted: wait at the epoch's end (``on_wait``:
        called at each poll instead of :attr:`on_wait`).

        Marks this rank arrived (and returns ``None`` at once before the epoch was opened,
        :meth:`open`), then polls (every ``poll_s``, calling ``on_wait`` first) until
        a returned unit can be taken (withdraws the arrival and returns the unit) or every rank
        in ``live()`` has arrived and no returned unit is left (``None``; also ``None`` once
        this rank is not in ``live()``: the others went on without it).

        Raises:
            TimeoutError: after ``timeout`` seconds, naming the live ranks not arrived.
        """
        mine = self._key(epoch, "arrived", self.rank)
        what = f"waiting at the end of epoch {epoch}"
        self._call(lambda: self.store.set(mine, "1"), what)
        self.arrived = epoch
        if epoch != self.opened:  # the loader's set-up, before the epoch opened (see open())
            return None
        deadline = time.monotonic() + self.timeout
        while True:
            (on_wait or self.on_wait)()
            ranks = [int(r) for r in self.live()]
            if self.rank not in ranks:  # the others went on without this rank: take nothing
                return None
            arrived = [self._key(epoch, "arrived", r) for r in ranks]
            # arrivals first, the queue after: a rank withdraws its arrival before it takes,
            # so a unit pushed before the all-arrived check is seen by the queue read
            everyone = bool(self._call(lambda k=arrived: self.store.check(k), what))
            if self._tried.get(epoch, 0) < self._pushed(epoch):
                self._call(lambda: self.store.delete_key(mine), what)
                self.arrived = None
                unit = self.take_returned(epoch)
                if unit is not None:
                    return unit
                self._call(lambda: self.store.set(mine, "1"), what)
                self.arrived = epoch
            elif everyone:
                return None
            if time.monotonic() > deadline:
                missing = [r for r, k in zip(ranks, arrived, strict=True)
                           if not self._call(lambda k=k: self.store.check([k]), what)]
                raise TimeoutError(
                    f"rank {self.rank}: rank(s) {', '.join(map(str, missing))} did not reach "
                    f"the end of epoch {epoch} within {self.timeout:g} s (the shared cursor "
                    "waits there until every live rank has used up its claims)")
            time.sleep(self.poll_s)
