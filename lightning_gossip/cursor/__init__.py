"""The shared cursor: straggler-resilient data, where the ranks draw an epoch's batches from one
shared counter, so a faster rank takes more and every sample is used once per epoch
(``ADPSGDStrategy(shared_cursor=True)``, the default; elastic ``dpsgd``). This package imports no
Lightning: the adapters rebuild their training loaders with it
(:mod:`lightning_gossip.strategies.shared_loader` under Lightning). One concept per module:

* :mod:`~.store`: the library's keys in the default group's c10d store (:func:`default_store`);
* :mod:`~.claims`: the next unit of an epoch for a rank, or for a hierarchical node that claims
  as one (:class:`Claims`);
* :mod:`~.sampler`: chunks of one seeded permutation of the samples
  (:class:`SharedCursorSampler`);
* :mod:`~.batches`: whole precomputed batches of a batch sampler that lists them
  (:class:`SharedBatchSampler`, the :class:`SharedBatches` protocol);
* :mod:`~.end_balance`: a slower claimant leaves an epoch's last units to those that finish
  first (:class:`EndBalance`, ``shared_cursor="balanced"``);
* :mod:`~.loader`: which shared sampler fits a ``DataLoader`` (:func:`shared_sampler`);
* :mod:`~.resume`: the cursor's position in the requeue checkpoint (:class:`CursorResume`).

An elastic fit also records who claimed what, so a lost rank's untrained batches go back to the
survivors: :class:`~lightning_gossip.elastic.claim_ledger.ClaimLedger`, in the elastic package.
"""

from __future__ import annotations

from lightning_gossip.cursor.batches import SharedBatches, SharedBatchSampler
from lightning_gossip.cursor.claims import Claims
from lightning_gossip.cursor.end_balance import EndBalance
from lightning_gossip.cursor.loader import shared_sampler
from lightning_gossip.cursor.resume import CURSOR_KEY, CursorResume
from lightning_gossip.cursor.sampler import SharedCursorSampler
from lightning_gossip.cursor.store import default_store

__all__ = [
    "CURSOR_KEY",
    "Claims",
    "CursorResume",
    "EndBalance",
    "SharedBatchSampler",
    "SharedBatches",
    "SharedCursorSampler",
    "default_store",
    "shared_sampler",
]
