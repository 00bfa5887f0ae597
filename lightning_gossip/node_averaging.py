"""Inside a node of hierarchical gossip: :class:`NodeAverager`, the gradients and floating
buffers averaged over the ranks of one node, the node's all-reduce and all-gather, with waits
that watch the heartbeats; and the layout of set-up, checked over every rank
(:func:`check_node_layout`, :func:`node_layout`).

Its owners: the Trainer strategies (:class:`~lightning_gossip.strategies.DPSGDStrategy`,
:class:`~lightning_gossip.strategies.ADPSGDStrategy`, as ``strategy.node``), and
:class:`~lightning_gossip.plain_loop.Gossip` (``gossip.node``), which serves the Fabric
strategies and ``attach()``; ``None`` when flat. This module imports no Lightning.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_gossip.errors import GossipTimeout, PeerSilent
from lightning_gossip.flat import FlatState
from lightning_gossip.hierarchy import NodeLayout, check_layout
from lightning_gossip.liveness import GRACE_S, Heartbeat, keep_alive_at_exit, wait_for_peers
from lightning_gossip.overlapped_allreduce import OverlappedAllReduce

__all__ = ["NodeAverager", "check_node_layout", "node_layout"]


def check_node_layout(world_size: int, rank: int, node_rank: int, local_rank: int,
                      num_nodes: int, devices: int) -> None:
    """Gather ``(rank, node_rank, local_rank)`` of every rank (a collective on the default
    group) and check the layout: the same ``ValueError`` on every rank."""
    entries: list[Any] = [None] * world_size
    dist.all_gather_object(entries, (rank, node_rank, local_rank))
    check_layout(entries, num_nodes, devices)


def node_layout(rank: int, world_size: int, layout: NodeLayout | None = None) -> NodeLayout:
    """This rank's place in the nodes, checked over every rank: ``layout`` when given, else
    torchrun's environment (``LOCAL_WORLD_SIZE`` processes per node, this rank's node
    ``GROUP_RANK`` and its ``LOCAL_RANK``). The check (:func:`check_node_layout`) is a collective
    on the default group, so every rank calls this at the same point and a bad layout raises
    the same ``ValueError`` on every rank.

    Raises ``ValueError`` without ``layout`` when torchrun's variables are not set (a launch by
    another launcher: give ``layout=NodeLayout(num_nodes, devices, node, local)``).
    """
    if layout is None:
        try:
            devices = int(os.environ["LOCAL_WORLD_SIZE"])
            node, local = int(os.environ["GROUP_RANK"]), int(os.environ["LOCAL_RANK"])
        except KeyError as e:
            raise ValueError(
                f"hierarchical gossip needs the node layout: {e.args[0]} is not set (torchrun "
                "sets LOCAL_WORLD_SIZE, GROUP_RANK and LOCAL_RANK); under another launcher "
                "give layout=lightning_gossip.hierarchy.NodeLayout(num_nodes, "
                "processes_per_node, node_rank, local_rank)") from None
        if devices < 1 or world_size % devices:
            raise ValueError(f"hierarchical gossip needs nodes of equal size, but the world of "
                             f"{world_size} ranks has {devices} processes on this node")
        layout = NodeLayout(world_size // devices, devices, node, local)
    check_node_layout(world_size, rank, layout.node, layout.local, layout.num_nodes,
                      layout.devices)
    return layout


class NodeAverager:
    """Averaging over this rank's node (hierarchical gossip).

    Args:
        module: the replica's module (its parameters' gradients are averaged).
        flat: the replica's :class:`~lightning_gossip.flat.FlatState` (its tensors that are not
            parameters are the floating buffers, averaged after every step).
        layout: this rank's place in the nodes.
        group: the node's process group (the training thread's).
        timeout: limit for every wait.
        heartbeat: watched by every wait (a rank of the node that stops beating is named).
        step: the current step, for error messages.
        overlap: all-reduce the gradients in buckets as backward produces them
            (:class:`~lightning_gossip.overlapped_allreduce.OverlappedAllReduce`, the same
            values) instead of in one piece after backward.
    """

    def __init__(self, module: nn.Module, flat: FlatState, layout: NodeLayout,
                 group: dist.ProcessGroup, timeout: timedelta, heartbeat: Heartbeat | None,
                 step: Callable[[], int], overlap: bool = False) -> None:
        self.module = module
        self.layout = layout
        self.group = group
        self.timeout = timeout
        self.heartbeat = heartbeat
        self._step = step
        params = {id(p) for p in module.parameters()}
        self.buffers: list[Tensor] = [t for t in flat.tensors if id(t) not in params]
        self.overlap = overlap
        #: the last overlapped average (``overlap``; rebuilt when the trainable set changes)
        self.overlapped: OverlappedAllReduce | None = None
        #: an elastic fit's survivors' ``retry`` (:meth:`~.elastic.Survivors.retry`): an
        #: all-reduce that a loss elsewhere interrupted is issued again, on the node's new
        #: :attr:`group` (the survivors build one per membership change); ``None``: not elastic
        self.retry: Callable[[Callable[[], Tensor]], Tensor] | None = None
        #: what every gradient all-reduce carries besides the gradients (:meth:`ride`;
        #: ``None``: nothing)
        self.rider: Any = None

    def ride(self, rider: Any) -> None:
        """Carry ``rider``'s values in every gradient all-reduce from now on:
        ``rider.values()`` (a tensor of the same length on every rank of the node, at every
        step) is summed over the node with the gradients, and ``rider.summed(sums)`` is told
        the sums once the all-reduce returned, the same on every rank of the node. An elastic
        fit's join flags ride here (:class:`~lightning_gossip.elastic.joins.NodeJoins`): a
        collective of their own, entered by the ranks that think a look is due, could meet
        a node-mate's gradient all-reduce. Not with ``overlap`` (``ValueError``)."""
        if self.overlap:
            raise ValueError("the overlapped gradient all-reduce carries no other values "
                             "(node_allreduce='overlapped' with an elastic fit)")
        self.rider = rider

    def wrap(self, closure: Any) -> Any:
        """``closure`` (forward/backward), then the gradients averaged over the node; with
        ``overlap`` the all-reduce starts during backward, bucket by bucket."""
        if self.overlap:
            return functools.partial(self._overlapped().run, closure)

        def run() -> Any:
            result = closure()
            self.average_gradients()
            return result

        return run

    def _overlapped(self) -> OverlappedAllReduce:
        """The overlapped average over the trainable parameters (built again when they
        changed, e.g. a layer was frozen)."""
        params = [p for p in self.module.parameters() if p.requires_grad]
        built = self.overlapped
        if built is None or [id(p) for p in built.params] != [id(p) for p in params]:
            self.overlapped = OverlappedAllReduce(
                params, self.layout.devices,
                launch=lambda flat: dist.all_reduce(flat, group=self.group, async_op=True),
                wait=lambda works: self._wait(works, "gradient all-reduce (overlapped)"))
        return self.overlapped

    @torch.no_grad()
    def average_gradients(self) -> None:
        """One flat all-reduce (mean) of every parameter's gradient on the node group; a
        parameter without a gradient contributes zeros. It gets the node's average when some
        rank of the node has a gradient for it (a branch only some ranks used this step), so
        the optimizer steps it on every rank alike; it stays without one when no rank has."""
        params = [p for p in self.module.parameters() if p.requires_grad]
        rider = self.rider.values() if self.rider is not None else None
        if not params and rider is None:
            return
        grads = [p.grad for p in params]
        parts = [
            g.detach().reshape(-1).float() if g is not None
            else torch.zeros(p.numel(), device=p.device)
            for p, g in zip(params, grads)
        ]
        if params:
            parts.append(torch.tensor([float(g is not None) for g in grads],
                                      device=params[0].device))
        if rider is not None:  # (after the gradients: their sums go back to the rider)
            parts.append(rider.to(params[0].device if params else rider.device, torch.float32))
        flat = torch.cat(parts)
        self.all_reduce(flat, "gradient all-reduce")
        if rider is not None:
            flat, sums = flat.split([flat.numel() - rider.numel(), rider.numel()])
        flat.div_(self.layout.devices)
        *values, present = flat.split([p.numel() for p in params] + [len(params)])
        for p, g, v, has in zip(params, grads, values, present.tolist()):
            if g is None and has > 0:
                p.grad = g = torch.zeros_like(p)
            if g is not None:
                g.copy_(v.view_as(g))
        if rider is not None:
            self.rider.summed(sums.cpu())

    @torch.no_grad()
    def average_buffers(self) -> None:
        """Average the floating buffers (e.g. BatchNorm statistics) over the node, so its
        ranks hold bit-identical replicas."""
        if not self.buffers:
            return
        flat = torch.cat([b.reshape(-1).float() for b in self.buffers])
        self.all_reduce(flat, "buffer all-reduce")
        flat.div_(self.layout.devices)
        for b, v in zip(self.buffers, flat.split([b.numel() for b in self.buffers])):
            b.copy_(v.view_as(b))

    def all_reduce(self, flat: Tensor, what: str) -> None:
        """Sum ``flat`` over the node group, failing fast and naming the rank(s) when a rank of
        the node left after an error or stopped beating (instead of a bare gloo error, or a
        wait of ``timeout``). Elastic (:attr:`retry`): a loss found while it waits is survived,
        and the sum is taken again on the new group from the same values."""
        if self.retry is None:
            self._wait([dist.all_reduce(flat, group=self.group, async_op=True)], what)
            return
        values, retried = flat.clone(), [False]

        def attempt() -> Tensor:  # a retry sums a fresh copy of the same values (an
            mine = values.clone() if retried[0] else flat  # abandoned all-reduce keeps its own)
            retried[0] = True
            self._wait([dist.all_reduce(mine, group=self.group, async_op=True)], what)
            return mine

        summed = self.retry(attempt)
        if summed is not flat:
            flat.copy_(summed)

    def all_gather(self, mine: Tensor, out: Tensor) -> None:
        """``out`` = the node's ranks' ``mine``, in local-rank order (the slice deltas of
        sharded gossip); waits as :meth:`all_reduce` does."""
        slices = list(out.split(mine.numel()))
        work = dist.all_gather(slices, mine, group=self.group, async_op=True)
        self._wait([work], "all-gather of the gossip deltas")

    def _wait(self, works: list[Any], what: str) -> None:
        """Wait for collectives on the node group (see :meth:`all_reduce`)."""
        layout = self.layout
        ranks = layout.node_ranks(layout.node)
        label = (f"rank {layout.rank}: {what} in node {layout.node} (ranks "
                 f"{ranks}) at step {self._step()}")
        try:
            wait_for_peers(works, ranks, self.heartbeat, self.timeout, label,
                           polled=self.retry is not None)  # (elastic: it may be abandoned)
        except GossipTimeout:
            keep_alive_at_exit(self.group)
            raise
        except RuntimeError as e:
            keep_alive_at_exit(self.group)
            silent: list[int] = []
            if self.heartbeat is not None:  # the failed rank marks itself gone as it exits
                deadline = time.monotonic() + GRACE_S
                while not silent and time.monotonic() < deadline:
                    silent = self.heartbeat.silent(ranks)
                    time.sleep(0.05)
            if silent:
                assert self.heartbeat is not None
                raise PeerSilent(f"{label}: {self.heartbeat.describe(silent)}", silent) from e
            raise RuntimeError(f"{label} failed: {e}") from e
