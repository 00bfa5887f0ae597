"""Nodes as super-learners: the rank layout and its process groups.

With ``DPSGDStrategy(hierarchical=True)`` the ranks of a node (the same ``node_rank``) act as
one learner: gradients are averaged inside the node every step, so the node's ranks hold
bit-identical weights, and gossip runs between nodes only. Lightning numbers ranks
``global_rank = node_rank * devices + local_rank``; :class:`NodeLayout` holds that numbering.

:class:`NodeLayout` is the package's one type for where ranks sit among nodes. It is a
description of the whole fit (``num_nodes`` nodes of ``devices`` ranks) seen from one rank
(``node``, ``local``), so it answers both kinds of question: this rank's (:attr:`~NodeLayout.rank`,
its column, its slice of the replica, its node's :attr:`~NodeLayout.leader`) and the fit's, the
same on every rank (:meth:`~NodeLayout.node_ranks`, :meth:`~NodeLayout.whole_nodes`: what
leaves an elastic fit together, :meth:`~NodeLayout.complete_nodes`: what may join it,
:meth:`~NodeLayout.leaders`: who claims the shared cursor's batches for a node). A flat fit is
the layout of nodes of one rank (:meth:`NodeLayout.flat`). The fit-wide answers read only
``devices`` and ``num_nodes``, so they stay methods of the one type rather than a second,
rank-free type: every user builds its layout from the same four numbers (Lightning's ranks, or
torchrun's environment), and an elastic fit's live ranks are a subset of that layout's ranks,
never a new numbering. What is not about where a rank sits stays with its own concept: how a
node's claims of the shared cursor wait at an epoch's end and under which key a rejoined node
claims (:class:`~lightning_gossip.elastic.claim_ledger.ClaimLedger`), which groups an elastic
generation builds (:func:`~lightning_gossip.elastic.nodes.generation_groups`).

The inter-node exchange is sharded: the flat replica is cut into ``devices`` equal slices
(zero-padded), local rank ``l`` exchanges slice ``l`` with local rank ``l`` of the peer nodes
on its *column* group (the ranks with local rank ``l`` on every node), and the node then
all-gathers the mixed slices (:class:`~lightning_gossip.sync_gossip.sharded.ShardedExchange`).
Every inter-node link carries ``1/devices`` of the replica.
``DPSGDStrategy`` finishes these rounds on its communication thread, which all-gathers on a
second group per node (:attr:`NodeGroups.node_gossip`) so that the training thread's
collectives on the node group (gradients, buffers) never meet another thread's.

``ADPSGDStrategy(hierarchical=True)`` uses the same layout and groups: local rank ``l`` runs
AD-PSGD's gossip thread on its column for slice ``l``, with the pairing over nodes
(:class:`~lightning_gossip.pairing.ColumnPairing` translates node indices into the column's
global ranks).

Example::

    >>> layout = NodeLayout(num_nodes=2, devices=2, node=1, local=0)
    >>> layout.rank, layout.node_ranks(1), layout.column_ranks(0)
    (2, [2, 3], [0, 2])
    >>> three = NodeLayout(num_nodes=3, devices=2, node=0, local=0)
    >>> three.shard_bounds(5)  # local rank 0 owns values 0..2 of 5
    (0, 3)
    >>> layout.shard_size(5)  # 5 values in 2 slices of 3 (one padding value)
    3
    >>> layout.leader, layout.whole_nodes((3,)), layout.leaders((0, 1, 3))
    (2, (2, 3), (0, 2))
    >>> three.complete_nodes((2, 3, 4))  # rank 5 of node 2 is missing
    [2, 3]
    >>> flat = NodeLayout.flat(world_size=4, rank=3)  # each rank alone
    >>> flat.node, flat.whole_nodes((3,)), flat.leaders((0, 2))
    (3, (3,), (0, 2))
    >>> check_layout([(0, 0, 0), (1, 0, 1), (2, 1, 0)], num_nodes=2, devices=2)
    Traceback (most recent call last):
    ...
    ValueError: hierarchical gossip needs 2 nodes of 2 ranks each, but node 1 has 1 rank(s) \
(global ranks [2]); every node must run the same number of processes
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from datetime import timedelta

import torch.distributed as dist

from lightning_gossip.topology import Peers

__all__ = ["NodeGroups", "NodeLayout", "check_layout", "make_async_groups", "make_node_groups"]


@dataclass(frozen=True)
class NodeLayout:
    """Where ranks sit among nodes: ``num_nodes`` nodes of ``devices`` ranks, numbered
    ``rank = node * devices + local``, seen from the rank at ``node`` and ``local`` (see the
    module docstring: this rank's questions and the fit's, the same on every rank)."""

    num_nodes: int
    devices: int
    node: int
    local: int

    @classmethod
    def flat(cls, world_size: int, rank: int) -> NodeLayout:
        """A flat fit: each of ``world_size`` ranks alone, a node of one (seen from
        ``rank``)."""
        return cls(world_size, 1, rank, 0)

    @property
    def rank(self) -> int:
        """This rank's global rank, ``node * devices + local``."""
        return self.node * self.devices + self.local

    @property
    def leader(self) -> int:
        """This rank's node's leader, its local rank 0 (:meth:`leader_of`)."""
        return self.leader_of(self.rank)

    def leader_of(self, rank: int) -> int:
        """The local rank 0 of ``rank``'s node: the rank that speaks for the node (it claims
        the shared cursor's batches for it, and is its claimant in an elastic fit's ledger)."""
        return rank - rank % self.devices

    def leaders(self, ranks: Iterable[int]) -> tuple[int, ...]:
        """The leaders of the nodes of ``ranks``, sorted."""
        return tuple(sorted({self.leader_of(r) for r in ranks}))

    def whole_nodes(self, ranks: Iterable[int]) -> tuple[int, ...]:
        """Every rank of the nodes of ``ranks``, sorted (in an elastic fit a rank lost takes
        its node with it)."""
        d = self.devices
        return tuple(sorted({r - r % d + k for r in ranks for k in range(d)}))

    def complete_nodes(self, ranks: Iterable[int]) -> list[int]:
        """The ranks of ``ranks`` whose whole node is in it (an elastic fit admits a node whole;
        its processes ask to join one by one)."""
        ranks = set(ranks)
        return sorted(r for r in ranks if set(self.whole_nodes((r,))) <= ranks)

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
    return NodeGroups(node=node_group, column=column_group, node_gossip=node_gossip)


def make_async_groups(layout: NodeLayout | None, backend: str | None,
                      timeout: timedelta) -> NodeGroups:
    """AD-PSGD's groups, created on every rank in the same order: with a ``layout`` (sharded)
    the node and column groups (:func:`make_node_groups`), then every gloo column group
    (``control``); flat (``None``), one gloo group (``control``) and one data group (``node``
    and ``column``) over every rank."""
    if layout is None:
        control = dist.new_group(backend="gloo", timeout=timeout)
        data = dist.new_group(backend=backend, timeout=timeout)
        return NodeGroups(node=data, column=data, control=control)
    groups, control = make_node_groups(layout, backend, timeout), None
    for k in range(layout.devices):
        g = dist.new_group(layout.column_ranks(k), backend="gloo", timeout=timeout)
        if k == layout.local:
            control = g
    return replace(groups, control=control)
