"""Collectives over whole replicas: the exact average and the consensus distance.

These run on a process group's main thread (the default group unless one is given) and are the
only all-reduces gossip training uses: for evaluation, checkpoints, the final average and the
occasional consensus-distance measurement, never per step.

Example (inside an initialised process group)::

    flat = FlatState(model).pack()
    avg = all_average(flat)                 # the same vector on every rank
    d = consensus_distance(flat)            # mean_i ||x_i - avg||^2 / ||avg||^2

The per-rank term needs no process group:

    >>> import torch
    >>> float(relative_distance(torch.tensor([1.0, 3.0]), torch.tensor([2.0, 2.0])))
    0.25
    >>> float(relative_distance(torch.tensor([1.0]), torch.tensor([0.0])))  # zero mean
    1.0
    >>> check_every("global_average_every_n_steps", 0)
    Traceback (most recent call last):
    ...
    ValueError: global_average_every_n_steps must be a positive integer or None, got 0
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_gossip.liveness.collectives import watched_collective

__all__ = ["all_average", "check_every", "consensus_distance", "relative_distance"]


def all_average(flat: Tensor, group: dist.ProcessGroup | None = None, *,
                timeout: timedelta | None = None, what: str = "averaging the replicas") -> Tensor:
    """The element-wise mean of ``flat`` over the ranks of ``group`` (a new tensor).

    With ``timeout`` the all-reduce is waited for like a gossip wait
    (:func:`~lightning_gossip.liveness.watched_collective`): a rank that stops beating makes the
    others fail naming it and ``what``; without, it is a plain blocking all-reduce.
    """
    out = flat.detach().clone()
    _sum(out, group, timeout, what)
    out.div_(dist.get_world_size(group))
    return out


def relative_distance(x: Tensor, mean: Tensor) -> Tensor:
    """``||x - mean||^2 / ||mean||^2`` as a 0-d fp64 tensor (0 when ``mean`` is zero)."""
    num = (x.double() - mean.double()).square().sum()
    den = mean.double().square().sum()
    return torch.where(den > 0, num / den.clamp_min(1e-300), num)


def consensus_distance(flat: Tensor, group: dist.ProcessGroup | None = None, *,
                       timeout: timedelta | None = None,
                       what: str = "measuring the consensus distance") -> float:
    """Mean over ranks of ``||x_i - mean||^2 / ||mean||^2``: 0 when all replicas agree.

    ``timeout`` and ``what`` as for :func:`all_average`.
    """
    mean = all_average(flat, group, timeout=timeout, what=what)
    local = relative_distance(flat, mean).to(flat.device)
    _sum(local, group, timeout, what)
    return float(local) / dist.get_world_size(group)


def _sum(t: Tensor, group: dist.ProcessGroup | None, timeout: timedelta | None,
         what: str) -> None:
    """In-place sum over the ranks of ``group``; watched when ``timeout`` is given."""
    if timeout is None:
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    else:
        watched_collective(dist.all_reduce, t, op=dist.ReduceOp.SUM, group=group,
                           timeout=timeout, what=what)


def check_every(name: str, value: int | None) -> int | None:
    """``value`` if it is a positive integer or ``None`` (an "every n steps" option), else
    ``ValueError`` naming the option ``name``."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer or None, got {value!r}")
    return value
