"""Elastic hierarchical fits: the node is the unit that leaves, and each generation's groups
by name (:class:`ElasticGroups`, :func:`generation_groups`).

With ``ADPSGDStrategy`` or ``DPSGDStrategy(hierarchical=True, elastic=True)`` (``dpsgd``: the
differences in :mod:`~.rounds`) the ranks of a node are one learner
(their gradients are averaged inside the node every step). A node that loses one of its ranks
cannot take another step, so the survivors of a loss count the lost rank's whole node lost
(:meth:`NodeLayout.whole_nodes <lightning_gossip.hierarchy.NodeLayout.whole_nodes>`): its
other ranks learn that they were left out and exit (:class:`~lightning_gossip.errors.
RankExcluded`), and the live nodes go on with

* Lightning's collectives over the live ranks, a new group per node (the node's gradient and
  buffer all-reduce and gossip all-gather: a collective interrupted by the loss is issued
  again on it, :class:`~lightning_gossip.node_averaging.NodeAverager`), and per
  column (local rank ``l`` of every live node) a new gossip data group and gloo control group
  (:func:`generation_groups`, named: :class:`ElasticGroups`);
* the pairing over the live nodes, seen by each column
  (:meth:`~.engines.PairwiseEngines.pairing_over`; ``dpsgd``: the topology over them; none for
  a lone node, which trains on without gossip);
* the lost node's claimed but untrained batches returned to the shared cursor: the node claims
  as one (its leader, local rank 0, is the *claimant*: it records the node's claims in the
  :class:`~lightning_gossip.elastic.claim_ledger.ClaimLedger`).

Where a rank sits is the fit's :class:`~lightning_gossip.hierarchy.NodeLayout` (a flat fit:
nodes of one rank). A lost node's relaunched processes rejoin together (the members admit whole
nodes only, :mod:`~.joins`). Not covered yet: ``start_timeout``, and the loss of node 0, whose
rank 0 hosts the store (the emergency checkpoint, as for flat fits).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lightning_gossip.elastic.membership import Membership
from lightning_gossip.hierarchy import NodeLayout

__all__ = ["ElasticGroups", "generation_groups"]


@dataclass(frozen=True)
class ElasticGroups:
    """The process groups of one generation of an elastic fit, by name
    (:func:`generation_groups`; a founder's or newcomer's first ones too).

    Attributes:
        lightning: Lightning's collectives and the sync points, over every live rank (the
            membership's group; a newcomer's or founder's default group).
        control: gossip control messages (gloo), over this rank's column (flat: every live
            rank).
        data: gossip data, over this rank's column (flat: every live rank).
        node: hierarchical: this rank's node (the node's all-reduce and all-gather).
        node_control: hierarchical ``dpsgd``: a gloo group over the node (the survivors'
            agreement on the step, the communication thread's all-gather of sharded rounds).
        rounds: hierarchical ``dpsgd``: every live rank (the rounds' stop messages go to
            column peers and node-mates).
    """

    lightning: Any
    control: Any
    data: Any
    node: Any = None
    node_control: Any = None
    rounds: Any = None

    @property
    def gossip(self) -> Any:
        """The group of ``dpsgd``'s rounds over every live rank: :attr:`rounds`
        (hierarchical), else :attr:`data`."""
        return self.rounds if self.rounds is not None else self.data


def generation_groups(layout: NodeLayout, membership: Membership, backend: str, *,
                      synchronous: bool = False, newcomer: bool = False) -> ElasticGroups:
    """The groups of :attr:`Membership.live <.membership.Membership.live>`, by name: Lightning's
    (over every live rank; it becomes ``membership.group``,
    :meth:`~.membership.Membership.lightning_group`), the gossip control (gloo) and data groups
    of this rank's column, and (``layout`` of several ranks per node) this rank's node group;
    ``synchronous`` (hierarchical ``dpsgd``) adds a gloo group over each node (the survivors'
    agreement on the step, then the communication thread's all-gather of the sharded rounds)
    and one over every live rank (the rounds' stop messages go to column peers and
    node-mates). Every group is built by its members only, all in the same order (Lightning's,
    the nodes', the columns'); a ``newcomer``'s first is its default group. Only the layout's
    ``devices`` is read: the live ranks are the membership's."""
    lightning = membership.lightning_group(backend, newcomer=newcomer)
    if layout.devices == 1:
        return ElasticGroups(lightning=lightning, control=membership.named_group(1, "gloo"),
                             data=membership.named_group(2, backend))
    live, rank, d = list(membership.live), membership.rank, layout.devices
    column = [r for r in live if r % d == rank % d]
    mates = [r for r in live if r // d == rank // d]
    node = membership.named_group(1, backend, mates, f"node{rank // d}")
    node_control = rounds = None
    if synchronous:
        node_control = membership.named_group(1, "gloo", mates, f"nodecontrol{rank // d}")
        rounds = membership.named_group(1, backend, live, "rounds")
    control = membership.named_group(1, "gloo", column, f"control{rank % d}")
    data = membership.named_group(1, backend, column, f"column{rank % d}")
    return ElasticGroups(lightning=lightning, control=control, data=data, node=node,
                         node_control=node_control, rounds=rounds)
