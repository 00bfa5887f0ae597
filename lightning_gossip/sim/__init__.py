"""Simulate many decentralized learners in one process.

``N`` virtual learners keep their replicas stacked in one ``(N, d)`` fp32 tensor; per-learner
gradients come from :func:`torch.func.vmap` over :func:`torch.func.grad`, and replicas are mixed
with the very :class:`~lightning_gossip.topology.Topology` objects the strategies use, so the
simulator answers "how would this topology train with 1,024 learners?" on a laptop.

Two algorithms:

* :class:`DPSGDSimulator`: synchronous D-PSGD with exactly the update of
  :class:`~lightning_gossip.DPSGDStrategy` at optimizer step ``t`` with ``W_t =
  topology.mixing_matrix(t)``:

  - ``overlap=True`` (default): ``x_{t+1} = x'_t + (W_t x_t - x_t)``, where ``x'_t`` is the
    local optimizer step from ``x_t`` (plain SGD: ``x_{t+1} = W_t x_t - lr * g(x_t)``);
  - ``overlap=False``: ``x_{t+1} = W_t x'_t``;
  - ``delay_by_one=True``: the change ``W_t x_t - x_t`` lands at step ``t + 1``.

  Parameters and floating-point buffers are mixed, in fp32.

* :class:`ADPSGDSimulator`: asynchronous AD-PSGD in virtual time. Learner ``i`` needs
  ``compute_times[i]`` time units per step (optionally with random jitter); its gradient is
  computed on the replica as it was when the step started and applied to the replica as it is
  when the step ends (staleness). After each of its steps an *active* learner (the same
  :class:`~lightning_gossip.pairing.Pairing` the real strategy uses, ``"ring"`` by default)
  averages with one passive partner; the exchange lands at the end of the active's next step
  (as the real strategy overlaps one exchange with one step), one step later with
  ``delay_by_one=True``, or at once with ``overlap=False``. Both sides receive
  ``(theirs - mine) / 2`` as computed at launch, so the sum of replicas is conserved.

Both model the communication budget (``period``, the strategies' ``gossip_every_n_steps``,
``"auto"`` included) and, given an ``exchange_time`` in virtual time units, the time of the
exchanges on the link: D-PSGD's rounds every ``period`` steps follow the strategy's own
:class:`~lightning_gossip.sync_gossip.schedule.RoundSchedule` and go over the link one after
the other, so a period of ``n`` steps of compute ``c`` takes ``max(n c, exchange_time)``
overlapped, what ``lightning-gossip plan`` predicts; an AD-PSGD active starts an exchange at
most once every ``period`` of its steps, and an exchange occupies both learners for
``exchange_time``. ``"auto"`` picks the period with the strategies' policy from the same two
numbers (:mod:`~lightning_gossip.sim.period`).

Both report :meth:`Simulator.absolute_consensus_distance`, ``mean_i ||x_i - mean||^2`` (the
strategies log the relative :func:`lightning_gossip.consensus.consensus_distance`).

Modules: :mod:`~lightning_gossip.sim.base` (stacked replicas, local SGD),
:mod:`~lightning_gossip.sim.dpsgd`, :mod:`~lightning_gossip.sim.adpsgd`,
:mod:`~lightning_gossip.sim.workloads` (data shards, step times, the digits task),
:mod:`~lightning_gossip.sim.period` (the period ``"auto"`` picks for simulated learners),
:mod:`~lightning_gossip.sim.runners` (timed runs and their curves); the mixing itself is
:class:`lightning_gossip.mixing.Mixer`. Everything is deterministic for a seed.

Example::

    >>> import torch
    >>> from lightning_gossip.sim import DPSGDSimulator
    >>> model = torch.nn.Linear(4, 1)
    >>> sim = DPSGDSimulator(model, torch.nn.functional.mse_loss, "random_ring", 64, lr=0.1)
    >>> x, y = torch.randn(64, 8, 4), torch.randn(64, 8, 1)   # one minibatch per learner
    >>> sim.step(x, y)
    >>> sim.replicas.shape, sim.step_count
    (torch.Size([64, 5]), 1)
    >>> float(sim.absolute_consensus_distance()) > 0
    True
"""

from __future__ import annotations

from lightning_gossip.mixing import Mixer
from lightning_gossip.sim.adpsgd import ADPSGDSimulator, BatchFn
from lightning_gossip.sim.base import Simulator
from lightning_gossip.sim.dpsgd import DPSGDSimulator
from lightning_gossip.sim.runners import SimResult, run_adpsgd, run_dpsgd
from lightning_gossip.sim.workloads import ComputeModel, DataShards, LossFn, digits_problem

__all__ = [
    "ADPSGDSimulator",
    "BatchFn",
    "ComputeModel",
    "DPSGDSimulator",
    "DataShards",
    "LossFn",
    "Mixer",
    "SimResult",
    "Simulator",
    "digits_problem",
    "run_adpsgd",
    "run_dpsgd",
]
