"""The engine of D-PSGD: synchronous neighbour gossip, one round per step.

No Lightning here: :class:`SyncGossip` is driven by a training loop that calls
:meth:`SyncGossip.before_step` before forward/backward and :meth:`SyncGossip.after_step` after
the optimizer step, on every rank and for every step ``t`` (see ``docs/engines.md``):

* **Overlapped** (default): ``before_step(t)`` snapshots ``x_t`` and posts non-blocking sends
  and receives to the peers of ``W_t``; the loop computes ``x' = x_t - lr u_t``;
  ``after_step(t)`` adds ``W_t x_t - x_t``. With ``delay_by_one`` it adds the previous step's
  change instead, so every exchange has a whole step to hide behind. **Blocking**
  (``overlap=False``): ``after_step(t)`` replaces ``x'`` by ``W_t x'``.
* A :class:`~lightning_gossip.exchange.CommWorker` thread waits on each round's messages,
  checks them (a peer's NaN is named) and mixes them into the round's own buffer while the
  loop computes; the training thread's share is one snapshot copy and one add.
* **Sharded rounds** (:class:`~lightning_gossip.sync_gossip.sharded.ShardedExchange`): over
  nodes (hierarchical gossip, a :class:`~lightning_gossip.hierarchy.NodeLayout` with several
  ranks per node) each local rank exchanges its slice of the replica with the same local rank
  of the peer nodes and the node all-gathers the mixed slices; a compressed ``wire_dtype`` uses
  the same path (mean-preserving: ``x_i += sum_j W_ij (Q(x_j) - Q(x_i))``). The all-gather runs
  on the worker's own node group (:attr:`~lightning_gossip.hierarchy.NodeGroups.node_gossip`),
  or, without one (NCCL), on the training thread through ``node_gather``.
* **Gossip period** (``period``, the strategies' ``gossip_every_n_steps``): only every
  ``period``-th step exchanges (its last step ``e`` of a period, with ``W_e``); overlapped, its
  round is posted at the period's first step and hides behind all of the period's steps
  (:class:`~lightning_gossip.sync_gossip.schedule.RoundSchedule`). Bytes per step scale by
  ``1 / period``.
* **Agreed stop**: every round carries a two-value side message, the smallest "stop at step s"
  and "requeue at step s" this rank knows of (:class:`StopAgreement`), so every rank can stop at
  the same step without a collective.

The parts, one module each:

* :mod:`~lightning_gossip.sync_gossip.engine`: :class:`SyncGossip`, the training thread's API.
* :mod:`~lightning_gossip.sync_gossip.rounds`: :class:`Round`, one round in flight;
  :class:`SyncStats`, what was sent.
* :mod:`~lightning_gossip.sync_gossip.stop`: :class:`StopAgreement`, the agreed stop step.
* :mod:`~lightning_gossip.sync_gossip.schedule`: :class:`RoundSchedule`, which steps exchange.
* :mod:`~lightning_gossip.sync_gossip.sharded`: :class:`ShardedExchange`, a sharded round.

Example (inside an initialised process group)::

    group = dist.new_group(backend="gloo")             # the engine's own
    engine = SyncGossip(FlatState(model), rank, build("random_ring", world), group,
                        timeout=timedelta(minutes=5))
    engine.start()
    for t, batch in enumerate(loader):
        engine.before_step(t)    # snapshot x_t, post the exchange
        train_step(batch)
        engine.after_step(t)     # x <- x' + (W_t x_t - x_t)
    engine.quiesce()             # nothing in flight: evaluate, checkpoint, average...
    engine.close()
"""

from __future__ import annotations

from lightning_gossip.sync_gossip.engine import SyncGossip
from lightning_gossip.sync_gossip.rounds import Round, SyncStats
from lightning_gossip.sync_gossip.schedule import RoundSchedule
from lightning_gossip.sync_gossip.sharded import ShardedExchange
from lightning_gossip.sync_gossip.stop import NO_STOP, StopAgreement, StopMessages

__all__ = ["NO_STOP", "Round", "RoundSchedule", "ShardedExchange", "StopAgreement",
           "StopMessages", "SyncGossip", "SyncStats"]
