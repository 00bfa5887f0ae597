"""Lightning's collective API (``reduce``, ``barrier``, ``broadcast``) for the gossip strategies,
each a watched wait: ``watched(collective, *args, what=..., group=..., **kwargs)`` runs the
collective with ``async_op=True`` and fails fast, naming the rank, when a rank of the group stops
beating (:meth:`~lightning_gossip.strategies.gossip.GossipStrategy.watched`)."""

from __future__ import annotations

import pickle
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_gossip import _compat

#: ``watched(collective, *args, what=..., group=..., **kwargs)``
Watched = Callable[..., None]


def reduce(tensor: Tensor, group: Any | None, reduce_op: Any | None, watched: Watched) -> Tensor:
    """All-reduce ``tensor`` in place (mean for ``None``, ``"mean"`` or ``"avg"``; ``"sum"``,
    ``"max"``, ... or a ``ReduceOp``); anything but a tensor, or without a process group, is
    returned as is."""
    if not isinstance(tensor, Tensor) or not _compat.distributed_is_initialized():
        return tensor
    mean = isinstance(reduce_op, str) and reduce_op.lower() in ("mean", "avg")
    if reduce_op is None or mean:
        op = dist.ReduceOp.SUM
    elif isinstance(reduce_op, str):
        op = getattr(dist.ReduceOp, reduce_op.upper())
    else:
        op = reduce_op
    watched(dist.all_reduce, tensor, op=op, group=group,
            what=f"the all-reduce of a logged or monitored value ({reduce_op})")
    if not mean:
        return tensor
    n = dist.get_world_size(group)
    if not torch.is_floating_point(tensor):
        return tensor.copy_(tensor / n)
    return tensor.div_(n)


def barrier(name: str | None, device: torch.device, watched: Watched) -> None:
    """Wait for every rank (no-op without a process group)."""
    if not _compat.distributed_is_initialized():
        return
    extra: dict[str, Any] = {}
    if dist.get_backend() == "nccl" and device.type == "cuda":
        extra["device_ids"] = [device.index]
    watched(dist.barrier, what=f"the barrier {name or ''}".rstrip(), **extra)


def broadcast_object(obj: Any, src: int, group: Any | None, rank: int, device: torch.device,
                     watched: Watched) -> Any:
    """``obj`` from global rank ``src`` on every rank of ``group`` (``rank``: this one's): its
    pickled bytes as a length and a byte tensor (on ``device`` with NCCL), each watched."""
    device = device if dist.get_backend(group) == "nccl" else torch.device("cpu")
    mine = rank == src
    data = (torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8) if mine
            else torch.empty(0, dtype=torch.uint8))
    size = torch.tensor([data.numel()], dtype=torch.int64, device=device)
    what = f"the broadcast of an object from rank {src}"
    watched(dist.broadcast, size, src=src, group=group, what=what)
    buf = data.to(device) if mine else torch.empty(int(size.item()), dtype=torch.uint8,
                                                   device=device)
    watched(dist.broadcast, buf, src=src, group=group, what=what)
    return obj if mine else pickle.loads(buf.cpu().numpy().tobytes())  # noqa: S301


def sync_metrics_over(module: torch.nn.Module | None, group: Any) -> None:
    """Make the torchmetrics ``Metric``\\ s in ``module`` gather over ``group`` (their
    ``process_group``) when Lightning computes them: an elastic fit's collectives move to the
    live ranks' group after a loss or a join, and a metric would otherwise still gather over the
    default group, whose lost ranks never answer."""
    if module is None:
        return
    from torchmetrics import Metric

    for metric in module.modules():
        if isinstance(metric, Metric):
            metric.process_group = group


def batches_mark(had_batches: bool, rank: int, world_size: int) -> list[float]:
    """This rank's two values in a maximum all-reduce at a training epoch's end that finds the
    rank of :func:`share_epoch_values`: whether it trained no batch in the epoch, and
    ``world_size - rank`` when it trained one (the maximum names the lowest such rank).

    >>> marks = [batches_mark(r != 0, r, 3) for r in range(3)]  # rank 0 trained none
    >>> marks
    [[1.0, 0.0], [0.0, 2.0], [0.0, 1.0]]
    >>> batches_source([max(m) for m in zip(*marks)], world_size=3)  # rank 1 shares
    1
    >>> batches_source([0.0, 3.0], world_size=3) is None  # every rank trained one
    True
    """
    return [float(not had_batches), float(world_size - rank) if had_batches else 0.0]


def batches_source(reduced: Sequence[float], world_size: int) -> int | None:
    """The lowest rank that trained a batch in the epoch, from the maximum of every rank's
    :func:`batches_mark`; ``None`` when every rank trained one (nothing to share) or none did."""
    without, lowest = reduced
    return world_size - int(lowest) if without > 0 and lowest > 0 else None


def share_epoch_values(trainer: Any, had_batches: bool, watched: Watched,
                       reduced: Sequence[float] | None = None) -> None:
    """At a training epoch's end, on every live rank: when some rank trained no batch in the
    epoch, the lowest rank that trained one sends what it logged to be reduced at the epoch's
    end (``_compat.logged_epoch_values``), and each rank without a batch registers it
    (``_compat.register_epoch_values``), so that it takes part in each of Lightning's
    reductions of those values instead of skipping them: a skipped one meets another
    collective (under the real SLURM: the members in a torchmetrics metric's gather, a
    newcomer without a batch in ``ModelCheckpoint``'s ``reduce_boolean_decision``).

    ``reduced``: the maximum of every rank's :func:`batches_mark` (``adpsgd``'s epoch-end
    meeting carries it); ``None``: all-reduced here first (one watched all-reduce of two
    numbers over the live ranks). ``watched``: the strategy's watched wait."""
    rank, world = trainer.global_rank, trainer.world_size
    device = trainer.strategy.root_device
    device = device if dist.get_backend() == "nccl" else torch.device("cpu")
    if reduced is None:
        marks = torch.tensor(batches_mark(had_batches, rank, world), device=device)
        watched(dist.all_reduce, marks, op=dist.ReduceOp.MAX,
                what="the epoch-end count of the ranks without a batch")
        reduced = marks.tolist()
    src = batches_source(reduced, world)
    if src is None:
        return
    logged = broadcast_object(_compat.logged_epoch_values(trainer) if rank == src else None,
                              src, None, rank, device, watched)
    if not had_batches:
        _compat.register_epoch_values(trainer, logged)
