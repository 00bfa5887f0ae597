"""The ``adpsgd`` survivors' engines (:class:`PairwiseEngines`) and what a hierarchical node's
averaging is told after a membership change (:func:`node_regroup`, :func:`node_retries`).

After a loss or a join the survivors build the next engine through one signature,
``engines.over(live, groups)`` (:class:`~.survivors.Engines`): ``adpsgd`` pairs the live ranks
(hierarchical: the live nodes, seen by this rank's column) and opens the new engine's phase at
the session's step, here; ``dpsgd`` agrees on a step and numbers a topology over them from it
(:class:`~.rounds.RoundEngines`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from lightning_gossip.elastic.nodes import ElasticGroups
from lightning_gossip.elastic.session import ElasticSession
from lightning_gossip.hierarchy import NodeLayout
from lightning_gossip.pairing import Pairing, PairingName, RankPairing

__all__ = ["PairwiseEngines", "node_regroup", "node_retries"]


def node_regroup(node: Any, groups: ElasticGroups) -> None:
    """A hierarchical node's averaging (``node``; ``None``: flat) goes on over the new
    generation's node group. (The node averager keeps its group as an attribute:
    :class:`~lightning_gossip.node_averaging.NodeAverager`.)"""
    if node is not None and groups.node is not None:
        node.group = groups.node


def node_retries(node: Any, retry: Callable[..., Any]) -> None:
    """A node all-reduce interrupted by a loss is issued again over the survivors: ``retry``
    (:meth:`~.survivors.Survivors.retry`) becomes the node averaging's (``None``: flat)."""
    if node is not None:
        node.retry = retry


class PairwiseEngines:
    """``adpsgd``'s engines over the live ranks (see the module docstring).

    Args:
        session: the fit's session (the step the new engine's phase opens at).
        layout: the fit's nodes, seen from this rank (hierarchical: nodes leave together;
            their columns pair).
        pairing: the pairing's name and seed.
        make: ``(pairing, control_group=, data_group=)``: an engine, not started
            (:class:`~lightning_gossip.async_gossip.AsyncGossip` with the fit's values).
        node: hierarchical: this rank's node averaging (it goes on over the new node group);
            ``None``: flat.
    """

    def __init__(self, session: ElasticSession, layout: NodeLayout,
                 pairing: tuple[PairingName, int], make: Callable[..., Any],
                 node: Any = None) -> None:
        self.session, self.layout, self.pairing = session, layout, pairing
        self.make, self.node = make, node

    def pairing_over(self, live: Sequence[int]) -> RankPairing | None:
        """The pairing of this rank's engine over the live ranks ``live`` (the same on every
        member; hierarchical: over the live nodes, in this rank's column); ``None`` with fewer
        than two."""
        name, seed = self.pairing
        column = tuple(c + self.layout.local for c in self.layout.leaders(live))
        return RankPairing(Pairing(name, len(column), seed), column) if len(column) > 1 else None

    def first(self, pairing: Pairing, live: Sequence[int] | None) -> Pairing | RankPairing:
        """The pairing of this process's first engine: ``pairing`` (every rank slot), or over
        ``live``, a newcomer's or founder's generation's live ranks (slots may be free)."""
        if live is None:
            return pairing
        first = self.pairing_over(live)
        assert first is not None  # (at least two founders; a newcomer and a member)
        return first

    def over(self, live: Sequence[int], groups: ElasticGroups) -> Any:
        """A started engine over ``live`` and ``groups`` (none for a lone learner), its phase
        open at the session's step."""
        node_regroup(self.node, groups)
        pairing = self.pairing_over(live)
        if pairing is None:
            return None
        engine = self.make(pairing, control_group=groups.control, data_group=groups.data)
        engine.start()
        engine.before_step(self.session.step)
        return engine
