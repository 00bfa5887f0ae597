"""Nodes as super-learners: the rank layout, its process groups, and sharded inter-node gossip.

With ``DPSGDStrategy(hierarchical=True)`` the ranks of a node (the same ``node_rank``) act as
one learner: gradients are averaged inside the node every step, so the node's ranks hold
bit-identical weights, and gossip runs between nodes only. Lightning numbers ranks
``global_rank = node_rank * devices + local_rank``; :class:`NodeLayout` holds that numbering.

The inter-node exchange is sharded: the flat replica is cut into ``devices`` equal slices
(zero-padded), local rank ``l`` exchanges slice ``l`` with local rank ``l`` of the peer nodes
on its *column* group (the ranks with local rank ``l`` on every node), and the node then
all-gathers the mixed slices. Every inter-node link carries ``1/devices`` of the replica.
``DPSGDStrategy`` finishes these rounds on its communication thread, which all-gathers on a
second group per node (:attr:`NodeGroups.node_gossip`) so that the training thread's
collectives on the node group (gradients, buffers) never meet another thread's.

``ADPSGDStrategy(hierarchical=True)`` uses the same layout and groups: local rank ``l`` runs
AD-PSGD's gossip thread on its column for slice ``l``, with the pairing over nodes
(:class:`ColumnPairing` translates node indices into the column's global ranks).

Example::

    >>> layout = NodeLayout(num_nodes=2, devices=2, node=1, local=0)
    >>> layout.rank, layout.node_ranks(1), layout.column_ranks(0)
    (2, [2, 3], [0, 2])
    >>> from lightning_gossip.pairing import Pairing
    >>> three = NodeLayout(num_nodes=3, devices=2, node=0, local=0)
    >>> column = ColumnPairing(Pairing("ring", 3), three)  # local rank 0's column: 0, 2, 4
    >>> column.is_active(0), column.candidates(0), column.contacted_by(2)
    (True, (4, 2), (0,))
    >>> three.shard_bounds(5)  # local rank 0 owns values 0..2 of 5
    (0, 3)
    >>> layout.shard_size(5)  # 5 values in 2 slices of 3 (one padding value)
    3
    >>> check_layout([(0, 0, 0), (1, 0, 1), (2, 1, 0)], num_nodes=2, devices=2)
    Traceback (most recent call last):
    ...
    ValueError: hierarchical gossip needs 2 nodes of 2 ranks each, but node 1 has 1 rank(s) \
(global ranks [2]); every node must run the same number of processes
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_gossip.compression import pairwise_delta, quantize
from lightning_gossip.exchange import NeighborExchange, wait_all
from lightning_gossip.liveness import keep_alive_at_exit
from lightning_gossip.pairing import Pairing
from lightning_gossip.topology import Peers

__all__ = ["ColumnPairing", "NodeGroups", "NodeLayout", "ShardedExchange", "check_layout",
           "make_async_groups", "make_node_groups"]


@dataclass(frozen=True)
class NodeLayout:
    """Where this rank sits: ``num_nodes`` nodes of ``devices`` ranks, this rank's node and
    local rank."""

    num_nodes: int
    devices: int
    node: int
    local: int

    @property
    def rank(self) -> int:
        """This rank's global rank, ``node * devices + local``."""
        return self.node * self.devices + self.local

    def node_ranks(self, node: int) -> list[int]:
        """The global ranks of ``node``."""
        return [node * self.devices + k for k in range(self.devices)]

    def column_ranks(self, local: int) -> list[int]:
        """The global ranks with local rank ``local`` (one per node)."""
        return [n * self.devices + local for n in range(self.num_nodes)]

    def shard_size(self, numel: int) -> int:
        """Length of one slice when ``numel`` values are cut into ``devices`` equal slices."""
        return -(-numel // self.devices)

    def shard_bounds(self, numel: int) -> tuple[int, int]:
        """``(lo, hi)``: the values of a ``numel``-long replica in this rank's slice (the last
        slice may be shorter than :meth:`shard_size`, or empty)."""
        size = self.shard_size(numel)
        lo = min(self.local * size, numel)
        return lo, min(lo + size, numel)

    def column_peers(self, node_peers: Peers) -> Peers:
        """This rank's peers in its column, from its node's peers in the topology over nodes."""
        col = self.local
        return Peers(
            rank=self.rank,
            self_weight=node_peers.self_weight,
            recv_from=tuple((j * self.devices + col, w) for j, w in node_peers.recv_from),
            send_to=tuple(r * self.devices + col for r in node_peers.send_to),
        )


class ColumnPairing:
    """AD-PSGD's pairing over nodes, seen by one column: the same roles and partner choice as
    ``pairing`` (built for ``num_nodes``), in the global ranks of local rank ``layout.local``.

    Node ``n`` is rank ``n * devices + local`` here, so every column runs the same pairing of
    nodes, independently, on its own slice of the replica; messages and errors name global
    ranks. It has the methods of :class:`~lightning_gossip.pairing.Pairing` the gossip thread
    uses.

    Args:
        pairing: the pairing over nodes.
        layout: this rank's place in the nodes.
    """

    def __init__(self, pairing: Pairing, layout: NodeLayout) -> None:
        if pairing.world_size != layout.num_nodes:
            raise ValueError(f"the pairing is over {pairing.world_size} ranks, but there are "
                             f"{layout.num_nodes} nodes")
        self.pairing = pairing
        self.layout = layout

    def _node(self, rank: int) -> int:
        return rank // self.layout.devices

    def _rank(self, node: int) -> int:
        return node * self.layout.devices + self.layout.local

    def is_active(self, rank: int) -> bool:
        """Whether the node of global ``rank`` starts exchanges."""
        return self.pairing.is_active(self._node(rank))

    def candidates(self, rank: int) -> tuple[int, ...]:
        """The column's ranks on the passive nodes an active ``rank`` may contact."""
        return tuple(map(self._rank, self.pairing.candidates(self._node(rank))))

    def contacted_by(self, rank: int) -> tuple[int, ...]:
        """The column's ranks on the active nodes that may contact a passive ``rank``."""
        return tuple(map(self._rank, self.pairing.contacted_by(self._node(rank))))

    def partner(self, rank: int, k: int) -> int:
        """The column's rank on the node that ``rank``'s node exchanges with in its ``k``-th
        exchange."""
        return self._rank(self.pairing.partner(self._node(rank), k))


def check_layout(entries: list[tuple[int, int, int]], num_nodes: int, devices: int) -> None:
    """Check ``(global_rank, node_rank, local_rank)`` of every rank against the node layout.

    Raises ``ValueError`` (the same on every rank, since every rank checks the same gathered
    list) when the nodes differ in size or a rank is not numbered
    ``node_rank * devices + local_rank``.
    """
    by_node: dict[int, list[int]] = {}
    for rank, node, _local in sorted(entries):
        by_node.setdefault(node, []).append(rank)
    for node in sorted(by_node):
        ranks = by_node[node]
        if len(ranks) != devices or not 0 <= node < num_nodes:
            raise ValueError(
                f"hierarchical gossip needs {num_nodes} nodes of {devices} ranks each, but node "
                f"{node} has {len(ranks)} rank(s) (global ranks {ranks}); every node must run "
                "the same number of processes"
            )
    if len(by_node) != num_nodes:
        raise ValueError(
            f"hierarchical gossip needs {num_nodes} nodes, found ranks on nodes "
            f"{sorted(by_node)}"
        )
    for rank, node, local in entries:
        if rank != node * devices + local:
            raise ValueError(
                f"rank {rank} is on node {node} with local rank {local}, but hierarchical gossip "
                f"needs global rank = node_rank * {devices} + local_rank = "
                f"{node * devices + local}"
            )


@dataclass
class NodeGroups:
    """This rank's process groups: its node (all-reduce, all-gather) and its column (gossip).

    ``node_gossip`` (optional) spans the same ranks as ``node`` but is used by one thread
    only, the communication thread of :class:`~lightning_gossip.strategies.DPSGDStrategy`,
    for the all-gather of a sharded round, while the training thread keeps ``node`` for the
    gradients, the buffers and the broadcasts: two threads never issue collectives on one
    group (their order could differ between ranks: a deadlock, or wrong data). With NCCL it
    is its own communicator. ``control`` (AD-PSGD only) is the gloo group of the control
    messages over the same ranks as ``column``: a passive's receive-from-any-source must only
    ever match them. A flat layout has the gossip group as both ``node`` and ``column``.
    """

    node: dist.ProcessGroup
    column: dist.ProcessGroup
    node_gossip: dist.ProcessGroup | None = None
    control: dist.ProcessGroup | None = None

    @property
    def gossip_node(self) -> dist.ProcessGroup:
        """The group of the sharded rounds' all-gather: ``node_gossip``, else ``node``."""
        return self.node if self.node_gossip is None else self.node_gossip


def make_node_groups(layout: NodeLayout, backend: str | None, timeout: timedelta, *,
                     gossip_node_group: bool = False) -> NodeGroups:
    """Create every node group, then every column group, then (``gossip_node_group``) every
    node group once more for the communication thread (:attr:`NodeGroups.node_gossip`), on
    every rank in the same order (``dist.new_group`` is collective over the default group),
    and return this rank's."""
    node_group = column_group = node_gossip = None
    for n in range(layout.num_nodes):
        g = dist.new_group(layout.node_ranks(n), backend=backend, timeout=timeout)
        if n == layout.node:
            node_group = g
    for k in range(layout.devices):
        g = dist.new_group(layout.column_ranks(k), backend=backend, timeout=timeout)
        if k == layout.local:
            column_group = g
    if gossip_node_group:
        for n in range(layout.num_nodes):
            g = dist.new_group(layout.node_ranks(n), backend=backend, timeout=timeout)
            if n == layout.node:
                node_gossip = g
        assert node_gossip is not None
    assert node_group is not None and column_group is not None
    return NodeGroups(node_group, column_group, node_gossip)


def make_async_groups(layout: NodeLayout | None, backend: str | None,
                      timeout: timedelta) -> NodeGroups:
    """AD-PSGD's groups, created on every rank in the same order: with a ``layout`` (sharded)
    the node and column groups (:func:`make_node_groups`), then every gloo column group
    (``control``); flat (``None``), one gloo group (``control``) and one data group (``node``
    and ``column``) over every rank."""
    if layout is None:
        control = dist.new_group(backend="gloo", timeout=timeout)
        data = dist.new_group(backend=backend, timeout=timeout)
        return NodeGroups(data, data, control=control)
    groups = make_node_groups(layout, backend, timeout)
    for k in range(layout.devices):
        g = dist.new_group(layout.column_ranks(k), backend="gloo", timeout=timeout)
        if k == layout.local:
            groups.control = g
    return groups


class ShardedExchange:
    """One round of gossip between nodes: this rank's slice with its column, then the node's
    all-gather of the mixing change.

    Args:
        snapshot: the node replica ``x_t`` (fp32, ``devices * shard`` long, zero-padded); must
            not change until :meth:`delta` returns.
        layout: the node layout.
        node_peers: this node's peers at this step, in the topology over nodes.
        groups: this rank's node and column groups (the all-gather uses
            :attr:`NodeGroups.gossip_node`).
        wire_dtype: what is sent (``torch.float32``, ``bfloat16`` or ``float16``).
        buffers: reusable wire buffers (``[send, recv...]``) of an earlier round, or ``None``.
    """

    def __init__(self, snapshot: Tensor, layout: NodeLayout, node_peers: Peers,
                 groups: NodeGroups, wire_dtype: torch.dtype,
                 buffers: list[Tensor] | None = None) -> None:
        self.snapshot = snapshot
        self.layout = layout
        self.groups = groups
        size = snapshot.numel() // layout.devices
        self.shard = snapshot[layout.local * size:(layout.local + 1) * size]
        bufs = list(buffers or [])
        send = bufs.pop(0) if bufs else torch.empty(size, dtype=wire_dtype,
                                                    device=snapshot.device)
        if wire_dtype == torch.float32:
            send.copy_(self.shard)
        else:
            quantize(self.shard, wire_dtype, out=send)
        self.exchange = NeighborExchange(send, layout.column_peers(node_peers), groups.column,
                                         recv_buffers=bufs)

    @property
    def buffers(self) -> list[Tensor]:
        """The wire buffers ``[send, recv...]``, for reuse by a later round."""
        return [self.exchange.send] + [b for _, b in self.exchange.recv]

    @property
    def mates(self) -> list[int]:
        """The other ranks of this rank's node (the all-gather's)."""
        return [r for r in self.layout.node_ranks(self.layout.node) if r != self.layout.rank]

    @property
    def others(self) -> list[int]:
        """Every rank this round depends on: its column peers and its node's other ranks."""
        return sorted(set(self.exchange.others) | set(self.mates))

    def describe(self, step: int | None = None) -> str:
        """What this round is, for error messages (names the ranks)."""
        at = f" at step {step}" if step is not None else ""
        return (f"sharded gossip exchange of rank {self.layout.rank} with ranks "
                f"{self.exchange.others} and all-gather in node {self.layout.node} (ranks "
                f"{self.layout.node_ranks(self.layout.node)}){at}")

    def delta(self, timeout: timedelta, step: int, out: Tensor, watch_peers: bool = True,
              gather: bool = True) -> Tensor:
        """Wait, then ``out`` (like ``snapshot``) = ``sum_j W_ij (x_j - x_i)`` for the whole node
        replica (each slice computed by its local rank and all-gathered on
        :attr:`NodeGroups.gossip_node`; with ``gather=False`` only this rank's slice of
        ``out`` is written, the caller all-gathers).

        ``out`` may be the snapshot itself: it is not read once the constructor copied this
        rank's slice onto the wire. ``watch_peers=False`` waits plainly (up to ``timeout``):
        for a :class:`~lightning_gossip.exchange.CommWorker`, whose job is watched instead.
        """
        ex = self.exchange
        ex.wait(timeout, step=step, watch_peers=watch_peers)
        size = self.shard.numel()
        slices = list(out.split(size))
        mine = slices[self.layout.local]
        theirs = [(buf, w) for (_, buf), (_, w) in zip(ex.recv, ex.peers.recv_from)]
        pairwise_delta(ex.send, theirs, out=mine)
        if gather and self.layout.devices > 1:
            group = self.groups.gossip_node
            work = dist.all_gather(slices, mine.clone(), group=group, async_op=True)
            what = (f"all-gather of the mixing change of rank {self.layout.rank} in node "
                    f"{self.layout.node} (ranks {self.layout.node_ranks(self.layout.node)}) "
                    f"at step {step}")
            try:
                wait_all([work], timeout, what, peers=self.mates if watch_peers else ())
            except BaseException:
                keep_alive_at_exit(group)  # an abandoned gloo collective: exit at once
                raise
        return out
