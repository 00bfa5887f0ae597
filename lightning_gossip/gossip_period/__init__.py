"""How often to gossip: the period that ``gossip_every_n_steps="auto"`` picks, and the tuner
that measures a fit's first steps for it.

Pure Python (the standard library only: no torch, no torch.distributed, no Lightning), so the
strategies, a plain loop and ``lightning-gossip plan`` share one policy: what ``plan`` prints
for a cluster is what a strategy picks from the same two numbers.

**The ratio R.** ``R = exchange_s / compute_s`` (:func:`comm_compute_ratio`): the time of one
exchange of the replica as sent on the wire over the compute time of one step (forward,
backward, optimizer step). It decides whether gossip can hide: an exchange with ``R <= 1``
hides behind one step; ``R = 4`` needs 4 steps of compute between exchanges.

**The policy** (:func:`choose_period`): the smallest period ``n`` in ``1 .. max_period`` with
``n * compute_s >= margin * exchange_s``, or ``max_period`` when none qualifies. These are the
terms of the cost model (:mod:`lightning_gossip.plan`, :func:`~lightning_gossip.plan.step_time`):
with a period ``n`` an exchange is posted at the first step of its period and has the ``n``
steps up to its exchange step ``e`` to complete (``overlap``; with ``delay_by_one`` its change
is applied one step later, after the step ``e + 1``, where the next one is posted), so in the
steady state a period of ``n`` steps takes ``max(n compute, exchange)`` (plus the blocking
part) with ``overlap=1``, and the exchange is hidden exactly when
``n compute >= exchange``. The margin (default :data:`DEFAULT_MARGIN`, 10 %) asks for
headroom: the measurements are medians of steps that vary, and an exchange that runs next to
compute is slower than one measured alone (shared cores with gloo, shared memory bandwidth on
GPUs). In ``blocking`` mode no period hides an exchange; the same rule bounds its cost, spread
over the period, to ``1 / margin`` of a step's compute. The longest period,
:data:`DEFAULT_MAX_PERIOD` (32), is the communication budget's floor: 1/32 of a replica per
node and step.

**The tuner** (:class:`PeriodTuner`) is what a strategy drives: it collects one compute time
per step and the time of every exchange, skips the first steps (their warm-up costs:
allocation, kernel selection, connection set-up), and says when a decision is due; the
strategy then (for ``dpsgd``, whose ranks must agree on one period) takes the cross-rank
maximum of :meth:`PeriodTuner.local_values` with one all-reduce and hands it to
:meth:`PeriodTuner.decide`. When a decision is due is a function of the number of steps
recorded only, so ranks that step in lockstep reach it at the same step. How to drive it:
:class:`PeriodTuner`; the driver both engines use (``gossip_every_n_steps="auto"`` in the
strategies, Fabric and ``attach``) is :class:`~lightning_gossip.gossip_period.auto.PeriodDriver`
(not imported here: it needs torch), its settings an :class:`AutoPeriod`.

>>> choose_period(0.1, 0.05)  # R = 0.5: every step
1
>>> choose_period(0.1, 0.25)  # R = 2.5: 3 steps of compute cover 1.1 x the exchange
3
>>> choose_period(0.1, 100.0)  # R = 1000: hidden by no allowed period, the longest one
32
"""

from __future__ import annotations

from lightning_gossip.gossip_period.policy import (
    DEFAULT_MARGIN,
    DEFAULT_MAX_PERIOD,
    choose_period,
    comm_compute_ratio,
    period_hides,
)
from lightning_gossip.gossip_period.tuner import AutoPeriod, PeriodDecision, PeriodTuner

__all__ = [
    "AutoPeriod",
    "DEFAULT_MARGIN",
    "DEFAULT_MAX_PERIOD",
    "PeriodDecision",
    "PeriodTuner",
    "choose_period",
    "comm_compute_ratio",
    "period_hides",
]
