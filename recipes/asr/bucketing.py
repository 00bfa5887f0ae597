"""Length-bucketed batches, sharded over ranks so every rank gets the same number of batches.

Under ``adpsgd`` the batches are shared instead of sharded: the sampler implements
:class:`~lightning_gossip.cursor.batches.SharedBatches` (``shared_batches(epoch)`` lists the
epoch's batches for all ranks, the same on every rank), and the strategy hands them out one at
a time, so faster ranks take more of them.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import numpy as np
from torch.utils.data import Sampler

#: entropy word that separates the shared batch order's random stream from every rank's
SHARED_STREAM = 1 << 20


class LengthBucketBatchSampler(Sampler[list[int]]):
    """Yields lists of dataset indices whose utterances have similar lengths.

    The sampler does its own sharding over ``num_replicas`` ranks (so the trainer must run
    with ``use_distributed_sampler=False``) and guarantees that every rank gets the same
    number of batches in every epoch, which synchronous decentralized training needs.

    * Training (``shuffle=True``): each epoch the indices are permuted with
      ``seed + epoch`` (the same on every rank), padded by repetition to a multiple of the
      world size and dealt out round robin. Each rank sorts pools of
      ``batch_size * pool_multiplier`` utterances by length, cuts them into batches and
      shuffles the batch order.
    * Evaluation (``shuffle=False``): indices are sorted by length and dealt out without
      repetition, so every utterance is scored exactly once; shards differ by at most one
      utterance and are split into the same number of batches (a batch may then be empty,
      in the rare case that a rank has fewer utterances than batches).

    * Shared (:meth:`shared_batches`, used by ``adpsgd``): all utterances, each exactly once
      (no padding), permuted with ``seed + epoch``, cut into pools that are sorted by length
      and into batches; the batch order is shuffled with the seed and the epoch only. Every
      rank lists the same batches; a batch has the per-rank ``batch_size`` as in training.

    ``batch_size`` counts utterances. Optional batch-size warmup: over the first
    ``warmup_epochs`` epochs the batch size grows linearly from ``initial_batch_size``.

    Lightning calls ``set_epoch`` at the start of every training epoch (through
    :attr:`sampler`, as it does for the sampler inside a batch sampler).
    """

    def __init__(self, lengths: Sequence[int], batch_size: int, *, num_replicas: int = 1,
                 rank: int = 0, shuffle: bool = True, seed: int = 0, pool_multiplier: int = 50,
                 warmup_epochs: int = 0, initial_batch_size: int | None = None) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} is not in [0, {num_replicas})")
        if len(lengths) < num_replicas:
            raise ValueError(f"{len(lengths)} utterances cannot be shared by {num_replicas} ranks")
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self._batch_size = batch_size
        self.num_replicas, self.rank = num_replicas, rank
        self.shuffle, self.seed = shuffle, seed
        self.pool_multiplier = pool_multiplier
        self.warmup_epochs = warmup_epochs
        self.initial_batch_size = initial_batch_size or batch_size
        self.epoch = 0

    @property
    def sampler(self) -> LengthBucketBatchSampler:
        """This sampler itself: Lightning calls ``loader.batch_sampler.sampler.set_epoch``."""
        return self

    def set_epoch(self, epoch: int) -> None:
        """Called by Lightning at the start of every training epoch."""
        self.epoch = epoch

    def batch_size_at(self, epoch: int) -> int:
        """Utterances per batch and rank in ``epoch`` (after warmup: ``batch_size``)."""
        if epoch >= self.warmup_epochs:
            return self._batch_size
        frac = epoch / self.warmup_epochs
        return max(1, round(self.initial_batch_size + frac * (self._batch_size
                                                              - self.initial_batch_size)))

    def _bucket(self, indices: np.ndarray, size: int) -> list[list[int]]:
        """Sort pools of ``size * pool_multiplier`` indices by length and cut them into batches."""
        batches: list[list[int]] = []
        pool = size * self.pool_multiplier
        for start in range(0, len(indices), pool):
            chunk = indices[start:start + pool]
            chunk = chunk[np.argsort(self.lengths[chunk], kind="stable")]
            batches.extend(chunk[i:i + size].tolist() for i in range(0, len(chunk), size))
        return batches

    def _batches(self) -> list[list[int]]:
        size = self.batch_size_at(self.epoch)
        n = len(self.lengths)
        if not self.shuffle:
            order = np.argsort(self.lengths, kind="stable")
            shard = order[self.rank::self.num_replicas]
            num_batches = math.ceil(math.ceil(n / self.num_replicas) / size)
            return [chunk.tolist() for chunk in np.array_split(shard, num_batches)]
        rng = np.random.default_rng(self.seed + self.epoch)
        order = rng.permutation(n)
        total = math.ceil(n / self.num_replicas) * self.num_replicas
        order = np.concatenate([order, order[: total - n]])
        batches = self._bucket(order[self.rank::self.num_replicas], size)
        rank_rng = np.random.default_rng((self.seed, self.epoch, self.rank))
        return [batches[i] for i in rank_rng.permutation(len(batches))]

    def shared_batches(self, epoch: int) -> list[list[int]]:
        """Every batch of ``epoch`` for all ranks together, the same list on every rank.

        Each utterance exactly once; batches of ``batch_size_at(epoch)`` utterances (for
        evaluation: the length-sorted utterances in batches of about ``batch_size``).
        """
        size = self.batch_size_at(epoch)
        n = len(self.lengths)
        if not self.shuffle:
            order = np.argsort(self.lengths, kind="stable")
            return [chunk.tolist() for chunk in np.array_split(order, math.ceil(n / size))]
        order = np.random.default_rng(self.seed + epoch).permutation(n)
        batches = self._bucket(order, size)
        shared_rng = np.random.default_rng((self.seed, epoch, SHARED_STREAM))
        return [batches[i] for i in shared_rng.permutation(len(batches))]

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self._batches())

    def __len__(self) -> int:
        size = self.batch_size_at(self.epoch)
        per_rank = math.ceil(len(self.lengths) / self.num_replicas)
        if not self.shuffle:
            return math.ceil(per_rank / size)
        pool = size * self.pool_multiplier
        full, rest = divmod(per_rank, pool)
        return full * math.ceil(pool / size) + math.ceil(rest / size)
