"""LightningModule: BLSTM acoustic model trained with CTC on characters or frame CE on senones."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor
from torchmetrics.classification import MulticlassAccuracy
from torchmetrics.text import WordErrorRate

from recipes.asr.dataset import IGNORE_INDEX, Batch
from recipes.asr.features import SpecAugment
from recipes.asr.model import BLSTMAcousticModel
from recipes.asr.schedule import gossip_learners, gossip_lr_multiplier, lr_factor
from recipes.asr.scoring import REPORT_NAME, write_report
from recipes.asr.vocabulary import BLANK, CharacterVocabulary

Target = Literal["ctc", "frame_ce"]


def subsample_frame_targets(targets: Tensor, factor: int) -> Tensor:
    """Frame targets at the rate of the stacked frames: the label of each group's middle frame."""
    if factor == 1:
        return targets
    pad = (-targets.shape[1]) % factor
    if pad:
        targets = F.pad(targets, (0, pad), value=IGNORE_INDEX)
    return targets[:, factor // 2::factor]


class SpeechRecognizer(LightningModule):
    """Acoustic model training, WER/frame-accuracy evaluation and transcription.

    An ordinary LightningModule with no knowledge of how gradients or weights are combined
    across ranks, so it runs under ``ddp``, ``dpsgd`` and ``adpsgd`` alike.

    Args:
        input_dim: feature dimension (linked from the data module by the CLI).
        characters: CTC spelling units besides blank and space (linked from the data module).
        target: ``"ctc"`` (characters; WER is reported) or ``"frame_ce"`` (per-frame senone
            cross entropy on Kaldi alignments; frame accuracy is reported).
        num_pdfs: number of senones for ``frame_ce``.
        num_layers, hidden_size, bottleneck_dim, dropout, frame_stacking: see
            :class:`~recipes.asr.model.BLSTMAcousticModel`.
        spec_augment: mask frequency bands and time spans in training.
        optimizer: ``"adam"`` or ``"sgd"`` (with ``momentum``, Nesterov).
        lr: peak learning rate as found under ``ddp``; schedule: see
            :func:`~recipes.asr.schedule.lr_factor`.
        gossip_lr_rule: ``"auto"``: under ``dpsgd``/``adpsgd`` with Adam the peak rate is
            ``lr * sqrt(learners)`` (SGD keeps ``lr``), see
            :func:`~recipes.asr.schedule.gossip_lr_multiplier`; ``"none"``: ``lr`` as given.
        report_dir: where the test report goes; default: the trainer's log directory.
    """

    def __init__(
        self,
        input_dim: int = 40,
        characters: str = "abcdefghijklmnopqrstuvwxyz'",
        target: Target = "ctc",
        num_pdfs: int | None = None,
        num_layers: int = 4,
        hidden_size: int = 256,
        bottleneck_dim: int | None = None,
        dropout: float = 0.1,
        frame_stacking: int = 3,
        spec_augment: bool = True,
        freq_masks: int = 2,
        freq_width: int = 8,
        time_masks: int = 2,
        time_width: int = 20,
        optimizer: Literal["adam", "sgd"] = "adam",
        lr: float = 1e-3,
        gossip_lr_rule: Literal["auto", "none"] = "auto",
        momentum: float = 0.9,
        weight_decay: float = 0.0,
        warmup_steps: int = 0,
        warmup_start: float = 0.1,
        anneal_start_epoch: int | None = None,
        anneal_factor: float = 0.5**0.5,
        report_dir: str | None = None,
        report_examples: int = 8,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.vocabulary = CharacterVocabulary(characters)
        if target == "frame_ce":
            if not num_pdfs:
                raise ValueError("target='frame_ce' needs num_pdfs (the number of senones)")
            num_targets = num_pdfs
        else:
            num_targets = len(self.vocabulary)
        augment = SpecAugment(freq_masks, freq_width, time_masks, time_width) if spec_augment \
            else None
        self.model = BLSTMAcousticModel(
            input_dim, num_targets, num_layers=num_layers, hidden_size=hidden_size,
            bottleneck_dim=bottleneck_dim, dropout=dropout, frame_stacking=frame_stacking,
            spec_augment=augment)
        if target == "ctc":
            self.val_wer, self.test_wer = WordErrorRate(), WordErrorRate()
        else:
            kwargs = dict(num_classes=num_targets, average="micro", ignore_index=IGNORE_INDEX)
            self.val_acc = MulticlassAccuracy(**kwargs)
            self.test_acc = MulticlassAccuracy(**kwargs)
        self._test_records: list[tuple[str, str, str]] = []
        self.test_report: dict[str, Any] | None = None
        self._epoch_batches = 0
        #: training batches this rank processed in the last finished training epoch
        self.last_epoch_batches: int | None = None

    # ---- set-up --------------------------------------------------------------------------
    def setup(self, stage: str) -> None:
        """Take global CMVN statistics from the training data unless a checkpoint brings them."""
        if bool(self.model.cmvn.initialized):
            return
        datamodule = getattr(self.trainer, "datamodule", None) if self._trainer else None
        stats = getattr(datamodule, "cmvn_stats", None)
        if callable(stats) and (stage == "fit" or getattr(datamodule, "train_dir", None)):
            self.model.cmvn.set_stats(*stats())
        elif stage == "fit":
            rank_zero_warn("no CMVN statistics available: features are not normalized")

    def peak_lr(self) -> float:
        """``lr`` times the gossip rule's factor for the trainer's strategy (``lr`` without one)."""
        hp = self.hparams
        learners = 1
        if self._trainer is not None:
            learners = gossip_learners(self.trainer.strategy, self.trainer.world_size)
        return hp.lr * gossip_lr_multiplier(hp.optimizer, learners, hp.gossip_lr_rule)

    def configure_optimizers(self) -> dict[str, Any]:
        hp = self.hparams
        lr = self.peak_lr()
        if lr != hp.lr:
            rank_zero_info(f"peak learning rate {lr:g} (model.lr {hp.lr:g} x "
                           f"{lr / hp.lr:g}: Adam under gossip, gossip_lr_rule="
                           f"{hp.gossip_lr_rule!r})")
        if hp.optimizer == "sgd":
            opt: torch.optim.Optimizer = torch.optim.SGD(
                self.parameters(), lr=lr, momentum=hp.momentum, nesterov=hp.momentum > 0,
                weight_decay=hp.weight_decay)
        else:
            opt = torch.optim.AdamW(self.parameters(), lr=lr, weight_decay=hp.weight_decay)

        def factor(step: int) -> float:
            return lr_factor(step, self.current_epoch, warmup_steps=hp.warmup_steps,
                             warmup_start=hp.warmup_start,
                             anneal_start_epoch=hp.anneal_start_epoch,
                             anneal_factor=hp.anneal_factor)

        schedule = torch.optim.lr_scheduler.LambdaLR(opt, factor)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    # ---- forward and losses --------------------------------------------------------------
    def forward(self, features: Tensor, lengths: Tensor) -> tuple[Tensor, Tensor]:
        """Log-probabilities ``(B, T', units)`` and output lengths."""
        logits, out_lengths = self.model(features, lengths)
        return logits.log_softmax(dim=-1), out_lengths

    def _loss(self, batch: Batch) -> tuple[Tensor, Tensor, Tensor]:
        log_probs, out_lengths = self(batch.features, batch.lengths)
        if self.hparams.target == "ctc":
            loss = F.ctc_loss(log_probs.transpose(0, 1).float(), batch.targets,
                              out_lengths, batch.target_lengths, blank=BLANK,
                              reduction="mean", zero_infinity=True)
        else:
            targets = subsample_frame_targets(batch.targets, self.model.frame_stacking)
            loss = F.cross_entropy(log_probs.flatten(0, 1), targets.flatten(),
                                   ignore_index=IGNORE_INDEX)
        return loss, log_probs, out_lengths

    def on_train_epoch_start(self) -> None:
        """Start counting this rank's training batches of the epoch."""
        self._epoch_batches = 0

    def training_step(self, batch: Batch, batch_idx: int) -> Tensor:
        self._epoch_batches += 1
        loss, _, _ = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True, batch_size=len(batch))
        return loss

    def on_train_epoch_end(self) -> None:
        """Keep the epoch's batch count (reported next to the test WER, see ``wer.json``)."""
        self.last_epoch_batches = self._epoch_batches

    # ---- evaluation ----------------------------------------------------------------------
    def _evaluate(self, batch: Batch, stage: str) -> list[str] | None:
        loss, log_probs, out_lengths = self._loss(batch)
        self.log(f"{stage}_loss", loss, sync_dist=True, batch_size=len(batch))
        if self.hparams.target == "ctc":
            hyps = self.vocabulary.greedy_decode(log_probs, out_lengths)
            metric = self.val_wer if stage == "val" else self.test_wer
            metric.update(hyps, batch.texts)
            self.log(f"{stage}_wer", metric, prog_bar=True, batch_size=len(batch))
            return hyps
        targets = subsample_frame_targets(batch.targets, self.model.frame_stacking)
        metric = self.val_acc if stage == "val" else self.test_acc
        metric.update(log_probs.argmax(-1).flatten(), targets.flatten())
        self.log(f"{stage}_frame_acc", metric, prog_bar=True, batch_size=len(batch))
        return None

    def validation_step(self, batch: Batch, batch_idx: int) -> None:
        if len(batch):
            self._evaluate(batch, "val")

    def on_test_epoch_start(self) -> None:
        self._test_records = []

    def test_step(self, batch: Batch, batch_idx: int) -> None:
        if not len(batch):
            return
        hyps = self._evaluate(batch, "test")
        if hyps is not None:
            self._test_records.extend(zip(batch.utt_ids, batch.texts, hyps))

    def on_test_epoch_end(self) -> None:
        if self.hparams.target != "ctc":
            return
        records = self._test_records
        batches = [self.last_epoch_batches]
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            gathered: list[tuple[list[tuple[str, str, str]], int | None]] = [
                ([], None) for _ in range(dist.get_world_size())]
            dist.all_gather_object(gathered, (records, self.last_epoch_batches))
            records = [r for part, _ in gathered for r in part]
            batches = [n for _, n in gathered]
        if self.global_rank != 0:
            return
        out_dir = Path(self.hparams.report_dir or self.trainer.log_dir or ".")
        extra = {}
        if any(n is not None for n in batches):  # tested right after fitting
            extra["train_batches_last_epoch"] = batches
        self.test_report = write_report(records, out_dir, num_examples=self.hparams.report_examples,
                                        extra=extra)
        self.test_report["report"] = str(out_dir / REPORT_NAME)
        rank_zero_info(f"test WER {100 * self.test_report['wer']:.2f}% on "
                       f"{self.test_report['utterances']} utterances; report: "
                       f"{out_dir / REPORT_NAME}")

    # ---- transcription -------------------------------------------------------------------
    def predict_step(self, batch: Batch, batch_idx: int) -> list[tuple[str, str]]:
        """``(utt_id, transcript)`` per utterance; with ``frame_ce`` the best senone ids."""
        if not len(batch):
            return []
        log_probs, out_lengths = self(batch.features, batch.lengths)
        if self.hparams.target == "ctc":
            return list(zip(batch.utt_ids, self.vocabulary.greedy_decode(log_probs, out_lengths)))
        best = log_probs.argmax(-1).cpu()
        return [(u, " ".join(str(int(p)) for p in row[:n]))
                for u, row, n in zip(batch.utt_ids, best, out_lengths.tolist())]
