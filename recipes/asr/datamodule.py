"""LightningDataModule over Kaldi data directories with length-bucketed, rank-sharded batches."""

from __future__ import annotations

import warnings
from functools import partial
from typing import Literal

import numpy as np
from lightning.pytorch import LightningDataModule
from torch import Tensor
from torch.utils.data import DataLoader

from recipes.asr.bucketing import LengthBucketBatchSampler
from recipes.asr.dataset import UtteranceDataset, collate_examples
from recipes.asr.features import accumulate_stats
from recipes.asr.kaldi_data import DataDirError, Utterance, load_data_dir, read_alignments
from recipes.asr.vocabulary import CharacterVocabulary


class KaldiDataModule(LightningDataModule):
    """Train/validation/test/predict data from Kaldi data directories.

    Batches are made by :class:`~recipes.asr.bucketing.LengthBucketBatchSampler`, which shards
    over ranks itself, so the trainer runs with ``use_distributed_sampler=False`` (the CLI sets
    this default). Under ``adpsgd`` the training batches are shared instead: the strategy
    hands the sampler's ``shared_batches(epoch)`` out one at a time, so faster ranks take more.

    Args:
        train_dir, val_dir, test_dir, predict_dir: Kaldi data directories.
        target: ``"ctc"`` (character transcripts) or ``"frame_ce"`` (senone alignments).
        characters: CTC spelling units (see :class:`~recipes.asr.vocabulary.CharacterVocabulary`).
        train_alignments, val_alignments, test_alignments: Kaldi text alignments
            (``utt-id pdf pdf ...``) for ``frame_ce``.
        num_pdfs: number of senones for ``frame_ce``.
        num_mel_bins, deltas, sample_rate: features (see
            :func:`~recipes.asr.features.compute_fbank`).
        allow_pipes: run ``wav.scp`` pipe commands (off unless asked for).
        batch_size: utterances per batch and rank; ``eval_batch_size`` for evaluation.
        batch_size_warmup_epochs, initial_batch_size: grow the batch size linearly from
            ``initial_batch_size`` over the first epochs (needs
            ``trainer.reload_dataloaders_every_n_epochs=1`` to change the number of batches).
        max_duration: training utterances longer than this (seconds) are skipped.
        cmvn_utterances: how many training utterances (a fixed random subset, the same on
            every rank) the global CMVN statistics are computed from.
        cache_features: keep features in memory after the first epoch.
    """

    def __init__(
        self,
        train_dir: str | None = None,
        val_dir: str | None = None,
        test_dir: str | None = None,
        predict_dir: str | None = None,
        target: Literal["ctc", "frame_ce"] = "ctc",
        characters: str = "abcdefghijklmnopqrstuvwxyz'",
        train_alignments: str | None = None,
        val_alignments: str | None = None,
        test_alignments: str | None = None,
        num_pdfs: int | None = None,
        sample_rate: int = 16000,
        num_mel_bins: int = 40,
        deltas: bool = False,
        allow_pipes: bool = False,
        batch_size: int = 16,
        eval_batch_size: int | None = None,
        batch_size_warmup_epochs: int = 0,
        initial_batch_size: int | None = None,
        max_duration: float | None = None,
        cmvn_utterances: int = 500,
        num_workers: int = 0,
        cache_features: bool = False,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.train_dir, self.val_dir, self.test_dir = train_dir, val_dir, test_dir
        self.predict_dir = predict_dir
        self.vocabulary = CharacterVocabulary(characters)
        self.datasets: dict[str, UtteranceDataset] = {}

    # ---- loading -------------------------------------------------------------------------
    def _dataset(self, split: str) -> UtteranceDataset:
        if split in self.datasets:
            return self.datasets[split]
        hp = self.hparams
        path = {"train": hp.train_dir, "val": hp.val_dir, "test": hp.test_dir,
                "predict": hp.predict_dir}[split]
        if path is None:
            raise ValueError(f"no data directory given for {split} (data.{split}_dir)")
        utterances, _ = load_data_dir(path, sample_rate=hp.sample_rate, allow_pipes=hp.allow_pipes,
                                      require_text=split != "predict")
        if split != "predict":
            utterances = self._usable(utterances, path, split)
        alignments = None
        if hp.target == "frame_ce" and split != "predict":
            ali_path = {"train": hp.train_alignments, "val": hp.val_alignments,
                        "test": hp.test_alignments}[split]
            if ali_path is None:
                raise ValueError(f"target 'frame_ce' needs data.{split}_alignments")
            alignments = read_alignments(ali_path)
            self._check_alignments(alignments, ali_path)
            missing = [u for u in utterances if u.utt_id not in alignments]
            if missing:
                warnings.warn(f"{ali_path}: no alignment for {len(missing)} utterance(s) of "
                              f"{path} (e.g. {missing[0].utt_id}); skipped them", stacklevel=2)
                utterances = [u for u in utterances if u.utt_id in alignments]
        if not utterances:
            raise DataDirError(f"{path}: no usable utterances")
        self.datasets[split] = UtteranceDataset(
            utterances, self.vocabulary, sample_rate=hp.sample_rate,
            num_mel_bins=hp.num_mel_bins, deltas=hp.deltas, allow_pipes=hp.allow_pipes,
            alignments=alignments, cache=hp.cache_features)
        return self.datasets[split]

    def _usable(self, utterances: list[Utterance], path: str, split: str) -> list[Utterance]:
        """Drop utterances with nothing left to recognize after normalization, or too long."""
        hp = self.hparams
        kept, empty, long = [], 0, 0
        for u in utterances:
            if hp.target == "ctc" and not self.vocabulary.normalize(u.text):
                empty += 1
            elif (split == "train" and hp.max_duration is not None and u.num_samples is not None
                  and u.num_samples > hp.max_duration * hp.sample_rate):
                long += 1
            else:
                kept.append(u)
        if empty or long:
            warnings.warn(f"{path}: skipped {empty} utterance(s) whose transcript is empty after "
                          f"normalization and {long} longer than {hp.max_duration} s",
                          stacklevel=2)
        return kept

    def _check_alignments(self, alignments: dict[str, np.ndarray], path: str) -> None:
        limit = self.hparams.num_pdfs
        if limit is None:
            raise ValueError("target 'frame_ce' needs data.num_pdfs")
        for utt_id, pdfs in alignments.items():
            if len(pdfs) and int(pdfs.max()) >= limit:
                raise DataDirError(f"{path}: {utt_id} has pdf id {int(pdfs.max())} but "
                                   f"num_pdfs is {limit}")

    def setup(self, stage: str) -> None:
        splits = {"fit": ["train", "val"], "validate": ["val"], "test": ["test"],
                  "predict": ["predict"]}[stage]
        for split in splits:
            if split == "val" and self.hparams.val_dir is None:
                continue
            self._dataset(split)

    # ---- CMVN ----------------------------------------------------------------------------
    def cmvn_stats(self) -> tuple[float, Tensor, Tensor]:
        """Frame count, sum and sum of squares of features over a fixed training subset."""
        dataset = self._dataset("train")
        n = min(self.hparams.cmvn_utterances, len(dataset))
        picks = np.random.default_rng(self.hparams.seed).choice(len(dataset), n, replace=False)
        return accumulate_stats([dataset.features(int(i)) for i in sorted(picks)])

    # ---- loaders -------------------------------------------------------------------------
    def _world(self) -> tuple[int, int]:
        if self.trainer is None:
            return 1, 0
        return self.trainer.world_size, self.trainer.global_rank

    def _loader(self, split: str, shuffle: bool) -> DataLoader:
        hp = self.hparams
        dataset = self._dataset(split)
        world_size, rank = self._world()
        size = hp.batch_size if shuffle else (hp.eval_batch_size or hp.batch_size)
        sampler = LengthBucketBatchSampler(
            dataset.num_frames(), size, num_replicas=world_size, rank=rank, shuffle=shuffle,
            seed=hp.seed, warmup_epochs=hp.batch_size_warmup_epochs if shuffle else 0,
            initial_batch_size=hp.initial_batch_size)
        if shuffle and self.trainer is not None:
            sampler.set_epoch(self.trainer.current_epoch)
        frame_targets = hp.target == "frame_ce" and split != "predict"
        return DataLoader(dataset, batch_sampler=sampler, num_workers=hp.num_workers,
                          collate_fn=partial(collate_examples, frame_targets=frame_targets),
                          persistent_workers=hp.num_workers > 0)

    def train_dataloader(self) -> DataLoader:
        return self._loader("train", shuffle=True)

    def val_dataloader(self) -> DataLoader | list:
        if self.hparams.val_dir is None:
            return []  # no validation
        return self._loader("val", shuffle=False)

    def test_dataloader(self) -> DataLoader:
        return self._loader("test", shuffle=False)

    def predict_dataloader(self) -> DataLoader:
        return self._loader("predict", shuffle=False)
