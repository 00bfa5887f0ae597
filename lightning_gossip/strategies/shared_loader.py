"""The training loader of a Lightning fit rebuilt to draw through the shared cursor
(:func:`shared_cursor_loader`): the Lightning side of :mod:`lightning_gossip.shared_cursor` and
:mod:`lightning_gossip.shared_batches`, used by ``ADPSGDStrategy`` (through
:class:`~.cursor_resume.CursorResume`)."""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, NamedTuple

import torch.distributed as dist
from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, IterableDataset, Sampler

from lightning_gossip import _compat
from lightning_gossip.end_balance import EndBalance
from lightning_gossip.node_claims import Claims, NodeShare
from lightning_gossip.shared_batches import SharedBatches, SharedBatchSampler
from lightning_gossip.shared_cursor import SharedCursorSampler, default_store

if TYPE_CHECKING:
    from lightning_gossip.elastic.claim_ledger import ClaimLedger

__all__ = ["SharedLoader", "shared_cursor_loader"]


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
                         node: NodeShare | None = None,
                         ledger: ClaimLedger | None = None,
                         balance_as: tuple[int, int] | None = None) -> SharedLoader | None:
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
        ledger: elastic claims (elastic adpsgd: a lost rank's unfinished units come back to
            the survivors; a node claims as one, see :mod:`~lightning_gossip.elastic.claim_ledger`).
        balance_as: ``(claimant, claimants)``: this rank (or ``node``) is claimant ``claimant``
            of ``claimants`` and leaves an epoch's last units to those that finish them first
            (:mod:`~lightning_gossip.end_balance`); ``None``: claim to the end.

    Returns:
        The new loader and its sampler's :class:`~lightning_gossip.node_claims.Claims` (which
        the requeue checkpoint saves), or ``None`` when ``dataloader`` is to be used unchanged.
    """
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
    store = store or default_store()
    # (Lightning's fetcher holds one batch ahead, a loader's workers prefetch more)
    ahead = 1 + dataloader.num_workers * (dataloader.prefetch_factor or 0)
    balance = None if balance_as is None else EndBalance(store, f"{key}/balance", *balance_as,
                                                        ahead=ahead)
    if isinstance(batch_sampler, SharedBatches):
        shared = SharedBatchSampler(batch_sampler, store, key=f"{key}/batches",
                                    node=node, ledger=ledger, balance=balance)
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
                                 store=store, key=key, shuffle=shuffle,
                                 seed=seed, node=node, ledger=ledger, balance=balance)
    return SharedLoader(_compat.update_dataloader(dataloader, cursor, mode=RunningStage.TRAINING),
                        cursor.claims)
