"""Straggler-resilient data: ranks draw batches from one shared permutation.

With a ``DistributedSampler`` every rank owns ``1/n`` of the data, so an epoch lasts as long as
the slowest rank needs for its share. :class:`SharedCursorSampler` instead hands out chunks of
one seeded permutation (the same on every rank) through an atomic counter in the c10d store
that the process group already has: a faster rank simply claims more chunks. An epoch ends when
the permutation is used up, and every sample is seen exactly once per epoch.

The sampler has no ``__len__`` (how many batches a rank gets is not known in advance), so
Lightning treats the training loader as having unknown length: the progress bar counts batches
without a total, and validation runs at the end of each epoch.

Example (inside an initialised process group; the strategy does this for you)::

    sampler = SharedCursorSampler(len(dataset), chunk_size=32, store=default_store(),
                                  key="run0", seed=0)
    loader = DataLoader(dataset, batch_size=32, sampler=sampler)
    for epoch in range(3):
        sampler.set_epoch(epoch)
        for batch in loader: ...
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.utils.data import Sampler

__all__ = ["SharedCursorSampler", "default_store"]


def default_store() -> dist.Store:
    """The key-value store of the default process group (created by ``init_process_group``)."""
    from torch.distributed import distributed_c10d

    store = distributed_c10d._get_default_store()
    return dist.PrefixStore("lightning_gossip/", store)


class SharedCursorSampler(Sampler[int]):
    """Yields indices chunk by chunk; chunks are claimed with an atomic shared counter.

    Args:
        num_samples: size of the dataset.
        chunk_size: indices claimed per counter increment; use the loader's batch size so
            that every batch is one claimed chunk.
        store: a c10d store shared by all ranks.
        key: a name unique to this run (and the same on every rank).
        shuffle: draw a fresh seeded permutation each epoch (else the natural order).
        seed: permutation seed; the epoch is mixed in, as ``DistributedSampler`` does.
    """

    def __init__(self, num_samples: int, chunk_size: int, store: dist.Store, key: str,
                 shuffle: bool = True, seed: int = 0) -> None:
        if num_samples < 1:
            raise ValueError(f"the dataset is empty (num_samples={num_samples})")
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        self.num_samples = int(num_samples)
        self.chunk_size = int(chunk_size)
        self.store = store
        self.key = key
        self.shuffle = shuffle
        self.seed = int(seed)
        self.epoch = 0
        #: number of chunks this rank claimed in the last (or current) epoch
        self.claimed = 0

    @property
    def num_chunks(self) -> int:
        return math.ceil(self.num_samples / self.chunk_size)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def permutation(self) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(self.num_samples)
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(self.num_samples, generator=g)

    def __iter__(self) -> Iterator[int]:
        perm = self.permutation()
        counter = f"{self.key}/epoch{self.epoch}"
        self.claimed = 0
        while True:
            chunk = int(self.store.add(counter, 1)) - 1
            if chunk >= self.num_chunks:
                return
            self.claimed += 1
            yield from perm[chunk * self.chunk_size:(chunk + 1) * self.chunk_size].tolist()
