"""Lightning's side of an elastic ``dpsgd`` fit's rounds (:class:`~.dpsgd_elastic.
ElasticRounds`): :func:`attach` checks the trainer and puts :class:`EpochHooks` first in its
callbacks: an epoch opens, a batch is trained, the ranks settle before validation during ``fit``
and at the epoch's end."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from typing_extensions import override

from lightning_gossip import _compat

if TYPE_CHECKING:
    from lightning_gossip.strategies.dpsgd_elastic import ElasticRounds

__all__ = ["EpochHooks", "attach"]


def attach(rounds: ElasticRounds, trainer: pl.Trainer) -> None:
    """Check the trainer (``ValueError`` for what an elastic ``dpsgd`` fit cannot support)
    and put ``rounds``' :class:`EpochHooks` first in its callbacks (once)."""
    if trainer.val_check_interval != 1.0:
        raise ValueError(
            "DPSGDStrategy(elastic=True) validates at epoch ends only (the ranks share the "
            "epoch's batches, so they may train different numbers of them); got "
            f"val_check_interval={trainer.val_check_interval}. Use "
            "check_val_every_n_epoch.")
    for cb in trainer.checkpoint_callbacks:
        if isinstance(cb, ModelCheckpoint) and _compat.checkpoints_within_epoch(cb):
            raise ValueError(
                "DPSGDStrategy(elastic=True) checkpoints at epoch ends and validations only; "
                "ModelCheckpoint(every_n_train_steps / train_time_interval) is not supported.")
    if not any(isinstance(cb, EpochHooks) for cb in trainer.callbacks):
        trainer.callbacks.insert(0, EpochHooks(rounds))


class EpochHooks(Callback):
    """Lightning's side of :class:`~.dpsgd_elastic.ElasticRounds` (see the module
    docstring)."""

    def __init__(self, rounds: ElasticRounds) -> None:
        self.rounds = rounds

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.rounds.epoch_end_restored = _compat.epoch_end_restored(trainer)

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.rounds.in_epoch, self.rounds.batches, self.rounds.epoch_end_restored = True, 0, False
        self.rounds.survivors.epoch_opened(trainer.current_epoch)

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           outputs: Any, batch: Any, batch_idx: int) -> None:
        self.rounds.batches += 1
        self.rounds.survivors.batch_trained(trainer.current_epoch)

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.state.fn == "fit" and not trainer.sanity_checking:
            self.rounds.settle(trainer.current_epoch)

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.rounds.end_epoch(trainer)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                     exception: BaseException) -> None:
        self.rounds.in_epoch = False  # a later validate / test meets the others
