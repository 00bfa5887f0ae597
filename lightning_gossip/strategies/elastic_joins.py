"""When the ranks of a node look for processes asking to join a hierarchical elastic fit:
:class:`NodeJoins` (``ADPSGDStrategy(elastic=True, hierarchical=True)``).

A flat ``adpsgd`` member looks for join requests at any step boundary, once a second. The ranks
of a node cannot: the admission's first collective must be the next one they issue together
(their node all-reduce is every step's), so they look at the same step, every
:data:`JOIN_CHECK_EVERY` steps while a rank slot is free, and take the union of what each read
(one node all-reduce), so that a request one of them saw a moment before the other is admitted
by both. At an epoch's end, where the node's ranks wait without a node collective, each only
joins an admission another member began (as flat members that arrived there do). Only whole
nodes are admitted: a node's relaunched processes ask one by one.

>>> from datetime import timedelta
>>> import torch.distributed as dist
>>> from lightning_gossip.membership import Membership
>>> from lightning_gossip.strategies.elastic_nodes import NodeUnits
>>> members = Membership(dist.HashStore(), 0, 6, timedelta(seconds=5), live=(0, 1, 4, 5))
>>> step, asked = [16], [(2,)]
>>> joins = NodeJoins(members, NodeUnits(2), node_union=list, step=lambda: step[0],
...                   asked=lambda read=None: asked[0])
>>> joins.look(at_end=False)  # node 1's rank 3 has not asked yet
[]
>>> step[0], asked[0] = 24, (2, 3)
>>> joins.look(at_end=False), joins.look(at_end=False)  # (once per step)
([2, 3], [])
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from lightning_gossip.membership import POLL_EVERY_S, Membership
from lightning_gossip.strategies.elastic_nodes import NodeUnits

__all__ = ["JOIN_CHECK_EVERY", "NodeJoins"]

JOIN_CHECK_EVERY = 8
"""Steps between the looks for join requests where the members must look at the same step
(``dpsgd``'s members, a hierarchical node's ranks), only while a rank slot is free."""


class NodeJoins:
    """When this rank's node looks for joins (see the module docstring).

    Args:
        membership: the fit's membership (its live ranks: is a slot free?).
        units: the nodes.
        node_union: ``(ranks)``: the union of what the node's ranks give (a node collective).
        step: the current optimizer step (the same on a node's ranks).
        asked: ``(read=None)``: the rank slots asked for (``read``: ``membership.deciding``,
            whether another member began an admission), or ``None``.
    """

    def __init__(self, membership: Membership, units: NodeUnits,
                 node_union: Callable[[Sequence[int]], list[int]], step: Callable[[], int],
                 asked: Callable[..., Any]) -> None:
        self.membership, self.units, self.node_union = membership, units, node_union
        self.step, self.asked = step, asked
        self._checked, self._polled = -1, 0.0  # the step last checked; when last polled

    def due(self) -> bool:
        """Whether the node's ranks look at the current step (a multiple of
        :data:`JOIN_CHECK_EVERY`, a rank slot free; once per step). Ask before surviving a loss
        found at this step boundary: a node-mate may find it only inside the step's first node
        collective, survive it there and issue that collective again; had this rank looked
        because the loss just freed a slot, the two would enter different node collectives."""
        step, membership = self.step(), self.membership
        if (step % JOIN_CHECK_EVERY or step == self._checked
                or len(membership.live) == membership.world_size):
            return False
        self._checked = step
        return True

    def look(self, at_end: bool, due: bool | None = None) -> list[int]:
        """The rank slots of whole nodes to admit now (empty: none; ``at_end``: this rank
        waits at an epoch's end; ``due``: :meth:`due`, asked before a loss was survived at
        this step boundary; ``None``: ask now)."""
        membership = self.membership
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
        return self.units.complete(asked or ())
