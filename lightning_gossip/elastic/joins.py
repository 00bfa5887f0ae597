"""When the members of an elastic fit that must act together look for processes asking to
join: :class:`JoinSteps` (the steps), :class:`NodeJoins` (a hierarchical ``adpsgd`` node's
ranks).

A flat ``adpsgd`` member looks for join requests at any step boundary, once a second
(:meth:`~.survivors.Survivors.poll`). Members whose next collective couples them cannot: the
admission's first collective must be the next one they issue together, so they look at the same
step, every :data:`JOIN_CHECK_EVERY` steps (:class:`JoinSteps`), and take the union of what each
read with one collective, so that a request one of them saw a moment before the others is
admitted by all. Two kinds of members do: ``dpsgd``'s (their rounds couple them; the union over
the survivors' gloo groups, :meth:`~.rounds.ElasticRounds.admit_joins`) and the ranks of a
hierarchical ``adpsgd`` node (their node all-reduce is every step's; :class:`NodeJoins`, while
a rank slot is free). At an epoch's end, where a node's ranks wait without a node collective,
each only joins an admission another member began (as flat members that arrived there do).
Only whole nodes are admitted: a node's relaunched processes ask one by one.

>>> from datetime import timedelta
>>> import torch.distributed as dist
>>> from lightning_gossip.elastic.membership import Membership
>>> from lightning_gossip.elastic.session import ElasticSession
>>> from lightning_gossip.hierarchy import NodeLayout
>>> session = ElasticSession(step=16)
>>> session.begin(Membership(dist.HashStore(), 0, 6, timedelta(seconds=5), live=(0, 1, 4, 5)))
>>> asked = [(2,)]
>>> layout = NodeLayout(num_nodes=3, devices=2, node=0, local=0)  # (rank 0's view)
>>> joins = NodeJoins(session, layout, node_union=list, asked=lambda read=None: asked[0])
>>> joins.look(at_end=False)  # node 1's rank 3 has not asked yet
[]
>>> asked[0] = (2, 3)
>>> session.move_to(24)
>>> joins.look(at_end=False), joins.look(at_end=False)  # (once per step)
([2, 3], [])
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from lightning_gossip.elastic.membership import POLL_EVERY_S
from lightning_gossip.elastic.session import ElasticSession
from lightning_gossip.hierarchy import NodeLayout

__all__ = ["JOIN_CHECK_EVERY", "JoinSteps", "NodeJoins", "NodeUnion"]

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
    """When this rank's node looks for joins (see the module docstring).

    Args:
        session: the fit's session (its membership: is a slot free?; its step, the same on a
            node's ranks).
        layout: the fit's nodes (a node is admitted whole).
        node_union: ``(ranks)``: the union of what the node's ranks give (a node collective).
        asked: ``(read=None)``: the rank slots asked for (``read``: ``membership.deciding``,
            whether another member began an admission), or ``None``.
    """

    def __init__(self, session: ElasticSession, layout: NodeLayout,
                 node_union: Callable[[Sequence[int]], list[int]],
                 asked: Callable[..., Any]) -> None:
        self.session, self.layout, self.node_union, self.asked = (session, layout, node_union,
                                                                  asked)
        self.steps = JoinSteps()
        self._polled = 0.0  # when last polled (at an epoch's end)

    def due(self) -> bool:
        """Whether the node's ranks look at the session's step (a multiple of
        :data:`JOIN_CHECK_EVERY`, a rank slot free; once per step). Ask before surviving a loss
        found at this step boundary: a node-mate may find it only inside the step's first node
        collective, survive it there and issue that collective again; had this rank looked
        because the loss just freed a slot, the two would enter different node collectives."""
        membership = self.session.membership
        assert membership is not None
        return not membership.full and self.steps.due(self.session.step)

    def look(self, at_end: bool, due: bool | None = None) -> list[int]:
        """The rank slots of whole nodes to admit now (empty: none; ``at_end``: this rank
        waits at an epoch's end; ``due``: :meth:`due`, asked before a loss was survived at
        this step boundary; ``None``: ask now)."""
        membership = self.session.membership
        assert membership is not None
        if at_end:
            now = time.monotonic()
            if now < self._polled + POLL_EVERY_S:
                return []
            self._polled = now
            asked = self.asked(membership.deciding) and self.asked()
        else:
            if not (self.due() if due is None else due):
                return []
            asked = self.node_union(self.asked() or ())
        return self.layout.complete_nodes(asked or ())


class NodeUnion:
    """``(ranks)``: the union of the rank slots the node's ranks give (one all-reduce of a
    flag per slot on the node's group), so that they admit a node's newcomers at the same
    step (:class:`NodeJoins`' ``node_union``).

    Args:
        node: this rank's node averaging (its ``all_reduce`` over the node's group:
            :class:`~lightning_gossip.node_averaging.NodeAverager`).
        world_size: the fit's rank slots.
        device: the device of the node's all-reduce.
    """

    def __init__(self, node: Any, world_size: int, device: Any = None) -> None:
        self.node, self.world_size, self.device = node, world_size, device

    def __call__(self, ranks: Sequence[int]) -> list[int]:
        flags = torch.zeros(self.world_size, device=self.device)
        flags[list(ranks)] = 1.0
        self.node.all_reduce(flags, "agreeing on joins in the node")
        return flags.nonzero().flatten().tolist()
