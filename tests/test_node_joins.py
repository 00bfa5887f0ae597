"""The ranks of a hierarchical ``adpsgd`` node agree on joins inside their step's gradient
all-reduce, so that no timing of a loss can make them enter different node collectives
(``ADPSGDStrategy(elastic=True, hierarchical=True)``; issue 48, the exit soak's hangs).

Node-mates learn of a loss at different moments: one at a step boundary (``Survivors.poll``),
the other while it waits for its node's claim of the next batch (the claim read polls the
survivors as waits at an epoch's end do) or inside the step's gradient all-reduce (the wait
watches the liveness monitor's finding and issues the all-reduce again on the node's new
group). The look for joins used to be a node collective of its own, entered at a multiple of
``JOIN_CHECK_EVERY`` steps by the ranks whose view had a free slot. In the soak's fit 24
(``benchmarks/results/exit_soak/soak_seed2_fit24_log.txt``) rank 1 survived node 1's loss at the
boundary of step 8 and then looked, while rank 0 survived it inside step 8's gradient all-reduce
and issued that again; deciding whether to look before a loss is survived closed that path, not
seed 25's fit 1 (``soak_hier_seed25_fit1_log.txt``): rank 1 survived the loss before the
boundary of step 24 (no look due yet: every slot was live in its view), found a look due at the
boundary, and entered it while rank 0 entered step 24's gradient all-reduce. gloo aborted rank 1
("Received data size doesn't match expected size") and rank 0 left with ``RankExcluded``.

:func:`node_step` plays that path on a real node of two gloo processes in a fit of 4 rank slots
whose node 1 never comes (the heartbeat finds it silent): rank 1 waits for the finding and
survives it from its claim read (``Survivors.poll_at_end``) before the boundary of step 8, rank 0
reaches that boundary first and finds the loss only inside the gradient all-reduce. With the
separate look the two met in different collectives on the node's new group (rank 1's process
aborted); with the join flags in the gradient all-reduce both finish the step with the node's
average gradient and admit nothing, having looked at different generations. At the next
multiple both look at the same generation and agree on the relaunched node 1.
"""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_gossip import _compat
from lightning_gossip.elastic.engines import PairwiseEngines, node_retries
from lightning_gossip.elastic.joins import JOIN_CHECK_EVERY, NodeJoins
from lightning_gossip.elastic.membership import Membership
from lightning_gossip.elastic.session import ElasticSession
from lightning_gossip.elastic.survivors import Survivors
from lightning_gossip.flat import FlatState
from lightning_gossip.hierarchy import NodeLayout
from lightning_gossip.liveness import Heartbeat
from lightning_gossip.node_averaging import NodeAverager
from tests.scripts.engine_ranks import spawn_ranks

SLOTS = 4
"""The fit's rank slots: node 0 (ranks 0 and 1, the two processes) and node 1 (ranks 2 and 3,
never started: lost before step 8)."""
HEARTBEAT_S = 3.0
TIMEOUT = timedelta(seconds=60)


def _node_rank(rank: int, live: tuple[int, ...], generation: int) -> NodeJoins:
    session = ElasticSession(JOIN_CHECK_EVERY)
    session.begin(Membership(dist.HashStore(), rank, SLOTS, timedelta(seconds=5), live=live,
                             generation=generation))
    return NodeJoins(session, NodeLayout(2, 2, 0, rank), asked=lambda read=None: tuple(
        r for r in (2, 3) if r not in live))


def test_a_node_admits_only_what_its_ranks_agreed_on_at_one_generation() -> None:
    # rank 1 survived node 1's loss (generation 1), rank 0 not yet (every slot live in its view)
    late, early = _node_rank(0, (0, 1, 2, 3), 0), _node_rank(1, (0, 1), 1)
    sums = late.values() + early.values()  # the node's all-reduce
    assert sums.tolist() == [0, 0, 1, 1, 1, 2]  # rank 1 read the requests of slots 2 and 3
    late.summed(sums)
    early.summed(sums)
    assert late.take() == early.take() == []  # two generations: neither admits
    # one generation, but one rank did not look at this step (it looked at it already)
    a, b = _node_rank(0, (0, 1), 1), _node_rank(1, (0, 1), 1)
    b.values()
    sums = a.values() + b.values()
    a.summed(sums)
    b.summed(sums)
    assert a.take() == b.take() == []
    # the next multiple: both look at generation 1 and admit node 1, once, after the step
    for joins in (a, b):
        joins.session.move_to(2 * JOIN_CHECK_EVERY)
    sums = a.values() + b.values()
    assert sums.tolist() == [0, 0, 2, 2, 2, 2]
    a.summed(sums)
    b.summed(sums)
    assert a.take() == b.take() == [2, 3]
    assert a.take() == []
    # a node asked by one rank only (slot 3): only whole nodes are admitted
    c, d = _node_rank(0, (0, 1), 1), _node_rank(1, (0, 1), 1)
    c.asked = d.asked = lambda read=None: (3,)
    sums = c.values() + d.values()
    c.summed(sums)
    d.summed(sums)
    assert c.take() == d.take() == []


def _refuse(*args: object, **kwargs: object) -> None:
    raise AssertionError("no engine or admission in this test: node 0 is alone after the loss")


def node_step(rank: int, world: int) -> dict:
    """Rank ``rank`` of node 0 (see the module docstring): step 8, then the look at step 16."""
    assert world == 2
    session = ElasticSession(JOIN_CHECK_EVERY)
    node_group = dist.new_group([0, 1], backend="gloo", timeout=TIMEOUT)
    module = nn.Linear(3, 2)
    with torch.no_grad():
        for p in module.parameters():
            p.fill_(0.5)
    heartbeat = Heartbeat.connect(rank, SLOTS, HEARTBEAT_S, fallback=_compat.default_store())
    node = NodeAverager(module, FlatState(module), NodeLayout(2, 2, 0, rank), node_group,
                        TIMEOUT, heartbeat, step=session.current_step)
    layout = NodeLayout(2, 2, 0, rank)
    engines = PairwiseEngines(session, layout, ("ring", 0), make=_refuse, node=node)
    survivors = Survivors(session, "joins", rank, SLOTS, TIMEOUT, heartbeat=heartbeat,
                          backend="gloo", engines=engines, epoch=lambda: 0, hand_over=_refuse,
                          layout=layout, node=node)
    node_retries(node, survivors.retry)
    dist.barrier()
    heartbeat.start()  # node 1's slots never beat: found silent after HEARTBEAT_S
    if rank == 1:  # the finding, survived in its claim read before the step's boundary
        deadline = time.monotonic() + 60
        while not heartbeat.has_finding:
            assert time.monotonic() < deadline, "the liveness monitor found nothing"
            time.sleep(0.05)
        survivors.poll_at_end()
        assert survivors.live == (0, 1)
    # rank 0 comes here at once: every slot is live in its view
    survivors.poll()  # the boundary of step 8 (the strategy's check_liveness)
    module.zero_grad()
    module(torch.full((4, 3), float(rank + 1))).sum().backward()
    node.average_gradients()  # step 8's gradient all-reduce (the loss found in it by rank 0)
    survivors.admit_agreed()
    grads = [p.grad.flatten().tolist() for p in module.parameters()]
    stepped = {"live": list(survivors.live), "generation": survivors.membership.generation,
               "grads": grads, "losses": [list(lost) for _, lost, _, _ in survivors.losses]}
    # the relaunched node 1 asks; both ranks look at step 16 at the same generation
    for r in (2, 3):
        Membership.ask_to_join(survivors.membership.store, r)
    session.move_to(2 * JOIN_CHECK_EVERY)
    survivors.poll()
    module.zero_grad()
    module(torch.ones(4, 3)).sum().backward()
    node.average_gradients()
    assert survivors.node_joins is not None
    stepped["agreed"] = survivors.node_joins.take()  # (admit_agreed would admit them)
    heartbeat.stop()
    return stepped


@pytest.mark.multiprocess
def test_node_mates_that_find_a_loss_apart_step_on_together(tmp_path: Path) -> None:
    results = spawn_ranks(node_step, 2, tmp_path, timeout=150.0)
    for r in results:
        assert r["live"] == [0, 1] and r["generation"] == 1
        assert r["losses"] == [[2, 3]]  # each survived node 1's loss once
        # the node's average gradient: (1 + 2) / 2 per input, 4 samples; bias 4
        assert r["grads"] == [[6.0] * 6, [4.0] * 2]
        assert r["agreed"] == [2, 3]
