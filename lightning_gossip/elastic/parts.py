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
from lightning_gossip.elastic.session import ElasticSession
from lightning_gossip.elastic.survivors import Engines, Survivors
from lightning_gossip.hierarchy import NodeGroups, NodeLayout
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
        synchronous: hierarchical ``dpsgd``: each generation builds that strategy's groups
            too (:func:`~.nodes.generation_groups`).
    """

    def __init__(self, timeout: timedelta, heartbeat_timeout: float | None,
                 start_timeout: float | None = None, synchronous: bool = False) -> None:
        self.timeout = timeout
        self.heartbeat_timeout = heartbeat_timeout
        self.start_timeout = start_timeout
        self.synchronous = synchronous
        #: this process, admitted to a running fit (``None``: it started with the fit)
        self.newcomer: Newcomer | None = None
        #: this process, a founder of a fit started with the ranks that came (``start_timeout``)
        self.founders: Founders | None = None
        #: the fit's nodes (:meth:`join`'s; hierarchical: what leaves and joins together);
        #: ``None``: each rank alone
        self.layout: NodeLayout | None = None

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
             backend: str | None, layout: NodeLayout | None = None) -> Heartbeat | None:
        """Join the running fit ``run`` if there is one (:func:`~.newcomer.join_running_fit`;
        ``rank``, ``world_size``, ``address``, ``port``: this process's slot and the
        rendezvous; ``layout``: the fit's nodes), or start it with the ranks that came
        (``start_timeout``); the newcomer's or founder's heartbeat, or ``None`` (a normal
        start). A newcomer's checkpoint (:attr:`newcomer`) is the caller's to restore."""
        assert self.heartbeat_timeout is not None and backend is not None
        self.layout = layout
        where = (run, rank, world_size, address, port, self.timeout, self.heartbeat_timeout,
                 backend)
        self.newcomer = join_running_fit(*where, layout=layout, synchronous=self.synchronous)
        if self.newcomer is None and self.start_timeout is not None:
            self.founders = found_fit(*where, self.start_timeout)
            if self.founders is not None:
                return self.founders.heartbeat
            self.newcomer = join_running_fit(  # after the founders' decision
                *where, layout=layout, synchronous=self.synchronous)
        return self.newcomer.heartbeat if self.newcomer is not None else None

    def groups(self) -> NodeGroups | None:
        """A newcomer's or founder's gossip groups (data, control; hierarchical: its node's)
        of its generation; ``None`` otherwise."""
        if self.first is None:
            return None
        first = self.first.groups  # (hierarchical dpsgd: and its gloo node group)
        return NodeGroups(node=first.node if first.node is not None else first.data,
                          column=first.data, control=first.control,
                          node_gossip=first.node_control)

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
        keeps its membership and first groups; what leaves together: :attr:`layout`'s nodes);
        the other arguments are the survivors' own."""
        first = self.first
        return Survivors(session, run, rank, world_size, self.timeout, heartbeat=heartbeat,
                         backend=backend, engines=engines, epoch=epoch, loggers=loggers,
                         membership=self.membership, groups=first.groups if first else None,
                         hand_over=hand_over, poll_joins=poll_joins, on_group=on_group,
                         layout=self.layout, synchronous=self.synchronous, node=node)
