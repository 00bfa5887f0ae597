"""The shared cursor's claims, by one rank or by a whole node (hierarchical adpsgd).

The shared samplers (:mod:`~lightning_gossip.cursor.sampler`,
:mod:`~lightning_gossip.cursor.batches`) hand out the *units* of an epoch (chunks of samples, or
whole batches) through an atomic counter in the c10d store, so a faster rank takes more.
With ``ADPSGDStrategy(hierarchical=True)`` the ranks of a node step together (their gradients
are averaged every step), so the node is the learner that must take more when it is faster:
given the fit's :class:`~lightning_gossip.hierarchy.NodeLayout`, the node claims ``devices``
units at a time and local rank ``l`` takes unit ``claim * devices + l``. Its leader (local rank
0) claims on the shared counter and writes the claim under a per-node key; the other local
ranks read it there (a blocking ``get``), so every rank of the node takes the same number of
steps. Where the last claim runs past the epoch's units, the missing units wrap around to the
first ones (as ``DistributedSampler`` pads its shares). With elastic claims (a ledger) whose
``lockstep`` is set (hierarchical ``dpsgd``, whose gossip-only rounds at an epoch's end are node
collectives) the other local ranks run the ledger's wait only in step with local rank 0: it
announces each call under the node's claim key before it makes it, they make one call per
announcement, and the claim carries the number of calls (the mates make those they have not
seen: none when the calls are node collectives, which local rank 0 cannot finish without
them). An elastic node's claim keys carry the ledger's ``incarnation`` (a rejoined node's
processes do not read their predecessors' claims).

Example (one node of 2 ranks on a local store)::

    >>> from datetime import timedelta
    >>> import torch.distributed as dist
    >>> from lightning_gossip.hierarchy import NodeLayout
    >>> store = dist.HashStore()
    >>> a = Claims(store, "run", NodeLayout(num_nodes=1, devices=2, node=0, local=0))
    >>> b = Claims(store, "run", NodeLayout(num_nodes=1, devices=2, node=0, local=1))
    >>> [a.next(0, 5) for _ in range(4)], [b.next(0, 5) for _ in range(4)]
    ([0, 2, 4, None], [1, 3, 0, None])
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch.distributed as dist

from lightning_gossip.liveness.heartbeat import store_call

if TYPE_CHECKING:
    from lightning_gossip.cursor.end_balance import EndBalance
    from lightning_gossip.elastic.claim_ledger import ClaimLedger
    from lightning_gossip.hierarchy import NodeLayout

__all__ = ["Claims"]


class Claims:
    """The next unit of an epoch for this rank (alone, or as a local rank of its node).

    Args:
        store: the c10d store all ranks share.
        key: a name unique to the run and loader (the same on every rank).
        node: ``None``: this rank claims alone; else the fit's layout, seen from this rank:
            its node claims ``devices`` units at a time (see the module docstring).
        ledger: elastic claims: a returned unit of a lost rank is taken before the counter,
            every claim is recorded, and an exhausted counter waits at the epoch's end
            (:class:`~lightning_gossip.elastic.claim_ledger.ClaimLedger`; with ``node``, the
            node's claims, kept by its local rank 0, the other ranks polling for them with the
            ledger's ``on_wait``); ``None``: the counter alone.
        balance: near an epoch's end, leave the last units to the claimants that finish them
            first (:class:`~lightning_gossip.cursor.end_balance.EndBalance`; not with a ledger: a
            lost claimant could not take what it was left); ``None``: claim until the end.

    Every rank of a node must call :meth:`next` equally often per epoch (they step together).
    :attr:`start` (``epoch -> claims``) makes an epoch's counter start past the claims made
    before a requeue (:meth:`position`, saved in the requeue checkpoint).
    """

    def __init__(self, store: dist.Store, key: str, node: NodeLayout | None = None,
                 ledger: ClaimLedger | None = None, balance: EndBalance | None = None) -> None:
        if balance is not None and ledger is not None:
            raise ValueError("a balanced epoch end (EndBalance) cannot go with elastic claims "
                             "(a ClaimLedger): a lost claimant could not take the units left "
                             "to it")
        self.store = store
        self.ledger, self.balance = ledger, balance
        self.key = key
        self.node = node
        self._made: dict[int, int] = {}  # epoch -> claims made (a node's ranks agree on it)
        #: epoch -> claims already made before this run (resumed mid-epoch); the same on every rank
        self.start: dict[int, int] = {}
        self._claims: dict[int, int] = {}  # epoch -> claims the epoch has in all

    def resume(self, start: dict[int, int]) -> None:
        """Each epoch's counter starts past ``start[epoch]`` claims (a checkpoint's position,
        :attr:`start`)."""
        self.start = start

    def position(self, epoch: int) -> tuple[int, int] | None:
        """``(claims made so far, claims in all)`` of ``epoch`` on the shared counter (any rank
        can read it; the same on every rank once they have all stopped claiming); ``None``
        before this rank claimed in ``epoch``."""
        if epoch not in self._claims:
            return None
        counter = f"{self.key}/epoch{epoch}"
        made = int(store_call(lambda: self.store.add(counter, 0), "reading the shared cursor"))
        return made + self.start.get(epoch, 0), self._claims[epoch]

    def next(self, epoch: int, units: int) -> int | None:
        """The index (in ``[0, units)``) of this rank's next unit of ``epoch``; ``None`` when
        the epoch's units are all taken (with a ledger: and no returned unit is left once
        every live rank has reached the end; it waits there)."""
        counter = f"{self.key}/epoch{epoch}"
        what = f"claiming a batch of epoch {epoch}"
        layout, ledger = self.node, self.ledger
        offset, first = self.start.get(epoch, 0), epoch not in self._claims
        if layout is None:
            self._claims[epoch] = units
            if self.ledger is None:
                if not self._balanced(epoch, counter, units, offset, what):
                    return None
                index = int(store_call(lambda: self.store.add(counter, 1), what)) - 1 + offset
                return index if index < units else None
            return self._recorded(epoch, counter, units, offset, what, first)
        claims = self._claims[epoch] = math.ceil(units / layout.devices)
        k = self._made.get(epoch, 0)
        self._made[epoch] = k + 1
        incarnation = ledger.incarnation if ledger is not None else 0
        node = f"node{layout.node}" + (f".{incarnation}" if incarnation else "")
        mine = f"{counter}/{node}/claim{k}"
        if layout.local == 0:
            waits = None  # (lockstep: the ledger's waits, announced and counted)
            if ledger is not None:
                if ledger.lockstep:
                    waits = _Announced(self.store, mine, what, ledger.on_wait)
                claim = self._recorded(epoch, counter, claims, offset, what, first, waits)
                claim = claims if claim is None else claim
            else:
                claim = (int(store_call(lambda: self.store.add(counter, 1), what)) - 1 + offset
                         if self._balanced(epoch, counter, claims, offset, what)
                         else claims)  # (the node's other ranks end with it)
            value = str(claim) if waits is None else f"{claim} {waits.calls}"
            store_call(lambda: self.store.set(mine, value), what)
        else:
            claim = self._read_node_claim(mine, f"{what} (node {layout.node})")
        if claim >= claims:
            return None
        return (claim * layout.devices + layout.local) % units

    def _recorded(self, epoch: int, counter: str, units: int, offset: int, what: str,
                  first: bool, on_wait: Callable[[], None] | None = None) -> int | None:
        """The next unit through the :attr:`ledger` (see ``ledger``); ``None`` at the end.
        ``on_wait``: called at each poll of the ledger's wait instead of its own (a lockstep
        node's claimant announces each call first: :class:`_Announced`)."""
        ledger = self.ledger
        assert ledger is not None
        if ledger.rank not in ledger.live():  # the others went on without this rank
            return None
        if first and epoch >= 2:
            ledger.forget(epoch - 2)  # every live rank has left it (ClaimLedger.forget)
        unit = ledger.take_returned(epoch)
        if unit is None:
            index = int(store_call(lambda: self.store.add(counter, 1), what)) - 1 + offset
            unit = index if index < units else ledger.wait_at_end(epoch, on_wait=on_wait)
        if unit is not None:
            ledger.record_claim(epoch, unit)
        return unit

    def _read_node_claim(self, key: str, what: str) -> int:
        """The node's claim under ``key``, written by its local rank 0 (elastic: polled,
        running the ledger's ``on_wait`` meanwhile, so that this rank takes part in a recovery
        while its node's claimant waits at the epoch's end; ``lockstep``: once per call that
        local rank 0 announced, and the calls it made after this rank's last look, whose count
        comes with the claim)."""
        ledger = self.ledger
        if ledger is None:
            return int(store_call(lambda: self.store.get(key), what))
        lockstep = self.node is not None and ledger.lockstep
        deadline, pause, calls = time.monotonic() + ledger.timeout, 0.001, 0
        while not store_call(lambda: self.store.check([key]), what):
            if not lockstep:
                ledger.on_wait()
            elif store_call(lambda i=calls: self.store.check([f"{key}/wait{i}"]), what):
                ledger.on_wait()
                calls, deadline, pause = calls + 1, time.monotonic() + ledger.timeout, 0.001
                continue
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what}: local rank 0 did not claim within "
                                   f"{ledger.timeout:g} s")
            time.sleep(pause)
            pause = min(2 * pause, ledger.poll_s)
        claim, _, made = _text(store_call(lambda: self.store.get(key), what)).partition(" ")
        for _ in range(int(made or calls) - calls):  # (none when its rounds were collectives)
            ledger.on_wait()
        return int(claim)

    def _balanced(self, epoch: int, counter: str, claims: int, offset: int, what: str) -> bool:
        """Whether to claim now (always without :attr:`balance`; with it, ``False`` leaves the
        epoch's last claims to the others)."""
        if self.balance is None:
            return True
        made = int(store_call(lambda: self.store.add(counter, 0), what)) + offset
        return self.balance.take(epoch, claims - made)


class _Announced:
    """The ledger's wait of a lockstep node's claimant: each call of ``on_wait`` announced
    first under ``key``/wait<i> (its node-mates make one call per announcement), and counted
    (:attr:`calls`, written with the claim)."""

    def __init__(self, store: dist.Store, key: str, what: str,
                 on_wait: Callable[[], None]) -> None:
        self.store, self.key, self.what, self.on_wait = store, key, what, on_wait
        self.calls = 0

    def __call__(self) -> None:
        announced = f"{self.key}/wait{self.calls}"
        store_call(lambda: self.store.set(announced, ""), self.what)
        self.calls += 1
        self.on_wait()


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
