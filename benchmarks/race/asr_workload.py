"""The race's ``asr`` workload: the ASR recipe's BLSTM-CTC model on the synthetic corpus.

Used by ``benchmarks/race/worker.py`` inside every rank. The model is the recipe's
:class:`~recipes.asr.recognizer.SpeechRecognizer` (its ``BLSTMAcousticModel``, CTC loss, AdamW
with linear warm-up; the peak rate is the case's, set by the race for every method by the same
rule, ``rules.case_lr``), sized by ``--asr-layers`` and
``--asr-hidden`` (default 2 x 256 per direction, frame stacking 4: 2.45 M parameters, 9.8 MB in
fp32). The corpus is ``python -m recipes.asr.synth``'s (espeak-ng), generated and cached by the
driver (``benchmarks/race/driver.py``); validation is greedy-decoding WER of the exact replica
average on its ``dev`` split (voices not in training), sharded over the ranks and summed.

An "epoch" of the race is a chunk of ``chunk`` training utterances (:class:`ChunkBatchSampler`):
the ranks validate at every epoch end, so every case, ``adpsgd`` included (whose ranks meet only
at epoch ends), is validated every ``chunk`` samples of all ranks together.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Sampler


class ChunkBatchSampler(Sampler[list[int]]):
    """Epoch ``e`` covers chunk ``e mod C`` of a permutation of the training set, in batches.

    The permutation (seeded) is redrawn every ``C`` epochs (``C`` = training set // ``chunk``),
    so ``C`` epochs make one pass over the data. Under ``ddp``/``dpsgd`` rank ``r`` takes the
    chunk's batches ``r, r + world, ...`` (:meth:`__iter__`); under ``adpsgd`` the strategy hands
    out :meth:`shared_batches` through its shared cursor (a faster rank takes more). Every rank
    computes the same chunk from ``(seed, epoch)``.
    """

    def __init__(self, num_samples: int, batch_size: int, chunk: int, *, rank: int, world: int,
                 seed: int = 0) -> None:
        self.num_samples, self.batch_size = num_samples, batch_size
        self.chunk = max(batch_size * world, chunk - chunk % (batch_size * world))
        self.rank, self.world, self.seed = rank, world, seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Called by Lightning (through :attr:`sampler`) and by the shared cursor before every
        epoch."""
        self.epoch = epoch

    @property
    def sampler(self) -> ChunkBatchSampler:
        """This sampler itself: Lightning calls ``set_epoch`` on ``loader.batch_sampler.sampler``
        only, never on the batch sampler. Without it every case not drawn through the library's
        shared cursor (ddp, its hooks, the periodic averagers, ``dpsgd``) trained on epoch 0's
        chunk again and again (the races before the race rules did)."""
        return self

    @property
    def chunks_per_pass(self) -> int:
        """Epochs per pass over the training set."""
        return max(1, self.num_samples // self.chunk)

    def shared_batches(self, epoch: int) -> list[list[int]]:
        """The batches of ``epoch`` for all ranks together (the same list on every rank)."""
        passes, part = divmod(epoch, self.chunks_per_pass)
        order = np.random.default_rng((self.seed, passes)).permutation(self.num_samples)
        chunk = order[part * self.chunk:(part + 1) * self.chunk]
        return [chunk[i:i + self.batch_size].tolist()
                for i in range(0, len(chunk), self.batch_size)]

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self.shared_batches(self.epoch)[self.rank::self.world])

    def __len__(self) -> int:
        return math.ceil(len(self.shared_batches(self.epoch)) / self.world)


def make_recognizer_class(meter_type: type) -> type:
    """``SpeechRecognizer`` whose epoch end runs the race's validation (after its ranks met)."""
    from recipes.asr.recognizer import SpeechRecognizer

    class RaceRecognizer(SpeechRecognizer):
        def on_train_epoch_end(self) -> None:
            super().on_train_epoch_end()
            meter = next((c for c in self.trainer.callbacks if isinstance(c, meter_type)), None)
            if meter is not None:
                meter.epoch_end(self.trainer, self)

    return RaceRecognizer


def load(spec: dict[str, Any], rank: int, world: int) -> dict[str, Any]:
    """Corpus, features (computed now, before any clock runs), CMVN statistics, dev shard."""
    from recipes.asr.datamodule import KaldiDataModule
    from recipes.asr.dataset import collate_examples

    corpus = Path(spec["asr"]["corpus"])
    data = KaldiDataModule(train_dir=str(corpus / "train"), val_dir=str(corpus / "dev"),
                           batch_size=int(spec["batch_size"]), cache_features=True,
                           cmvn_utterances=300, seed=0)
    data.setup("fit")
    train, dev = data.datasets["train"], data.datasets["val"]
    for i in range(len(train)):
        train.features(i)
    order = np.argsort(dev.num_frames(), kind="stable").tolist()
    batches = [order[i:i + 32] for i in range(0, len(order), 32)]
    dev_shard = [collate_examples([dev[i] for i in b]) for b in batches[rank::world]]
    return {"data": data, "train": train, "dev_shard": dev_shard, "cmvn": data.cmvn_stats(),
            "num_dev": len(dev), "num_train": len(train), "world": world}


def make_model(spec: dict[str, Any], workload: dict[str, Any], meter_type: type,
               lr: float | None = None) -> Any:
    """The recipe's recognizer at the race's size, CMVN set, from the common seed.

    ``lr`` is the case's peak rate as the race's tuning procedure set it (the per-learner rule
    already applied, for every method alike: ``rules.case_lr``), so the recipe's own rule
    is off here; None: ``spec['lr']``."""
    asr = spec["asr"]
    cls = make_recognizer_class(meter_type)
    model = cls(num_layers=int(asr["layers"]), hidden_size=int(asr["hidden"]),
                frame_stacking=int(asr["frame_stacking"]), dropout=0.1,
                spec_augment=bool(asr["spec_augment"]), optimizer="adam",
                lr=float(spec["lr"] if lr is None else lr), gossip_lr_rule="none",
                warmup_steps=int(asr["warmup_steps"]), **anneal(spec, workload))
    model.model.cmvn.set_stats(*workload["cmvn"])
    return model


def anneal(spec: dict[str, Any], workload: dict[str, Any]) -> dict[str, Any]:
    """The recipe's annealing options for ``spec['asr']['anneal_after_passes']``: a race epoch
    is one validation chunk, so the decay per pass is spread over the chunks of a pass.

    >>> anneal({"batch_size": 4, "eval_every": 160, "asr": {"anneal_after_passes": 2,
    ...         "anneal_per_pass": 0.25}}, {"num_train": 1600, "world": 4})
    {'anneal_start_epoch': 20, 'anneal_factor': 0.8705505632961241}
    >>> anneal({"asr": {}}, {})
    {'anneal_start_epoch': None}
    """
    asr = spec["asr"]
    if asr.get("anneal_after_passes") is None:
        return {"anneal_start_epoch": None}
    sampler = ChunkBatchSampler(workload["num_train"], int(spec["batch_size"]),
                                int(spec["eval_every"]), rank=0, world=int(workload["world"]))
    chunks = sampler.chunks_per_pass
    return {"anneal_start_epoch": round(float(asr["anneal_after_passes"]) * chunks),
            "anneal_factor": float(asr["anneal_per_pass"]) ** (1.0 / chunks)}


def loader(spec: dict[str, Any], workload: dict[str, Any], rank: int, world: int) -> DataLoader:
    """Training batches: chunks of ``eval_every`` utterances (one race epoch each), in the
    order of the run's seed (``spec['seed']``)."""
    from functools import partial

    from recipes.asr.dataset import collate_examples

    sampler = ChunkBatchSampler(workload["num_train"], int(spec["batch_size"]),
                                int(spec["eval_every"]), rank=rank, world=world,
                                seed=int(spec.get("seed", 0)))
    return DataLoader(workload["train"], batch_sampler=sampler,
                      collate_fn=partial(collate_examples, frame_targets=False))


def wer(net: torch.nn.Module, workload: dict[str, Any], vocabulary: Any,
        group: dist.ProcessGroup) -> float:
    """WER, %, of ``net`` on the whole dev set: this rank's shard, errors summed over ranks."""
    import jiwer

    net.eval()
    errors = words = 0
    with torch.no_grad():
        for batch in workload["dev_shard"]:
            logits, lengths = net(batch.features, batch.lengths)
            hyps = vocabulary.greedy_decode(logits.log_softmax(-1), lengths)
            out = jiwer.process_words(list(batch.texts), hyps)
            errors += out.substitutions + out.deletions + out.insertions
            words += out.hits + out.substitutions + out.deletions
    counts = torch.tensor([errors, words], dtype=torch.int64)
    dist.all_reduce(counts, group=group)
    return 100.0 * float(counts[0]) / max(1, int(counts[1]))
