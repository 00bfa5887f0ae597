"""Synchronous D-PSGD over ``N`` virtual learners, step for step the update of
:class:`~lightning_gossip.DPSGDStrategy`."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from lightning_gossip import topology as _topology
from lightning_gossip.mixing import Mixer
from lightning_gossip.sim.base import Simulator
from lightning_gossip.sim.workloads import LossFn

__all__ = ["DPSGDSimulator"]


class DPSGDSimulator(Simulator):
    """Synchronous D-PSGD over ``world_size`` virtual learners (see :mod:`lightning_gossip.sim`).

    Args:
        topology: a name from :data:`lightning_gossip.topology.TOPOLOGIES`, a
            :class:`~lightning_gossip.topology.Topology` or a mixing matrix.
        seed: seeds time-varying topologies, as the strategy's ``seed``.
        overlap: ``True`` mixes the pre-step replicas (the strategy's default), ``False``
            mixes after the local step.
        delay_by_one: apply at step ``t`` the mixing change computed at step ``t - 1``:
            ``x_{t+1} = x'_t + (W_{t-1} x_{t-1} - x_{t-1})`` (implies ``overlap``); see
            :meth:`quiesce`.
        Other arguments: see :class:`~lightning_gossip.sim.Simulator`.

    Example::

        >>> import torch
        >>> sim = DPSGDSimulator(torch.nn.Linear(2, 1), torch.nn.functional.mse_loss, "ring",
        ...                      8, lr=0.0)
        >>> sim.set_replicas(torch.arange(8.0)[:, None].repeat(1, 3))
        >>> sim.step(torch.zeros(8, 1, 2), torch.zeros(8, 1, 1))
        >>> sim.replicas[:, 0].tolist()[:3]  # ring neighbours (7, 0, 1), (0, 1, 2), (1, 2, 3)
        [2.6666667461395264, 1.0, 2.0]
    """

    def __init__(
        self,
        model: nn.Module,
        loss_fn: LossFn,
        topology: str | _topology.Topology | np.ndarray,
        world_size: int,
        lr: float = 0.1,
        momentum: float = 0.0,
        weight_decay: float = 0.0,
        seed: int = 0,
        overlap: bool = True,
        delay_by_one: bool = False,
    ) -> None:
        super().__init__(model, loss_fn, world_size, lr, momentum, weight_decay)
        self.topology = _topology.resolve(topology, self.world_size, seed)
        self.mixer = Mixer(self.topology)
        self.overlap = bool(overlap) or bool(delay_by_one)
        self.delay_by_one = bool(delay_by_one)
        self.step_count = 0
        self._pending: torch.Tensor | None = None

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """One synchronous step; ``x``, ``y`` hold one minibatch per learner: ``(n, B, ...)``."""
        n = self.world_size
        if len(x) != n or len(y) != n:
            raise ValueError(f"expected one minibatch per learner (first dimension {n}), "
                             f"got {len(x)} and {len(y)}")
        g = self.gradients(self.replicas, self.buffers, x, y)
        local = self._sgd(slice(None), self.replicas, g)
        t = self.step_count
        d = self.replicas.shape[1]
        has_buffers = self.buffers.numel() > 0
        before = torch.cat([self.replicas, self.buffers], 1) if has_buffers else self.replicas
        after = torch.cat([local, self.buffers], 1) if has_buffers else local
        if not self.overlap:
            new = self.mixer.mix(after, t)
        elif self.delay_by_one:
            new = after if self._pending is None else after + self._pending
            self._pending = self.mixer.mix(before, t) - before
        else:
            new = after + (self.mixer.mix(before, t) - before)
        self.replicas = new[:, :d].contiguous()
        if has_buffers:
            self.buffers = new[:, d:].contiguous()
        self.step_count += 1

    def quiesce(self) -> None:
        """Apply a delay-by-one exchange still in flight (the strategy does so at sync points)."""
        if self._pending is not None:
            d = self.replicas.shape[1]
            self.replicas = self.replicas + self._pending[:, :d]
            if self.buffers.numel():
                self.buffers = self.buffers + self._pending[:, d:]
            self._pending = None

