"""The communication budget: ``gossip_every_n_steps``, local optimizer steps per gossip exchange,
checked and resolved in one place for every way the strategies are built (Trainer, Fabric,
:func:`~lightning_gossip.plain_loop.attach`).

A period ``n`` divides the bytes each rank sends per step by ``n``: ``dpsgd`` exchanges at every
``n``-th step only (:class:`~lightning_gossip.sync_gossip.schedule.RoundSchedule`), an
``adpsgd`` active rank starts an exchange at most once every ``n`` steps. With
``wire_dtype="bf16"`` a period of 32 sends 1/32 of a bf16 replica per step on average
(``docs/strategies.md``, Communication budget).

:func:`resolve_gossip_every_n_steps` is the one place where a given value becomes the period an
engine runs with; ``"auto"`` (a period picked from measured compute and exchange times) is
accepted by the type and refused there until its policy is wired in.

>>> check_gossip_every_n_steps(4)
4
>>> check_gossip_every_n_steps(0)  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
ValueError: gossip_every_n_steps must be a positive integer (local optimizer steps per ..., got 0
"""

from __future__ import annotations

from typing import Literal, Union

__all__ = ["AUTO", "GossipPeriod", "check_gossip_every_n_steps", "resolve_gossip_every_n_steps"]

#: the value that asks the strategy to pick the period itself
AUTO = "auto"
#: ``gossip_every_n_steps=``: local optimizer steps per gossip exchange, or ``"auto"``
GossipPeriod = Union[int, Literal["auto"]]  # noqa: UP007 - a runtime alias on Python 3.10


def resolve_gossip_every_n_steps(value: GossipPeriod) -> int:
    """The period an engine runs with for the option's ``value`` (``ValueError`` for a bad
    one). ``"auto"`` is refused until its policy (measure compute and exchange, pick the
    smallest period whose exchange hides behind the steps) is wired in here."""
    if value == AUTO:
        raise ValueError(
            "gossip_every_n_steps='auto' is not available yet in this version: give the number "
            "of local optimizer steps per gossip exchange (1 exchanges every step)")
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError("gossip_every_n_steps must be a positive integer (local optimizer "
                         f"steps per gossip exchange), got {value!r}")
    return value


def check_gossip_every_n_steps(value: GossipPeriod, *, elastic: bool = False,
                               owner: str = "the strategy") -> GossipPeriod:
    """Check the option at construction (``ValueError`` naming it), returned as given. With
    ``elastic=True`` only 1 is supported: survivors resume their rounds at steps of their own,
    so they would not agree on which steps exchange.

    >>> check_gossip_every_n_steps(2, elastic=True, owner="DPSGDStrategy")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: DPSGDStrategy(elastic=True, gossip_every_n_steps=2) is not supported: ...
    """
    period = resolve_gossip_every_n_steps(value)
    if elastic and period != 1:
        raise ValueError(f"{owner}(elastic=True, gossip_every_n_steps={value!r}) is not "
                         "supported: an elastic fit gossips every step (gossip_every_n_steps=1)")
    return value
