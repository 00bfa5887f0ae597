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
steps up to the next exchange to complete (``overlap``), or is applied at the next exchange
(``delay_by_one``), so a period of ``n`` steps takes ``max(n compute, exchange)`` (plus the
blocking part) with ``overlap=1``, and the exchange is hidden exactly when
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
:class:`PeriodTuner`.

>>> choose_period(0.1, 0.05)  # R = 0.5: every step
1
>>> choose_period(0.1, 0.25)  # R = 2.5: 3 steps of compute cover 1.1 x the exchange
3
>>> choose_period(0.1, 100.0)  # R = 1000: hidden by no allowed period, the longest one
32
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import asdict, dataclass

__all__ = [
    "DEFAULT_MARGIN",
    "DEFAULT_MAX_PERIOD",
    "PeriodDecision",
    "PeriodTuner",
    "choose_period",
    "comm_compute_ratio",
    "period_hides",
]

DEFAULT_MARGIN = 1.1
"""Headroom of the policy: a period ``n`` qualifies when ``n * compute_s >= DEFAULT_MARGIN *
exchange_s``."""
DEFAULT_MAX_PERIOD = 32
"""The longest period ``"auto"`` picks: 1/32 of a replica per node and step, the
communication budget's floor."""


def _seconds(name: str, value: float, positive: bool = False) -> float:
    """``value`` as a float; ``ValueError`` naming ``name`` unless finite and >= 0 (> 0)."""
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number of seconds, got {value!r}") from None
    if not math.isfinite(v) or v < 0 or (positive and v == 0):
        rel = "> 0" if positive else ">= 0"
        raise ValueError(f"{name} must be a finite number of seconds {rel}, got {value!r}")
    return v


def _check_policy(margin: float, max_period: int) -> None:
    """``ValueError`` unless ``margin`` is finite and > 0 and ``max_period`` an int >= 1."""
    if not (isinstance(margin, (int, float)) and math.isfinite(margin) and margin > 0):
        raise ValueError(f"margin must be a finite number > 0, got {margin!r}")
    if not isinstance(max_period, int) or isinstance(max_period, bool) or max_period < 1:
        raise ValueError(f"max_period must be an integer >= 1, got {max_period!r}")


def comm_compute_ratio(compute_s: float, exchange_s: float) -> float:
    """``R = exchange_s / compute_s``: one exchange's time over one step's compute time.

    >>> comm_compute_ratio(0.1, 0.25)
    2.5
    """
    c = _seconds("compute_s", compute_s, positive=True)
    return _seconds("exchange_s", exchange_s) / c


def period_hides(period: int, compute_s: float, exchange_s: float,
                 margin: float = 1.0) -> bool:
    """Whether ``period`` steps of ``compute_s`` cover ``margin`` times an exchange of
    ``exchange_s``: ``period * compute_s >= margin * exchange_s``, up to a relative 1e-9 (so
    that 3 steps of 0.1 s cover 1.5 times 0.2 s, although ``1.5 * 0.2 / 0.1`` is
    3.0000000000000004 in floating point).

    >>> period_hides(3, 0.1, 0.25), period_hides(2, 0.1, 0.25)
    (True, False)
    >>> period_hides(3, 0.1, 0.2, margin=1.5)  # exactly at the margin
    True
    """
    c = _seconds("compute_s", compute_s, positive=True)
    x = _seconds("exchange_s", exchange_s)
    return period * c >= margin * x * (1.0 - 1e-9)


def choose_period(compute_s: float, exchange_s: float, *, margin: float = DEFAULT_MARGIN,
                  max_period: int = DEFAULT_MAX_PERIOD) -> int:
    """The smallest period ``n`` in ``1 .. max_period`` (local steps between exchanges) whose
    exchange hides behind the compute of its steps with ``margin``:
    ``n * compute_s >= margin * exchange_s`` (:func:`period_hides`); ``max_period`` when no
    period qualifies. Deterministic: the same numbers give the same period on every rank.

    ``compute_s``: seconds of forward, backward and optimizer step of one step, without waits
    for communication (> 0). ``exchange_s``: seconds of one exchange of the replica as sent on
    the wire (>= 0; 0 gives 1). The module's docstring says why this is the cost model's
    condition for a hidden exchange.

    >>> choose_period(0.2, 0.2), choose_period(0.2, 0.2, margin=1.0)  # R = 1
    (2, 1)
    >>> choose_period(0.1, 0.0), choose_period(0.1, 1.0, max_period=4)
    (1, 4)
    >>> choose_period(0.0, 0.1)
    Traceback (most recent call last):
    ...
    ValueError: compute_s must be a finite number of seconds > 0, got 0.0
    """
    _check_policy(margin, max_period)
    c = _seconds("compute_s", compute_s, positive=True)
    x = _seconds("exchange_s", exchange_s)
    need = margin * x / c
    n = max(1, math.ceil(need))
    if n > 1 and period_hides(n - 1, c, x, margin):  # ceil overshot by a rounding error
        n -= 1
    return min(n, max_period)


@dataclass(frozen=True)
class PeriodDecision:
    """What the tuner decided, with what it measured: ``period`` (local steps between
    exchanges), ``compute_s`` and ``exchange_s`` (the values the policy was given: for
    ``dpsgd`` the cross-rank maxima of the medians), ``ratio`` (R), ``hidden`` (whether
    ``period`` covers ``margin`` times the exchange; ``False`` when even ``max_period`` does
    not), ``margin``, ``step`` (the number of steps the tuner had recorded when it decided) and
    the samples the medians came from (this rank's)."""

    period: int
    compute_s: float
    exchange_s: float
    ratio: float
    hidden: bool
    margin: float
    step: int
    compute_samples: int
    exchange_samples: int

    def describe(self) -> str:
        """One line for the log.

        >>> d = PeriodDecision(3, 0.1, 0.25, 2.5, True, 1.1, 10, 8, 8)
        >>> print(d.describe())  # doctest: +NORMALIZE_WHITESPACE
        gossip_every_n_steps="auto": period 3 (compute 100.0 ms/step, exchange 250.0 ms,
        R 2.50; hidden behind 3 steps with margin 1.1; after step 10, medians of 8 and 8
        samples)
        """
        how = (f"hidden behind {self.period} steps with margin {self.margin:g}" if self.hidden
               else f"not hidden even at period {self.period} (margin {self.margin:g})")
        return (f'gossip_every_n_steps="auto": period {self.period} (compute '
                f"{self.compute_s * 1e3:.1f} ms/step, exchange {self.exchange_s * 1e3:.1f} ms, "
                f"R {self.ratio:.2f}; {how}; after step {self.step}, medians of "
                f"{self.compute_samples} and {self.exchange_samples} samples)")

    def as_dict(self) -> dict:
        """The decision as a JSON-ready dict (for loggers and records)."""
        return asdict(self)


class PeriodTuner:
    """Measures compute and exchange times during a fit and decides the gossip period with
    :func:`choose_period`. No clocks and no collectives here: the strategy measures and
    reduces; the tuner keeps samples, medians and the schedule.

    Arguments: ``margin`` and ``max_period`` of the policy; ``warmup_steps``, the first steps
    whose samples are dropped; ``measure_steps``, the steps measured after them before the
    first decision (so it is due after ``warmup_steps + measure_steps`` steps);
    ``recheck_every``, the steps between later decisions (``None``: never again);
    ``max_samples``, the most recent samples of each kind a window keeps.

    **How a strategy drives it**, on every rank, once per optimizer step (also a step whose
    optimizer step AMP skipped, as long as every rank records it):

    1. Before the first decision the period is 1 (:attr:`period`): exchange every step.
    2. Time ``compute_s``: from when the step's exchange is posted (after ``before_step``
       returns) to the end of the optimizer step: forward, backward (with a hierarchical
       strategy's gradient all-reduce inside the node) and optimizer step, and no wait for a
       gossip exchange. On CUDA, synchronize the stream (or use events) before reading the
       clock.
    3. Time ``exchange_s`` of every exchange that completed during the step: its duration
       from posting to holding every peer's data (mixed, for a sharded exchange all-gathered
       in the node), i.e. what one blocking exchange of the replica as sent on the wire (its
       wire dtype, its shards) takes. This is not the training thread's wait, which is only
       the part that was not hidden: time it where the exchange is waited on (the exchange's
       worker thread) or time a blocking exchange around its post and wait. ``None`` for a
       step that completed no exchange.
    4. Call :meth:`record` with both, then read :attr:`due`. When it is ``True``:

       * ``dpsgd`` (the ranks must agree on one period): all-reduce
         ``list(tuner.local_values())`` with ``MAX`` (one 2-value tensor on a group of all
         ranks: the synchronous step runs at the slowest rank's compute, and the slowest
         exchange decides whether it hides), then ``decision = tuner.decide(c_max, x_max)``;
       * ``adpsgd`` (each rank gossips at its own pace): ``tuner.decide(*tuner.local_values())``.

       Log :meth:`PeriodDecision.describe`, and use ``decision.period`` from the next
       exchange on (an exchange in flight completes under the period it was posted with).

    Later windows keep measuring at the period in force: every step's compute, and the
    exchanges that happen (one per period). A window without an exchange (a period longer
    than ``recheck_every``) keeps the last decision's exchange time.

    >>> tuner = PeriodTuner(warmup_steps=1, measure_steps=3, recheck_every=4)
    >>> for c, x in [(9.0, 9.0), (0.1, 0.25), (0.1, 0.24), (0.12, 0.26)]:
    ...     tuner.record(c, x)
    >>> tuner.due, tuner.local_values()  # the first step (9 s) was dropped
    (True, (0.1, 0.25))
    >>> tuner.decide(*tuner.local_values()).period
    3
    >>> tuner.next_check, tuner.period  # re-checked 4 steps later
    (8, 3)
    """

    def __init__(self, *, margin: float = DEFAULT_MARGIN,
                 max_period: int = DEFAULT_MAX_PERIOD, warmup_steps: int = 2,
                 measure_steps: int = 8, recheck_every: int | None = 200,
                 max_samples: int = 256) -> None:
        _check_policy(margin, max_period)
        for name, v, least in (("warmup_steps", warmup_steps, 0),
                               ("measure_steps", measure_steps, 1),
                               ("max_samples", max_samples, 1)):
            if not isinstance(v, int) or isinstance(v, bool) or v < least:
                raise ValueError(f"{name} must be an integer >= {least}, got {v!r}")
        if recheck_every is not None and (not isinstance(recheck_every, int)
                                          or isinstance(recheck_every, bool)
                                          or recheck_every < 1):
            raise ValueError(f"recheck_every must be an integer >= 1 or None, "
                             f"got {recheck_every!r}")
        self.margin = float(margin)
        self.max_period = max_period
        self.warmup_steps = warmup_steps
        self.measure_steps = measure_steps
        self.recheck_every = recheck_every
        self._compute: deque[float] = deque(maxlen=max_samples)
        self._exchange: deque[float] = deque(maxlen=max_samples)
        self._steps = 0
        self._next: int | None = warmup_steps + measure_steps
        self._decisions: list[PeriodDecision] = []

    @property
    def steps(self) -> int:
        """Steps recorded so far (calls of :meth:`record`)."""
        return self._steps

    @property
    def period(self) -> int:
        """The period in force: 1 before the first decision, then the last decision's."""
        return self._decisions[-1].period if self._decisions else 1

    @property
    def decision(self) -> PeriodDecision | None:
        """The last decision (``None`` before the first)."""
        return self._decisions[-1] if self._decisions else None

    @property
    def decisions(self) -> tuple[PeriodDecision, ...]:
        """Every decision so far, oldest first."""
        return tuple(self._decisions)

    @property
    def next_check(self) -> int | None:
        """The step count (:attr:`steps`) at which the next decision is due (``None``: none
        will be, ``recheck_every=None`` after the first)."""
        return self._next

    @property
    def due(self) -> bool:
        """Whether a decision is due now (:meth:`local_values`, the reduction for ``dpsgd``,
        :meth:`decide`): a function of :attr:`steps` only, so lockstep ranks agree."""
        return self._next is not None and self._steps >= self._next

    def record(self, compute_s: float, exchange_s: float | None = None) -> None:
        """Record one step: its compute time and, if an exchange completed during it, that
        exchange's time (seconds; see the class's docstring for what to time). The samples of
        the first ``warmup_steps`` steps are dropped."""
        c = _seconds("compute_s", compute_s)
        x = None if exchange_s is None else _seconds("exchange_s", exchange_s)
        if self._steps >= self.warmup_steps or self._decisions:
            self._compute.append(c)
            if x is not None:
                self._exchange.append(x)
        self._steps += 1

    def local_values(self) -> tuple[float, float]:
        """``(compute_s, exchange_s)``: the medians of this rank's window (the values to
        all-reduce with ``MAX`` for ``dpsgd``). A window without an exchange keeps the last
        decision's exchange time; ``RuntimeError`` when there is none (the strategy recorded
        no exchange before the first decision: it must exchange every step until then)."""
        if not self._compute:
            raise RuntimeError("PeriodTuner: no compute time recorded in this window (call "
                               "record() once per step before local_values())")
        if self._exchange:
            x = statistics.median(self._exchange)
        elif self._decisions:
            x = self._decisions[-1].exchange_s
        else:
            raise RuntimeError("PeriodTuner: no exchange time recorded before the first "
                               "decision (exchange every step, period 1, and pass each "
                               "exchange's time to record())")
        return float(statistics.median(self._compute)), float(x)

    def decide(self, compute_s: float, exchange_s: float) -> PeriodDecision:
        """Decide the period from ``compute_s`` and ``exchange_s`` (for ``dpsgd`` the
        cross-rank maxima of :meth:`local_values`), start a new window and schedule the next
        decision ``recheck_every`` steps later. Returns the decision."""
        period = choose_period(compute_s, exchange_s, margin=self.margin,
                               max_period=self.max_period)
        d = PeriodDecision(
            period=period, compute_s=float(compute_s), exchange_s=float(exchange_s),
            ratio=comm_compute_ratio(compute_s, exchange_s),
            hidden=period_hides(period, compute_s, exchange_s, self.margin),
            margin=self.margin, step=self._steps, compute_samples=len(self._compute),
            exchange_samples=len(self._exchange))
        self._decisions.append(d)
        self._compute.clear()
        self._exchange.clear()
        self._next = None if self.recheck_every is None else self._steps + self.recheck_every
        return d
