"""Large-batch learning-rate rules (Goyal et al., 2017): linear scaling, warmup, decay.

All functions are pure, so the schedule's values can be checked without a Trainer.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

Decay = Literal["cosine", "step"]


def scaled_learning_rate(
    base_lr: float, global_batch_size: int, base_batch_size: int = 256
) -> float:
    """Linear scaling rule: ``base_lr`` is the rate for ``base_batch_size`` samples per step."""
    return base_lr * global_batch_size / base_batch_size


def goyal_warmup_start_factor(global_batch_size: int, base_batch_size: int = 256) -> float:
    """Warmup starts at the unscaled ``base_lr``, i.e. at ``1/k`` of the scaled rate (at most 1)."""
    return min(1.0, base_batch_size / global_batch_size)


def lr_multiplier(
    step: int,
    *,
    total_steps: int,
    warmup_steps: int = 0,
    warmup_start_factor: float = 0.0,
    decay: Decay = "cosine",
    milestones: Sequence[int] = (),
    gamma: float = 0.1,
) -> float:
    """Factor applied to the peak learning rate at optimizer step ``step`` (0-based).

    Warmup rises linearly from ``warmup_start_factor`` at step 0 to 1 at ``warmup_steps``.
    ``"cosine"`` then decays from 1 to 0 over the remaining steps up to ``total_steps``;
    ``"step"`` multiplies by ``gamma`` at each milestone (steps counted from 0, warmup included).
    """
    if warmup_steps > 0 and step < warmup_steps:
        warm = warmup_start_factor + (1.0 - warmup_start_factor) * step / warmup_steps
    else:
        warm = 1.0
    if decay == "cosine":
        span = max(1, total_steps - warmup_steps)
        progress = min(1.0, max(0.0, (step - warmup_steps) / span))
        return warm * 0.5 * (1.0 + math.cos(math.pi * progress))
    if decay == "step":
        return warm * gamma ** sum(step >= m for m in milestones)
    raise ValueError(f"unknown decay {decay!r}: expected 'cosine' or 'step'")
