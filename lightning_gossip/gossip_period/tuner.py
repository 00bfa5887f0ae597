"""The tuner a strategy drives for ``gossip_every_n_steps="auto"``: samples, medians, the
schedule of decisions (:class:`PeriodTuner`) and what it decided (:class:`PeriodDecision`)."""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import asdict, dataclass

from lightning_gossip.gossip_period.policy import (
    DEFAULT_MARGIN,
    DEFAULT_MAX_PERIOD,
    _check_policy,
    _seconds,
    choose_period,
    comm_compute_ratio,
    period_hides,
)

__all__ = ["AutoPeriod", "PeriodDecision", "PeriodTuner"]


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

    **How a strategy drives it** (what :class:`~lightning_gossip.gossip_period.auto.PeriodDriver`
    does for both engines; it times ``compute_s`` as the training thread's time between the
    engine's calls, which is this step's compute whether the loop posts before forward or at
    ``optimizer.step()``), on every rank, once per optimizer step (also a step whose
    optimizer step AMP skipped, as long as every rank records it):

    1. Before the first decision the period is 1 (:attr:`period`): exchange every step.
    2. Time ``compute_s``: from when the step's exchange is posted (after ``before_step``
       returns) to the end of the optimizer step: forward, backward (with a hierarchical
       strategy's gradient all-reduce inside the node) and optimizer step, and no wait for a
       gossip exchange. On CUDA, synchronize the stream (or use events) before reading the
       clock.
    3. Time ``exchange_s`` of every exchange that completed during the step: its duration
       from the moment every peer has posted it to holding every peer's data (mixed, for a
       sharded exchange all-gathered in the node), i.e. what one blocking exchange of the
       replica as sent on the wire (its wire dtype, its shards) takes between ranks that are
       ready. Not the wait for a peer that posts later: in a synchronous round that is the
       slower rank's compute, and counted as exchange time it would overestimate R (and
       lengthen the period) wherever the ranks' steps differ. Not the training thread's wait
       either, which is only the part that was not hidden: time it where the exchange is
       waited on (the exchange's worker thread) or time a blocking exchange around its post
       and wait. ``None`` for a step that completed no exchange.
    4. Call :meth:`record` with both, then read :attr:`due` (an exchange that completes
       outside the step's cadence, on a gossip thread: :meth:`record_exchange` for each,
       called from the training thread, which the gossip thread hands the times to with its
       deltas: the tuner is not thread-safe). When :attr:`due` is ``True``:

       * ``dpsgd`` (the ranks must agree on one period): all-reduce
         ``list(tuner.local_values())`` with ``MAX`` (one 2-value tensor on a group of all
         ranks: the synchronous step runs at the slowest rank's compute, and the slowest
         exchange decides whether it hides), then ``decision = tuner.decide(c_max, x_max)``;
       * ``adpsgd`` (each rank gossips at its own pace): ``tuner.decide(*tuner.local_values())``.

       Log :meth:`PeriodDecision.describe`, and use ``decision.period`` from the next
       exchange on (an exchange in flight completes under the period it was posted with).

    Later windows keep measuring at the period in force: every step's compute, and the
    exchanges that happen (one per period). A window without an exchange (a period longer
    than ``recheck_every``) keeps the last decision's exchange time. A fit (or a resumed fit)
    starts with a new tuner: period 1 until its first decision.

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
        if not self._warming_up:
            self._compute.append(c)
            if x is not None:
                self._exchange.append(x)
        self._steps += 1

    def record_exchange(self, exchange_s: float) -> None:
        """Record the time of one more exchange that completed during the current step (the
        step :meth:`record` records next), for strategies whose exchanges do not follow the
        steps one to one (a gossip thread). Dropped during the first ``warmup_steps`` steps."""
        x = _seconds("exchange_s", exchange_s)
        if not self._warming_up:
            self._exchange.append(x)

    @property
    def _warming_up(self) -> bool:
        """Whether samples recorded now are dropped (the first ``warmup_steps`` steps)."""
        return self._steps < self.warmup_steps and not self._decisions

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

    def postpone(self, steps: int) -> None:
        """Take no decision now: the next one is due ``steps`` steps later (at least 1), from
        the same window, which goes on collecting samples (the strategy cannot switch yet: for
        ``dpsgd``, a stop or requeue agreed along the rounds of the current period is still to
        come).

        >>> tuner = PeriodTuner(warmup_steps=0, measure_steps=2)
        >>> tuner.record(0.1, 0.3); tuner.record(0.1, 0.3)
        >>> tuner.due, tuner.postpone(3), tuner.due, tuner.next_check, tuner.period
        (True, None, False, 5, 1)
        """
        if not isinstance(steps, int) or isinstance(steps, bool):
            raise ValueError(f"steps must be an integer, got {steps!r}")
        self._next = self._steps + max(steps, 1)

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


@dataclass(frozen=True)
class AutoPeriod:
    """The settings of ``gossip_every_n_steps="auto"``: :class:`PeriodTuner`'s arguments, as a
    value the strategies, Fabric's strategies and :func:`~lightning_gossip.attach` take in
    place of ``"auto"`` (which is ``AutoPeriod()``: the defaults). Every fit builds a new tuner
    from it (:meth:`tuner`).

    >>> AutoPeriod(max_period=8).tuner().max_period
    8
    >>> AutoPeriod(margin=0)
    Traceback (most recent call last):
    ...
    ValueError: margin must be a finite number > 0, got 0
    """

    margin: float = DEFAULT_MARGIN
    max_period: int = DEFAULT_MAX_PERIOD
    warmup_steps: int = 2
    measure_steps: int = 8
    recheck_every: int | None = 200
    max_samples: int = 256

    def __post_init__(self) -> None:
        self.tuner()  # checks every value (ValueError naming it)

    def tuner(self) -> PeriodTuner:
        """A new :class:`PeriodTuner` with these settings."""
        return PeriodTuner(margin=self.margin, max_period=self.max_period,
                           warmup_steps=self.warmup_steps, measure_steps=self.measure_steps,
                           recheck_every=self.recheck_every, max_samples=self.max_samples)
