"""The balanced epoch end (``lightning_gossip.cursor.end_balance``): claimants of different
speeds on one shared counter, simulated on a clock of their own (each claims one unit ahead, as
under Lightning's fetcher), and the guarantee that no unit is left unclaimed.

The multi-process run of the same option (a 2 x 2 fit with a slow node) is
``tests/test_hierarchical_adpsgd.py::test_a_balanced_end_leaves_the_last_batches_to_the_fast_node``.
"""

from __future__ import annotations

import heapq
from collections import deque

import pytest
import torch.distributed as dist

from lightning_gossip.cursor.claims import Claims
from lightning_gossip.cursor.end_balance import EndBalance, should_claim
from lightning_gossip.hierarchy import NodeLayout
from lightning_gossip.strategies import ADPSGDStrategy


def simulate(paces: list[float], units: int, balanced: bool, epochs: int = 2,
             ) -> tuple[list[list[list[int]]], list[list[float]]]:
    """Claimant ``i`` computes a unit in ``paces[i]`` seconds and claims one unit ahead (two
    claims at the epoch's start, then one as it starts each unit); an epoch starts when every
    claimant has finished the last one. Per epoch: the units each claimant took, and when each
    finished its last, counted from the epoch's start (the epoch's length is their maximum)."""
    store, now = dist.HashStore(), [0.0]
    claims = [Claims(store, "sim", balance=EndBalance(store, "sim/balance", i, len(paces),
                                                      ahead=1, clock=lambda: now[0])
                     if balanced else None) for i in range(len(paces))]
    took, ends = [], []
    for epoch in range(epochs):
        start = now[0]
        held: list[deque[int]] = [deque() for _ in paces]
        mine: list[list[int]] = [[] for _ in paces]
        finish, done = [start] * len(paces), [False] * len(paces)
        events = [(start, i, 2) for i in range(len(paces))]
        while events:
            t, i, tries = heapq.heappop(events)
            now[0] = t
            for _ in range(tries):
                unit = None if done[i] else claims[i].next(epoch, units)
                done[i] = done[i] or unit is None
                if unit is not None:
                    held[i].append(unit)
                    mine[i].append(unit)
            if held[i]:
                held[i].popleft()
                finish[i] = t + paces[i]
                heapq.heappush(events, (finish[i], i, 1))
        now[0] = max(finish)  # the epoch-end meeting
        took.append(mine)
        ends.append([f - start for f in finish])
    return took, ends


@pytest.mark.parametrize("paces", [[1.0, 2.2], [1.0, 1.0, 3.0], [1.0, 1.3, 2.0, 4.0],
                                   [1.0] * 8, [1.0, 1.05]])
@pytest.mark.parametrize("units", [7, 20, 41])
def test_every_unit_once_and_the_epoch_never_ends_later(paces, units):
    greedy_took, greedy_ends = simulate(paces, units, balanced=False)
    took, ends = simulate(paces, units, balanced=True)
    for epoch in took:
        assert sorted(u for mine in epoch for u in mine) == list(range(units))
    for greedy, balanced in zip(greedy_ends, ends, strict=True):
        assert max(balanced) <= max(greedy) + 1e-9, (greedy, balanced)


def test_a_twice_as_slow_claimant_stops_and_the_fast_one_waits_less():
    """The race's handicap (the slow node's step about 2.2x the fast node's): greedily the fast
    claimant idles at the epoch's end while the slow one finishes; balanced, the slow one leaves
    the last units, the two end within one fast unit and the epoch ends sooner."""
    greedy_took, greedy_ends = simulate([1.0, 2.2], 20, balanced=False)
    took, ends = simulate([1.0, 2.2], 20, balanced=True)
    epoch = 1  # (in epoch 0 the paces are still being learnt)
    assert greedy_ends[epoch][1] - greedy_ends[epoch][0] > 1.0, greedy_ends
    assert abs(ends[epoch][1] - ends[epoch][0]) <= 1.0 + 1e-9, ends
    length = [max(e[epoch]) for e in (greedy_ends, ends)]
    assert length[1] < length[0], length
    assert len(took[epoch][1]) < len(greedy_took[epoch][1])


def test_equal_claimants_never_stop():
    took, _ = simulate([1.0] * 4, 17, balanced=True)
    greedy, _ = simulate([1.0] * 4, 17, balanced=False)
    assert took == greedy


def test_when_every_other_claimant_stopped_the_last_takes_the_units():
    """Stale paces can make every claimant think the others finish first; the one whose stop
    would make them all stopped takes the units instead, so none is left."""
    store, now = dist.HashStore(), [0.0]
    a = EndBalance(store, "k", 0, 2, ahead=0, clock=lambda: now[0])
    b = EndBalance(store, "k", 1, 2, ahead=0, clock=lambda: now[0])
    for t in (0.0, 1.0, 2.0):  # both take a unit a second
        now[0] = t
        assert a.take(0, 50) and b.take(0, 50)
    store.set("k/pace/1", "0.01")  # a sees b as 100x faster
    now[0] = 3.0
    assert not a.take(0, 2) and a.left_early == [0]
    store.set("k/pace/0", "0.01")  # b sees a as 100x faster, but a has stopped
    assert b.take(0, 2) and b.left_early == []


def test_a_node_that_stops_stops_all_its_ranks():
    """Hierarchical claims: local rank 0 decides for the node; its other ranks end with it."""
    store, fast_now, slow_now = dist.HashStore(), [0.0], [0.0]
    fast = Claims(store, "n", NodeLayout(2, 2, 0, 0),
                  balance=EndBalance(store, "n/b", 0, 2, ahead=0, clock=lambda: fast_now[0]))
    slow0 = Claims(store, "n", NodeLayout(2, 2, 1, 0),
                   balance=EndBalance(store, "n/b", 1, 2, ahead=0, clock=lambda: slow_now[0]))
    slow1 = Claims(store, "n", NodeLayout(2, 2, 1, 1))
    units = 40  # 20 node claims; the fast node claims once a second, the slow one every 10 s

    def slow_claims(t: float) -> tuple[int | None, int | None]:
        slow_now[0] = t
        return slow0.next(0, units), slow1.next(0, units)

    def fast_claims(n: int) -> list[int | None]:
        out = []
        for _ in range(n):
            out.append(fast.next(0, units))
            fast_now[0] += 1.0
        return out

    assert None not in fast_claims(3) + [*slow_claims(0.0), *slow_claims(10.0)]  # 15 left
    assert None not in fast_claims(9)
    assert slow_claims(20.0) == (None, None)  # 6 claims left: the fast node ends sooner
    assert slow0.balance.left_early == [0]
    rest = fast_claims(7)
    assert rest[-1] is None and None not in rest[:-1]


def test_the_option_is_checked():
    with pytest.raises(ValueError, match="elastic"):
        ADPSGDStrategy(shared_cursor="balanced", elastic=True)
    with pytest.raises(ValueError, match="shared_cursor must be"):
        ADPSGDStrategy(shared_cursor="yes")
    with pytest.raises(ValueError, match="ledger|elastic"):
        Claims(dist.HashStore(), "x", ledger=object(),
               balance=EndBalance(dist.HashStore(), "x", 0, 1))
    with pytest.raises(ValueError, match="claimant 2 is not one of 2"):
        EndBalance(dist.HashStore(), "x", 2, 2)
    assert should_claim(0, 1.0, [1.0]) is False
