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
treatment through :class:`~lightning_gossip.shared_batches.SharedBatchSampler`, which hands out
whole precomputed batches; :func:`shared_cursor_loader` picks the one that fits a loader.

Example (inside an initialised process group; the strategy does this for you)::

    sampler = SharedCursorSampler(len(dataset), chunk_size=32, store=default_store(),
                                  key="run0", seed=0)
    loader = DataLoader(dataset, batch_size=32, sampler=sampler)
    for epoch in range(3):
        sampler.set_epoch(epoch)
        for batch in loader: ...
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, IterableDataset, Sampler

from lightning_gossip import _compat
from lightning_gossip.node_claims import Claims, NodeShare
from lightning_gossip.shared_batches import SharedBatches, SharedBatchSampler

__all__ = ["SharedCursorSampler", "SharedLoader", "default_store", "shared_cursor_loader"]


def default_store() -> dist.Store:
    """The key-value store of the default process group (created by ``init_process_group``).

    Keys are prefixed with ``lightning_gossip/`` so that they cannot collide with torch's own.
    """
    return dist.PrefixStore("lightning_gossip/", _compat.default_store())


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
        node: claim as a node whose ranks step together (hierarchical adpsgd; see
            :mod:`~lightning_gossip.node_claims`); ``None``: this rank claims alone.
    """

    def __init__(self, num_samples: int, chunk_size: int, store: dist.Store, key: str,
                 shuffle: bool = True, seed: int = 0, node: NodeShare | None = None) -> None:
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
        self.claims = Claims(store, key, node)
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
            if self.claims.share is not None:
                # a node's ranks must take one claim per batch each: a short last chunk would
                # make the loader's batch sampler claim again on one rank only; pad it as
                # DistributedSampler pads (wrapping around to the first samples)
                part += perm[:self.chunk_size - len(part)].tolist()
            yield from part


def _with_batch_sampler(dataloader: DataLoader, batch_sampler: Sampler[list[int]]) -> DataLoader:
    """A copy of ``dataloader`` (any subclass, every setting kept) that uses ``batch_sampler``.

    ``DataLoader`` forbids assigning ``batch_sampler`` after construction, and Lightning's
    re-instantiation cannot swap a custom batch sampler, so the attribute is set on a shallow
    copy that has not been iterated yet.
    """
    loader = copy.copy(dataloader)
    object.__setattr__(loader, "batch_sampler", batch_sampler)
    object.__setattr__(loader, "_iterator", None)
    return loader


class SharedLoader(NamedTuple):
    """A training loader rebuilt by :func:`shared_cursor_loader` and the claims it draws by."""

    loader: DataLoader
    claims: Claims


def shared_cursor_loader(dataloader: object, *, key: str, seed: int = 0,
                         store: dist.Store | None = None,
                         node: NodeShare | None = None) -> SharedLoader | None:
    """The training loader rebuilt to draw its data through the shared cursor, if it can be.

    * a batch sampler that implements
      :class:`~lightning_gossip.shared_batches.SharedBatches` (lists the epoch's batches):
      wrapped in a :class:`~lightning_gossip.shared_batches.SharedBatchSampler`, which hands
      out whole batches;
    * a plain ``batch_size`` loader over a map-style dataset: its sampler is replaced by a
      :class:`SharedCursorSampler` over one seeded permutation (shuffled unless the loader's
      ``DistributedSampler`` says ``shuffle=False``);
    * a loader that already uses either: returned as is (``None``);
    * anything else (an iterable dataset, a batch sampler without ``shared_batches``): a
      warning says why, and ``None`` (the loader is used as is, each rank keeps its share).

    Args:
        dataloader: the training loader (after Lightning's sampler injection).
        key: a name unique to the run (and the same on every rank); prefixes the counters.
        seed: the permutation seed of :class:`SharedCursorSampler`.
        store: the shared store; default :func:`default_store`.
        node: claim as this rank's node (hierarchical adpsgd: the node's ranks step together
            and the node takes ``devices`` units per claim); ``None``: this rank alone.

    Returns:
        The new loader and its sampler's :class:`~lightning_gossip.node_claims.Claims` (which
        the requeue checkpoint saves), or ``None`` when ``dataloader`` is to be used unchanged.
    """
    from lightning.pytorch.trainer.states import RunningStage
    from lightning.pytorch.utilities.rank_zero import rank_zero_warn

    if not isinstance(dataloader, DataLoader):
        return None
    batch_sampler = dataloader.batch_sampler
    if isinstance(batch_sampler, SharedBatchSampler) or isinstance(
            dataloader.sampler, SharedCursorSampler):
        return None
    if isinstance(dataloader.dataset, IterableDataset):
        rank_zero_warn("adpsgd: the training loader has an iterable dataset, so it is used as "
                       "is (the shared cursor needs a map-style dataset).")
        return None
    if isinstance(batch_sampler, SharedBatches):
        shared = SharedBatchSampler(batch_sampler, store or default_store(), key=f"{key}/batches",
                                    node=node)
        return SharedLoader(_with_batch_sampler(dataloader, shared), shared.claims)
    if dataloader.batch_size is None or (
            batch_sampler is not None and type(batch_sampler) is not BatchSampler):
        rank_zero_warn(
            f"adpsgd: the training loader's batch sampler ({type(batch_sampler).__name__}) does "
            "not list its batches, so it is used as is and every rank keeps its own share. "
            "Implement shared_batches(epoch) (see lightning_gossip.shared_batches) to share "
            "its batches between the ranks."
        )
        return None
    sampler = dataloader.sampler
    shuffle = sampler.shuffle if isinstance(sampler, DistributedSampler) else True
    cursor = SharedCursorSampler(len(dataloader.dataset), chunk_size=dataloader.batch_size,
                                 store=store or default_store(), key=key, shuffle=shuffle,
                                 seed=seed, node=node)
    return SharedLoader(_compat.update_dataloader(dataloader, cursor, mode=RunningStage.TRAINING),
                        cursor.claims)
