"""The ASR race's chunk sampler (``benchmarks/race/asr_workload.ChunkBatchSampler``) moves on to
the next chunk every epoch when Lightning drives it.

Lightning calls ``set_epoch`` on ``loader.batch_sampler.sampler`` only, never on the batch
sampler itself; before the sampler exposed itself as ``.sampler`` every case not drawn through
the library's shared cursor (ddp, its hooks, the periodic averagers, ``dpsgd``) trained on
epoch 0's chunk again and again, while ``adpsgd`` (whose shared cursor sets the epoch) saw the
whole training set.
"""

from __future__ import annotations

from lightning.fabric.utilities.data import _set_sampler_epoch
from torch.utils.data import DataLoader

from benchmarks.race.asr_workload import ChunkBatchSampler


def test_lightning_s_set_epoch_reaches_the_chunk_sampler() -> None:
    sampler = ChunkBatchSampler(1600, 4, 160, rank=0, world=4)
    loader = DataLoader(list(range(1600)), batch_sampler=sampler)
    seen = set()
    for epoch in range(10):  # one pass: 10 chunks of 160
        _set_sampler_epoch(loader, epoch)  # what Lightning's fit loop does before each epoch
        assert sampler.epoch == epoch
        for rank in range(4):
            part = ChunkBatchSampler(1600, 4, 160, rank=rank, world=4)
            part.set_epoch(epoch)
            seen.update(i for batch in part for i in batch)
    assert seen == set(range(1600))  # every utterance once per pass, not chunk 0 ten times


def test_ranks_split_a_chunk_and_the_shared_list_is_the_same() -> None:
    parts = []
    for rank in range(4):
        s = ChunkBatchSampler(1600, 4, 160, rank=rank, world=4)
        s.set_epoch(7)
        parts.append([i for batch in s for i in batch])
    union = sorted(i for part in parts for i in part)
    shared = ChunkBatchSampler(1600, 4, 160, rank=0, world=4).shared_batches(7)
    assert union == sorted(i for batch in shared for i in batch) and len(union) == 160
