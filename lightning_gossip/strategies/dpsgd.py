"""Synchronous decentralized parallel SGD (D-PSGD, Lian et al. 2017).

Every optimizer step, every rank averages its replica with this step's neighbours as the
topology's mixing matrix ``W_t`` says: ``x_{t+1} = W_t x_t - lr * g(x_t)``. With the default
randomized ring (RAND-PSGD, Zhang et al. 2020) each step costs two messages per rank while
replicas converge to consensus about as fast as with a fully connected graph.
"""

from __future__ import annotations

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
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_gossip.exchange import NeighborExchange
from lightning_gossip.strategies.gossip import GossipStrategy
from lightning_gossip.topology import Topology, check_name, resolve

__all__ = ["DPSGDStrategy"]


@dataclass
class _Round:
    """One in-flight exchange: the step it belongs to, and its buffers."""

    step: int
    exchange: NeighborExchange


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
        final_average, evaluate, consensus_every_n_steps, process_group_backend, timeout:
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
        final_average: bool = True,
        evaluate: str = "consensus",
        consensus_every_n_steps: int | None = 100,
        process_group_backend: str | None = None,
        timeout: timedelta | float = default_pg_timeout,
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
        )
        if isinstance(topology, str):
            check_name(topology)  # fail at construction, not on every rank at set-up
        self.topology_spec = topology
        self.seed = int(seed)
        self.overlap = bool(overlap) or bool(delay_by_one)
        self.delay_by_one = bool(delay_by_one)
        self.topology: Topology | None = None
        self._group: dist.ProcessGroup | None = None
        self._pending: list[_Round] = []  # started, not yet applied (oldest first)
        self._spare: list[list[Tensor]] = []  # recycled [send, recv...] buffer sets
        self._scratch: Tensor | None = None  # where the mixed vector is computed

    # ------------------------------------------------------------------------------------------
    @override
    def setup_gossip(self, trainer: pl.Trainer) -> None:
        """Build :attr:`topology` for this world size and the gossip process group."""
        self.topology = resolve(self.topology_spec, self.world_size, self.seed)
        if self._group is None:
            # Its own group: gossip messages never interleave with Lightning's collectives.
            self._group = dist.new_group(
                backend=self.process_group_backend, timeout=self.timeout
            )

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
        if self.gossip_enabled and self.overlap and not self._started(self.step):
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
        if self.overlap and not self._started(t):  # manual optimization, or a 2nd optimizer
            self._start(t)
        # The local step runs whatever happens (also when AMP skips it): every rank must
        # take part in every exchange, or its peers would wait for it.
        out = super().optimizer_step(optimizer, closure, model, **kwargs)
        if not self.overlap:
            self._finish_blocking(self._start(t))
        elif self.delay_by_one:
            if len(self._pending) > 1:  # the exchange from step t-1
                self._apply_delta(self._pending.pop(0))
        else:
            self._apply_delta(self._pending.pop(0))
        self.step = t + 1
        self.maybe_log_consensus()
        return out

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
        peers = self.topology.peers(self.global_rank, step)
        bufs = self._spare.pop() if self._spare else [self._flat.empty()]
        send = self._flat.pack(out=bufs[0])
        exchange = NeighborExchange(send, peers, self._group, recv_buffers=bufs[1:])
        rnd = _Round(step, exchange)
        if self.overlap:
            self._pending.append(rnd)
        return rnd

    def _recycle(self, rnd: _Round) -> None:
        self._spare.append([rnd.exchange.send] + [b for _, b in rnd.exchange.recv])

    def _apply_delta(self, rnd: _Round) -> None:
        """``x <- x + (W_t x_t - x_t)``: add the mixing's change to the current weights."""
        assert self._flat is not None
        rnd.exchange.wait(self.timeout, step=rnd.step)
        delta = rnd.exchange.mixed(out=self._mix_buffer())
        delta.sub_(rnd.exchange.send)
        self._flat.add_(delta)
        self._recycle(rnd)

    def _finish_blocking(self, rnd: _Round) -> None:
        """``x <- W_t x'``: replace the weights by the mixed ones."""
        assert self._flat is not None
        rnd.exchange.wait(self.timeout, step=rnd.step)
        self._flat.copy_(rnd.exchange.mixed(out=self._mix_buffer()))
        self._recycle(rnd)

    def _mix_buffer(self) -> Tensor:
        assert self._flat is not None
        if self._scratch is None:
            self._scratch = self._flat.empty()
        return self._scratch
