"""A topology over some of the ranks: :class:`MemberTopology`, what the survivors of an elastic
``dpsgd`` fit mix with after a loss.

The survivors build a topology over themselves (``k`` of the ``world_size`` ranks) and number its
rounds from the step at which each of them starts gossiping again: ranks that recover at
different optimizer steps (a synchronous fit's ranks can be a step or two apart when a peer
dies) still agree on every round's matrix. A rank outside the members keeps its own value
(``W[r, r] = 1``) and exchanges nothing, so the matrix over the whole world stays doubly
stochastic and ranks keep their global numbers.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from lightning_gossip.topology.base import Peers, Topology

__all__ = ["MemberTopology"]


class MemberTopology(Topology):
    """``base`` (over ``len(members)`` positions) placed on the ranks ``members`` of a world of
    ``world_size`` ranks, its round ``t - first_step`` used at step ``t``.

    Args:
        base: the topology over the members' positions (``base.world_size == len(members)``).
        members: the ranks, in position order (sorted, distinct, each below ``world_size``).
        world_size: the ranks numbered in the fit (members and others).
        first_step: the step at which this rank starts the base's round 0 (each member gives
            its own: rounds, not steps, are counted alike).

    >>> from lightning_gossip.topology import build
    >>> topo = MemberTopology(build("ring", 3), members=(0, 2, 3), world_size=4, first_step=7)
    >>> topo.peers(2, step=7).recv_from
    ((0, 0.3333333333333333), (3, 0.3333333333333333))
    >>> topo.peers(1, step=7).send_to  # rank 1 is not a member: it exchanges nothing
    ()
    >>> topo.mixing_matrix(7).sum(axis=0)
    array([1., 1., 1., 1.])
    >>> rr = build("random_ring", 3, seed=5)
    >>> later = MemberTopology(rr, (0, 2, 3), 4, first_step=9)
    >>> bool((later.mixing_matrix(10)[[0, 2, 3]][:, [0, 2, 3]] == rr.mixing_matrix(1)).all())
    True
    """

    name = "members"

    def __init__(self, base: Topology, members: Sequence[int], world_size: int,
                 first_step: int = 0) -> None:
        super().__init__(world_size, base.seed)
        members = tuple(int(r) for r in members)
        if len(members) != base.world_size:
            raise ValueError(f"{len(members)} members but the topology is over "
                             f"{base.world_size} ranks")
        if list(members) != sorted(set(members)) or not all(0 <= r < world_size
                                                            for r in members):
            raise ValueError(f"members must be distinct ranks below {world_size}, in "
                             f"increasing order: {members}")
        self.base, self.members, self.first_step = base, members, int(first_step)
        self.is_time_varying = base.is_time_varying
        self._position = {r: p for p, r in enumerate(members)}

    def round(self, step: int) -> int:
        """The base's round at optimizer ``step`` (``step - first_step``, never negative)."""
        if step < self.first_step:
            raise ValueError(f"step {step} comes before this topology's first step "
                             f"{self.first_step}")
        return step - self.first_step

    def mixing_matrix(self, step: int = 0) -> np.ndarray:
        """The base's round matrix over the members; the identity on the other ranks."""
        w = np.eye(self.world_size)
        idx = np.asarray(self.members)
        w[np.ix_(idx, idx)] = self.base.mixing_matrix(self.round(step))
        return w

    def peers(self, rank: int, step: int = 0) -> Peers:
        """The base's peers of ``rank``'s position, as global ranks (none for a non-member)."""
        self._check_rank(rank)
        position = self._position.get(rank)
        if position is None:
            return Peers(rank, 1.0, (), ())
        p = self.base.peers(position, self.round(step))
        m = self.members
        return Peers(rank, p.self_weight, tuple((m[j], w) for j, w in p.recv_from),
                     tuple(m[j] for j in p.send_to))

    def __repr__(self) -> str:
        return (f"MemberTopology({self.base!r}, members={self.members}, "
                f"world_size={self.world_size}, first_step={self.first_step})")
