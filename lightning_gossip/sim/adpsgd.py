"""Asynchronous AD-PSGD over ``N`` virtual learners in virtual time."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
import torch
from torch import nn

from lightning_gossip.budget import GossipPeriod, auto_period
from lightning_gossip.gossip_period import AutoPeriod
from lightning_gossip.pairing import Pairing, PairingName
from lightning_gossip.sim.base import Simulator
from lightning_gossip.sim.period import _periods, auto_periods
from lightning_gossip.sim.workloads import ComputeModel, LossFn

__all__ = ["ADPSGDSimulator", "BatchFn"]

#: ``batches(ranks, local_steps) -> (x, y)``: one minibatch per rank, stacked
BatchFn = Callable[[np.ndarray, np.ndarray], tuple[torch.Tensor, torch.Tensor]]
"""``batches(ranks, steps) -> (x, y)``: one batch per learner, stacked on dimension 0."""


class ADPSGDSimulator(Simulator):
    """Asynchronous AD-PSGD in virtual time (see :mod:`lightning_gossip.sim`).

    Learner ``i`` needs ``compute.duration(i, s)`` time units for its step ``s``; its gradient is
    computed on the replica as it was when the step started and applied to the replica as it is
    when the step ends (staleness). After each of its steps an *active* learner averages with
    one passive partner. An exchange launched after the active's step ``s`` lands (both sides
    receiving ``(theirs - mine) / 2`` as computed at launch, so the sum of replicas is
    conserved) at the end of its step ``s + k``, ``k`` = :attr:`steps_in_flight`:

    * ``k = 1`` (default): overlapped with the active's next step, as
      :class:`~lightning_gossip.ADPSGDStrategy` does;
    * ``k = 2`` (``delay_by_one=True``): one step boundary later, as the strategy's
      ``delay_by_one=True``;
    * ``k = 0`` (``overlap=False``): an atomic average right after the step (an idealisation).

    **Gossip period** (``period``, the strategy's ``gossip_every_n_steps``): an active learner
    starts an exchange after its step ``s`` only when ``period`` steps passed since the step
    after which it started its last one (the engine's rule: a fresh snapshot at most every
    ``period`` steps), so the first after step ``period``; ``period=1`` is one after every
    step. A sequence gives each learner its own; ``"auto"`` (or an
    :class:`~lightning_gossip.gossip_period.AutoPeriod`) gives each the period the strategy's
    ``"auto"`` picks for it (:func:`~lightning_gossip.sim.period.auto_periods`: from its own
    median step time and ``exchange_time``, each rank for itself), from the step after its
    first ``warmup_steps + measure_steps`` steps, at period 1 until then.

    **Exchange time** (``exchange_time``, virtual time units of one exchange on the link; 0,
    the default, lands exchanges by steps alone as above): an exchange occupies the active and
    the passive from its start, when both are free (a passive serves one exchange at a time, so
    a request may wait behind another active's exchange), for ``exchange_time``; it lands at
    the first step boundary of the active at or after both the ``k`` steps above and the end
    of its exchange. An active whose last exchange is still on the link starts none at a step
    boundary (its gossip thread is busy).

    Args:
        pairing: ``"ring"`` (default, as the strategy) or ``"random"`` (see
            :class:`~lightning_gossip.pairing.Pairing`).
        compute: per-learner step times; default: every learner takes 1 time unit.
        overlap: ``False`` averages atomically right after each step (``k = 0``).
        delay_by_one: apply each exchange one step boundary later (``k = 2``; implies
            ``overlap``).
        seed: seeds the random pairing.
        period: local steps per exchange of an active: an int, one per learner, or
            ``"auto"`` / an :class:`~lightning_gossip.gossip_period.AutoPeriod` (see above).
        exchange_time: virtual time units of one exchange (see above).
        Other arguments: see :class:`~lightning_gossip.sim.Simulator`.

    Example::

        >>> import torch
        >>> sim = ADPSGDSimulator(torch.nn.Linear(2, 1), torch.nn.functional.mse_loss, 8, lr=0.0,
        ...                       compute=ComputeModel.with_slow(8, slow=1, slow_factor=3.0))
        >>> sim.set_replicas(torch.randn(8, 3))
        >>> total = sim.replicas.sum(0)
        >>> def batches(ranks, steps):
        ...     return torch.zeros(len(ranks), 1, 2), torch.zeros(len(ranks), 1, 1)
        >>> sim.run_until(10.0, batches)
        >>> torch.allclose(sim.replicas.sum(0), total, atol=1e-5), sim.local_steps.tolist()
        (True, [10, 10, 10, 10, 10, 10, 10, 3])
    """

    def __init__(
        self,
        model: nn.Module,
        loss_fn: LossFn,
        world_size: int,
        lr: float = 0.1,
        momentum: float = 0.0,
        weight_decay: float = 0.0,
        pairing: PairingName = "ring",
        compute: ComputeModel | None = None,
        overlap: bool = True,
        delay_by_one: bool = False,
        seed: int = 0,
        period: GossipPeriod | Sequence[int] = 1,
        exchange_time: float = 0.0,
    ) -> None:
        super().__init__(model, loss_fn, world_size, lr, momentum, weight_decay)
        self.pairing = Pairing(pairing, self.world_size, seed)
        self.compute = compute or ComputeModel(np.ones(self.world_size))
        if len(self.compute.compute_times) != self.world_size:
            raise ValueError(
                f"compute model has {len(self.compute.compute_times)} learners, "
                f"expected {self.world_size}"
            )
        self.overlap = bool(overlap) or bool(delay_by_one)
        self.delay_by_one = bool(delay_by_one)
        #: steps of the active an exchange stays in flight (0, 1 or 2; see above)
        self.steps_in_flight = (2 if self.delay_by_one else 1) if self.overlap else 0
        n = self.world_size
        self.time = 0.0
        self.local_steps = np.zeros(n, dtype=np.int64)
        self.exchanges = np.zeros(n, dtype=np.int64)
        self._snapshot: torch.Tensor | None = None
        self._finish = self.compute.duration(np.arange(n), self.local_steps)
        self._active = np.array([self.pairing.is_active(r) for r in range(n)])
        if not (math.isfinite(exchange_time) and exchange_time >= 0):
            raise ValueError(f"exchange_time must be a finite number >= 0, got {exchange_time!r}")
        self.exchange_time = float(exchange_time)
        settings = auto_period(period) if isinstance(period, (str, AutoPeriod)) else None
        #: the period each learner uses once ``auto_from`` of its steps are done (before them:
        #: 1); the fixed period(s) given: ``auto_from`` is 0
        self.periods = (auto_periods(self.compute, self.exchange_time, settings)
                        if settings is not None else _periods(period, n))
        self.auto_from = 0 if settings is None else settings.warmup_steps + settings.measure_steps
        # the local step after which each learner last started an exchange; when the link
        # (exchange_time) frees each learner
        self._launched = np.zeros(n, dtype=np.int64)
        self._free = np.zeros(n)
        # per active: list of (due local step, done time, partner, delta for me)
        self._inflight: dict[int, list[tuple[int, float, int, torch.Tensor]]] = {}
        #: pairwise averages that landed on a replica while its gradient was being computed
        self.staleness_sum = 0
        self._hits = np.zeros(n, dtype=np.int64)

    @property
    def total_steps(self) -> int:
        """Local steps of all learners together."""
        return int(self.local_steps.sum())

    @property
    def mean_staleness(self) -> float:
        """Pairwise averages that landed on a replica between the snapshot a gradient was
        computed on and the moment it was applied, per local step."""
        return self.staleness_sum / max(self.total_steps, 1)

    def set_replicas(self, params: torch.Tensor, buffers: torch.Tensor | None = None) -> None:
        """Replace the stacked replicas (see :meth:`Simulator.set_replicas`)."""
        super().set_replicas(params, buffers)
        self._snapshot = None

    def run_until(self, until: float, batches: BatchFn) -> None:
        """Advance virtual time to ``until``, processing every step that ends by then.

        Args:
            until: virtual time to stop at (steps ending exactly then are processed).
            batches: ``batches(ranks, local_steps) -> (x, y)`` with one minibatch per rank.
        """
        if self._snapshot is None:
            self._snapshot = self.replicas.clone()
            self._snap_buffers = self.buffers.clone()
        while True:
            t_next = float(self._finish.min())
            if t_next > until + 1e-9:
                break
            done = np.flatnonzero(self._finish <= t_next + 1e-9)
            idx = torch.as_tensor(done)
            x, y = batches(done, self.local_steps[done])
            g = self.gradients(self._snapshot[idx], self._snap_buffers[idx], x, y)
            # the stale gradient (from the snapshot) is applied to the current replica
            self.replicas[idx] = self._sgd(idx, self.replicas[idx], g)
            self.staleness_sum += int(self._hits[done].sum())
            self.local_steps[done] += 1
            for i in done[self._active[done]]:
                self._gossip(int(i), t_next)
            self._hits[done] = 0  # what landed so far precedes their next snapshot
            self._snapshot[idx] = self.replicas[idx]
            self._snap_buffers[idx] = self.buffers[idx]
            self._finish[done] = t_next + self.compute.duration(done, self.local_steps[done])
            self.time = t_next
        self.time = max(self.time, until)

    def period_of(self, rank: int) -> int:
        """The period learner ``rank`` uses after its current step (1 during its first
        ``auto_from`` steps with ``"auto"``)."""
        return int(self.periods[rank]) if self.local_steps[rank] > self.auto_from else 1

    def _gossip(self, i: int, now: float) -> None:
        step = int(self.local_steps[i])
        queue = self._inflight.setdefault(i, [])
        while queue and queue[0][0] <= step and queue[0][1] <= now + 1e-9:
            _, _, j, delta = queue.pop(0)
            self._apply_pair(i, j, delta)
        period = self.period_of(i)
        if step - self._launched[i] < period or self._free[i] > now + 1e-9:
            return  # not due in this period, or its gossip thread is still exchanging
        self._launched[i] = step
        j = self.pairing.partner(i, int(self.exchanges[i]))
        self.exchanges[i] += 1
        done = max(now, self._free[i], self._free[j]) + self.exchange_time
        if self.steps_in_flight:
            self._free[i] = self._free[j] = done
        if self.steps_in_flight == 0:
            avg = (self.replicas[i] + self.replicas[j]) / 2
            self.replicas[i] = avg
            self.replicas[j] = avg
            if self.buffers.numel():
                bavg = (self.buffers[i] + self.buffers[j]) / 2
                self.buffers[i] = bavg
                self.buffers[j] = bavg
            self._hits[j] += 1
        else:
            delta = torch.cat([(self.replicas[j] - self.replicas[i]) / 2,
                               (self.buffers[j] - self.buffers[i]) / 2])
            queue.append((step + self.steps_in_flight, done, j, delta))

    def _apply_pair(self, i: int, j: int, delta: torch.Tensor) -> None:
        d = self.replicas.shape[1]
        self.replicas[i] += delta[:d]
        self.replicas[j] -= delta[:d]
        if self.buffers.numel():
            self.buffers[i] += delta[d:]
            self.buffers[j] -= delta[d:]
        self._hits[j] += 1  # lands at i's step boundary, but in the middle of j's step
