"""Straggler-resilient data for batch samplers: whole precomputed batches, one shared counter.

:class:`~lightning_gossip.cursor.sampler.SharedCursorSampler` shares one permutation of *samples*
between the ranks. Many training pipelines make their batches themselves instead (length
buckets for speech, token budgets for text), with a batch sampler that also shards the batches
over the ranks, so every rank owns a fixed share of the epoch and the epoch lasts as long as the
slowest rank needs for its share. :class:`SharedBatchSampler` replaces the sharding: it lists
the epoch's batches (all ranks' batches, the same list on every rank) and hands them out one at
a time through an atomic counter in the c10d store, so a faster rank simply takes more batches.
Every batch is used exactly once per epoch.

**The protocol.** A batch sampler opts in by implementing :class:`SharedBatches`, one method::

    def shared_batches(self, epoch: int) -> Sequence[Sequence[int]]:
        '''Every batch of ``epoch`` for all ranks together, the same list on every rank.'''

It must be deterministic (seeded, and the seed must be the same on every rank) and must not
shard: the union of the batches is the epoch's data, each index as often as it should be seen
per epoch. The rank's own sharding (``num_replicas``/``rank``) stays in ``__iter__`` for
synchronous strategies, which need equal batch counts. Under ``ADPSGDStrategy`` (with
``shared_cursor=True``, the default) a training loader whose batch sampler implements the
protocol gets a :class:`SharedBatchSampler` automatically; see
:func:`~lightning_gossip.cursor.loader.shared_sampler`. Every rank writes a
digest of its list to the store, and the first rank whose list differs stops with an error that
names it.

>>> import torch.distributed as dist
>>> class Pairs:
...     def shared_batches(self, epoch: int) -> list[list[int]]:
...         return [[0, 1], [2, 3], [4, 5]] if epoch % 2 == 0 else [[4, 5], [2, 3], [0, 1]]
>>> sampler = SharedBatchSampler(Pairs(), dist.HashStore(), key="doc")
>>> sampler.set_epoch(1)
>>> list(sampler), sampler.claimed  # alone, this rank takes every batch
([[4, 5], [2, 3], [0, 1]], 3)
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch.distributed as dist
from torch.utils.data import Sampler

from lightning_gossip.cursor.claims import Claims

if TYPE_CHECKING:
    from lightning_gossip.cursor.end_balance import EndBalance
    from lightning_gossip.elastic.claim_ledger import ClaimLedger
    from lightning_gossip.hierarchy import NodeLayout

__all__ = ["SharedBatchSampler", "SharedBatches"]


@runtime_checkable
class SharedBatches(Protocol):
    """A batch sampler that can list the whole epoch's batches, identically on every rank."""

    def shared_batches(self, epoch: int) -> Sequence[Sequence[int]]:
        """Every batch of ``epoch`` (for all ranks together), the same list on every rank."""
        ...


class SharedBatchSampler(Sampler[list[int]]):
    """Yields whole batches of ``source``; each batch is claimed with an atomic shared counter.

    Args:
        source: lists an epoch's batches: an object implementing :class:`SharedBatches`, or a
            function ``epoch -> batches`` with the same contract.
        store: a c10d store shared by all ranks (e.g.
            :func:`~lightning_gossip.cursor.store.default_store`).
        key: a name unique to this run and loader (and the same on every rank).
        check: compare a digest of the batch list across ranks (through the store, without
            waiting) and raise on the first rank whose list differs.
        node: claim as this rank's node, whose ranks step together (hierarchical; the fit's
            layout, see :mod:`~lightning_gossip.cursor.claims`); ``None``: this rank claims
            alone.
        ledger: elastic claims (a lost rank's unfinished batches come back; see
            :mod:`~lightning_gossip.elastic.claim_ledger`); ``None``: the counter alone.
        balance: leave an epoch's last units to the claimants that finish them first
            (:mod:`~lightning_gossip.cursor.end_balance`); ``None``: claim to the end.

    The sampler has no ``__len__``: how many batches a rank gets is only known at the end of
    the epoch (then :attr:`claimed`). A new iterator within the same epoch ends the previous
    one and first hands out again the batches that one took (an abandoned iterator loses no
    batches; Lightning abandons one, with a prefetched batch, whenever it reloads a loader).
    Lightning calls :meth:`set_epoch` every epoch through :attr:`sampler` (it calls
    ``set_epoch`` on ``loader.batch_sampler.sampler``); ``set_epoch`` is passed on to
    ``source`` when it has one.
    """

    def __init__(self, source: SharedBatches | Callable[[int], Sequence[Sequence[int]]],
                 store: dist.Store, key: str, *, check: bool = True,
                 node: NodeLayout | None = None, ledger: ClaimLedger | None = None,
                 balance: EndBalance | None = None) -> None:
        if not (isinstance(source, SharedBatches) or callable(source)):
            raise TypeError(f"source must implement shared_batches(epoch) or be a function of "
                            f"the epoch, got {type(source).__name__}")
        self.source = source
        self.store = store
        self.key = key
        self.check = check
        self.claims = Claims(store, key, node, ledger, balance)
        self.epoch = int(getattr(source, "epoch", 0) or 0)
        #: batches this rank claimed in the last (or current) epoch
        self.claimed = 0
        #: batches in the last listed epoch (all ranks together)
        self.num_batches = 0
        self._generation = 0  # only the newest iterator draws
        self._taken: list[list[int]] = []  # what the newest iterator handed out
        self._taken_epoch = -1
        self._taken_done = False

    @property
    def sampler(self) -> SharedBatchSampler:
        """This sampler itself, so that Lightning's per-epoch ``set_epoch`` call reaches it."""
        return self

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose batches (and shared counter) the next iteration uses."""
        self.epoch = int(epoch)
        set_source_epoch = getattr(self.source, "set_epoch", None)
        if callable(set_source_epoch):
            set_source_epoch(self.epoch)

    def batches(self) -> list[list[int]]:
        """The current epoch's batches for all ranks, in the order they are handed out."""
        if isinstance(self.source, SharedBatches):
            listed = self.source.shared_batches(self.epoch)
        else:
            listed = self.source(self.epoch)
        return [[int(i) for i in batch] for batch in listed]

    def _check_same_on_every_rank(self, batches: list[list[int]]) -> None:
        digest = hashlib.sha256(json.dumps(batches).encode()).hexdigest()
        first = self.store.compare_set(f"{self.key}/epoch{self.epoch}/digest", "", digest)
        if first.decode() != digest:
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
            raise RuntimeError(
                f"shared batches: rank {rank} lists different batches for epoch {self.epoch} "
                f"than the rank that listed them first ({len(batches)} batches here). "
                "shared_batches(epoch) must return the same list on every rank (same seed, "
                "no per-rank sharding)."
            )

    def __iter__(self) -> Iterator[list[int]]:
        self._generation += 1
        return self._iterate(self._generation)

    def _iterate(self, generation: int) -> Iterator[list[int]]:
        batches = self.batches()
        self.num_batches = len(batches)
        if self.check:
            self._check_same_on_every_rank(batches)
        # Batches an unfinished earlier iterator of this epoch took are handed out first:
        # Lightning starts an iterator when it (re)loads a loader, then sets the epoch and
        # starts another, and the first one's prefetched batch would otherwise be lost.
        replay = self._taken if self._taken_epoch == self.epoch and not self._taken_done else []
        self._taken, self._taken_epoch, self._taken_done = [], self.epoch, False
        self.claimed = 0
        for batch in replay:
            if generation != self._generation:
                return
            self._taken.append(batch)
            self.claimed += 1
            yield batch
        while generation == self._generation:
            index = self.claims.next(self.epoch, len(batches))
            if index is None:
                self._taken_done = True
                return
            self._taken.append(batches[index])
            self.claimed += 1
            yield batches[index]
