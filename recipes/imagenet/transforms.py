"""Standard ImageNet training and evaluation transforms (torchvision ``transforms.v2``)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torchvision.transforms import v2

#: ImageNet channel statistics (RGB, 0..1 scale).
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def train_transform(
    crop_size: int = 224,
    crop_scale: Sequence[float] = (0.08, 1.0),
    horizontal_flip: bool = True,
    mean: Sequence[float] = IMAGENET_MEAN,
    std: Sequence[float] = IMAGENET_STD,
) -> v2.Compose:
    """Random-resized crop (area fraction in ``crop_scale``), optional flip, normalise."""
    steps: list[v2.Transform] = [
        v2.RandomResizedCrop(crop_size, scale=tuple(crop_scale), antialias=True)
    ]
    if horizontal_flip:
        steps.append(v2.RandomHorizontalFlip())
    steps += [v2.ToImage(), v2.ToDtype(torch.float32, scale=True), v2.Normalize(mean, std)]
    return v2.Compose(steps)


def eval_transform(
    resize_size: int = 256,
    crop_size: int = 224,
    mean: Sequence[float] = IMAGENET_MEAN,
    std: Sequence[float] = IMAGENET_STD,
) -> v2.Compose:
    """Resize the short side to ``resize_size``, centre crop ``crop_size``, normalise."""
    return v2.Compose([
        v2.Resize(resize_size, antialias=True),
        v2.CenterCrop(crop_size),
        v2.ToImage(),
        v2.ToDtype(torch.float32, scale=True),
        v2.Normalize(mean, std),
    ])
