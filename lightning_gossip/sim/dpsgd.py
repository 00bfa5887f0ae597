"""Synchronous D-PSGD over ``N`` virtual learners, step for step the update of
:class:`~lightning_gossip.DPSGDStrategy`."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from lightning_gossip import topology as _topology
from lightning_gossip.mixing import Mixer
from lightning_gossip.sim.base import Simulator
from lightning_gossip.sim.workloads import LossFn
from lightning_gossip.sync_gossip.schedule import RoundSchedule

__all__ = ["DPSGDSimulator"]


@dataclass
class _Round:
    """A round in flight: its exchange step, the snapshot it mixes (``(n, d)``, parameters and
    float buffers side by side) and the virtual time its exchange completes."""

    step: int
    snapshot: torch.Tensor
    done: float


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
        period: local steps per round (the strategy's ``gossip_every_n_steps``; default 1,
            a round every step). The rounds follow the strategy's own
            :class:`~lightning_gossip.sync_gossip.schedule.RoundSchedule`: the round of the
            exchange step ``e`` (``(e + 1) % period == 0``) mixes with ``W_e`` only; overlapped,
            it snapshots the replicas at the start of its period's first step and adds
            ``W_e x_s - x_s`` after the local step of ``e`` (``delay_by_one``: of ``e + 1``);
            blocking, ``x <- W_e x'`` after the local step of ``e``. A period that aliases a
            periodic topology is refused as the strategy refuses it. :meth:`set_period`
            switches it (``gossip_every_n_steps="auto"``).
        exchange_time: virtual time units one round's exchange takes on the link (default 0:
            free). The rounds go over the link one after the other, each from when it is
            posted (or the previous one is done, if later); a step that applies a round ends
            no earlier than its exchange (:attr:`time`). So with a constant compute ``c`` a
            period of ``n`` steps takes ``max(n c, exchange_time)`` overlapped and
            ``n c + exchange_time`` blocking: :func:`~lightning_gossip.plan.step_time` of the
            cost model with ``overlap=1``.
        Other arguments: see :class:`~lightning_gossip.sim.Simulator`.

    Example::

        >>> import torch
        >>> sim = DPSGDSimulator(torch.nn.Linear(2, 1), torch.nn.functional.mse_loss, "ring",
        ...                      8, lr=0.0)
        >>> sim.set_replicas(torch.arange(8.0)[:, None].repeat(1, 3))
        >>> sim.step(torch.zeros(8, 1, 2), torch.zeros(8, 1, 1))
        >>> sim.replicas[:, 0].tolist()[:3]  # ring neighbours (7, 0, 1), (0, 1, 2), (1, 2, 3)
        [2.6666667461395264, 1.0, 2.0]
        >>> slow = DPSGDSimulator(torch.nn.Linear(2, 1), torch.nn.functional.mse_loss, "ring",
        ...                       8, period=2, exchange_time=3.0)
        >>> for _ in range(4):
        ...     slow.step(torch.zeros(8, 1, 2), torch.zeros(8, 1, 1), duration=1.0)
        >>> slow.time, slow.exchanges  # 2 periods of max(2 x 1, 3)
        (6.0, 2)
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
        period: int = 1,
        exchange_time: float = 0.0,
    ) -> None:
        super().__init__(model, loss_fn, world_size, lr, momentum, weight_decay)
        self.topology = _topology.resolve(topology, self.world_size, seed)
        self.mixer = Mixer(self.topology)
        self.overlap = bool(overlap) or bool(delay_by_one)
        self.delay_by_one = bool(delay_by_one)
        if not (math.isfinite(exchange_time) and exchange_time >= 0):
            raise ValueError(f"exchange_time must be a finite number >= 0, got {exchange_time!r}")
        self.exchange_time = float(exchange_time)
        self.schedule = self._schedule(period)
        self.step_count = 0
        #: virtual time: the end of the last step (its compute, and the exchanges it waited for)
        self.time = 0.0
        #: rounds started so far (as the strategy's ``gossip_stats["exchanges"]``)
        self.exchanges = 0
        self._rounds: list[_Round] = []  # posted, not yet applied (oldest first)
        self._last_round: int | None = None  # the exchange step of the last round posted
        self._link_free = 0.0  # when the link has sent the last round posted

    @property
    def period(self) -> int:
        """Local steps per round (``gossip_every_n_steps``)."""
        return self.schedule.period

    def _schedule(self, period: int) -> RoundSchedule:
        schedule = RoundSchedule(period, self.overlap, self.delay_by_one)
        schedule.check_connects(self.topology)
        return schedule

    def set_period(self, period: int) -> None:
        """A round every ``period`` steps from the next step on, the exchange steps still
        counted from step 0, as the strategy's engine switches (``gossip_every_n_steps=
        "auto"``): with no round in flight (``RuntimeError`` otherwise: :meth:`quiesce`
        first, as the strategy does before it decides)."""
        if self._rounds:
            raise RuntimeError("set_period needs no round in flight: call quiesce() first")
        self.schedule = self._schedule(period)
        self._last_round = None

    def _post(self, step: int, snapshot: torch.Tensor, at: float) -> None:
        """Post the round of exchange step ``step`` at virtual time ``at``."""
        done = max(at, self._link_free) + self.exchange_time
        self._link_free = done
        self._rounds.append(_Round(step, snapshot.clone(), done))
        self._last_round = step
        self.exchanges += 1

    def step(self, x: torch.Tensor, y: torch.Tensor, duration: float = 1.0) -> None:
        """One synchronous step; ``x``, ``y`` hold one minibatch per learner: ``(n, B, ...)``.
        ``duration``: the step's compute in virtual time units (the slowest learner's: the
        step is synchronous); :attr:`time` advances by it, or up to the end of the exchange
        of a round the step applies, if later."""
        n = self.world_size
        if len(x) != n or len(y) != n:
            raise ValueError(f"expected one minibatch per learner (first dimension {n}), "
                             f"got {len(x)} and {len(y)}")
        g = self.gradients(self.replicas, self.buffers, x, y)
        local = self._sgd(slice(None), self.replicas, g)
        t, schedule, start = self.step_count, self.schedule, self.time
        d = self.replicas.shape[1]
        has_buffers = self.buffers.numel() > 0
        before = torch.cat([self.replicas, self.buffers], 1) if has_buffers else self.replicas
        after = torch.cat([local, self.buffers], 1) if has_buffers else local
        end = start + float(duration)
        if not self.overlap:
            new = after
            if schedule.is_round(t):  # exchange now, after the local step: x <- W_t x'
                self._post(t, after, end)
                end = self._rounds.pop().done
                new = self.mixer.mix(after, t)
        else:
            posted = schedule.started_at(t)
            if posted is not None and self._last_round != posted:
                self._post(posted, before, start)  # at the period's first step, x_s
            if schedule.is_round(t) and self._last_round != t:
                self._post(t, after, end)  # its first step came before a switch: post now
            new = after
            while self._rounds and schedule.apply_step(self._rounds[0].step) <= t:
                rnd = self._rounds.pop(0)
                new = new + (self.mixer.mix(rnd.snapshot, rnd.step) - rnd.snapshot)
                end = max(end, rnd.done)
        self.replicas = new[:, :d].contiguous()
        if has_buffers:
            self.buffers = new[:, d:].contiguous()
        self.step_count += 1
        self.time = end

    def quiesce(self) -> None:
        """Apply every round still in flight (``delay_by_one``'s last one, a round posted in a
        period not yet ended), each with the matrix of its exchange step, as the strategy
        does at sync points; :attr:`time` waits for their exchanges."""
        d = self.replicas.shape[1]
        while self._rounds:
            rnd = self._rounds.pop(0)
            change = self.mixer.mix(rnd.snapshot, rnd.step) - rnd.snapshot
            self.replicas = self.replicas + change[:, :d]
            if self.buffers.numel():
                self.buffers = self.buffers + change[:, d:]
            self.time = max(self.time, rnd.done)
