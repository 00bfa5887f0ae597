"""The size of the benchmarks' 2-hidden-layer MLP (digits: 64 inputs, 10 classes), standard
library only, so that a driver can size the model without importing torch."""

from __future__ import annotations

import math


def hidden_width(model_mb: float, in_features: int = 64, classes: int = 10) -> int:
    """Width ``w`` of a 2-hidden-layer MLP whose fp32 parameters take about ``model_mb`` MB.

    >>> hidden_width(4.0)
    962
    """
    params = model_mb * 1e6 / 4
    # in*w + w + w*w + w + w*classes + classes = params
    b = in_features + 2 + classes
    return max(8, int((-b + math.sqrt(b * b + 4 * (params - classes))) / 2))


def param_count(width: int, in_features: int = 64, classes: int = 10) -> int:
    """Parameters of the 2-hidden-layer MLP of ``width``.

    >>> param_count(962)
    998566
    """
    return in_features * width + width + width * width + width + width * classes + classes
