"""The options every gossip strategy takes (those of
:class:`~lightning_gossip.strategies.gossip.GossipStrategy`), checked in one place when a strategy
is constructed, so bad input fails before any process starts."""

from __future__ import annotations

from datetime import timedelta
from typing import Literal

from lightning_gossip.budget import GossipPeriod, check_gossip_every_n_steps
from lightning_gossip.outer import OuterOptimizer, check_outer
from lightning_gossip.overlapped_allreduce import NodeAllreduce
from lightning_gossip.pairing import check_pairing_name
from lightning_gossip.topology import check_name

__all__ = ["EVALUATE_CHOICES", "NODE_ALLREDUCE_CHOICES", "Backend", "Evaluate", "SharedCursor",
           "check_adpsgd", "check_dpsgd", "check_max_staleness", "check_options", "check_remedies",
           "check_shared_cursor"]

#: ``evaluate=``: validation and test on the average of the replicas, or on each rank's own
Evaluate = Literal["consensus", "local"]
#: ``ADPSGDStrategy(shared_cursor=)``: off, greedy to the epoch's end, or with a balanced end
SharedCursor = bool | Literal["balanced"]
#: ``process_group_backend=`` (``None``: from the device)
Backend = Literal["gloo", "nccl"]

EVALUATE_CHOICES: tuple[Evaluate, ...] = ("consensus", "local")


def check_options(*, evaluate: Evaluate | str, consensus_every_n_steps: int | None,
                  process_group_backend: Backend | str | None, timeout: timedelta | float,
                  heartbeat_timeout: float | None) -> timedelta:
    """Raise ``ValueError`` naming the first bad option; return ``timeout`` as a
    ``timedelta``.

    >>> check_options(evaluate="local", consensus_every_n_steps=None, process_group_backend=None,
    ...               timeout=30, heartbeat_timeout=None)
    datetime.timedelta(seconds=30)
    """
    if heartbeat_timeout is not None and not float(heartbeat_timeout) > 0:
        raise ValueError(
            f"heartbeat_timeout must be positive or None, got {heartbeat_timeout!r}")
    if evaluate not in EVALUATE_CHOICES:
        raise ValueError(f"evaluate must be one of {EVALUATE_CHOICES}, got {evaluate!r}")
    if consensus_every_n_steps is not None and (
        not isinstance(consensus_every_n_steps, int) or consensus_every_n_steps < 1
    ):
        raise ValueError(
            "consensus_every_n_steps must be a positive integer or None, "
            f"got {consensus_every_n_steps!r}"
        )
    if process_group_backend not in (None, "gloo", "nccl"):
        raise ValueError(
            "process_group_backend must be 'gloo', 'nccl' or None, "
            f"got {process_group_backend!r}"
        )
    if not isinstance(timeout, timedelta):
        timeout = timedelta(seconds=float(timeout))
    if timeout.total_seconds() <= 0:
        raise ValueError(f"timeout must be positive, got {timeout}")
    return timeout


def check_dpsgd(topology: object, elastic: bool, hierarchical: bool,
                heartbeat_timeout: float | None, start_timeout: float | None,
                node_allreduce: str, gossip_every_n_steps: GossipPeriod) -> GossipPeriod:
    """``DPSGDStrategy``'s own options (``ValueError`` naming the option): those of
    :func:`check_elastic`; a topology name must be known, and an elastic fit needs one (the
    survivors rebuild the topology by its name) and gossips every step
    (:func:`~lightning_gossip.budget.check_gossip_every_n_steps`); returns
    ``gossip_every_n_steps`` as given."""
    check_elastic("DPSGDStrategy", elastic, hierarchical, heartbeat_timeout, start_timeout,
                  node_allreduce)
    if elastic and not isinstance(topology, str):
        raise ValueError("DPSGDStrategy(elastic=True) rebuilds the topology over the "
                         f"survivors by its name: give a name, not {type(topology).__name__}")
    if isinstance(topology, str):
        check_name(topology)  # fail at construction, not on every rank at set-up
    return check_gossip_every_n_steps(gossip_every_n_steps, elastic=elastic,
                                      owner="DPSGDStrategy")


def check_adpsgd(pairing: str, max_staleness: int | None, shared_cursor: SharedCursor | str,
                 elastic: bool, hierarchical: bool, heartbeat_timeout: float | None,
                 start_timeout: float | None, node_allreduce: str,
                 gossip_every_n_steps: GossipPeriod) -> tuple[SharedCursor, GossipPeriod]:
    """``ADPSGDStrategy``'s own options (``ValueError`` naming the option): those of
    :func:`check_elastic`, the pairing's name, ``max_staleness``, ``shared_cursor``
    (:func:`check_shared_cursor`) and ``gossip_every_n_steps`` (1 with ``elastic``:
    :func:`~lightning_gossip.budget.check_gossip_every_n_steps`); returns ``shared_cursor``
    and ``gossip_every_n_steps`` as given."""
    check_elastic("ADPSGDStrategy", elastic, hierarchical, heartbeat_timeout, start_timeout,
                  node_allreduce)
    check_pairing_name(pairing)
    check_max_staleness(max_staleness)
    return (check_shared_cursor(shared_cursor, elastic),
            check_gossip_every_n_steps(gossip_every_n_steps, elastic=elastic,
                                       owner="ADPSGDStrategy"))


def check_max_staleness(max_staleness: int | None) -> None:
    """``ADPSGDStrategy(max_staleness=)``: raise ``ValueError`` unless a non-negative integer or
    ``None``."""
    if max_staleness is not None and (not isinstance(max_staleness, int) or max_staleness < 0):
        raise ValueError(
            f"max_staleness must be a non-negative integer or None, got {max_staleness!r}")


def check_elastic(strategy: str, elastic: bool, hierarchical: bool,
                  heartbeat_timeout: float | None, start_timeout: float | None = None,
                  node_allreduce: str = "after_backward") -> None:
    """``<strategy>(elastic=True)``: raise ``ValueError`` without a heartbeat (lost ranks are
    found by it), and with ``hierarchical=True`` unless the node all-reduce runs after backward
    and there is no ``start_timeout`` (:mod:`~lightning_gossip.elastic.nodes`);
    ``start_timeout`` needs ``elastic=True`` and is not negative.

    >>> check_elastic("DPSGDStrategy", True, True, 60.0, start_timeout=5.0)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: DPSGDStrategy(elastic=True, hierarchical=True) is not supported yet with ...
    """
    if elastic and heartbeat_timeout is None:
        raise ValueError(f"{strategy}(elastic=True) needs a heartbeat_timeout (lost ranks are "
                         "found by their heartbeat)")
    if elastic and hierarchical and (start_timeout is not None
                                     or node_allreduce != "after_backward"):
        raise ValueError(f"{strategy}(elastic=True, hierarchical=True) is not supported yet with "
                         "start_timeout or node_allreduce='overlapped'")
    if start_timeout is not None and (not elastic or not float(start_timeout) >= 0):
        raise ValueError(f"{strategy}(start_timeout={start_timeout!r}) needs elastic=True and "
                         "a number of seconds >= 0 (the others join the running fit)")


def check_shared_cursor(shared_cursor: SharedCursor | str, elastic: bool) -> SharedCursor:
    """``ADPSGDStrategy(shared_cursor=)``: ``True``, ``False`` or ``"balanced"`` (not with
    ``elastic=True``: a lost rank could not take the units left to it); returned as given.

    >>> check_shared_cursor("balanced", elastic=False)
    'balanced'
    """
    if shared_cursor not in (True, False, "balanced"):
        raise ValueError(f"shared_cursor must be True, False or 'balanced', got {shared_cursor!r}")
    if shared_cursor == "balanced" and elastic:
        raise ValueError("shared_cursor='balanced' cannot go with elastic=True (a lost rank "
                         "could not take the units left to it); use shared_cursor=True")
    return shared_cursor


#: ``node_allreduce``: when the node's gradient all-reduce runs (hierarchical gossip)
NODE_ALLREDUCE_CHOICES: tuple[NodeAllreduce, ...] = ("after_backward", "overlapped")


def check_remedies(outer_lr: float | None, outer_momentum: float, outer_nesterov: bool,
                   node_allreduce: str, global_average_every_n_steps: int | None,
                   hierarchical: bool) -> OuterOptimizer | None:
    """Check the outer optimizer's options and ``node_allreduce`` (``ValueError`` naming the
    option); return the :class:`~lightning_gossip.outer.OuterOptimizer` (``None`` without
    ``outer_lr``).

    >>> check_remedies(0.7, 0.9, True, "overlapped", global_average_every_n_steps=50,
    ...                hierarchical=True)
    OuterOptimizer(lr=0.7, momentum=0.9, nesterov=True)
    """
    if node_allreduce not in NODE_ALLREDUCE_CHOICES:
        raise ValueError(
            f"node_allreduce must be one of {NODE_ALLREDUCE_CHOICES}, got {node_allreduce!r}")
    if node_allreduce != "after_backward" and not hierarchical:
        raise ValueError(
            f"node_allreduce={node_allreduce!r} acts on the node's gradient all-reduce of "
            "hierarchical=True: set hierarchical=True too")
    return check_outer(outer_lr, outer_momentum, outer_nesterov, global_average_every_n_steps)
