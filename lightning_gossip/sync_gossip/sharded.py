"""D-PSGD's sharded round between nodes (:class:`ShardedExchange`): this rank's slice of the
node replica with its column, then the node's all-gather of the mixing change (hierarchical
gossip, :mod:`lightning_gossip.hierarchy`), and every round sent in a compressed wire dtype
(mixed in the mean-preserving form of :mod:`lightning_gossip.compression`)."""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_gossip.compression import pairwise_delta, quantize
from lightning_gossip.exchange import NeighborExchange, wait_all
from lightning_gossip.hierarchy import NodeGroups, NodeLayout
from lightning_gossip.liveness import keep_alive_at_exit
from lightning_gossip.topology import Peers

__all__ = ["ShardedExchange"]


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
