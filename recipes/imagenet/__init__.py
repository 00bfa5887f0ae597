"""ImageNet-style image classification recipe: any torchvision classifier on ImageFolder data.

An ordinary LightningModule and LightningDataModule with no gossip logic: the same code runs
under ``ddp``, ``dpsgd`` or ``adpsgd``. Start it with ``python -m recipes.imagenet``.
"""

from recipes.imagenet.classifier import ImageClassifier
from recipes.imagenet.datamodule import ImageFolderDataModule
from recipes.imagenet.dataset import CheckedImageFolder, ImageFolderError, UnreadableImageError

__all__ = [
    "CheckedImageFolder",
    "ImageClassifier",
    "ImageFolderDataModule",
    "ImageFolderError",
    "UnreadableImageError",
]
