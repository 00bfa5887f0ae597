"""Optimizer parameter groups that exempt normalisation and bias parameters from weight decay."""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.nn.modules.batchnorm import _NormBase

#: Layers whose affine parameters are not decayed (BatchNorm/InstanceNorm share ``_NormBase``).
NORM_LAYERS: tuple[type[nn.Module], ...] = (
    _NormBase, nn.LayerNorm, nn.GroupNorm, nn.LocalResponseNorm
)


def weight_decay_param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Split ``model``'s trainable parameters into a decayed and a non-decayed group.

    Parameters of normalisation layers and every parameter named ``bias`` get no weight decay
    (the usual large-batch ImageNet practice); all others get ``weight_decay``. Shared
    parameters are listed once. Empty groups are dropped.
    """
    decay, no_decay, seen = [], [], set()
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            if not param.requires_grad or id(param) in seen:
                continue
            seen.add(id(param))
            if isinstance(module, NORM_LAYERS) or name == "bias":
                no_decay.append(param)
            else:
                decay.append(param)
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]
