"""Elastic membership: an elastic gossip fit goes on without its lost ranks and lets processes
join it, for both strategies (``elastic=True``; ``docs/faults.md``). This package imports no
Lightning: the strategies in :mod:`lightning_gossip.strategies` translate Lightning's hooks into
calls of its parts, and give it Lightning's side of a join (the checkpoint) as values.

Every part reads one :class:`ElasticSession` per strategy when it acts (the step, the engine,
the live ranks, their generation and its groups, by name), as torchft's algorithms read its
``Manager``; nothing is re-wired after a loss. The modules, from the bottom up:

* :mod:`~.membership`: the live ranks agreed in the rendezvous store, generation after
  generation, and process groups built by name over them (:class:`Membership`);
* :mod:`~.nodes`: the named groups of a generation (:class:`ElasticGroups`,
  :func:`generation_groups`); what leaves together (a rank, or a hierarchical fit's node) is
  the fit's :class:`~lightning_gossip.hierarchy.NodeLayout`;
* :mod:`~.session`: :class:`ElasticSession`;
* :mod:`~.claim_ledger`: the shared cursor's claims, so that a lost rank's untrained batches go
  back (:class:`ClaimLedger`);
* :mod:`~.survivors`: recovery from a loss and admission of newcomers, one path for both
  strategies (:class:`Survivors`), with the engines of each: :mod:`~.engines`
  (``adpsgd``'s pairwise engines) and :mod:`~.rounds` (``dpsgd``'s rounds over a
  :class:`MemberTopology`, :mod:`~.member_topology`, settled at epoch ends by
  :class:`EvenRounds`, :mod:`~.even_rounds`);
* joins: :mod:`~.newcomer` (a process in a free slot joins a running fit), :mod:`~.founders`
  (a fit starts with the ranks that came), :mod:`~.joins` (when members that act together look
  for joins), :mod:`~.parts` (how this process came to the fit; the survivors' builder);
* :mod:`~.loop`: the same recovery at a plain loop's step boundaries and sync points
  (:class:`~.loop.ElasticLoop`, for ``attach()`` and Fabric's strategies; no joins there).
"""

from __future__ import annotations

from lightning_gossip.elastic.claim_ledger import ClaimLedger
from lightning_gossip.elastic.even_rounds import EvenRounds
from lightning_gossip.elastic.member_topology import MemberTopology
from lightning_gossip.elastic.membership import Membership
from lightning_gossip.elastic.nodes import ElasticGroups, generation_groups
from lightning_gossip.elastic.rounds import ElasticRounds, RoundEngines
from lightning_gossip.elastic.session import ElasticSession
from lightning_gossip.elastic.survivors import LIVE_METRIC, Survivors

__all__ = [
    "LIVE_METRIC",
    "ClaimLedger",
    "ElasticGroups",
    "ElasticRounds",
    "ElasticSession",
    "EvenRounds",
    "MemberTopology",
    "Membership",
    "RoundEngines",
    "Survivors",
    "generation_groups",
]
