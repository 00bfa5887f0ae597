"""The period policy of ``gossip_every_n_steps="auto"``: the smallest period whose exchange
hides behind the compute of its steps (:func:`choose_period`), and the ratio R. Why this is
the cost model's condition: :mod:`lightning_gossip.gossip_period`."""

from __future__ import annotations

import math

__all__ = ["DEFAULT_MARGIN", "DEFAULT_MAX_PERIOD", "choose_period", "comm_compute_ratio",
           "period_hides"]

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
