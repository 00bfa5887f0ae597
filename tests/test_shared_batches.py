"""SharedBatchSampler and shared_cursor_loader in one process, on a real c10d ``HashStore``.

Several samplers on one store stand for several ranks; the multi-process runs (real gloo groups,
a slow rank, the ASR recipe) are in ``tests/recipes/test_asr_shared_batches.py``.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, Sampler, TensorDataset

from lightning_gossip.cursor.batches import SharedBatches, SharedBatchSampler
from lightning_gossip.cursor.sampler import SharedCursorSampler
from lightning_gossip.strategies.shared_loader import shared_cursor_loader


class Listed(Sampler[list[int]]):
    """A batch sampler with a per-rank shard in ``__iter__`` and the shared list on request."""

    def __init__(self, n: int, size: int, rank: int = 0, world: int = 1) -> None:
        self.n, self.size, self.rank, self.world = n, size, rank, world
        self.epoch = 0
        self.epochs_set: list[int] = []

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.epochs_set.append(epoch)

    def shared_batches(self, epoch: int) -> list[list[int]]:
        order = torch.randperm(self.n, generator=torch.Generator().manual_seed(epoch)).tolist()
        return [order[i:i + self.size] for i in range(0, self.n, self.size)]

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self.shared_batches(self.epoch)[self.rank::self.world])


def interleave(samplers: list[SharedBatchSampler], pattern: list[int]) -> list[list[list[int]]]:
    """Draw from the samplers' iterators in turn (``pattern`` repeats) until all are done."""
    iters = [iter(s) for s in samplers]
    got: list[list[list[int]]] = [[] for _ in samplers]
    live = set(range(len(samplers)))
    step = 0
    while live:
        r = pattern[step % len(pattern)]
        step += 1
        if r not in live:
            continue
        try:
            got[r].append(next(iters[r]))
        except StopIteration:
            live.discard(r)
    return got


def test_every_batch_once_per_epoch_and_faster_ranks_take_more() -> None:
    store = dist.HashStore()
    samplers = [SharedBatchSampler(Listed(60, 3, rank=r, world=3), store, key="k")
                for r in range(3)]
    assert isinstance(samplers[0].source, SharedBatches)
    for epoch in range(2):
        for s in samplers:
            s.sampler.set_epoch(epoch)  # the path Lightning takes
        got = interleave(samplers, [0, 0, 0, 1, 2, 2])  # rank 0 three times as fast as rank 1
        expected = Listed(60, 3).shared_batches(epoch)
        assert sorted(b for rank in got for b in rank) == sorted(expected)
        counts = [len(rank) for rank in got]
        assert counts == [s.claimed for s in samplers] and sum(counts) == 20
        assert counts[0] > counts[2] > counts[1], counts
        assert all(s.num_batches == 20 for s in samplers)
    assert samplers[0].source.epochs_set == [0, 1]  # set_epoch is passed on


def test_batches_are_handed_out_in_listed_order() -> None:
    sampler = SharedBatchSampler(lambda epoch: [[epoch, 1], [2], [3, 4, 5]], dist.HashStore(),
                                 key="fn")
    sampler.set_epoch(7)
    assert list(sampler) == [[7, 1], [2], [3, 4, 5]] and sampler.claimed == 3
    assert list(sampler) == []  # the epoch's counter is used up; the next epoch has its own
    sampler.set_epoch(8)
    assert list(sampler) == [[8, 1], [2], [3, 4, 5]]


def test_a_rank_with_different_batches_is_named() -> None:
    store = dist.HashStore()
    first = SharedBatchSampler(lambda epoch: [[0, 1], [2, 3]], store, key="d")
    other = SharedBatchSampler(lambda epoch: [[0, 1], [3, 2]], store, key="d")
    assert next(iter(first)) == [0, 1]
    with pytest.raises(RuntimeError, match="rank 0 lists different batches for epoch 0"):
        next(iter(other))
    unchecked = SharedBatchSampler(lambda epoch: [[0, 1], [3, 2]], store, key="d", check=False)
    assert list(unchecked) == [[3, 2]]  # not compared; takes what the first one left


def test_source_must_list_batches() -> None:
    with pytest.raises(TypeError, match="shared_batches"):
        SharedBatchSampler(BatchSampler(range(4), 2, False), dist.HashStore(), key="x")


def _collate(batch: list) -> list:
    return batch


class Stream(IterableDataset):
    def __iter__(self) -> Iterator[int]:
        return iter(range(4))


def test_shared_cursor_loader_picks_batches_samples_or_nothing() -> None:
    store = dist.HashStore()
    data = TensorDataset(torch.arange(12))

    listed = DataLoader(data, batch_sampler=Listed(12, 4, rank=1, world=2), collate_fn=_collate)
    shared, claims = shared_cursor_loader(listed, key="a", store=store)
    assert claims is shared.batch_sampler.claims
    assert isinstance(shared.batch_sampler, SharedBatchSampler)
    assert shared.batch_sampler.source is listed.batch_sampler
    assert shared.collate_fn is _collate and shared.dataset is data
    assert len(list(shared)) == 3 and list(listed) != []  # the original loader is untouched
    assert shared_cursor_loader(shared, key="a", store=store) is None  # already shared

    plain = DataLoader(data, batch_size=5)
    cursor, claims = shared_cursor_loader(plain, key="b", seed=3, store=store)
    assert claims is cursor.sampler.claims
    assert isinstance(cursor.sampler, SharedCursorSampler) and cursor.batch_size == 5
    assert cursor.sampler.seed == 3 and cursor.sampler.num_chunks == 3
    assert sorted(int(i) for (b,) in cursor for i in b) == list(range(12))
    assert shared_cursor_loader(cursor, key="b", store=store) is None

    custom = DataLoader(data, batch_sampler=BatchSampler(range(12), 4, False))
    with pytest.warns(UserWarning, match=r"\(BatchSampler\) does not list its batches"):
        assert shared_cursor_loader(custom, key="c", store=store) is None
    own = DataLoader(data, batch_sampler=[[0, 1], [2, 3]])
    with pytest.warns(UserWarning, match=r"\(list\) does not list its batches"):
        assert shared_cursor_loader(own, key="d", store=store) is None
    with pytest.warns(UserWarning, match="iterable dataset"):
        assert shared_cursor_loader(DataLoader(Stream(), batch_size=2), key="e",
                                    store=store) is None
    assert shared_cursor_loader([1, 2], key="f", store=store) is None


def test_an_abandoned_iterator_loses_no_batches() -> None:
    # Lightning starts an iterator (and prefetches a batch) when it reloads a loader, then sets
    # the epoch and starts another one.
    store = dist.HashStore()
    ranks = [SharedBatchSampler(Listed(12, 2), store, key="r") for _ in range(2)]
    ranks[0].set_epoch(1)
    ranks[1].set_epoch(1)
    first = iter(ranks[0])
    prefetched = next(first)
    second = iter(ranks[0])
    assert next(second) == prefetched  # handed out again, not lost
    assert next(first, None) is None  # the old iterator stops drawing
    got = [prefetched, *second, *ranks[1]]
    assert sorted(got) == sorted(Listed(12, 2).shared_batches(1))
    ranks[0].set_epoch(2)  # a finished epoch is not replayed into the next one
    assert sorted([*ranks[0], *ranks[1]]) == sorted(Listed(12, 2).shared_batches(2))


def test_a_resumed_epoch_claims_only_what_was_not_claimed_before_the_requeue() -> None:
    """``Claims.start`` (from the requeue checkpoint): the interrupted epoch's counter starts
    past the claims made before, so before + after is the epoch, each unit once; other epochs
    start at 0; ``position`` reads the counter (what the checkpoint saves)."""
    from lightning_gossip.cursor.claims import Claims
    from lightning_gossip.hierarchy import NodeLayout

    before = SharedCursorSampler(40, chunk_size=4, store=dist.HashStore(), key="k", seed=3)
    it = iter(before)
    seen_before = [next(it) for _ in range(3 * 4)]  # 3 chunks claimed, then the requeue
    assert before.claims.position(0) == (3, 10)
    after = SharedCursorSampler(40, chunk_size=4, store=dist.HashStore(), key="k", seed=3)
    after.claims.start = {0: 3}
    seen_after = list(after)
    assert after.claimed == 7 and sorted(seen_before + seen_after) == list(range(40))
    assert after.claims.position(0) == (11, 10)  # the last, failed claim counts too
    after.set_epoch(1)
    assert len(list(after)) == 40  # the next epoch from its start

    store = dist.HashStore()  # hierarchical: a node's claims, 2 units each
    a, b = (Claims(store, "n", NodeLayout(1, 2, 0, local)) for local in (0, 1))
    a.start = b.start = {0: 2}
    units = [(a.next(0, 9), b.next(0, 9)) for _ in range(4)]
    assert units == [(4, 5), (6, 7), (8, 0), (None, None)], units
