"""LightningModule: image classifier trained with large-batch SGD, evaluated by top-1/top-5."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torchmetrics.classification import MulticlassAccuracy

from recipes.imagenet.lr_schedule import (
    Decay,
    goyal_warmup_start_factor,
    lr_multiplier,
    scaled_learning_rate,
)
from recipes.imagenet.models import build_model
from recipes.imagenet.param_groups import weight_decay_param_groups


class ImageClassifier(pl.LightningModule):
    """Any torchvision classifier (random init) with the ImageNet large-batch training recipe.

    Optimisation: SGD with momentum (optionally Nesterov), no weight decay on normalisation and
    bias parameters, label-smoothed cross-entropy, learning rate ``base_lr`` per
    ``base_batch_size`` samples scaled linearly to the global batch (per-device batch x world
    size x gradient accumulation), linear warmup, then cosine or step decay, updated every
    optimizer step.

    Metrics: ``val/top1`` and ``val/top5`` (torchmetrics, reduced over all ranks at epoch end),
    ``val/loss`` and ``train/loss`` (rank means), ``train/top1`` and ``lr``.

    On CUDA the model runs in ``channels_last`` memory format and its forward pass under bf16
    autocast (the loss is computed in fp32); on other devices both are off.

    Args:
        arch: architecture name (see :func:`recipes.imagenet.models.build_model`).
        num_classes: number of classes.
        arch_kwargs: extra constructor arguments of the architecture.
        batch_size_per_device: samples per device and step (for the linear scaling rule).
        base_lr: learning rate for ``base_batch_size`` samples per step.
        base_batch_size: reference batch size of the linear scaling rule.
        momentum: SGD momentum.
        nesterov: use Nesterov momentum.
        weight_decay: L2 penalty of the decayed group (conv/linear weights).
        label_smoothing: label smoothing of the cross-entropy loss.
        warmup_epochs: epochs of linear warmup (fractions allowed; 0 disables warmup).
        warmup_start_factor: first warmup rate as a fraction of the peak rate; ``None`` uses
            Goyal et al.'s choice, the unscaled ``base_lr``.
        lr_decay: ``"cosine"`` (to zero at the end of training) or ``"step"``.
        step_milestones: epochs at which step decay multiplies the rate by ``step_gamma``.
        step_gamma: factor of each step decay.
        channels_last: use ``channels_last`` memory format on CUDA.
        bf16_autocast: run the forward pass under bf16 autocast on CUDA.
    """

    def __init__(
        self,
        arch: str = "resnet50",
        num_classes: int = 1000,
        arch_kwargs: dict[str, Any] | None = None,
        batch_size_per_device: int = 32,
        base_lr: float = 0.1,
        base_batch_size: int = 256,
        momentum: float = 0.9,
        nesterov: bool = False,
        weight_decay: float = 1e-4,
        label_smoothing: float = 0.1,
        warmup_epochs: float = 5.0,
        warmup_start_factor: float | None = None,
        lr_decay: Decay = "cosine",
        step_milestones: Sequence[float] = (30, 60, 80),
        step_gamma: float = 0.1,
        channels_last: bool = True,
        bf16_autocast: bool = True,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = build_model(arch, num_classes, **(arch_kwargs or {}))
        self.loss_fn = nn.CrossEntropyLoss(label_smoothing=label_smoothing)
        top5 = min(5, num_classes)
        self.train_top1 = MulticlassAccuracy(num_classes, top_k=1, average="micro")
        self.val_top1 = MulticlassAccuracy(num_classes, top_k=1, average="micro")
        self.val_top5 = MulticlassAccuracy(num_classes, top_k=top5, average="micro")

    def _on_cuda(self) -> bool:
        trainer = self._trainer
        device = trainer.strategy.root_device if trainer is not None else self.device
        return device.type == "cuda"

    def configure_model(self) -> None:
        """Switch the model to ``channels_last`` before the strategy sets it up (CUDA only)."""
        if self.hparams.channels_last and self._on_cuda():
            self.model.to(memory_format=torch.channels_last)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """fp32 logits of ``images`` (``(batch, 3, H, W)``)."""
        if images.device.type != "cuda":
            return self.model(images)
        if self.hparams.channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.hparams.bf16_autocast):
            return self.model(images).float()

    def training_step(
        self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int
    ) -> torch.Tensor:
        """Label-smoothed cross-entropy on one batch."""
        images, targets = batch
        logits = self(images)
        loss = self.loss_fn(logits, targets)
        self.train_top1(logits, targets)
        self.log("train/loss", loss, prog_bar=True, sync_dist=True)
        self.log("train/top1", self.train_top1, on_step=False, on_epoch=True)
        self.log("lr", self.optimizers().param_groups[0]["lr"], on_step=True, on_epoch=False)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        """Accumulate top-1/top-5 and the loss over the validation set."""
        images, targets = batch
        logits = self(images)
        self.val_top1(logits, targets)
        self.val_top5(logits, targets)
        self.log("val/loss", self.loss_fn(logits, targets), sync_dist=True)
        self.log("val/top1", self.val_top1, prog_bar=True)
        self.log("val/top5", self.val_top5)

    def global_batch_size(self) -> int:
        """Samples per optimizer step over all ranks."""
        trainer = self.trainer
        per_step = self.hparams.batch_size_per_device * trainer.world_size
        return per_step * trainer.accumulate_grad_batches

    def steps_per_epoch(self) -> int:
        """Optimizer steps per epoch on this rank, to place warmup and decay epochs.

        From the training loader's length when it has one (``limit_train_batches`` included);
        otherwise, e.g. when a strategy hands out batches dynamically so ranks take different
        numbers of steps, from the training set's size: ``len(dataset) // global batch``.
        """
        trainer = self.trainer
        if trainer.max_epochs is None or trainer.max_epochs < 1:
            raise ValueError("the ImageNet recipe needs a finite trainer.max_epochs to place its "
                             "warmup and decay epochs")
        trainer.estimated_stepping_batches  # noqa: B018  (loads the training data if needed)
        if math.isfinite(trainer.num_training_batches):
            return max(1, math.ceil(trainer.num_training_batches / trainer.accumulate_grad_batches))
        dataset = getattr(trainer.train_dataloader, "dataset", None)
        try:
            return max(1, len(dataset) // self.global_batch_size())
        except TypeError:
            raise ValueError("the ImageNet recipe needs a training loader or data set with a "
                             "length to place its warmup and decay epochs") from None

    def configure_optimizers(self) -> dict[str, Any]:
        """SGD with decay/no-decay groups and a per-step warmup + decay schedule."""
        hp = self.hparams
        global_batch = self.global_batch_size()
        peak_lr = scaled_learning_rate(hp.base_lr, global_batch, hp.base_batch_size)
        optimizer = torch.optim.SGD(
            weight_decay_param_groups(self.model, hp.weight_decay),
            lr=peak_lr,
            momentum=hp.momentum,
            nesterov=hp.nesterov,
        )
        steps_per_epoch = self.steps_per_epoch()
        total_steps = steps_per_epoch * self.trainer.max_epochs
        if self.trainer.max_steps >= 0:
            total_steps = min(total_steps, self.trainer.max_steps)
        start = hp.warmup_start_factor
        if start is None:
            start = goyal_warmup_start_factor(global_batch, hp.base_batch_size)
        schedule = {
            "total_steps": total_steps,
            "warmup_steps": round(hp.warmup_epochs * steps_per_epoch),
            "warmup_start_factor": start,
            "decay": hp.lr_decay,
            "milestones": [round(e * steps_per_epoch) for e in hp.step_milestones],
            "gamma": hp.step_gamma,
        }
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: lr_multiplier(step, **schedule)
        )
        per_step = {"scheduler": scheduler, "interval": "step"}
        return {"optimizer": optimizer, "lr_scheduler": per_step}
