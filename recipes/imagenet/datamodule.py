"""LightningDataModule for ImageFolder data in the standard ImageNet layout."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import lightning.pytorch as pl
from torch.utils.data import DataLoader

from recipes.imagenet.dataset import CheckedImageFolder, ImageFolderError
from recipes.imagenet.transforms import IMAGENET_MEAN, IMAGENET_STD, eval_transform, train_transform


class ImageFolderDataModule(pl.LightningDataModule):
    """Train/val ImageFolder data: ``root/train/<class>/*`` and ``root/val/<class>/*``.

    The train and val trees must hold the same class folders, and ``num_classes`` of them;
    anything else is an :class:`~recipes.imagenet.dataset.ImageFolderError`. Distributed
    sharding is left to the Trainer (it adds a ``DistributedSampler`` under any multi-process
    strategy), so ``batch_size`` is per device.

    Args:
        root: dataset root containing ``train/`` and ``val/``.
        num_classes: expected number of class folders.
        batch_size: samples per device and step.
        num_workers: data-loading worker processes per device.
        pin_memory: page-lock batches for faster host-to-GPU copies.
        persistent_workers: keep workers alive between epochs (only with ``num_workers > 0``).
        skip_unreadable: log and skip unreadable images instead of failing on the first one.
        train_crop_size: side of the random-resized training crop.
        train_crop_scale: range of the crop's area fraction.
        horizontal_flip: random horizontal flips during training.
        eval_resize_size: short side after resizing for evaluation.
        eval_crop_size: side of the evaluation centre crop.
        mean: per-channel normalisation mean (RGB).
        std: per-channel normalisation standard deviation (RGB).
    """

    def __init__(
        self,
        root: str,
        num_classes: int,
        batch_size: int = 32,
        num_workers: int = 8,
        pin_memory: bool = True,
        persistent_workers: bool = True,
        skip_unreadable: bool = False,
        train_crop_size: int = 224,
        train_crop_scale: Sequence[float] = (0.08, 1.0),
        horizontal_flip: bool = True,
        eval_resize_size: int = 256,
        eval_crop_size: int = 224,
        mean: Sequence[float] = IMAGENET_MEAN,
        std: Sequence[float] = IMAGENET_STD,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.root = Path(root)
        self.num_classes = num_classes
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.pin_memory = pin_memory
        self.persistent_workers = persistent_workers and num_workers > 0
        self.skip_unreadable = skip_unreadable
        self.train_transform = train_transform(
            train_crop_size, train_crop_scale, horizontal_flip, mean, std
        )
        self.eval_transform = eval_transform(eval_resize_size, eval_crop_size, mean, std)
        self.train_set: CheckedImageFolder | None = None
        self.val_set: CheckedImageFolder | None = None

    def setup(self, stage: str) -> None:
        """Index both trees and check that their classes agree with each other and the config."""
        if self.train_set is not None:
            return
        train = CheckedImageFolder(self.root / "train", self.train_transform, self.skip_unreadable)
        val = CheckedImageFolder(self.root / "val", self.eval_transform, self.skip_unreadable)
        check_same_classes(train, val)
        if len(train.classes) != self.num_classes:
            raise ImageFolderError(
                f"num_classes is {self.num_classes} but {train.root} has "
                f"{len(train.classes)} class folders"
            )
        self.train_set, self.val_set = train, val

    def _loader(self, dataset: CheckedImageFolder | None, train: bool) -> DataLoader:
        if dataset is None:
            raise RuntimeError("call setup() before asking for a data loader")
        return DataLoader(
            dataset,
            batch_size=self.batch_size,
            shuffle=train,
            drop_last=train,
            num_workers=self.num_workers,
            pin_memory=self.pin_memory,
            persistent_workers=self.persistent_workers,
        )

    def train_dataloader(self) -> DataLoader:
        """Shuffled training batches (the last incomplete batch is dropped)."""
        return self._loader(self.train_set, train=True)

    def val_dataloader(self) -> DataLoader:
        """Validation batches in folder order."""
        return self._loader(self.val_set, train=False)


def check_same_classes(train: CheckedImageFolder, val: CheckedImageFolder) -> None:
    """Raise :class:`ImageFolderError` unless both trees have exactly the same class folders."""
    if train.classes == val.classes:
        return
    only_train = sorted(set(train.classes) - set(val.classes))
    only_val = sorted(set(val.classes) - set(train.classes))
    raise ImageFolderError(
        f"class folders of {train.root} and {val.root} differ: "
        f"only in train: {only_train[:10] or 'none'}; only in val: {only_val[:10] or 'none'}"
    )
