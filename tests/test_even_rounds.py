"""The end-of-epoch meeting of synchronous rounds (:mod:`lightning_gossip.elastic.even_rounds`):
ranks that trained different numbers of steps leave at the same step, every round any rank
started is run by every rank (a round here is a barrier of all ranks: the strictest coupling),
and nobody waits forever."""

from __future__ import annotations

import threading
from collections import defaultdict

import pytest
import torch.distributed as dist

from lightning_gossip.elastic.even_rounds import EvenRounds


class Rounds:
    """Round ``t`` returns once every rank has entered it (a barrier per round)."""

    def __init__(self, ranks: int) -> None:
        self.ranks = ranks
        self.barriers: dict[int, threading.Barrier] = defaultdict(lambda: threading.Barrier(ranks))
        self.lock = threading.Lock()
        self.run: dict[int, list[int]] = defaultdict(list)  # rank -> rounds it ran

    def round(self, rank: int, t: int) -> int:
        with self.lock:
            barrier = self.barriers[t]
        self.run[rank].append(t)
        barrier.wait(timeout=10)
        return t + 1


@pytest.mark.parametrize("trained", [(5, 5, 5), (3, 7, 4, 5), (0, 2, 9), (6,)])
def test_ranks_with_different_steps_leave_together(trained: tuple[int, ...]) -> None:
    store, n = dist.HashStore(), len(trained)
    rounds, left, errors = Rounds(n), {}, []

    def rank_main(rank: int) -> None:
        try:
            step = 0
            meeting = EvenRounds(store, "fit", rank, live=lambda: tuple(range(n)), timeout_s=20)
            # the training steps run rounds too, until this rank's batches are used up
            while step < trained[rank]:
                step = rounds.round(rank, step)
            left[rank] = meeting.settle("epoch0", step, lambda t: rounds.round(rank, t))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
            for b in rounds.barriers.values():
                b.abort()

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    assert len(set(left.values())) == 1, left
    target = left[0]
    assert target >= max(trained)
    # every rank ran every round 0..target-1, once
    assert all(rounds.run[r] == list(range(target)) for r in range(n)), dict(rounds.run)


def test_a_rank_that_never_comes_is_named() -> None:
    store = dist.HashStore()
    meeting = EvenRounds(store, "fit", 0, live=lambda: (0, 1), timeout_s=0.3)
    with pytest.raises(TimeoutError, match=r"rank\(s\) 1 did not come"):
        meeting.settle("epoch0", 4, lambda t: t + 1)


def test_a_new_meeting_after_a_loss_counts_only_the_live() -> None:
    store, live = dist.HashStore(), [0, 1, 2]
    a = EvenRounds(store, "fit", 0, live=lambda: tuple(live), timeout_s=5)
    assert a._post("fit/epoch0/gen0", 7) is None  # ranks 1 and 2 have not come
    live.remove(2)  # rank 2 lost: the survivors meet again under the next generation's name
    b = EvenRounds(store, "fit", 1, live=lambda: tuple(live), timeout_s=5)
    assert b._post("fit/epoch0/gen1", 6) is None
    assert a.settle("epoch0/gen1", 7, lambda t: t + 1) == 7
    assert b.settle("epoch0/gen1", 6, lambda t: t + 1) == 7
