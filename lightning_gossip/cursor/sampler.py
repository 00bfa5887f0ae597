"""Straggler-resilient data: ranks draw batches from one shared permutation.

With a ``DistributedSampler`` every rank owns ``1/n`` of the data, so an epoch lasts as long as
the slowest rank needs for its share. :class:`SharedCursorSampler` instead hands out chunks of
one seeded permutation (the same on every rank) through an atomic counter in the c10d store
that the process group already has: a faster rank simply claims more chunks. An epoch ends when
the permutation is used up, and every sample is seen exactly once per epoch.

The sampler has no ``__len__`` (how many batches a rank gets is not known in advance), so
Lightning treats the training loader as having unknown length: the progress bar counts batches
without a total, and validation runs at the end of each epoch.

Batch samplers that make their own batches (length buckets, token budgets) get the same
treatment through :class:`~lightning_gossip.cursor.batches.SharedBatchSampler`, which hands out
whole precomputed batches; :func:`~lightning_gossip.cursor.loader.shared_sampler` picks the one
that fits a loader (under Lightning,
:func:`~lightning_gossip.strategies.shared_loader.shared_cursor_loader` rebuilds the loader with
it).

Example (inside an initialised process group; the strategy does this for you)::

    from lightning_gossip.cursor.store import default_store

    sampler = SharedCursorSampler(len(dataset), chunk_size=32, store=default_store(),
                                  key="run0", seed=0)
    loader = DataLoader(dataset, batch_size=32, sampler=sampler)
    for epoch in range(3):
        sampler.set_epoch(epoch)
        for batch in loader: ...
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.utils.data import Sampler

from lightning_gossip.cursor.claims import Claims

if TYPE_CHECKING:
    from lightning_gossip.cursor.end_balance import EndBalance
    from lightning_gossip.elastic.claim_ledger import ClaimLedger
    from lightning_gossip.hierarchy import NodeLayout

__all__ = ["SharedCursorSampler"]


class SharedCursorSampler(Sampler[int]):
    """Yields indices chunk by chunk; chunks are claimed with an atomic shared counter.

    Args:
        num_samples: size of the dataset.
        chunk_size: indices claimed per counter increment; use the loader's batch size so
            that every batch is one claimed chunk.
        store: a c10d store shared by all ranks.
        key: a name unique to this run (and the same on every rank).
        shuffle: draw a fresh seeded permutation each epoch (else the natural order).
        seed: permutation seed; the epoch is mixed in, as ``DistributedSampler`` does.
        node: claim as this rank's node, whose ranks step together (hierarchical; the fit's
            layout, see :mod:`~lightning_gossip.cursor.claims`); ``None``: this rank claims
            alone.
        ledger: elastic claims (a lost rank's unfinished chunks come back; see
            :mod:`~lightning_gossip.elastic.claim_ledger`); ``None``: the counter alone.
        balance: leave an epoch's last units to the claimants that finish them first
            (:mod:`~lightning_gossip.cursor.end_balance`); ``None``: claim to the end.
    """

    def __init__(self, num_samples: int, chunk_size: int, store: dist.Store, key: str,
                 shuffle: bool = True, seed: int = 0, node: NodeLayout | None = None,
                 ledger: ClaimLedger | None = None,
                 balance: EndBalance | None = None) -> None:
        if num_samples < 1:
            raise ValueError(f"the dataset is empty (num_samples={num_samples})")
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        self.num_samples = int(num_samples)
        self.chunk_size = int(chunk_size)
        self.store = store
        self.key = key
        self.shuffle = shuffle
        self.seed = int(seed)
        self.epoch = 0
        self.claims = Claims(store, key, node, ledger, balance)
        #: number of chunks this rank claimed in the last (or current) epoch
        self.claimed = 0

    @property
    def num_chunks(self) -> int:
        """Chunks per epoch (the last one may be shorter)."""
        return math.ceil(self.num_samples / self.chunk_size)

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose permutation (and shared counter) the next iteration uses."""
        self.epoch = int(epoch)

    def permutation(self) -> torch.Tensor:
        """The epoch's order of all sample indices, the same on every rank."""
        if not self.shuffle:
            return torch.arange(self.num_samples)
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(self.num_samples, generator=g)

    def __iter__(self) -> Iterator[int]:
        perm = self.permutation()
        self.claimed = 0
        while True:
            chunk = self.claims.next(self.epoch, self.num_chunks)
            if chunk is None:
                return
            self.claimed += 1
            part = perm[chunk * self.chunk_size:(chunk + 1) * self.chunk_size].tolist()
            if self.claims.node is not None:
                # a node's ranks must take one claim per batch each: a short last chunk would
                # make the loader's batch sampler claim again on one rank only; pad it as
                # DistributedSampler pads (wrapping around to the first samples)
                part += perm[:self.chunk_size - len(part)].tolist()
            yield from part
