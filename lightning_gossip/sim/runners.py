"""Experiments: run a simulator for some virtual time and record its curves in a
:class:`SimResult` (what ``lightning-gossip simulate`` prints, plots and writes as JSON)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from lightning_gossip.budget import GossipPeriod, auto_period, resolve_gossip_every_n_steps
from lightning_gossip.pairing import PairingName
from lightning_gossip.sim.adpsgd import ADPSGDSimulator
from lightning_gossip.sim.dpsgd import DPSGDSimulator
from lightning_gossip.sim.period import agreed_auto_period
from lightning_gossip.sim.workloads import ComputeModel, DataShards, LossFn

__all__ = ["SimResult", "run_adpsgd", "run_dpsgd"]


@dataclass
class SimResult:
    """Curves of one simulated run, one entry per evaluation.

    ``time`` is virtual time, ``steps`` the total local steps / n, ``loss`` and ``accuracy``
    those of the averaged model, ``absolute_consensus_distance`` the simulator's
    :meth:`~lightning_gossip.sim.Simulator.absolute_consensus_distance`; ``topology`` holds the
    AD-PSGD pairing for ``algorithm == "adpsgd"``; ``extra`` goes into :meth:`as_dict` as is.
    """

    algorithm: str
    topology: str
    world_size: int
    time: list[float] = field(default_factory=list)
    steps: list[float] = field(default_factory=list)
    loss: list[float] = field(default_factory=list)
    accuracy: list[float] = field(default_factory=list)
    absolute_consensus_distance: list[float] = field(default_factory=list)
    extra: dict = field(default_factory=dict)

    def record(self, time: float, steps: float, loss: float, acc: float, cons: float) -> None:
        """Append one evaluation (``cons``: the absolute consensus distance)."""
        self.time.append(float(time))
        self.steps.append(float(steps))
        self.loss.append(float(loss))
        self.accuracy.append(float(acc))
        self.absolute_consensus_distance.append(float(cons))

    def first_below(self, target: float, axis: str = "steps") -> float | None:
        """The first recorded ``steps`` (or ``time``) at which the loss is ``<= target``."""
        xs = self.steps if axis == "steps" else self.time
        for x, loss in zip(xs, self.loss):
            if loss <= target:
                return x
        return None

    def as_dict(self) -> dict:
        """The run as JSON-ready dict (the curves, then ``extra``'s items)."""
        return {
            "algorithm": self.algorithm, "topology": self.topology, "world_size": self.world_size,
            "time": self.time, "steps": self.steps, "loss": self.loss, "accuracy": self.accuracy,
            "absolute_consensus_distance": self.absolute_consensus_distance, **self.extra,
        }



def _progress(total: float, desc: str, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, disable=not enabled, leave=False, dynamic_ncols=True)


def run_dpsgd(
    model: nn.Module,
    loss_fn: LossFn,
    shards: DataShards,
    eval_data: tuple[torch.Tensor, torch.Tensor],
    topology: str,
    duration: float,
    lr: float,
    momentum: float = 0.0,
    seed: int = 0,
    overlap: bool = True,
    compute: ComputeModel | None = None,
    eval_every: float = 10.0,
    progress: bool = False,
    delay_by_one: bool = False,
    gossip_every_n_steps: GossipPeriod = 1,
    exchange_time: float = 0.0,
) -> SimResult:
    """Run synchronous D-PSGD for ``duration`` virtual time units; record every ``eval_every``.

    A synchronous step lasts as long as its slowest learner (``compute``; default 1 unit each),
    and a step that applies a round no shorter than the round's exchange (``exchange_time``
    units each, one after the other on the link). ``overlap``, ``delay_by_one``, the rounds of
    ``gossip_every_n_steps`` and the time model: see
    :class:`~lightning_gossip.sim.DPSGDSimulator`. ``gossip_every_n_steps="auto"`` (or an
    :class:`~lightning_gossip.gossip_period.AutoPeriod`): period 1 for the first
    ``warmup_steps + measure_steps`` steps, then the rounds in flight are applied and the
    period becomes :func:`~lightning_gossip.sim.period.agreed_auto_period`'s, as the strategy
    switches. The result's ``extra`` holds ``period`` (the period at the end), ``exchanges``
    (rounds started) and ``exchange_time``.

    Example::

        >>> import torch
        >>> x, y = torch.linspace(-1, 1, 64)[:, None].repeat(1, 4), torch.arange(64) % 3
        >>> shards = DataShards(x, y, 16, batch_size=8)
        >>> model, loss_fn = torch.nn.Linear(4, 3), torch.nn.functional.cross_entropy
        >>> r = run_dpsgd(model, loss_fn, shards, (x, y), "random_ring", duration=5, lr=0.1)
        >>> r.steps
        [0.0, 5.0]
    """
    n = shards.world_size
    compute = compute or ComputeModel(np.ones(n))
    settings = auto_period(gossip_every_n_steps)
    sim = DPSGDSimulator(model, loss_fn, topology, n, lr=lr, momentum=momentum, seed=seed,
                         overlap=overlap, delay_by_one=delay_by_one,
                         period=resolve_gossip_every_n_steps(gossip_every_n_steps),
                         exchange_time=exchange_time)
    switch_at = None if settings is None else settings.warmup_steps + settings.measure_steps
    res = SimResult("dpsgd", sim.topology.name, n)
    ranks = np.arange(n)
    next_eval = 0.0
    with _progress(duration, f"dpsgd {sim.topology.name} n={n}", progress) as bar:
        while True:
            t = sim.time
            if t >= next_eval - 1e-9:
                res.record(t, sim.step_count, *sim.evaluate(*eval_data),
                           float(sim.absolute_consensus_distance()))
                next_eval += eval_every
            steps = np.full(n, sim.step_count)
            dt = float(compute.duration(ranks, steps).max())
            if t + dt > duration + 1e-9:
                break
            sim.step(*shards.batch(ranks, steps), duration=dt)
            if settings is not None and sim.step_count == switch_at:
                sim.quiesce()  # as the strategy, before it decides
                sim.set_period(agreed_auto_period(compute, sim.exchange_time, settings))
            bar.update(sim.time - t)
    if res.time[-1] < sim.time - 1e-9:
        res.record(sim.time, sim.step_count, *sim.evaluate(*eval_data),
                   float(sim.absolute_consensus_distance()))
    res.extra = {"period": sim.period, "exchanges": sim.exchanges,
                 "exchange_time": sim.exchange_time}
    return res


def run_adpsgd(
    model: nn.Module,
    loss_fn: LossFn,
    shards: DataShards,
    eval_data: tuple[torch.Tensor, torch.Tensor],
    pairing: PairingName,
    duration: float,
    lr: float,
    momentum: float = 0.0,
    seed: int = 0,
    compute: ComputeModel | None = None,
    eval_every: float = 10.0,
    progress: bool = False,
    overlap: bool = True,
    delay_by_one: bool = False,
    gossip_every_n_steps: GossipPeriod = 1,
    exchange_time: float = 0.0,
) -> SimResult:
    """Run AD-PSGD for ``duration`` virtual time units; record every ``eval_every``.

    ``steps`` in the result is the total number of local steps divided by the number of
    learners (comparable with synchronous steps). ``overlap``, ``delay_by_one``,
    ``gossip_every_n_steps`` (a number, or ``"auto"``: each learner its own period) and
    ``exchange_time``: see :class:`~lightning_gossip.sim.ADPSGDSimulator`. The result's
    ``extra`` also holds ``periods`` (each learner's, after its first steps with ``"auto"``)
    and ``exchanges`` (started by each learner).
    """
    n = shards.world_size
    sim = ADPSGDSimulator(model, loss_fn, n, lr=lr, momentum=momentum, pairing=pairing,
                          compute=compute, overlap=overlap, delay_by_one=delay_by_one, seed=seed,
                          period=gossip_every_n_steps, exchange_time=exchange_time)
    res = SimResult("adpsgd", pairing, n)
    t = 0.0
    with _progress(duration, f"adpsgd {pairing} n={n}", progress) as bar:
        while True:
            res.record(t, sim.total_steps / n, *sim.evaluate(*eval_data),
                       float(sim.absolute_consensus_distance()))
            if t >= duration - 1e-9:
                break
            nxt = min(t + eval_every, duration)
            sim.run_until(nxt, shards.batch)
            bar.update(nxt - t)
            t = nxt
    res.extra = {"local_steps": sim.local_steps.tolist(), "mean_staleness": sim.mean_staleness,
                 "periods": sim.periods.tolist(), "exchanges": sim.exchanges.tolist()}
    return res
