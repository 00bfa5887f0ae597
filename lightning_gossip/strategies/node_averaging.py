"""Inside a node of hierarchical gossip, as a mixin of
:class:`~lightning_gossip.strategies.DPSGDStrategy` and
:class:`~lightning_gossip.strategies.ADPSGDStrategy`: the node layout check, the gradients (and
buffers) averaged over the ranks of one node, and the node's all-gather, with waits that watch
the heartbeats.

The strategy provides ``layout`` (a :class:`~lightning_gossip.hierarchy.NodeLayout`),
``_node_group``, ``_buffers`` (the floating buffers), ``step``, ``heartbeat`` and ``timeout``.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_gossip.errors import GossipTimeout, PeerSilent
from lightning_gossip.hierarchy import check_layout
from lightning_gossip.liveness import GRACE_S, keep_alive_at_exit, wait_for_peers


class _NodeAveragingMixin:
    """Averaging over the node of hierarchical :class:`DPSGDStrategy` and
    :class:`ADPSGDStrategy`."""

    def _check_node_layout(self) -> None:
        """Gather ``(global_rank, node_rank, local_rank)`` of every rank (a collective on the
        default group) and check the layout: the same ``ValueError`` on every rank."""
        entries: list[Any] = [None] * self.world_size
        dist.all_gather_object(entries, (self.global_rank, self.node_rank, self.local_rank))
        check_layout(entries, self.num_nodes, self.num_processes)

    def _find_node_buffers(self) -> list[Tensor]:
        """The floating buffers of the replica (averaged over the node after every step)."""
        params = {id(p) for p in self.lightning_module.parameters()}
        assert self._flat is not None
        return [t for t in self._flat.tensors if id(t) not in params]

    # ------------------------------------------------------------------------------------------
    # Inside a node (hierarchical)
    # ------------------------------------------------------------------------------------------
    def _node_averaging(self, closure: Any) -> Any:
        """``closure`` (forward/backward), then the gradients averaged over the node."""

        def run() -> Any:
            result = closure()
            self._average_node_gradients()
            return result

        return run

    @torch.no_grad()
    def _average_node_gradients(self) -> None:
        """One flat all-reduce (mean) of every parameter's gradient on the node group; a
        parameter without a gradient contributes zeros. It gets the node's average when some
        rank of the node has a gradient for it (a branch only some ranks used this step), so
        the optimizer steps it on every rank alike; it stays without one when no rank has."""
        params = [p for p in self.lightning_module.parameters() if p.requires_grad]
        if not params:
            return
        grads = [p.grad for p in params]
        flat = torch.cat([
            g.detach().reshape(-1).float() if g is not None
            else torch.zeros(p.numel(), device=p.device)
            for p, g in zip(params, grads)
        ] + [torch.tensor([float(g is not None) for g in grads], device=params[0].device)])
        self._node_all_reduce(flat, "gradient all-reduce")
        flat.div_(self.num_processes)
        *values, present = flat.split([p.numel() for p in params] + [len(params)])
        for p, g, v, has in zip(params, grads, values, present.tolist()):
            if g is None and has > 0:
                p.grad = g = torch.zeros_like(p)
            if g is not None:
                g.copy_(v.view_as(g))

    def _node_all_reduce(self, flat: Tensor, what: str) -> None:
        """Sum ``flat`` over the node group, failing fast and naming the rank(s) when a rank of
        the node left after an error or stopped beating (instead of a bare gloo error, or a
        wait of ``timeout``)."""
        self._node_wait(dist.all_reduce(flat, group=self._node_group, async_op=True), what)

    def _node_all_gather(self, mine: Tensor, out: Tensor) -> None:
        """``out`` = the node's ranks' ``mine``, in local-rank order (the slice deltas of
        hierarchical AD-PSGD); waits as :meth:`_node_all_reduce` does."""
        slices = list(out.split(mine.numel()))
        work = dist.all_gather(slices, mine, group=self._node_group, async_op=True)
        self._node_wait(work, "all-gather of the gossip deltas")

    def _node_wait(self, work: Any, what: str) -> None:
        """Wait for a collective on the node group (see :meth:`_node_all_reduce`)."""
        assert self.layout is not None
        ranks = self.layout.node_ranks(self.layout.node)
        label = (f"rank {self.global_rank}: {what} in node {self.layout.node} (ranks "
                 f"{ranks}) at step {self.step}")
        try:
            wait_for_peers([work], ranks, self.heartbeat, self.timeout, label)
        except GossipTimeout:
            keep_alive_at_exit(self._node_group)
            raise
        except RuntimeError as e:
            keep_alive_at_exit(self._node_group)
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

    @torch.no_grad()
    def _average_node_buffers(self) -> None:
        """Average the floating buffers (e.g. BatchNorm statistics) over the node, so its
        ranks hold bit-identical replicas."""
        if not self._buffers:
            return
        flat = torch.cat([b.reshape(-1).float() for b in self._buffers])
        self._node_all_reduce(flat, "buffer all-reduce")
        flat.div_(self.num_processes)
        for b, v in zip(self._buffers, flat.split([b.numel() for b in self._buffers])):
            b.copy_(v.view_as(b))
