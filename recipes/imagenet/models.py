"""Build a randomly initialised classifier by architecture name."""

from __future__ import annotations

from typing import Any

import torchvision
from torch import nn

from recipes.imagenet.small_resnet import SmallResNet

#: Architectures defined by the recipe itself, next to torchvision's.
RECIPE_ARCHITECTURES: dict[str, type[nn.Module]] = {"small_resnet": SmallResNet}


def classification_architectures() -> list[str]:
    """Names accepted by :func:`build_model`: the recipe's plus torchvision's classifiers."""
    return sorted(RECIPE_ARCHITECTURES) + torchvision.models.list_models(module=torchvision.models)


def build_model(arch: str, num_classes: int, **kwargs: Any) -> nn.Module:
    """A randomly initialised ``arch`` with ``num_classes`` outputs (no pretrained weights).

    ``arch`` is a torchvision classification model name (``resnet50``, ``vit_b_16``, ...) or
    ``small_resnet``; ``kwargs`` go to the model's constructor.
    """
    if arch in RECIPE_ARCHITECTURES:
        return RECIPE_ARCHITECTURES[arch](num_classes=num_classes, **kwargs)
    known = torchvision.models.list_models(module=torchvision.models)
    if arch not in known:
        raise ValueError(
            f"unknown architecture {arch!r}; choose one of: "
            f"{', '.join(classification_architectures())}"
        )
    return torchvision.models.get_model(arch, weights=None, num_classes=num_classes, **kwargs)
