"""The communication budget: ``gossip_every_n_steps``, local optimizer steps per gossip exchange,
checked and resolved in one place for every way the strategies are built (Trainer, Fabric,
:func:`~lightning_gossip.plain_loop.attach`).

A period ``n`` divides the bytes each rank sends per step by ``n``: ``dpsgd`` exchanges at every
``n``-th step only (:class:`~lightning_gossip.sync_gossip.schedule.RoundSchedule`), an
``adpsgd`` active rank starts an exchange at most once every ``n`` steps. With
``wire_dtype="bf16"`` a period of 32 sends 1/32 of a bf16 replica per step on average
(``docs/strategies.md``, Communication budget).

:func:`resolve_gossip_every_n_steps` is the one place where a given value becomes the period an
engine starts with, :func:`auto_period` the one where it becomes the settings of ``"auto"``
(a period picked from measured compute and exchange times while training,
:mod:`lightning_gossip.gossip_period`; driven by
:class:`~lightning_gossip.gossip_period.auto.PeriodDriver`): ``"auto"`` or an
:class:`~lightning_gossip.gossip_period.AutoPeriod` (its settings) starts at period 1.

>>> check_gossip_every_n_steps(4)
4
>>> check_gossip_every_n_steps(0)  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
ValueError: gossip_every_n_steps must be a positive integer (local optimizer steps per ..., got 0
"""

from __future__ import annotations

from typing import Literal, Union

from lightning_gossip.gossip_period import AutoPeriod

__all__ = ["AUTO", "GossipPeriod", "auto_period", "check_gossip_every_n_steps",
           "resolve_gossip_every_n_steps"]

#: the value that asks the strategy to pick the period itself
AUTO = "auto"
#: ``gossip_every_n_steps=``: local optimizer steps per gossip exchange, ``"auto"``, or
#: ``"auto"``'s settings (:class:`~lightning_gossip.gossip_period.AutoPeriod`)
GossipPeriod = Union[int, Literal["auto"], AutoPeriod]  # noqa: UP007 - a runtime alias (3.10)


def auto_period(value: GossipPeriod) -> AutoPeriod | None:
    """The settings of ``"auto"`` for the option's ``value`` (``"auto"``: the defaults), or
    ``None`` for a fixed period.

    >>> auto_period("auto") == AutoPeriod(), auto_period(4)
    (True, None)
    """
    if isinstance(value, AutoPeriod):
        return value
    return AutoPeriod() if isinstance(value, str) and value == AUTO else None


def resolve_gossip_every_n_steps(value: GossipPeriod) -> int:
    """The period an engine starts with for the option's ``value`` (``ValueError`` for a bad
    one): the value itself, or 1 for ``"auto"`` (its first decision comes after the steps it
    measures)."""
    if auto_period(value) is not None:
        return 1
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError("gossip_every_n_steps must be a positive integer (local optimizer "
                         f"steps per gossip exchange), got {value!r}")
    return value


def check_gossip_every_n_steps(value: GossipPeriod, *, elastic: bool = False,
                               owner: str = "the strategy") -> GossipPeriod:
    """Check the option at construction (``ValueError`` naming it), returned as given. With
    ``elastic=True`` only 1 is supported: survivors resume their rounds at steps of their own,
    so they would not agree on which steps exchange (nor on the steps of a period ``"auto"``
    picks: it is refused too).

    >>> check_gossip_every_n_steps(2, elastic=True, owner="DPSGDStrategy")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: DPSGDStrategy(elastic=True, gossip_every_n_steps=2) is not supported: ...
    """
    period = resolve_gossip_every_n_steps(value)
    if elastic and (period != 1 or auto_period(value) is not None):
        raise ValueError(f"{owner}(elastic=True, gossip_every_n_steps={value!r}) is not "
                         "supported: an elastic fit gossips every step (gossip_every_n_steps=1)")
    return value
