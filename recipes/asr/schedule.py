"""Learning-rate schedule: linear warmup, hold, then per-epoch exponential annealing."""

from __future__ import annotations


def lr_factor(step: int, epoch: int, *, warmup_steps: int = 0, warmup_start: float = 0.1,
              anneal_start_epoch: int | None = None, anneal_factor: float = 0.5**0.5) -> float:
    """Multiplier of the peak learning rate at optimizer ``step`` in ``epoch`` (both from 0).

    * steps ``0 .. warmup_steps``: linear ramp from ``warmup_start`` to 1 (large-batch and
      asynchronous training need this to stay stable, cf. Goyal et al. 2017 and the paper);
    * then 1 until epoch ``anneal_start_epoch``;
    * from then on multiplied by ``anneal_factor`` once per epoch (the paper's Switchboard
      recipe anneals by 1/sqrt(2) per epoch).
    """
    factor = 1.0
    if warmup_steps > 0 and step < warmup_steps:
        factor = warmup_start + (1.0 - warmup_start) * step / warmup_steps
    if anneal_start_epoch is not None and epoch >= anneal_start_epoch:
        factor *= anneal_factor ** (epoch - anneal_start_epoch + 1)
    return factor
