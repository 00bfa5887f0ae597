"""Who averages with whom in asynchronous gossip (AD-PSGD).

Pure Python/NumPy, shared by :class:`~lightning_gossip.ADPSGDStrategy` and the simulator.

AD-PSGD averages pairs of replicas atomically. To rule out deadlock (two ranks each waiting for
the other to answer) the ranks are split into *active* ranks, which start exchanges, and
*passive* ranks, which only answer them. In ring order, position ``k`` is active when ``k`` is
even, except the last position when ``n`` is odd (which is passive, so that no two actives are
adjacent); every active then has passive ring neighbours and the graph stays connected.

Example::

    >>> p = Pairing("ring", 5)
    >>> p.actives, p.passives
    ((0, 2), (1, 3, 4))
    >>> p.candidates(0)
    (4, 1)
    >>> [p.partner(0, k) for k in range(4)]
    [4, 1, 4, 1]

Hierarchical AD-PSGD pairs nodes; each local rank's column sees that pairing in its global
ranks (:class:`ColumnPairing`)::

    >>> from lightning_gossip.hierarchy import NodeLayout
    >>> three = NodeLayout(num_nodes=3, devices=2, node=0, local=0)
    >>> column = ColumnPairing(Pairing("ring", 3), three)  # local rank 0's column: 0, 2, 4
    >>> column.is_active(0), column.candidates(0), column.contacted_by(2)
    (True, (4, 2), (0,))
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

import numpy as np

from lightning_gossip.topology import check_world_size

if TYPE_CHECKING:
    from lightning_gossip.hierarchy import NodeLayout

__all__ = ["PAIRINGS", "ColumnPairing", "Pairing", "PairingName", "RankPairing",
           "check_pairing_name", "is_active"]

PairingName = Literal["ring", "random"]
"""The name of an AD-PSGD pairing (``pairing=``): ring neighbours in turn, or random."""

PAIRINGS: tuple[PairingName, ...] = ("ring", "random")
"""The AD-PSGD pairings: ``"ring"`` (alternate ring neighbours) and ``"random"``."""


def check_pairing_name(name: object) -> None:
    """Raise ``ValueError`` listing the valid choices unless ``name`` is a known pairing."""
    if name not in PAIRINGS:
        raise ValueError(
            f"unknown AD-PSGD pairing {name!r}; valid choices: {', '.join(PAIRINGS)}"
        )


def is_active(rank: int, world_size: int) -> bool:
    """Whether ``rank`` starts exchanges (even position, except the last one when ``n`` is odd)."""
    if world_size < 2:
        return False
    if world_size % 2 == 1 and rank == world_size - 1:
        return False
    return rank % 2 == 0


class Pairing:
    """The bipartite active/passive split and each active rank's choice of partner.

    Args:
        name: ``"ring"``: an active rank alternates between its two ring neighbours.
            ``"random"``: an active rank picks a passive rank uniformly at random for every
            exchange (the paper's randomized peer choice), from ``(seed, rank, k)``.
        world_size: number of ranks, >= 2 (see :func:`~lightning_gossip.topology.check_world_size`).
        seed: seeds the random choice; all ranks pass the same.
    """

    def __init__(self, name: PairingName, world_size: int, seed: int = 0) -> None:
        check_pairing_name(name)
        self.name = name
        self.world_size = check_world_size(world_size, minimum=2)
        self.seed = int(seed)
        self.actives = tuple(r for r in range(world_size) if is_active(r, world_size))
        self.passives = tuple(r for r in range(world_size) if not is_active(r, world_size))

    def is_active(self, rank: int) -> bool:
        """Whether ``rank`` starts exchanges (see :func:`is_active`)."""
        return is_active(rank, self.world_size)

    def candidates(self, rank: int) -> tuple[int, ...]:
        """The passive ranks an active ``rank`` may contact (empty for a passive rank)."""
        if not self.is_active(rank):
            return ()
        if self.name == "random":
            return self.passives
        n = self.world_size
        left, right = (rank - 1) % n, (rank + 1) % n
        return (left,) if left == right else (left, right)

    def contacted_by(self, rank: int) -> tuple[int, ...]:
        """The active ranks that may contact a passive ``rank`` (empty for an active rank)."""
        if self.is_active(rank):
            return ()
        return tuple(a for a in self.actives if rank in self.candidates(a))

    def partner(self, rank: int, k: int) -> int:
        """The passive rank active ``rank`` exchanges with in its ``k``-th exchange."""
        cands = self.candidates(rank)
        if not cands:
            raise ValueError(f"rank {rank} is passive; only active ranks choose partners")
        if self.name == "ring" or len(cands) == 1:
            return cands[k % len(cands)]
        rng = np.random.default_rng(np.random.SeedSequence([self.seed, rank, k]))
        return cands[int(rng.integers(len(cands)))]


class RankPairing:
    """A pairing over positions ``0..n-1`` seen in global ranks: position ``i`` is
    ``ranks[i]``. It has the methods of :class:`Pairing` the gossip thread uses, so messages
    and errors name global ranks. The survivors of an elastic fit pair this way over the live
    ranks (:mod:`~lightning_gossip.elastic.membership`)::

        >>> survivors = RankPairing(Pairing("ring", 3), (0, 1, 3))  # rank 2 was lost
        >>> survivors.is_active(0), survivors.candidates(0), survivors.contacted_by(3)
        (True, (3, 1), (0,))

    Args:
        pairing: the pairing over positions.
        ranks: the global rank of each position.
    """

    def __init__(self, pairing: Pairing, ranks: tuple[int, ...]) -> None:
        if pairing.world_size != len(ranks):
            raise ValueError(f"the pairing is over {pairing.world_size} positions, but "
                             f"{len(ranks)} ranks were given")
        self.pairing = pairing
        self.ranks = tuple(ranks)
        self._position = {r: i for i, r in enumerate(self.ranks)}

    def _ranks(self, positions: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(self.ranks[p] for p in positions)

    def is_active(self, rank: int) -> bool:
        """Whether global ``rank``'s position starts exchanges."""
        return self.pairing.is_active(self._position[rank])

    def candidates(self, rank: int) -> tuple[int, ...]:
        """The passive ranks an active ``rank`` may contact."""
        return self._ranks(self.pairing.candidates(self._position[rank]))

    def contacted_by(self, rank: int) -> tuple[int, ...]:
        """The active ranks that may contact a passive ``rank``."""
        return self._ranks(self.pairing.contacted_by(self._position[rank]))

    def partner(self, rank: int, k: int) -> int:
        """The rank that active ``rank`` exchanges with in its ``k``-th exchange."""
        return self.ranks[self.pairing.partner(self._position[rank], k)]


class ColumnPairing(RankPairing):
    """AD-PSGD's pairing over nodes, seen by one column: the same roles and partner choice as
    ``pairing`` (built for ``num_nodes``), in the global ranks of local rank ``layout.local``.

    Node ``n`` is rank ``n * devices + local`` here, so every column runs the same pairing of
    nodes, independently, on its own slice of the replica.

    Args:
        pairing: the pairing over nodes.
        layout: this rank's place in the nodes.
    """

    def __init__(self, pairing: Pairing, layout: NodeLayout) -> None:
        if pairing.world_size != layout.num_nodes:
            raise ValueError(f"the pairing is over {pairing.world_size} ranks, but there are "
                             f"{layout.num_nodes} nodes")
        super().__init__(pairing, tuple(n * layout.devices + layout.local
                                        for n in range(layout.num_nodes)))
        self.layout = layout
