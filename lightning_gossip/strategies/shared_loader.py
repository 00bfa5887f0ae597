"""The training loader of a Lightning fit rebuilt to draw through the shared cursor
(:func:`shared_cursor_loader`, :func:`shared_training_loader`): the Lightning side of
:mod:`lightning_gossip.cursor`, whose :mod:`~lightning_gossip.cursor.loader` picks the shared
sampler; here Lightning re-creates the loader around it and warns (rank 0) when a loader cannot
be shared. Used by both strategies' training loaders (``adpsgd``; elastic ``dpsgd``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch.distributed as dist
from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.utils.data import DataLoader

from lightning_gossip import _compat
from lightning_gossip.cursor.batches import SharedBatchSampler
from lightning_gossip.cursor.claims import Claims
from lightning_gossip.cursor.loader import (
    drawn_through_cursor,
    shared_sampler,
    unshareable,
    with_batch_sampler,
)

if TYPE_CHECKING:
    from lightning_gossip.cursor.resume import CursorResume
    from lightning_gossip.elastic.claim_ledger import ClaimLedger
    from lightning_gossip.hierarchy import NodeLayout

__all__ = ["SharedLoader", "shared_cursor_loader", "shared_training_loader"]


class SharedLoader(NamedTuple):
    """A training loader rebuilt by :func:`shared_cursor_loader` and the claims it draws by."""

    loader: DataLoader
    claims: Claims


def shared_cursor_loader(dataloader: object, *, key: str, seed: int = 0,
                         store: dist.Store | None = None,
                         node: NodeLayout | None = None,
                         ledger: ClaimLedger | None = None,
                         balance_as: tuple[int, int] | None = None) -> SharedLoader | None:
    """The training loader rebuilt to draw its data through the shared cursor, if it can be
    (:mod:`~lightning_gossip.cursor.loader`: which sampler, and when none fits): a batch
    sampler that lists its batches goes into a copy of the loader, a
    :class:`~lightning_gossip.cursor.sampler.SharedCursorSampler` into the loader Lightning
    re-creates around it. A loader that cannot be shared is used as is, with a warning (rank
    0) saying why. The arguments after ``dataloader`` are
    :func:`~lightning_gossip.cursor.loader.shared_sampler`'s.

    Returns:
        The new loader and its sampler's :class:`~lightning_gossip.cursor.claims.Claims`
        (which the requeue checkpoint saves), or ``None`` when ``dataloader`` is to be used
        unchanged.
    """
    if not isinstance(dataloader, DataLoader) or drawn_through_cursor(dataloader):
        return None
    reason = unshareable(dataloader)
    if reason is not None:
        rank_zero_warn(reason)
        return None
    sampler = shared_sampler(dataloader, key=key, seed=seed, store=store, node=node,
                             ledger=ledger, balance_as=balance_as)
    if isinstance(sampler, SharedBatchSampler):
        return SharedLoader(with_batch_sampler(dataloader, sampler), sampler.claims)
    return SharedLoader(_compat.update_dataloader(dataloader, sampler, mode=RunningStage.TRAINING),
                        sampler.claims)


def shared_training_loader(cursor: CursorResume, dataloader: object, *, key: str, seed: int,
                           node: NodeLayout | None, epoch: int = 0,
                           ledger: ClaimLedger | None = None,
                           balance_as: tuple[int, int] | None = None) -> object:
    """``dataloader`` rebuilt to draw through the shared cursor (or as is: see
    :func:`shared_cursor_loader`), its claims followed by ``cursor`` (the strategy's
    :class:`~lightning_gossip.cursor.resume.CursorResume`: the requeue checkpoint's position,
    the sampler started in ``epoch``, :meth:`~lightning_gossip.cursor.resume.CursorResume.
    follow`); ``ledger``: elastic claims (:mod:`~lightning_gossip.elastic.claim_ledger`);
    ``balance_as``: a balanced epoch end (:mod:`~lightning_gossip.cursor.end_balance`)."""
    shared = shared_cursor_loader(dataloader, key=key, seed=seed, node=node, ledger=ledger,
                                  balance_as=balance_as)
    return dataloader if shared is None else cursor.follow(shared.loader, shared.claims, epoch)
