"""The Lightning side of an elastic ``DPSGDStrategy(elastic=True)`` fit, whose rounds are
:class:`~lightning_gossip.elastic.rounds.ElasticRounds`: the trainer's checks and
:class:`EpochHooks` (put first in the trainer's callbacks by :func:`attach`), the training
loader drawn from the shared cursor (:func:`training_loader`) and the epoch's end
(:func:`end_epoch`).
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.trainer.states import RunningStage
from typing_extensions import override

from lightning_gossip import _compat
from lightning_gossip.cursor.resume import CursorResume
from lightning_gossip.elastic.rounds import ElasticRounds
from lightning_gossip.hierarchy import NodeLayout
from lightning_gossip.strategies.collectives import Watched, share_epoch_values
from lightning_gossip.strategies.shared_loader import shared_training_loader

__all__ = ["EpochHooks", "attach", "end_epoch", "training_loader"]


def training_loader(rounds: ElasticRounds, cursor: CursorResume, dataloader: object,
                    trainer: pl.Trainer, seed: int, node: NodeLayout | None = None) -> object:
    """A training loader rebuilt to draw from the shared cursor (``cursor``), its claims
    tracked so that a lost rank's untrained batches go back (as ``adpsgd``'s); others as they
    are. ``node``: hierarchical, the fit's layout: the node claims as one, its ranks waiting at
    an epoch's end in lockstep (each wait is a gossip-only round, a node collective)."""
    if trainer.state.stage != RunningStage.TRAINING:
        return dataloader
    ledger = rounds.survivors.ledger(f"{rounds.run}/ledger", on_wait=rounds.wait_round,
                                     lockstep=True)
    return shared_training_loader(
        cursor, dataloader, key=f"{rounds.run}/cursor", seed=seed, node=node, ledger=ledger,
        epoch=trainer.fit_loop.epoch_progress.current.processed)


def end_epoch(rounds: ElasticRounds, trainer: pl.Trainer, watched: Watched) -> None:
    """At the epoch's end: :meth:`~lightning_gossip.elastic.rounds.ElasticRounds.settle`.
    Lightning steps the epoch's schedulers and validates after an epoch's last batch, so a rank
    whose epoch had none (fewer batches left than ranks, a newcomer admitted as the shared
    cursor ran out) does both here: the others validate after settling with it. Then every
    rank: a rank without a batch takes part in the epoch-end reductions of what the others
    logged (:func:`~.collectives.share_epoch_values`)."""
    rounds.settle(trainer.current_epoch)
    if not (rounds.batches or rounds.epoch_end_restored):
        _compat.end_epoch_without_batches(trainer)
        if _compat.validation_due(trainer):
            _compat.validate_now(trainer)
    share_epoch_values(trainer, rounds.batches > 0, watched)


def attach(rounds: ElasticRounds, trainer: pl.Trainer, watched: Watched) -> None:
    """Check the trainer (``ValueError`` for what an elastic ``dpsgd`` fit cannot support)
    and put ``rounds``' :class:`EpochHooks` first in its callbacks (once; ``watched``: the
    strategy's watched wait, for the epoch-end reductions)."""
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
        trainer.callbacks.insert(0, EpochHooks(rounds, watched))


class EpochHooks(Callback):
    """Lightning's side of :class:`~lightning_gossip.elastic.rounds.ElasticRounds`: an epoch
    opens, a batch is trained, the ranks settle before validation during ``fit`` and at the
    epoch's end."""

    def __init__(self, rounds: ElasticRounds, watched: Watched) -> None:
        self.rounds = rounds
        self.watched = watched

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.rounds.resumed(_compat.epoch_end_restored(trainer))

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.rounds.open_epoch(trainer.current_epoch)

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           outputs: Any, batch: Any, batch_idx: int) -> None:
        self.rounds.batch_trained(trainer.current_epoch)

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.state.fn == "fit" and not trainer.sanity_checking:
            self.rounds.settle(trainer.current_epoch)

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        end_epoch(self.rounds, trainer, self.watched)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                     exception: BaseException) -> None:
        self.rounds.interrupted()
