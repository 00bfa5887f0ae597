"""SharedCursorSampler alone (no Lightning) on the default store of a real 2-rank gloo group.

One launch runs every check (:func:`cursor_cases`). The slow rank is made slow without clocks:
after its first chunk it waits (with a timeout) until the fast rank has finished the epoch.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from lightning_gossip._compat import default_store
from lightning_gossip.cursor.sampler import SharedCursorSampler
from tests.scripts.engine_ranks import spawn_ranks

pytestmark = pytest.mark.multiprocess

WORLD = 2
NUM_SAMPLES, CHUNK = 103, 4  # 26 chunks, the last one short
SLOW_RANK = 1
WAIT = timedelta(seconds=60)


def _epoch(sampler: SharedCursorSampler, store: dist.Store, epoch: int, rank: int,
           slow: bool) -> dict:
    sampler.set_epoch(epoch)
    dist.barrier()  # both ranks start the epoch together
    indices = []
    for i in sampler:
        indices.append(i)
        if slow and len(indices) == CHUNK:  # one chunk done: stall until the fast rank is done
            store.wait([f"fast_done/{epoch}"], WAIT)
    if rank != SLOW_RANK:
        store.set(f"fast_done/{epoch}", "1")
    dist.barrier()
    return {"indices": indices, "claimed": sampler.claimed,
            "permutation": sampler.permutation().tolist()}


def cursor_cases(rank: int, world: int) -> dict:
    store = dist.PrefixStore("test_shared_cursor/", default_store())
    sampler = SharedCursorSampler(NUM_SAMPLES, CHUNK, store=store, key="run0", seed=7)
    return {
        # epoch 0: rank 1 is slow; epoch 1: nobody is; epoch 2: rank 1 slow again
        "epochs": [_epoch(sampler, store, e, rank, slow=rank == SLOW_RANK and e != 1)
                   for e in range(3)],
        "num_chunks": sampler.num_chunks,
    }


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    return spawn_ranks(cursor_cases, WORLD, Path(tmp_path_factory.mktemp("cursor")))


def test_every_index_exactly_once_per_epoch(results):
    for e in range(3):
        together = results[0]["epochs"][e]["indices"] + results[1]["epochs"][e]["indices"]
        assert sorted(together) == list(range(NUM_SAMPLES)), f"epoch {e}"
        claimed = [results[r]["epochs"][e]["claimed"] for r in range(WORLD)]
        assert sum(claimed) == results[0]["num_chunks"] == 26


def test_a_slow_rank_claims_fewer_chunks(results):
    for e in (0, 2):
        slow = results[SLOW_RANK]["epochs"][e]["claimed"]
        fast = results[1 - SLOW_RANK]["epochs"][e]["claimed"]
        assert slow <= 1 < fast, f"epoch {e}: slow rank {slow} chunks, fast rank {fast}"


def test_one_permutation_per_epoch_shared_by_the_ranks(results):
    perms = [[results[r]["epochs"][e]["permutation"] for e in range(3)] for r in range(WORLD)]
    assert perms[0] == perms[1]  # the same permutation on every rank
    assert len({tuple(p) for p in perms[0]}) == 3  # a different one every epoch
    for e in range(3):  # each rank's indices are whole chunks of that permutation, in order
        perm = perms[0][e]
        chunks = {tuple(perm[k:k + CHUNK]) for k in range(0, NUM_SAMPLES, CHUNK)}
        for r in range(WORLD):
            got = results[r]["epochs"][e]["indices"]
            assert {tuple(got[k:k + CHUNK]) for k in range(0, len(got), CHUNK)} <= chunks
