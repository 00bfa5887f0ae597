"""Synchronous decentralized parallel SGD (D-PSGD, Lian et al. 2017).

Every optimizer step, every rank averages its replica with this step's neighbours as the
topology's mixing matrix ``W_t`` says: ``x_{t+1} = W_t x_t - lr * g(x_t)``. With the default
randomized ring (RAND-PSGD, Zhang et al. 2020) each step costs two messages per rank while
replicas converge to consensus about as fast as with a fully connected graph.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_gossip.compression import check_wire_dtype
from lightning_gossip.consensus import check_every
from lightning_gossip.exchange import GossipTimeout, NeighborExchange
from lightning_gossip.hierarchy import (
    NodeGroups,
    NodeLayout,
    ShardedExchange,
    check_layout,
    make_node_groups,
)
from lightning_gossip.liveness import GRACE_S, PeerSilent, wait_for_peers
from lightning_gossip.strategies.gossip import GossipStrategy
from lightning_gossip.topology import Topology, check_name, resolve

__all__ = ["DPSGDStrategy"]


@dataclass
class _Round:
    """One in-flight exchange: the step it belongs to, and its buffers."""

    step: int
    exchange: NeighborExchange | ShardedExchange


class DPSGDStrategy(GossipStrategy):
    """Synchronous D-PSGD: mix with this step's neighbours around every optimizer step.

    Args:
        topology: a name from :data:`lightning_gossip.topology.TOPOLOGIES`, a
            :class:`~lightning_gossip.topology.Topology`, or a doubly stochastic matrix.
            Default ``"random_ring"`` (RAND-PSGD).
        seed: seeds time-varying topologies; the strategy mixes with exactly
            ``topology.build(name, world_size, seed).mixing_matrix(t)`` at optimizer step ``t``.
        overlap: snapshot ``x_t`` and start the exchange before forward/backward, so it runs
            while the gradient is computed; then ``x_{t+1} = x_t' + (W_t x_t - x_t)`` where
            ``x_t'`` is the result of the local optimizer step. ``False`` exchanges after the
            local step: ``x_{t+1} = W_t x_t'`` (blocking).
        delay_by_one: apply at step ``t`` the neighbours' contribution from the exchange
            started at step ``t - 1``: ``x_{t+1} = x_t' + (W_{t-1} x_{t-1} - x_{t-1})``. Every
            exchange gets a whole step to hide behind. Implies ``overlap``.
        hierarchical: treat the ranks of a node (same ``node_rank``) as one learner: average
            gradients inside the node every step (one all-reduce on the node's group), so its
            ranks hold bit-identical weights, and gossip only between nodes, following
            ``topology.build(name, num_nodes, seed).mixing_matrix(t)`` over nodes. Local rank
            ``l`` exchanges slice ``l`` of the replica with local rank ``l`` of the peer nodes,
            then the node all-gathers the mixed slices. One process per node: the same as
            ``False``; one node: plain data parallelism (with a warning).
        wire_dtype: what gossip sends, ``"fp32"`` (default), ``"bf16"`` or ``"fp16"`` (half the
            bytes). Compressed values are mixed in the mean-preserving form
            ``x_i += sum_j W_ij (Q(x_j) - Q(x_i))`` (:mod:`lightning_gossip.compression`), so
            the mean of the replicas is kept to fp32 rounding.
        final_average, evaluate, consensus_every_n_steps, global_average_every_n_steps,
            process_group_backend, timeout, heartbeat_timeout:
            see :class:`~lightning_gossip.strategies.gossip.GossipStrategy`.

    Example::

        import lightning as L
        import lightning_gossip  # registers "dpsgd"

        trainer = L.Trainer(strategy="dpsgd", accelerator="cpu", devices=4)
        trainer = L.Trainer(
            strategy=lightning_gossip.DPSGDStrategy(topology="exponential", overlap=False),
            accelerator="gpu", devices=8, num_nodes=4,
        )
    """

    strategy_name = "dpsgd"

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register ``"dpsgd"`` in Lightning's ``StrategyRegistry`` (called on import of
        :mod:`lightning_gossip`; Lightning does not discover external strategies)."""
        strategy_registry.register(
            cls.strategy_name,
            cls,
            description="Synchronous decentralized parallel SGD (D-PSGD) on a randomized ring",
            override=True,
        )

    def __init__(
        self,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        *,
        topology: str | Topology | np.ndarray | list = "random_ring",
        seed: int = 0,
        overlap: bool = True,
        delay_by_one: bool = False,
        hierarchical: bool = False,
        wire_dtype: str = "fp32",
        final_average: bool = True,
        evaluate: str = "consensus",
        consensus_every_n_steps: int | None = 100,
        global_average_every_n_steps: int | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | float = default_pg_timeout,
        heartbeat_timeout: float | None = 60.0,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            final_average=final_average,
            evaluate=evaluate,
            consensus_every_n_steps=consensus_every_n_steps,
            process_group_backend=process_group_backend,
            timeout=timeout,
            heartbeat_timeout=heartbeat_timeout,
        )
        if isinstance(topology, str):
            check_name(topology)  # fail at construction, not on every rank at set-up
        self.topology_spec = topology
        self.seed = int(seed)
        self.overlap = bool(overlap) or bool(delay_by_one)
        self.delay_by_one = bool(delay_by_one)
        self.hierarchical = bool(hierarchical)
        self.global_average_every_n_steps = check_every(
            "global_average_every_n_steps", global_average_every_n_steps)
        self._wire = check_wire_dtype(wire_dtype)
        self.wire_dtype = wire_dtype
        #: the built topology: over nodes with ``hierarchical=True`` (after set-up)
        self.topology: Topology | None = None
        #: this rank's place in the nodes (the sharded / compressed exchange), after set-up
        self.layout: NodeLayout | None = None
        self._groups: NodeGroups | None = None
        self._node_group: dist.ProcessGroup | None = None  # gradients averaged here
        self._buffers: list[Tensor] = []  # floating buffers, averaged in the node
        self._exchanging = True  # False: one node of several ranks (plain data parallelism)
        self._sent_bytes = 0
        self._messages = 0
        self._exchanges = 0
        self._group: dist.ProcessGroup | None = None
        self._pending: list[_Round] = []  # started, not yet applied (oldest first)
        self._spare: list[list[Tensor]] = []  # recycled [send, recv...] buffer sets
        self._scratch: Tensor | None = None  # where the mixed vector is computed

    # ------------------------------------------------------------------------------------------
    @override
    def setup_gossip(self, trainer: pl.Trainer) -> None:
        """Check the node layout (``hierarchical``), build :attr:`topology` (over ranks, or over
        nodes) and the gossip process groups. Bad input fails here on every rank."""
        world, nodes, devices = self.world_size, self.num_nodes, self.num_processes
        hierarchical = self.hierarchical and devices > 1
        if self.hierarchical:
            entries: list[Any] = [None] * world
            dist.all_gather_object(entries, (self.global_rank, self.node_rank, self.local_rank))
            check_layout(entries, nodes, devices)
        self._exchanging = not (hierarchical and nodes == 1)
        if not self._exchanging:
            rank_zero_warn(
                f"DPSGDStrategy(hierarchical=True) on one node of {devices} processes: "
                "gradients are averaged inside the node and there is nothing to gossip with "
                "(plain data parallelism)."
            )
        else:
            self.topology = self.resolve_topology(nodes, devices)
        if self._group is None:
            # Its own group: gossip messages never interleave with Lightning's collectives.
            self._group = dist.new_group(
                backend=self.process_group_backend, timeout=self.timeout
            )
            if hierarchical:
                layout = NodeLayout(nodes, devices, self.node_rank, self.local_rank)
                self._groups = make_node_groups(layout, self.process_group_backend, self.timeout)
            else:
                layout = NodeLayout(world, 1, self.global_rank, 0)
                self._groups = NodeGroups(node=self._group, column=self._group)
            self.layout = layout
        if hierarchical:
            assert self._groups is not None
            self._node_group = self._groups.node
            params = {id(p) for p in self.lightning_module.parameters()}
            assert self._flat is not None
            self._buffers = [t for t in self._flat.tensors if id(t) not in params]
        else:
            self._node_group = None
            self._buffers = []

    def resolve_topology(self, num_nodes: int, devices: int) -> Topology:
        """The topology gossip follows for ``num_nodes`` nodes of ``devices`` processes: over
        the nodes with ``hierarchical=True`` (several processes per node), else over all ranks.

        Raises ``ValueError`` (saying it is over nodes) when it does not fit, e.g. a matrix or a
        :class:`~lightning_gossip.topology.Topology` built for another size.
        """
        if not (self.hierarchical and devices > 1):
            return resolve(self.topology_spec, num_nodes * devices, self.seed)
        try:
            return resolve(self.topology_spec, num_nodes, self.seed)
        except ValueError as e:
            raise ValueError(
                f"DPSGDStrategy(hierarchical=True) gossips between the {num_nodes} nodes (of "
                f"{devices} processes each), so the topology must be over {num_nodes} nodes: "
                f"{e}"
            ) from e

    @property
    def sharded(self) -> bool:
        """Whether the exchange goes through :class:`~lightning_gossip.hierarchy.ShardedExchange`
        (``hierarchical`` with several processes per node, or a compressed ``wire_dtype``)."""
        return self._node_group is not None or self._wire != torch.float32

    @override
    def teardown_gossip(self) -> None:
        """Drop in-flight exchanges and buffers."""
        self._pending.clear()
        self._spare.clear()
        self._scratch = None

    # ------------------------------------------------------------------------------------------
    # The step
    # ------------------------------------------------------------------------------------------
    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """Start this step's exchange (``overlap``), so it runs during forward/backward."""
        # Start this step's exchange before forward/backward so it overlaps with them. Under
        # gradient accumulation only the first micro-batch starts one (x_t does not change).
        if (self.gossip_enabled and self._exchanging and self.overlap
                and not self._started(self.step)):
            self._start(self.step)

    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Any,
        model: pl.LightningModule | torch.nn.Module | None = None,
        **kwargs: Any,
    ) -> Any:
        """The local optimizer step (forward/backward run inside it), then mix as the
        topology's ``W_t`` says; every rank takes part even when AMP skips the step."""
        if not self.gossip_enabled:
            out = super().optimizer_step(optimizer, closure, model, **kwargs)
            self.step += 1
            return out
        t = self.step
        if self._exchanging and self.overlap and not self._started(t):  # manual opt., 2nd opt.
            self._start(t)
        if self._node_group is not None:
            closure = self._node_averaging(closure)
        # The local step runs whatever happens (also when AMP skips it): every rank must
        # take part in every exchange, or its peers would wait for it.
        out = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self._node_group is not None:
            self._average_node_buffers()
        if not self._exchanging:
            pass
        elif not self.overlap:
            self._finish_blocking(self._start(t))
        elif self.delay_by_one:
            if len(self._pending) > 1:  # the exchange from step t-1
                self._apply_delta(self._pending.pop(0))
        else:
            self._apply_delta(self._pending.pop(0))
        self.step = t + 1
        n = self.global_average_every_n_steps
        if n is not None and self.step % n == 0:
            self.global_average()
        self.maybe_log_consensus()
        return out

    def global_average(self) -> None:
        """Replace this rank's replica by the exact average of all replicas (a collective on
        the default group; in-flight ``delay_by_one`` exchanges stay in flight)."""
        assert self._flat is not None
        self._flat.copy_(self.average_replicas())

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
        assert self.layout is not None
        ranks = self.layout.node_ranks(self.layout.node)
        label = (f"rank {self.global_rank}: {what} in node {self.layout.node} (ranks "
                 f"{ranks}) at step {self.step}")
        work = dist.all_reduce(flat, group=self._node_group, async_op=True)
        try:
            wait_for_peers([work], ranks, self.heartbeat, self.timeout, label)
        except GossipTimeout:
            raise
        except RuntimeError as e:
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

    @override
    def quiesce(self) -> None:
        """Finish in-flight exchanges. Their deltas are applied, so no mixing is lost."""
        while self._pending:
            self._apply_delta(self._pending.pop(0))

    # ------------------------------------------------------------------------------------------
    def _started(self, step: int) -> bool:
        return any(r.step == step for r in self._pending)

    def _start(self, step: int) -> _Round:
        assert self._flat is not None and self.topology is not None and self._group is not None
        if self.sharded:
            return self._start_sharded(step)
        peers = self.topology.peers(self.global_rank, step)
        bufs = self._spare.pop() if self._spare else [self._flat.empty()]
        send = self._flat.pack(out=bufs[0])
        exchange = NeighborExchange(send, peers, self._group, recv_buffers=bufs[1:])
        self._count(exchange)
        rnd = _Round(step, exchange)
        if self.overlap:
            self._pending.append(rnd)
        return rnd

    def _padded(self) -> Tensor:
        """A zeroed fp32 vector of ``devices * shard`` values (the replica, zero-padded)."""
        assert self._flat is not None and self.layout is not None
        size = self.layout.devices * self.layout.shard_size(self._flat.numel)
        return torch.zeros(size, dtype=torch.float32, device=self._flat.device)

    def _start_sharded(self, step: int) -> _Round:
        assert self._flat is not None and self.topology is not None
        assert self.layout is not None and self._groups is not None
        bufs = self._spare.pop() if self._spare else [self._padded()]
        snapshot = bufs[0]
        self._flat.pack(out=snapshot[: self._flat.numel])
        exchange = ShardedExchange(snapshot, self.layout,
                                   self.topology.peers(self.layout.node, step), self._groups,
                                   self._wire, buffers=bufs[1:])
        self._count(exchange.exchange)
        rnd = _Round(step, exchange)
        if self.overlap:
            self._pending.append(rnd)
        return rnd

    def _count(self, exchange: NeighborExchange) -> None:
        sends = len(exchange.peers.send_to)
        self._exchanges += 1
        self._messages += sends
        self._sent_bytes += sends * exchange.send.numel() * exchange.send.element_size()

    @property
    def gossip_stats(self) -> dict[str, float]:
        """What this rank's gossip sent so far (this process): ``sent_bytes`` (payload of the
        replica messages, without the node's all-reduce and all-gather), ``messages`` and
        ``exchanges`` (rounds started)."""
        return {"sent_bytes": float(self._sent_bytes), "messages": float(self._messages),
                "exchanges": float(self._exchanges)}

    def _recycle(self, rnd: _Round) -> None:
        ex = rnd.exchange
        if isinstance(ex, ShardedExchange):
            self._spare.append([ex.snapshot, *ex.buffers])
        else:
            self._spare.append([ex.send] + [b for _, b in ex.recv])

    def _sharded_delta(self, rnd: _Round) -> Tensor:
        """``sum_j W_ij (x_j - x_i)`` of the round (the node's, all-gathered), unpadded."""
        assert self._flat is not None and isinstance(rnd.exchange, ShardedExchange)
        if self._scratch is None:
            self._scratch = self._padded()
        delta = rnd.exchange.delta(self.timeout, rnd.step, out=self._scratch)
        return delta[: self._flat.numel]

    def _apply_delta(self, rnd: _Round) -> None:
        """``x <- x + (W_t x_t - x_t)``: add the mixing's change to the current weights."""
        assert self._flat is not None
        if isinstance(rnd.exchange, ShardedExchange):
            self._flat.add_(self._sharded_delta(rnd))
            self._recycle(rnd)
            return
        rnd.exchange.wait(self.timeout, step=rnd.step)
        delta = rnd.exchange.mixed(out=self._mix_buffer())
        delta.sub_(rnd.exchange.send)
        self._flat.add_(delta)
        self._recycle(rnd)

    def _finish_blocking(self, rnd: _Round) -> None:
        """``x <- W_t x'``: replace the weights by the mixed ones."""
        assert self._flat is not None
        if isinstance(rnd.exchange, ShardedExchange):  # x' + sum_j W_ij (x'_j - x'_i)
            self._apply_delta(rnd)
            return
        rnd.exchange.wait(self.timeout, step=rnd.step)
        self._flat.copy_(rnd.exchange.mixed(out=self._mix_buffer()))
        self._recycle(rnd)

    def _mix_buffer(self) -> Tensor:
        assert self._flat is not None
        if self._scratch is None:
            self._scratch = self._flat.empty()
        return self._scratch
