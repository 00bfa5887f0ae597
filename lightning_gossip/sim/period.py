"""The communication budget in the simulator: ``gossip_every_n_steps`` as a number of local
steps per exchange, and the period ``gossip_every_n_steps="auto"`` picks for simulated
learners, by the strategies' own policy (:func:`~lightning_gossip.gossip_period.choose_period`).

What the strategies measure in their first steps, the simulator knows from its models: a
learner's compute per step is the median of its step times (:meth:`ComputeModel.medians
<lightning_gossip.sim.workloads.ComputeModel.medians>`; the tuner takes medians), one
exchange's time is the ``exchange_time`` given to the simulator (the time on the link from
when both sides are ready: what the strategies time, without waits for a partner). So:

* ``dpsgd`` (:func:`agreed_auto_period`): one period for every learner, the policy's for the
  largest median compute and the exchange time (the strategy all-reduces both with ``MAX``);
* ``adpsgd`` (:func:`auto_periods`): each learner its own, from its own median compute.

Both start at period 1 and switch after the first ``warmup_steps + measure_steps`` steps
(:attr:`AutoPeriod.warmup_steps <lightning_gossip.gossip_period.AutoPeriod>`), as the
strategies do. Their later re-checks would see the same medians in these stationary models,
so they are not simulated.

>>> from lightning_gossip.gossip_period import AutoPeriod
>>> from lightning_gossip.sim.workloads import ComputeModel
>>> compute = ComputeModel([1.0, 1.0, 2.0, 4.0])
>>> auto_periods(compute, 2.5, AutoPeriod()).tolist()  # 1.1 x 2.5 = 2.75 units to cover
[3, 3, 2, 1]
>>> agreed_auto_period(compute, 2.5, AutoPeriod())  # the slowest learner's 4 units
1
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from lightning_gossip.budget import GossipPeriod, resolve_gossip_every_n_steps
from lightning_gossip.gossip_period import AutoPeriod, choose_period
from lightning_gossip.sim.workloads import ComputeModel

__all__ = ["agreed_auto_period", "auto_periods"]


def auto_periods(compute: ComputeModel, exchange_time: float,
                 settings: AutoPeriod) -> np.ndarray:
    """The period each learner's ``"auto"`` picks (``adpsgd``: every rank for itself):
    :func:`~lightning_gossip.gossip_period.choose_period` of its median step time and
    ``exchange_time``, with the settings' margin and longest period."""
    return np.array([choose_period(c, exchange_time, margin=settings.margin,
                                   max_period=settings.max_period)
                     for c in compute.medians()], dtype=np.int64)


def agreed_auto_period(compute: ComputeModel, exchange_time: float,
                       settings: AutoPeriod) -> int:
    """The one period ``"auto"`` picks for synchronous learners (``dpsgd``): the policy's for
    the largest median step time and ``exchange_time``."""
    return choose_period(float(compute.medians().max()), exchange_time,
                         margin=settings.margin, max_period=settings.max_period)


def _periods(value: GossipPeriod | Sequence[int], world_size: int) -> np.ndarray:
    """One fixed period per learner: ``value`` for all, or one each (``ValueError`` for a bad
    one, as the strategies')."""
    if isinstance(value, np.integer):
        value = int(value)
    if isinstance(value, (int, str, AutoPeriod)):
        return np.full(world_size, resolve_gossip_every_n_steps(value), dtype=np.int64)
    values = [resolve_gossip_every_n_steps(v) for v in value]
    if len(values) != world_size:
        raise ValueError(f"expected one period per learner ({world_size}), got {len(values)}")
    return np.array(values, dtype=np.int64)
