"""Elastic hierarchical fits: the node is the unit that leaves (:class:`NodeUnits`).

With ``ADPSGDStrategy`` or ``DPSGDStrategy(hierarchical=True, elastic=True)`` (``dpsgd``: the
differences in :mod:`~.rounds`) the ranks of a node are one learner
(their gradients are averaged inside the node every step). A node that loses one of its ranks
cannot take another step, so the survivors of a loss count the lost rank's whole node lost: its
other ranks learn that they were left out and exit (:class:`~lightning_gossip.errors.
RankExcluded`), and the live nodes go on with

* Lightning's collectives over the live ranks, a new group per node (the node's gradient and
  buffer all-reduce and gossip all-gather: a collective interrupted by the loss is issued
  again on it, :class:`~lightning_gossip.node_averaging.NodeAverager`), and per
  column (local rank ``l`` of every live node) a new gossip data group and gloo control group
  (:meth:`NodeUnits.groups`, named: :class:`ElasticGroups`);
* the pairing over the live nodes, seen by each column (:meth:`NodeUnits.pairing`; ``dpsgd``:
  the topology over them; none for a lone node, which trains on without gossip);
* the lost node's claimed but untrained batches returned to the shared cursor: the node claims
  as one (its local rank 0, the *claimant*, records the node's claims in the
  :class:`~lightning_gossip.elastic.claim_ledger.ClaimLedger`).

A lost node's relaunched processes rejoin together (the members admit whole nodes only,
:mod:`~.joins`). Not covered yet: ``start_timeout``, and the loss of node 0, whose rank
0 hosts the store (the emergency checkpoint, as for flat fits). Example::

    >>> units = NodeUnits(devices=2)
    >>> units.whole((3,)), units.claimant(3), units.claimants((0, 1, 4, 5))
    ((2, 3), 2, (0, 4))
    >>> units.complete((2, 3, 4))  # node 2 has not asked whole yet
    [2, 3]
    >>> flat = NodeUnits(devices=1)
    >>> flat.whole((3,)), flat.claimants((0, 2))
    ((3,), (0, 2))
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from lightning_gossip import _compat
from lightning_gossip.elastic.membership import Membership, group_name
from lightning_gossip.pairing import Pairing, PairingName, RankPairing

__all__ = ["RANKS", "ElasticGroups", "NodeUnits"]


@dataclass(frozen=True)
class ElasticGroups:
    """The process groups of one generation of an elastic fit, by name
    (:meth:`NodeUnits.groups`; a founder's or newcomer's first ones too).

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


@dataclass(frozen=True)
class NodeUnits:
    """The units of an elastic fit: nodes of ``devices`` ranks (``1``: each rank alone, a
    flat fit), numbered ``rank = node * devices + local``; ``synchronous`` (hierarchical
    ``dpsgd``): :meth:`groups` adds a gloo group over each node (the survivors' agreement on
    the step, then the communication thread's all-gather of the sharded rounds) and one over
    every live rank (the rounds' stop messages go to column peers and node-mates)."""

    devices: int = 1
    synchronous: bool = False

    def whole(self, ranks: Iterable[int]) -> tuple[int, ...]:
        """Every rank of the nodes of ``ranks`` (a rank lost takes its node with it)."""
        d = self.devices
        return tuple(sorted({r - r % d + k for r in ranks for k in range(d)}))

    def complete(self, ranks: Iterable[int]) -> list[int]:
        """The ranks of ``ranks`` whose whole node is in it (a node joins whole; its processes
        ask one by one)."""
        ranks = set(ranks)
        return sorted(r for r in ranks if set(self.whole((r,))) <= ranks)

    def claimant(self, rank: int) -> int:
        """The rank that claims the shared cursor's batches for ``rank``'s node."""
        return rank - rank % self.devices

    def claimants(self, live: Iterable[int]) -> tuple[int, ...]:
        """The claimants of the nodes of ``live``."""
        return tuple(sorted({self.claimant(r) for r in live}))

    def pairing(self, name: PairingName, seed: int, live: Sequence[int],
                rank: int) -> RankPairing | None:
        """The gossip pairing over the live nodes, in the global ranks of ``rank``'s column
        (flat: over the live ranks); ``None`` with fewer than two."""
        column = tuple(c + rank % self.devices for c in self.claimants(live))
        return RankPairing(Pairing(name, len(column), seed), column) if len(column) > 1 else None

    def groups(self, membership: Membership, backend: str,
               newcomer: bool = False) -> ElasticGroups:
        """The groups of :attr:`Membership.live <.membership.Membership.live>`, by name (see
        :meth:`~.membership.Membership.new_groups`): Lightning's (over every live rank; it
        becomes ``membership.group``), the gossip control (gloo) and data groups of this
        rank's column, and this rank's node group (:attr:`synchronous`: then its gloo node
        group and the rounds' group). Every group is built by its members only, all in
        the same order (Lightning's, the nodes', the columns'); a ``newcomer``'s first is its
        default group (:meth:`~.membership.Membership.join_groups`)."""
        build = membership.join_groups if newcomer else membership.new_groups
        if self.devices == 1:
            return ElasticGroups(*build([backend, "gloo", backend]))
        live, rank, d = list(membership.live), membership.rank, self.devices
        column = [r for r in live if r % d == rank % d]

        def over(ranks: list[int], kind: str, group_backend: str) -> Any:
            name = f"{group_name(membership.name, membership.generation, 1)}/{kind}"
            return _compat.named_group(ranks, rank, group_backend, membership.store, name,
                                       membership.timeout)

        lightning = build([backend])[0]
        mates = [r for r in live if r // d == rank // d]
        node = over(mates, f"node{rank // d}", backend)
        extra = (over(mates, f"nodecontrol{rank // d}", "gloo"), over(live, "rounds", backend)
                 ) if self.synchronous else (None, None)
        control = over(column, f"control{rank % d}", "gloo")
        data = over(column, f"column{rank % d}", backend)
        return ElasticGroups(lightning, control, data, node, *extra)


RANKS = NodeUnits()
"""The units of a flat fit: each rank alone."""
