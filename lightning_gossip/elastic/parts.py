"""How this process comes to an elastic fit, and the fit's :class:`~.survivors.Survivors`, the
same for both strategies: :class:`ElasticParts` (owned by the strategy as
``strategy.elastic_parts``, built from its values).

Before the default group exists, an elastic strategy calls :meth:`ElasticParts.join`: a
process in a free rank slot of a running fit joins it (:mod:`~.newcomer`); with a start timeout
the fit may start with the ranks that came (:mod:`~.founders`); otherwise the process starts
with every rank. At set-up the strategy builds the fit's survivors through
:meth:`ElasticParts.survivors` (the membership and first groups of a newcomer or founder kept),
with the engines of its kind (:class:`~.engines.PairwiseEngines`, ``adpsgd``;
:class:`~.rounds.RoundEngines`, ``dpsgd``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

from lightning_gossip.elastic.founders import Founders, found_fit
from lightning_gossip.elastic.membership import Membership
from lightning_gossip.elastic.newcomer import Newcomer, join_running_fit
from lightning_gossip.elastic.nodes import RANKS, NodeUnits
from lightning_gossip.elastic.session import ElasticSession
from lightning_gossip.elastic.survivors import Engines, Survivors
from lightning_gossip.hierarchy import NodeGroups
from lightning_gossip.liveness import Heartbeat

__all__ = ["ElasticParts"]


class ElasticParts:
    """A newcomer's admission or a founder's start (:meth:`join`) and the fit's
    :class:`~.survivors.Survivors` (:meth:`survivors`).

    Args:
        timeout: the process groups' timeout.
        heartbeat_timeout: the heartbeat's.
        start_timeout: start the fit with the ranks that came within this many seconds
            (:mod:`~.founders`); ``None``: every rank meets in Lightning's start.
    """

    def __init__(self, timeout: timedelta, heartbeat_timeout: float | None,
                 start_timeout: float | None = None) -> None:
        self.timeout = timeout
        self.heartbeat_timeout = heartbeat_timeout
        self.start_timeout = start_timeout
        #: this process, admitted to a running fit (``None``: it started with the fit)
        self.newcomer: Newcomer | None = None
        #: this process, a founder of a fit started with the ranks that came (``start_timeout``)
        self.founders: Founders | None = None
        #: the fit's units (:meth:`join`'s): each rank alone, or nodes (hierarchical)
        self.units = RANKS
        #: a newcomer's generation at its admission (0 otherwise): its node's claims' keys
        #: (:class:`~lightning_gossip.node_claims.NodeShare`) are not its earlier incarnation's
        self.incarnation = 0

    @property
    def first(self) -> Newcomer | Founders | None:
        """How this process came to the fit: a newcomer's join, a founder's start, or ``None``
        (every rank started it in Lightning's start)."""
        return self.newcomer or self.founders

    @property
    def membership(self) -> Membership | None:
        """A newcomer's or a founder's membership (``None``: every rank started the fit)."""
        return self.first.membership if self.first else None

    def join(self, run: str, rank: int, world_size: int, address: str, port: int,
             backend: str | None, units: NodeUnits = RANKS) -> Heartbeat | None:
        """Join the running fit ``run`` if there is one (:func:`~.newcomer.join_running_fit`;
        ``rank``, ``world_size``, ``address``, ``port``: this process's slot and the
        rendezvous; ``units``: the fit's nodes), or start it with the ranks that came
        (``start_timeout``); the newcomer's or founder's heartbeat, or ``None`` (a normal
        start). A newcomer's checkpoint (:attr:`newcomer`) is the caller's to restore."""
        assert self.heartbeat_timeout is not None and backend is not None
        self.units = units
        where = (run, rank, world_size, address, port, self.timeout, self.heartbeat_timeout,
                 backend)
        self.newcomer = join_running_fit(*where, units=units)
        if self.newcomer is None and self.start_timeout is not None:
            self.founders = found_fit(*where, self.start_timeout)
            if self.founders is not None:
                return self.founders.heartbeat
            self.newcomer = join_running_fit(*where, units=units)  # after the founders' decision
        if self.newcomer is None:
            return None
        self.incarnation = self.newcomer.membership.generation
        return self.newcomer.heartbeat

    def groups(self) -> NodeGroups | None:
        """A newcomer's or founder's gossip groups (data, control; hierarchical: its node's)
        of its generation; ``None`` otherwise."""
        if self.first is None:
            return None
        first = self.first.groups  # (hierarchical dpsgd: and its gloo node group)
        return NodeGroups(first.node if first.node is not None else first.data, first.data,
                          control=first.control, node_gossip=first.node_control)

    def open_phase(self, engine: Any, step: int) -> int:
        """A newcomer's first step (the lowest member's at the handover), its engine's phase
        open at it (the members opened theirs: no meeting); ``step`` for any other rank."""
        if self.newcomer is None:
            return step
        engine.before_step(self.newcomer.step)
        return self.newcomer.step

    def survivors(self, session: ElasticSession, *, run: str, rank: int, world_size: int,
                  heartbeat: Heartbeat | None, backend: str, engines: Engines,
                  epoch: Callable[[], int], loggers: Sequence[Any],
                  hand_over: Callable[[Any, Any, list[int], bool], None] | None,
                  on_group: Callable[[Any], None] | None, poll_joins: bool = True,
                  node: Any = None) -> Survivors:
        """The fit's :class:`~.survivors.Survivors` over ``session`` (a newcomer or founder
        keeps its membership and first groups; what leaves together: :attr:`units`); the
        other arguments are the survivors' own."""
        first = self.first
        return Survivors(session, run, rank, world_size, self.timeout, heartbeat=heartbeat,
                         backend=backend, engines=engines, epoch=epoch, loggers=loggers,
                         membership=self.membership, groups=first.groups if first else None,
                         hand_over=hand_over, poll_joins=poll_joins, on_group=on_group,
                         units=self.units, node=node)
