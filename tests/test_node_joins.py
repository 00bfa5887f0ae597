"""The ranks of a node look for joins at the same steps, also at the step where a loss is
survived (``ADPSGDStrategy(elastic=True, hierarchical=True)``; the exit soak's fit 24,
``benchmarks/results/exit_soak/soak_seed2_fit24_log.txt``).

A node's look is a node collective (the union of the join requests its ranks read). It is due
every ``JOIN_CHECK_EVERY`` steps while a rank slot is free. At the step where node 1 was lost,
rank 1 found the loss at the step boundary (``Survivors.poll``), survived it, and then found a
look due, the loss having just freed a slot: it entered the look's all-reduce. Its node-mate,
rank 0, had passed that boundary before its liveness monitor found the loss (no slot free: no
look), found it inside the step's gradient all-reduce, survived it there and issued that
all-reduce again. The two all-reduces met on the node's new group: gloo aborted rank 1
("Received data size doesn't match expected size") and rank 0 left with ``RankExcluded``.
Now whether a look is due at a step boundary is decided before a loss found there is survived
(:meth:`NodeJoins.due`), so both ranks skip that step's look.
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

from lightning_gossip.elastic.joins import JOIN_CHECK_EVERY, NodeJoins
from lightning_gossip.elastic.membership import Membership
from lightning_gossip.elastic.session import ElasticSession
from lightning_gossip.hierarchy import NodeLayout


def _node_rank(rank: int, session: ElasticSession,
               unions: list[list[int]]) -> tuple[Membership, NodeJoins]:
    members = Membership(dist.HashStore(), rank, 4, timedelta(seconds=5))  # every slot live
    mine = ElasticSession(session.step)  # each rank's own session, at the node's step
    mine.begin(members)

    def union(ranks: list[int]) -> list[int]:  # (the node all-reduce of the strategy)
        unions.append(list(ranks))
        return list(ranks)

    return members, NodeJoins(mine, NodeLayout(2, 2, rank // 2, rank % 2), node_union=union,
                              asked=lambda read=None: None)


def test_a_loss_survived_at_a_step_boundary_makes_no_look_due_there() -> None:
    node = ElasticSession(JOIN_CHECK_EVERY)
    unions: dict[int, list[list[int]]] = {0: [], 1: []}
    rank0, joins0 = _node_rank(0, node, unions[0])
    rank1, joins1 = _node_rank(1, node, unions[1])
    # rank 1: its step boundary with the finding: due first, then the survivors' decision
    due1 = joins1.due()
    rank1.live = (0, 1)  # node 1 (ranks 2, 3) lost
    assert joins1.look(at_end=False, due=due1) == []
    # rank 0: its boundary before the finding (nothing due: every slot live), the loss
    # survived later inside the step's gradient all-reduce
    assert joins0.look(at_end=False) == []
    rank0.live = (0, 1)
    assert unions == {0: [], 1: []}  # neither entered a look's all-reduce at this step
    # asked after the decision, the look was due: what rank 1 did before (fit 24)
    late_session = ElasticSession(JOIN_CHECK_EVERY)
    late_session.begin(rank1)
    late = NodeJoins(late_session, NodeLayout(2, 2, 0, 1), node_union=lambda ranks: [9],
                     asked=lambda read=None: None)
    assert late.due()
    # the next multiple: both look, one all-reduce each, and once per step only
    for joins, mine in ((joins0, unions[0]), (joins1, unions[1])):
        joins.session.move_to(2 * JOIN_CHECK_EVERY)
        assert joins.look(at_end=False, due=joins.due()) == []
        assert joins.look(at_end=False) == []
        assert mine == [[]]
