"""A training loader's data drawn through the shared cursor, without Lightning: which shared
sampler fits a ``DataLoader`` (:func:`shared_sampler`; :func:`unshareable` says why none does)
and a copy of a loader with another batch sampler (:func:`with_batch_sampler`).

* a batch sampler that implements :class:`~lightning_gossip.cursor.batches.SharedBatches`
  (lists the epoch's batches): wrapped in a
  :class:`~lightning_gossip.cursor.batches.SharedBatchSampler`, which hands out whole batches;
* a plain ``batch_size`` loader over a map-style dataset: its sampler is replaced by a
  :class:`~lightning_gossip.cursor.sampler.SharedCursorSampler` over one seeded permutation
  (shuffled unless the loader's ``DistributedSampler`` says ``shuffle=False``);
* a loader that already uses either is left as it is (:func:`drawn_through_cursor`);
* anything else (an iterable dataset, a batch sampler without ``shared_batches``) cannot be
  shared: the loader is used as is and each rank keeps its share.

An adapter puts the sampler into its loader: under Lightning
:func:`~lightning_gossip.strategies.shared_loader.shared_cursor_loader` (Lightning re-creates a
loader around a new sampler; a batch sampler goes into a copy, :func:`with_batch_sampler`).
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING

import torch.distributed as dist
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, IterableDataset, Sampler

from lightning_gossip.cursor.batches import SharedBatches, SharedBatchSampler
from lightning_gossip.cursor.end_balance import EndBalance
from lightning_gossip.cursor.sampler import SharedCursorSampler
from lightning_gossip.cursor.store import default_store

if TYPE_CHECKING:
    from lightning_gossip.elastic.claim_ledger import ClaimLedger
    from lightning_gossip.hierarchy import NodeLayout

__all__ = ["drawn_through_cursor", "shared_sampler", "unshareable", "with_batch_sampler"]


def drawn_through_cursor(dataloader: DataLoader) -> bool:
    """Whether ``dataloader`` draws through the shared cursor already (either shared sampler)."""
    return isinstance(dataloader.batch_sampler, SharedBatchSampler) or isinstance(
        dataloader.sampler, SharedCursorSampler)


def unshareable(dataloader: DataLoader) -> str | None:
    """Why ``dataloader`` cannot draw through the shared cursor (a warning's text: an iterable
    dataset, or a batch sampler that does not list its batches), or ``None`` when it can."""
    if isinstance(dataloader.dataset, IterableDataset):
        return ("adpsgd: the training loader has an iterable dataset, so it is used as "
                "is (the shared cursor needs a map-style dataset).")
    batch_sampler = dataloader.batch_sampler
    if isinstance(batch_sampler, SharedBatches):
        return None
    if dataloader.batch_size is None or (
            batch_sampler is not None and type(batch_sampler) is not BatchSampler):
        return (
            f"adpsgd: the training loader's batch sampler ({type(batch_sampler).__name__}) does "
            "not list its batches, so it is used as is and every rank keeps its own share. "
            "Implement shared_batches(epoch) (see lightning_gossip.cursor.batches) to share "
            "its batches between the ranks."
        )
    return None


def shared_sampler(dataloader: DataLoader, *, key: str, seed: int = 0,
                   store: dist.Store | None = None, node: NodeLayout | None = None,
                   ledger: ClaimLedger | None = None, balance_as: tuple[int, int] | None = None
                   ) -> SharedBatchSampler | SharedCursorSampler:
    """The shared sampler that replaces ``dataloader``'s (one :func:`unshareable` accepts): a
    :class:`~lightning_gossip.cursor.batches.SharedBatchSampler` around a batch sampler that
    lists its batches (a batch sampler), else a
    :class:`~lightning_gossip.cursor.sampler.SharedCursorSampler` of chunks of the loader's
    ``batch_size`` (a sampler).

    Args:
        dataloader: the training loader (under Lightning: after its sampler injection).
        key: a name unique to the run (and the same on every rank); prefixes the counters.
        seed: the permutation seed of the sampler.
        store: the shared store; default :func:`~lightning_gossip.cursor.store.default_store`.
        node: claim as this rank's node (the fit's layout, seen from this rank: the node's
            ranks step together and the node takes ``devices`` units per claim); ``None``:
            this rank alone.
        ledger: elastic claims (a lost rank's unfinished units come back to the survivors; a
            node claims as one, see :mod:`~lightning_gossip.elastic.claim_ledger`).
        balance_as: ``(claimant, claimants)``: this rank (or ``node``) is claimant ``claimant``
            of ``claimants`` and leaves an epoch's last units to those that finish them first
            (:mod:`~lightning_gossip.cursor.end_balance`); ``None``: claim to the end.
    """
    store = store or default_store()
    # (Lightning's fetcher holds one batch ahead, a loader's workers prefetch more)
    ahead = 1 + dataloader.num_workers * (dataloader.prefetch_factor or 0)
    balance = None if balance_as is None else EndBalance(store, f"{key}/balance", *balance_as,
                                                        ahead=ahead)
    batch_sampler = dataloader.batch_sampler
    if isinstance(batch_sampler, SharedBatches):
        return SharedBatchSampler(batch_sampler, store, key=f"{key}/batches",
                                  node=node, ledger=ledger, balance=balance)
    assert dataloader.batch_size is not None  # (unshareable says why not)
    sampler = dataloader.sampler
    shuffle = sampler.shuffle if isinstance(sampler, DistributedSampler) else True
    return SharedCursorSampler(len(dataloader.dataset), chunk_size=dataloader.batch_size,
                               store=store, key=key, shuffle=shuffle,
                               seed=seed, node=node, ledger=ledger, balance=balance)


def with_batch_sampler(dataloader: DataLoader, batch_sampler: Sampler[list[int]]) -> DataLoader:
    """A copy of ``dataloader`` (any subclass, every setting kept) that uses ``batch_sampler``.

    ``DataLoader`` forbids assigning ``batch_sampler`` after construction, and Lightning's
    re-instantiation cannot swap a custom batch sampler, so the attribute is set on a shallow
    copy that has not been iterated yet.
    """
    loader = copy.copy(dataloader)
    object.__setattr__(loader, "batch_sampler", batch_sampler)
    object.__setattr__(loader, "_iterator", None)
    return loader
