"""What the survivors of a lost node keep of their gossip (issue 48): the AD-PSGD engine alone
(no Lightning) on 6 real gloo processes, 3 nodes of 2 ranks, hierarchical (sharded) gossip.

Node 2 is the lost node: it freezes before gossip starts (its processes stay alive but never
answer). Node 0 (active) exchanges with node 1 (passive) for its first ``TURNS`` exchanges,
one per step (``max_staleness=0``), then turns to node 2, where its thread hangs. The survivors
then do what an elastic fit's survivors do on a loss (``elastic/survivors.py``,
``Survivors.recover``): :meth:`AsyncGossip.abandon` mid-phase, a new engine over new groups of
nodes 0 and 1 that takes what the old one left (:meth:`AsyncGossip.carry`), more steps, and
:meth:`AsyncGossip.quiesce`.

Every step adds a known local update to each replica (node 0's and node 1's differ, so their
exchanges keep moving values: two replicas that only average would be equal after the first).
The sum of the survivors' node replicas must then be their initial sum plus every update, to
fp32 rounding: node 2 never completed an exchange, so nothing else can have entered or left the
survivors' sum, and every delta of an exchange between them must be in their weights. Before
``carry``, a sharded engine's abandon dropped the slice deltas not yet all-gathered: the delta of
node 0's last exchange at least (``leftover`` below; in ``delay_by_one`` two exchanges' worth).
The ranks of a node must stay bit-identical throughout.
"""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from lightning_gossip.async_gossip import AsyncGossip
from lightning_gossip.hierarchy import NodeLayout
from lightning_gossip.pairing import ColumnPairing, Pairing
from tests.scripts.engine_ranks import spawn_ranks
from tests.test_async_gossip_unit import _replica

pytestmark = pytest.mark.multiprocess

WORLD, DEVICES = 6, 2
TURNS = 5
"""Node 0's exchanges with node 1 before it turns to the frozen node 2 (one per step)."""
STEPS_AFTER = 3
TIMEOUT = timedelta(seconds=60)
CASES = {"plain": False, "delay_by_one": True}


class _ThenFrozen:
    """A column's pairing: its node-0 rank (active) asks its node-1 rank for the first
    ``turns`` exchanges, then its node-2 rank (the frozen node); both are passive. The methods
    the gossip thread uses, as :class:`~lightning_gossip.pairing.Pairing` has them."""

    def __init__(self, column: tuple[int, int, int], turns: int) -> None:
        self.column, self.turns = column, turns

    def is_active(self, rank: int) -> bool:
        return rank == self.column[0]

    def candidates(self, rank: int) -> tuple[int, ...]:
        return self.column[1:] if self.is_active(rank) else ()

    def contacted_by(self, rank: int) -> tuple[int, ...]:
        return () if self.is_active(rank) else (self.column[0],)

    def partner(self, rank: int, k: int) -> int:
        return self.column[1] if k < self.turns else self.column[2]


def _new_group(ranks: list[int]) -> dist.ProcessGroup:
    return dist.new_group(ranks, backend="gloo", timeout=TIMEOUT)


def _groups(rank: int) -> dict[str, dist.ProcessGroup]:
    """Every group of one case, made by every rank in the same order: the node group, column
    control and data groups of the 3 nodes, then those of the 2 survivors (a survivor builds
    new ones after a loss), and one over the survivors."""
    node, local = divmod(rank, DEVICES)
    made: dict[str, dist.ProcessGroup] = {}
    for when, nodes in (("old", 3), ("new", 2)):
        for n in range(nodes):
            group = _new_group([n * DEVICES + k for k in range(DEVICES)])
            if n == node:
                made[f"{when}_node"] = group
        for c in range(DEVICES):
            column = [n * DEVICES + c for n in range(nodes)]
            control, data = _new_group(column), _new_group(column)
            if c == local:
                made[f"{when}_control"], made[f"{when}_data"] = control, data
    made["survivors"] = _new_group(list(range(2 * DEVICES)))
    return made


def _gather(group: dist.ProcessGroup):
    def gather(mine: torch.Tensor, out: torch.Tensor) -> None:
        dist.all_gather(list(out.split(mine.numel())), mine, group=group)
    return gather


def _engine(flat, rank: int, pairing, groups, when: str, **kwargs) -> AsyncGossip:
    return AsyncGossip(flat, rank, pairing, control_group=groups[f"{when}_control"],
                       data_group=groups[f"{when}_data"], timeout=TIMEOUT,
                       shard=(rank % DEVICES, DEVICES),
                       node_gather=_gather(groups[f"{when}_node"]), **kwargs)


def _survive(rank: int, delay_by_one: bool) -> dict:
    """One case; node 2's ranks only make the groups and wait at the end."""
    groups = _groups(rank)
    node, local = divmod(rank, DEVICES)
    if node == 2:  # frozen: no gossip thread, no answer, until the survivors are done
        dist.barrier()
        return {}
    _, flat = _replica(node)  # the ranks of a node start identical
    x0 = flat.pack().clone()
    update = torch.linspace(0.1, 1.0, flat.numel) * (node + 1)  # the local step (lr != 0)
    added = torch.zeros(flat.numel)
    column = (local, DEVICES + local, 2 * DEVICES + local)
    engine = _engine(flat, rank, _ThenFrozen(column, TURNS), groups, "old",
                     max_staleness=0 if node == 0 else None, delay_by_one=delay_by_one)
    engine.start()
    engine.before_step(0)
    for t in range(TURNS):  # node 0: one exchange with node 1 per step
        engine.before_step(t)
        flat.add_(update)
        added += update
        engine.after_step(t)
    exchanges = engine.stats.exchanges
    dist.barrier(group=groups["survivors"])  # node 0's exchanges with node 1 are done
    if node == 0:
        engine.idle()  # a fresh snapshot: the thread asks the frozen node 2 and hangs
    time.sleep(0.5)  # (for it to get there)
    leftover = engine.abandon()  # as the survivors of a loss
    assert leftover is not None
    # the survivors' new engine over nodes 0 and 1, its phase opened without a meeting
    layout = NodeLayout(num_nodes=2, devices=DEVICES, node=node, local=local)
    new = _engine(flat, rank, ColumnPairing(Pairing("ring", 2), layout), groups, "new",
                  max_staleness=None, delay_by_one=delay_by_one)
    new.start()
    new.before_step(TURNS)
    new.carry(leftover)
    for t in range(TURNS, TURNS + STEPS_AFTER):
        new.before_step(t)
        flat.add_(update)
        added += update
        new.after_step(t)
    new.quiesce()
    new.close()
    dist.barrier()
    return {"x0": x0.tolist(), "x": flat.pack().tolist(), "added": added.tolist(),
            "exchanges": exchanges,
            "leftover": float(leftover.abs().max()), "after": new.stats.exchanges}


def abandon_cases(rank: int, world: int) -> dict:
    """Every case in one launch."""
    return {name: _survive(rank, delay) for name, delay in CASES.items()}


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    return spawn_ranks(abandon_cases, WORLD, Path(tmp_path_factory.mktemp("abandon")))


@pytest.mark.parametrize("case", list(CASES))
def test_the_survivors_of_a_frozen_node_keep_every_delta(results, case):
    ranks = [results[r][case] for r in range(2 * DEVICES)]
    x0 = [torch.tensor(r["x0"]) for r in ranks]
    x = [torch.tensor(r["x"]) for r in ranks]
    # node 0 exchanged TURNS times with node 1 and never with node 2
    assert [r["exchanges"] for r in ranks[:DEVICES]] == [TURNS] * DEVICES
    # the abandoned engines held deltas that were not in the weights yet (node 0's last
    # exchange at least): what a sharded abandon dropped before it returned them. Without
    # delay-by-one that is certain; with it, whether node 0's last delta is still pending or
    # already gathered when the loss is found depends on the thread's timing (it was gathered
    # once in a loaded make test run): there the sum below is checked either way
    leftovers = [r["leftover"] for r in ranks[:DEVICES]]
    if not CASES[case]:
        assert all(v > 1e-2 for v in leftovers), leftovers  # (far above atol)
    assert all(r["after"] >= 1 for r in ranks)  # the new engines gossiped
    # the ranks of a node hold bit-identical replicas
    assert torch.equal(x[0], x[1]) and torch.equal(x[2], x[3])
    assert float((x0[0] - x0[2]).abs().max()) > 1.0  # the nodes started far apart
    # the sum of the survivors' node replicas is conserved across the loss: the initial sum
    # plus the local updates
    added = [torch.tensor(r["added"]) for r in ranks]
    torch.testing.assert_close(x[0] + x[2], x0[0] + x0[2] + added[0] + added[2], rtol=0,
                               atol=1e-4)
