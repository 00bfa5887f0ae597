"""When the members of an elastic fit that must act together look for processes asking to
join: :class:`JoinSteps` (the steps), :class:`NodeJoins` (a hierarchical ``adpsgd`` node's
ranks).

A flat ``adpsgd`` member looks for join requests at any step boundary, once a second
(:meth:`~.survivors.Survivors.poll`). Members whose next collective couples them cannot: the
admission's first collective must be the next one they issue together, so they look at the same
step, every :data:`JOIN_CHECK_EVERY` steps (:class:`JoinSteps`), and take the union of what each
read, so that a request one of them saw a moment before the others is admitted by all. Two kinds
of members do: ``dpsgd``'s (their rounds couple them; the union over the survivors' gloo groups,
:meth:`~.rounds.ElasticRounds.admit_joins`) and the ranks of a hierarchical ``adpsgd`` node
(:class:`NodeJoins`).

A node's ranks take the union inside the step's gradient all-reduce, which every rank of the
node issues at every step whatever it knows (:class:`~lightning_gossip.node_averaging.
NodeAverager` carries :meth:`NodeJoins.values`), never in a collective of its own: whether a
rank looks depends on what it knows of the membership, and node-mates learn of a loss at
different moments (one at a step boundary, the other while it waits for its node's claim or
inside the step's gradient all-reduce), so a separate look could be entered by one rank while
its node-mate entered the gradient all-reduce (the exit soak's hangs: the logs
``soak_seed2_fit24_log.txt`` and ``soak_hier_seed25_fit1_log.txt`` in
``benchmarks/results/exit_soak/``). Each rank gives a flag per rank slot asked for and
its membership's generation; the node admits the whole nodes asked for (only whole nodes are
admitted: a node's relaunched processes ask one by one) when every rank of the node looked at
the same generation (the same live ranks), right after that step (:meth:`NodeJoins.take`,
:meth:`~.survivors.Survivors.admit_agreed`), and not at all otherwise: the requests stay in the
store for the next look. At an epoch's end, where a node's ranks wait without a node
collective, each only joins an admission another member began (:meth:`NodeJoins.look`, as flat
members that arrived there do).

>>> from datetime import timedelta
>>> import torch.distributed as dist
>>> from lightning_gossip.elastic.membership import Membership
>>> from lightning_gossip.elastic.session import ElasticSession
>>> from lightning_gossip.hierarchy import NodeLayout
>>> def node_rank(rank, live):  # a rank of node 0, nodes of 2, node 1 (ranks 2, 3) lost
...     session = ElasticSession(step=16)
...     session.begin(Membership(dist.HashStore(), rank, 6, timedelta(seconds=5), live=live,
...                              generation=1))
...     layout = NodeLayout(num_nodes=3, devices=2, node=0, local=rank)
...     return NodeJoins(session, layout, asked=lambda read=None: (2, 3))
>>> a, b = node_rank(0, (0, 1, 4, 5)), node_rank(1, (0, 1, 4, 5))
>>> sums = a.values() + b.values()  # the node's all-reduce
>>> sums.tolist()  # a flag per slot asked for, then each local rank's generation + 1
[0.0, 0.0, 2.0, 2.0, 0.0, 0.0, 2.0, 2.0]
>>> a.summed(sums), b.summed(sums)
(None, None)
>>> a.take(), b.take(), a.take()  # both admit node 1 after the step (once)
([2, 3], [2, 3], [])
>>> a.values().tolist()  # (once per step)
[0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from lightning_gossip.elastic.membership import POLL_EVERY_S, Membership
from lightning_gossip.elastic.session import ElasticSession
from lightning_gossip.hierarchy import NodeLayout

__all__ = ["JOIN_CHECK_EVERY", "JoinSteps", "NodeJoins"]

JOIN_CHECK_EVERY = 8
"""Steps between the looks for join requests where the members must look at the same step
(``dpsgd``'s members, a hierarchical node's ranks)."""


class JoinSteps:
    """The steps at which members that must look together look for joins: every
    :data:`JOIN_CHECK_EVERY` steps, once per step.

    >>> steps = JoinSteps()
    >>> steps.due(8), steps.due(8), steps.due(9), steps.due(16)
    (True, False, False, True)
    """

    def __init__(self) -> None:
        self._checked = -1  # the step last looked at

    def due(self, step: int) -> bool:
        """Whether to look at ``step`` (and, if so, that it was looked at)."""
        if step % JOIN_CHECK_EVERY or step == self._checked:
            return False
        self._checked = step
        return True

    def looked(self, step: int) -> None:
        """``step`` counts as looked at (a newcomer admitted at it: the members looked)."""
        self._checked = step


class NodeJoins:
    """How a hierarchical ``adpsgd`` node's ranks agree on joins (see the module docstring):
    :meth:`values` for the step's gradient all-reduce, :meth:`summed` told the node's sums,
    :meth:`take` after the step; :meth:`look` at an epoch's end.

    Args:
        session: the fit's session (its membership: the generation, a free slot; its step,
            the same on a node's ranks).
        layout: the fit's nodes (a node is admitted whole).
        asked: ``(read=None)``: the rank slots asked for (``read``: ``membership.deciding``,
            whether another member began an admission), or ``None``.
    """

    def __init__(self, session: ElasticSession, layout: NodeLayout,
                 asked: Callable[..., Any]) -> None:
        self.session, self.layout, self.asked = session, layout, asked
        self.steps = JoinSteps()
        self._polled = 0.0  # when last polled (at an epoch's end)
        self._agreed: list[int] = []  # the slots the node agreed to admit (taken after the step)

    def _membership(self) -> Membership:
        membership = self.session.membership
        assert membership is not None
        return membership

    def values(self) -> Tensor:
        """This rank's part of the step's gradient all-reduce: a flag per rank slot it found
        asked for, then one value per local rank of the node, this rank's own set to its
        membership's generation plus one; at a multiple of :data:`JOIN_CHECK_EVERY` (once per
        step; it reads the store only while a slot is free in its view), zeros otherwise. The
        same length on every rank, at every step."""
        membership = self._membership()
        world, devices = membership.world_size, self.layout.devices
        out = torch.zeros(world + devices)
        if self.steps.due(self.session.step):
            out[world + membership.rank % devices] = membership.generation + 1
            if not membership.full:
                out[list(self.asked() or ())] = 1.0
        return out

    def summed(self, sums: Tensor) -> None:
        """The node's sums of :meth:`values` (the same on every rank of the node): when every
        rank of the node looked, at the same generation, the whole nodes asked for are to be
        admitted after the step (:meth:`take`); nothing otherwise."""
        world = self._membership().world_size
        flags, looked = sums[:world], sums[world:].tolist()
        if min(looked) > 0 and max(looked) == min(looked):
            if joined := self.layout.complete_nodes(flags.nonzero().flatten().tolist()):
                self._agreed = joined

    def take(self) -> list[int]:
        """The rank slots of whole nodes the node's ranks agreed to admit in this step's
        gradient all-reduce (empty: none; once)."""
        agreed, self._agreed = self._agreed, []
        return agreed

    def look(self) -> list[int]:
        """At an epoch's end (this rank waits there, no node collective): the rank slots of
        whole nodes in an admission another member began (empty: none; once a second)."""
        now = time.monotonic()
        if now < self._polled + POLL_EVERY_S:
            return []
        self._polled = now
        asked = self.asked(self._membership().deciding) and self.asked()
        return self.layout.complete_nodes(asked or ())
