"""The elastic parts of an ``ADPSGDStrategy(elastic=True)`` fit, set up from the strategy's
values: a newcomer's join before the default group exists (:mod:`~.newcomer`), a start with
the ranks that came (:mod:`~.founders`), and the
:class:`~.elastic.Survivors` of the fit with their side of a join (:func:`~.newcomer.hand_over`).
``DPSGDStrategy(elastic=True)`` uses the join and the members' side (:meth:`ElasticParts.join`,
:meth:`ElasticParts.members_side`; its survivors are :mod:`~.dpsgd_elastic`'s).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch

from lightning_gossip import _compat
from lightning_gossip.async_gossip import AsyncGossip
from lightning_gossip.hierarchy import NodeGroups
from lightning_gossip.liveness import Heartbeat
from lightning_gossip.membership import Membership
from lightning_gossip.pairing import Pairing, PairingName, RankPairing
from lightning_gossip.strategies.collectives import sync_metrics_over
from lightning_gossip.strategies.elastic import Survivors
from lightning_gossip.strategies.elastic_nodes import RANKS, NodeUnits
from lightning_gossip.strategies.founders import Founders, found_fit
from lightning_gossip.strategies.newcomer import Newcomer, hand_over, join_running_fit
from lightning_gossip.strategies.node_averaging import NodeAverager

__all__ = ["SETUP_BARRIERS", "ElasticParts"]

SETUP_BARRIERS = frozenset({"pre_setup", "post_setup", "run-stage", "train_dataloader()",
                            "val_dataloader()", "_CheckpointConnector.resume_end"})
"""Lightning's named barriers of a fit's set-up (lightning 2.6.6): a newcomer skips them, the
members passed theirs at their start (``ProcessGroupStrategy.joining``)."""


class ElasticParts:
    """A newcomer's admission (:meth:`join`) and the fit's :class:`~.elastic.Survivors`
    (:meth:`survivors`).

    Args:
        timeout: the process groups' timeout.
        heartbeat_timeout: the heartbeat's.
        pairing: the pairing's name and seed (``adpsgd``; ``None``: no survivors built here).
        start_timeout: start the fit with the ranks that came within this many seconds
            (:mod:`~.founders`); ``None``: every rank meets in Lightning's start.
    """

    def __init__(self, timeout: timedelta, heartbeat_timeout: float | None,
                 pairing: tuple[PairingName, int] | None = None,
                 start_timeout: float | None = None) -> None:
        self.timeout = timeout
        self.heartbeat_timeout = heartbeat_timeout
        self.pairing = pairing
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

    def join(self, run: str, env: Any, backend: str | None, trainer: Any,
             units: NodeUnits = RANKS) -> Heartbeat | None:
        """Join the running fit ``run`` if there is one (:func:`~.newcomer.join_running_fit`;
        ``env``: Lightning's cluster environment; ``units``: the fit's nodes): its checkpoint
        is handed to Lightning to restore; the newcomer's heartbeat, or ``None`` (a normal
        start)."""
        assert self.heartbeat_timeout is not None and backend is not None
        self.units = units
        where = (run, env.global_rank(), env.world_size(), env.main_address, env.main_port,
                 self.timeout, self.heartbeat_timeout, backend)
        self.newcomer = join_running_fit(*where, units=units)
        if self.newcomer is None and self.start_timeout is not None:
            self.founders = found_fit(*where, self.start_timeout)
            if self.founders is not None:
                return self.founders.heartbeat
            self.newcomer = join_running_fit(*where, units=units)  # after the founders' decision
        if self.newcomer is None:
            return None
        self.incarnation = self.newcomer.membership.generation
        _compat.preload_checkpoint(trainer, self.newcomer.checkpoint)
        return self.newcomer.heartbeat

    def groups(self) -> NodeGroups | None:
        """A newcomer's or founder's gossip groups (data, control; hierarchical: its node's)
        of its generation; ``None`` otherwise."""
        if self.first is None:
            return None
        _, control, data, *node = self.first.groups  # (hierarchical dpsgd: and its gloo node
        return NodeGroups(node[0] if node else data, data, control=control,  # group's)
                          node_gossip=node[1] if len(node) > 1 else None)

    def pairing_over(self, live: Sequence[int], rank: int) -> RankPairing | None:
        """The pairing of ``rank``'s engine over the live ranks ``live`` (the members' after a
        loss or a join, and a newcomer's first: the same on every member; hierarchical: over
        the live nodes, in ``rank``'s column); ``None`` with fewer than two."""
        assert self.pairing is not None
        return self.units.pairing(*self.pairing, live, rank)

    def first_pairing(self, pairing: Pairing) -> Pairing | RankPairing:
        """The pairing of this process's first engine: ``pairing`` (every rank slot), or a
        newcomer's or founder's over its generation's live ranks (slots may be free)."""
        membership = self.membership
        if membership is None:
            return pairing
        first = self.pairing_over(membership.live, membership.rank)
        assert first is not None  # (at least two founders; a newcomer and a member)
        return first

    def open_phase(self, engine: AsyncGossip, step: int) -> int:
        """A newcomer's first step (the lowest member's at the handover), its engine's phase
        open at it (the members opened theirs: no meeting); ``step`` for any other rank."""
        if self.newcomer is None:
            return step
        engine.before_step(self.newcomer.step)
        return self.newcomer.step

    def survivors(self, *, run: str, rank: int, world_size: int, heartbeat: Heartbeat | None,
                  backend: str, make_engine: Callable[..., AsyncGossip],
                  set_engine: Callable[[AsyncGossip | None], AsyncGossip | None],
                  step: Callable[[], int], epoch: Callable[[], int], loggers: Sequence[Any],
                  pack: Callable[[], Any], replicas: Any, trainer: Any,
                  node: NodeAverager | None = None, device: Any = None) -> Survivors:
        """The fit's :class:`~.elastic.Survivors` (a newcomer or founder keeps its membership);
        a join hands over the average of ``pack()`` and the lowest member's checkpoint with
        it. Hierarchical (``node``: this rank's node averaging, its all-reduce on ``device``):
        the node's new groups go to ``node``, a node all-reduce a loss interrupted is issued
        again (``node.retry``), and the node's ranks agree on joins (:mod:`~.elastic_joins`).
        What leaves together: :attr:`units` (:meth:`join`'s)."""

        def node_union(ranks: Sequence[int]) -> list[int]:
            assert node is not None
            flags = torch.zeros(world_size, device=device)
            flags[list(ranks)] = 1.0
            node.all_reduce(flags, "agreeing on joins in the node")
            return flags.nonzero().flatten().tolist()

        def engine_over(live: Sequence[int], _group: Any, control: Any, data: Any,
                        node_group: Any = None) -> AsyncGossip | None:
            """A pairing over ``live`` (none for a lone learner), the engine's phase open."""
            if node_group is not None:
                assert node is not None
                node.group = node_group
            pairing = self.pairing_over(live, rank)
            if pairing is None:
                return None
            engine = make_engine(pairing, control, data)
            engine.start()
            engine.before_step(step())
            return engine

        survivors = Survivors(
            run, rank, world_size, self.timeout, heartbeat=heartbeat, backend=backend,
            make_engine=engine_over, set_engine=set_engine, step=step, epoch=epoch,
            loggers=loggers, membership=self.membership, units=self.units,
            node_union=node_union if node else None,
            hand_over=self.members_side(pack, replicas, trainer, step),
            on_group=lambda group: sync_metrics_over(trainer.lightning_module, group))
        if node is not None:
            node.retry = survivors.retry
        return survivors

    def members_side(self, pack: Callable[[], Any], replicas: Any, trainer: Any,
                     step: Callable[[], int]) -> Callable[[Any, Any, list[int], bool], None]:
        """The members' side of a join (:class:`~.elastic.Survivors`' ``hand_over``): the exact
        average of ``pack()`` over the members, and the lowest member's checkpoint with it
        as the weights (:func:`~.newcomer.hand_over`), at ``step()``."""
        def checkpoint(average: Any) -> dict[str, Any]:
            with replicas.weights_as_is(average):  # no collective: only this member is here
                return _compat.dump_checkpoint(trainer)

        def members_side(old: Any, new: Any, newcomers: list[int], lowest: bool) -> None:
            hand_over(pack(), old, new, newcomers, lowest, checkpoint, step(), self.timeout)

        return members_side
