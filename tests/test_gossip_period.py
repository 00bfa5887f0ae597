"""The gossip period policy and its tuner (:mod:`lightning_gossip.gossip_period`): the period
``gossip_every_n_steps="auto"`` picks from a compute and an exchange time, and the schedule of
measurements and decisions a strategy drives. Pure Python: no processes, no clocks."""

from __future__ import annotations

import math

import pytest

from lightning_gossip.gossip_period import (
    DEFAULT_MARGIN,
    DEFAULT_MAX_PERIOD,
    PeriodDecision,
    PeriodTuner,
    choose_period,
    comm_compute_ratio,
    period_hides,
)


def test_defaults() -> None:
    assert DEFAULT_MARGIN == 1.1
    assert DEFAULT_MAX_PERIOD == 32  # the budget's floor: 1/32 of a replica per step


@pytest.mark.parametrize(("compute", "exchange", "period"), [
    (0.1, 0.0, 1),      # nothing to send
    (0.1, 0.05, 1),     # R = 0.5
    (0.1, 0.09, 1),     # R = 0.9: 0.99 of a step with the margin
    (0.1, 0.095, 2),    # R = 0.95: 1.045 steps with the margin
    (0.1, 0.1, 2),      # R = 1: 1.1 steps
    (0.1, 0.25, 3),     # R = 2.5: 2.75 steps
    (0.1, 0.2, 3),      # R = 2: 2.2 steps
    (0.357, 0.196, 1),  # the testbed's 2x2 at 200 Mbit/s (issue 47): R 0.55
    (0.1, 0.9, 10),     # R = 9: 9.9 steps
    (0.1, 2.9, 32),     # R = 29: 31.9 steps
    (0.1, 3.0, 32),     # R = 30: 33 steps, clipped
    (0.1, 1e6, 32),     # R = 1e7, clipped
])
def test_policy_with_the_default_margin(compute: float, exchange: float, period: int) -> None:
    assert choose_period(compute, exchange) == period


def test_policy_margin_and_range() -> None:
    assert choose_period(0.1, 0.095, margin=1.0) == 1  # R < 1 hides behind one step
    assert choose_period(0.1, 0.1, margin=1.0) == 1  # exactly one step
    assert choose_period(0.1, 0.25, margin=1.0) == 3
    # 1.5 x 0.2 / 0.1 is 3.0000000000000004 in floating point: still 3, not 4
    assert 1.5 * 0.2 / 0.1 > 3
    assert choose_period(0.1, 0.2, margin=1.5) == 3
    assert choose_period(0.3, 1.75, margin=1.2) == 7  # 7.000000000000001
    assert choose_period(0.1, 0.25, margin=1.2) == 3
    assert choose_period(0.1, 0.25, margin=1.25) == 4
    assert choose_period(0.1, 0.25, margin=0.5) == 2  # a margin below 1 accepts exposure
    assert choose_period(0.1, 10.0, max_period=8) == 8
    assert choose_period(0.1, 0.25, max_period=1) == 1


@pytest.mark.parametrize("margin", [1.0, 1.1, 1.5])
def test_policy_is_the_smallest_hiding_period(margin: float) -> None:
    for compute in (0.013, 0.1, 0.357, 2.0):
        for ratio in [0.01 * k for k in range(1, 400, 7)]:
            exchange = ratio * compute
            n = choose_period(compute, exchange, margin=margin)
            if n < DEFAULT_MAX_PERIOD:
                assert period_hides(n, compute, exchange, margin)
            if n > 1:
                assert not period_hides(n - 1, compute, exchange, margin)
            # deterministic, monotone in the exchange time
            assert choose_period(compute, exchange, margin=margin) == n
            assert choose_period(compute, exchange * 1.5, margin=margin) >= n


@pytest.mark.parametrize(("args", "kwargs", "message"), [
    ((0.0, 0.1), {}, "compute_s must be a finite number of seconds > 0, got 0.0"),
    ((-0.1, 0.1), {}, "compute_s must be a finite number of seconds > 0"),
    ((math.nan, 0.1), {}, "compute_s must be a finite number of seconds > 0, got nan"),
    ((math.inf, 0.1), {}, "compute_s must be a finite number of seconds > 0, got inf"),
    ((0.1, -1.0), {}, "exchange_s must be a finite number of seconds >= 0, got -1.0"),
    ((0.1, math.nan), {}, "exchange_s must be a finite number of seconds >= 0, got nan"),
    (("fast", 0.1), {}, "compute_s must be a number of seconds, got 'fast'"),
    ((0.1, None), {}, "exchange_s must be a number of seconds, got None"),
    ((0.1, 0.2), {"margin": 0.0}, "margin must be a finite number > 0, got 0.0"),
    ((0.1, 0.2), {"margin": math.nan}, "margin must be a finite number > 0"),
    ((0.1, 0.2), {"max_period": 0}, "max_period must be an integer >= 1, got 0"),
    ((0.1, 0.2), {"max_period": 4.0}, "max_period must be an integer >= 1, got 4.0"),
    ((0.1, 0.2), {"max_period": True}, "max_period must be an integer >= 1, got True"),
])
def test_policy_refuses_bad_input(args: tuple, kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError) as e:
        choose_period(*args, **kwargs)
    assert message in str(e.value)


def test_ratio() -> None:
    assert comm_compute_ratio(0.1, 0.25) == pytest.approx(2.5)
    assert comm_compute_ratio(0.1, 0.0) == 0.0
    with pytest.raises(ValueError, match="compute_s must be"):
        comm_compute_ratio(0.0, 1.0)


def _feed(tuner: PeriodTuner, steps: list[tuple[float, float | None]]) -> list[int]:
    """Record ``steps``; the step counts at which a decision was due (and not taken)."""
    due = []
    for c, x in steps:
        tuner.record(c, x)
        if tuner.due:
            due.append(tuner.steps)
    return due


def test_tuner_first_decision_skips_the_warm_up() -> None:
    tuner = PeriodTuner(warmup_steps=2, measure_steps=5, recheck_every=None)
    assert tuner.period == 1 and tuner.decision is None and tuner.next_check == 7
    # two warm-up steps 100x slower, then compute 0.1 s and exchanges near 0.25 s
    steps = [(10.0, 30.0), (10.0, 30.0), (0.1, 0.25), (0.11, 0.24), (0.09, 0.26),
             (0.1, 0.25), (0.5, 0.25)]  # one outlier step: the median ignores it
    for i, (c, x) in enumerate(steps):
        assert not tuner.due
        tuner.record(c, x)
        assert tuner.steps == i + 1
    assert tuner.due
    assert tuner.local_values() == (0.1, 0.25)
    d = tuner.decide(*tuner.local_values())
    assert d == PeriodDecision(period=3, compute_s=0.1, exchange_s=0.25, ratio=2.5, hidden=True,
                               margin=1.1, step=7, compute_samples=5, exchange_samples=5)
    assert tuner.period == 3 and tuner.decision == d and tuner.decisions == (d,)
    assert not tuner.due and tuner.next_check is None  # recheck_every=None: never again
    _feed(tuner, [(0.1, None)] * 50)
    assert not tuner.due and tuner.period == 3
    assert "period 3 (compute 100.0 ms/step, exchange 250.0 ms, R 2.50; hidden" in d.describe()
    assert d.as_dict()["period"] == 3


def test_tuner_rechecks_on_a_schedule_of_steps() -> None:
    tuner = PeriodTuner(warmup_steps=1, measure_steps=3, recheck_every=10)
    assert _feed(tuner, [(1.0, 1.0)] + [(0.1, 0.05)] * 3) == [4]
    assert tuner.decide(*tuner.local_values()).period == 1
    assert tuner.next_check == 14
    # the link slows down: exchanges of 0.45 s, every step at period 1
    assert _feed(tuner, [(0.1, 0.45)] * 9) == []
    assert not tuner.due
    tuner.record(0.1, 0.45)
    assert tuner.due and tuner.steps == 14
    # the new window's medians only (the first window's 0.05 s exchanges are gone)
    assert tuner.local_values() == (0.1, 0.45)
    d = tuner.decide(*tuner.local_values())
    assert (d.period, d.step, d.compute_samples, d.exchange_samples) == (5, 14, 10, 10)
    assert tuner.next_check == 24
    # at period 5 a window of 10 steps holds 2 exchanges; no warm-up is dropped after the first
    window = [(0.1, 0.2 if i % 5 == 4 else None) for i in range(10)]
    assert _feed(tuner, window) == [24]
    assert tuner.local_values() == (0.1, 0.2)
    assert tuner.decide(*tuner.local_values()).period == 3
    assert [d.period for d in tuner.decisions] == [1, 5, 3]


def test_tuner_window_without_an_exchange_keeps_the_last_one() -> None:
    tuner = PeriodTuner(warmup_steps=0, measure_steps=2, recheck_every=3, max_period=8)
    _feed(tuner, [(0.1, 2.0), (0.1, 2.0)])
    d = tuner.decide(*tuner.local_values())
    assert (d.period, d.hidden) == (8, False)  # R = 20: not hidden even at the longest period
    assert "not hidden even at period 8" in d.describe()
    _feed(tuner, [(0.2, None)] * 3)  # period 8 > 3 steps: no exchange in the window
    assert tuner.due
    assert tuner.local_values() == (0.2, 2.0)


def test_tuner_needs_an_exchange_before_the_first_decision() -> None:
    tuner = PeriodTuner(warmup_steps=1, measure_steps=2)
    _feed(tuner, [(0.1, 0.1), (0.1, None), (0.1, None)])  # the only exchange was warm-up
    assert tuner.due
    with pytest.raises(RuntimeError, match="no exchange time recorded before the first"):
        tuner.local_values()
    with pytest.raises(RuntimeError, match="no compute time recorded"):
        PeriodTuner().local_values()


def test_tuner_ranks_agree_through_the_cross_rank_max() -> None:
    """Two dpsgd ranks with different measurements and different exchange samples: due at the
    same step (a function of the step count only); the maxima give one period on both."""
    fast, slow = PeriodTuner(warmup_steps=1, measure_steps=4), PeriodTuner(warmup_steps=1,
                                                                          measure_steps=4)
    due_fast = _feed(fast, [(0.5, 0.5)] + [(0.1, 0.12)] * 4)
    due_slow = _feed(slow, [(0.5, 0.5)] + [(0.14, 0.3), (0.14, None), (0.14, 0.3), (0.14, 0.3)])
    assert due_fast == due_slow == [5]
    local = [fast.local_values(), slow.local_values()]
    assert local == [(0.1, 0.12), (0.14, 0.3)]
    # what the strategy's all-reduce(MAX) of the 2-value tensors returns on every rank
    c_max, x_max = (max(v) for v in zip(*local))
    decisions = [t.decide(c_max, x_max) for t in (fast, slow)]
    assert decisions[0].period == decisions[1].period == 3  # 1.1 x 0.3 / 0.14 = 2.36
    assert decisions[0].compute_s == decisions[1].compute_s == 0.14
    # each rank's own values would have disagreed
    assert choose_period(*local[0]) == 2 and choose_period(*local[1]) == 3


def test_tuner_exchanges_off_the_step_cadence() -> None:
    """A gossip thread's exchanges: several, or none, per step (adpsgd)."""
    tuner = PeriodTuner(warmup_steps=1, measure_steps=2, recheck_every=None)
    tuner.record_exchange(5.0)  # during the warm-up step: dropped
    tuner.record(5.0)
    for x in (0.2, 0.3, 0.4):
        tuner.record_exchange(x)
    tuner.record(0.1)
    tuner.record(0.1)  # no exchange in this step
    assert tuner.due
    assert tuner.local_values() == (0.1, 0.3)
    d = tuner.decide(*tuner.local_values())
    assert (d.period, d.compute_samples, d.exchange_samples) == (4, 2, 3)  # 1.1 x 3 = 3.3
    with pytest.raises(ValueError, match="exchange_s must be a finite number of seconds"):
        tuner.record_exchange(-0.1)


def test_tuner_keeps_the_latest_samples_and_refuses_bad_input() -> None:
    tuner = PeriodTuner(warmup_steps=0, measure_steps=6, max_samples=3)
    _feed(tuner, [(9.0, 9.0)] * 3 + [(0.1, 0.25)] * 3)
    assert tuner.local_values() == (0.1, 0.25)  # the 9 s samples fell out of the window
    with pytest.raises(ValueError, match="compute_s must be a finite number of seconds >= 0"):
        tuner.record(-1.0)
    with pytest.raises(ValueError, match="exchange_s must be a finite number of seconds >= 0"):
        tuner.record(0.1, math.inf)
    for kwargs, message in [({"warmup_steps": -1}, "warmup_steps must be an integer >= 0"),
                            ({"measure_steps": 0}, "measure_steps must be an integer >= 1"),
                            ({"recheck_every": 0}, "recheck_every must be an integer >= 1"),
                            ({"max_samples": 0}, "max_samples must be an integer >= 1"),
                            ({"margin": -1.0}, "margin must be a finite number > 0"),
                            ({"max_period": 0}, "max_period must be an integer >= 1")]:
        with pytest.raises(ValueError, match=message):
            PeriodTuner(**kwargs)
