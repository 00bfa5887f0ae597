"""The communication budget in the simulator (``lightning_gossip.sim``): D-PSGD rounds every
``period`` steps exactly as the strategy schedules them (the NumPy reference of the strategy's
own tests), their time on a serial link as the cost model (``lightning-gossip plan``) predicts
it, the period ``"auto"`` picks as the strategies and ``plan`` pick it, and AD-PSGD's one
exchange per period of each active. No process: exact arithmetic in virtual time.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from lightning_gossip import plan
from lightning_gossip.gossip_period import AutoPeriod, choose_period
from lightning_gossip.sim import (
    ADPSGDSimulator,
    ComputeModel,
    DataShards,
    DPSGDSimulator,
    run_adpsgd,
    run_dpsgd,
)
from lightning_gossip.sim.period import agreed_auto_period, auto_periods
from tests import period_cases as P

N = 6
SEED = 5


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(3, 2)


def _batch(n: int = N) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.zeros(n, 1, 3), torch.zeros(n, 1, 2)


def _dpsgd(**kw) -> DPSGDSimulator:
    sim = DPSGDSimulator(_model(), nn.functional.mse_loss, "random_ring", N, lr=0.0,
                         seed=SEED, **kw)
    torch.manual_seed(1)
    sim.set_replicas(torch.randn(N, sim.replicas.shape[1]))
    return sim


@pytest.mark.parametrize("overlap,delay", [(True, False), (False, False), (True, True)])
@pytest.mark.parametrize("period", [1, 3])
def test_dpsgd_rounds_every_period_are_the_strategy_s(period, overlap, delay):
    """lr = 0, 10 steps (the last period unfinished), then the sync point: after every step
    the replicas are what the strategy's tests expect of the strategy (only the exchange
    steps ``e`` mix, with ``W_e``; overlapped from the snapshot at the period's first step,
    delay-by-one a step later; the rounds in flight applied at the end), and the rounds
    started are the strategy's count."""
    sim = _dpsgd(period=period, overlap=overlap, delay_by_one=delay)
    x0 = sim.replicas.double().numpy().copy()
    want = P.expected_rounds(x0, sim.topology.mixing_matrix, 10, period, overlap, delay)
    for t in range(10):
        sim.step(*_batch())
        np.testing.assert_allclose(sim.replicas.double().numpy(), want[t], rtol=0, atol=1e-5,
                                   err_msg=f"step {t}")
    sim.quiesce()
    np.testing.assert_allclose(sim.replicas.double().numpy(), want[-1], rtol=0, atol=1e-5)
    assert sim.exchanges == P.rounds_posted(10, period, overlap)
    if period > 1:  # not what a round every step gives
        every = P.expected_rounds(x0, sim.topology.mixing_matrix, 10, 1, overlap, delay)
        assert np.abs(every[-1] - want[-1]).max() > 1e-3


def test_dpsgd_period_switch_posts_a_missed_round_at_its_exchange_step():
    """As the strategy's engine after ``set_period`` (``"auto"``): the exchange steps stay
    counted from step 0, and a round whose period began before the switch is posted at its
    exchange step; lr = 0: the replicas are the product of the matrices of the exchange
    steps used."""
    sim = _dpsgd()
    x = sim.replicas.double().numpy().copy()
    for _ in range(4):
        sim.step(*_batch())
    sim.quiesce()
    sim.set_period(3)
    for _ in range(8):
        sim.step(*_batch())
    sim.quiesce()  # (nothing in flight: step 11 ended a period)
    m = sim.topology.mixing_matrix
    for e in (0, 1, 2, 3, 5, 8, 11):
        x = m(e) @ x
    np.testing.assert_allclose(sim.replicas.double().numpy(), x, rtol=0, atol=1e-5)
    assert sim.exchanges == 7
    sim.step(*_batch())
    with pytest.raises(RuntimeError, match="quiesce"):
        sim.set_period(2)  # the round of step 14, posted at step 12, is in flight


@pytest.mark.parametrize("period,x", [(1, 0.5), (1, 2.5), (2, 1.5), (2, 2.5), (3, 4.0)])
def test_dpsgd_time_per_period_is_the_cost_model_s(period, x):
    """Compute 1 per step, ``x`` per exchange on a serial link: a period of ``n`` steps takes
    ``max(n, x)`` overlapped (from the first period), ``n + x`` blocking, and in the steady
    state ``max(n, x)`` with delay-by-one, which is ``n`` times the cost model's step time
    (:func:`lightning_gossip.plan.step_time` with ``overlap=1``)."""
    for mode in plan.MODES:
        sim = _dpsgd(period=period, exchange_time=x, overlap=mode != "blocking",
                     delay_by_one=mode == "delay_by_one")
        ends = []
        for _ in range(20 * period):
            sim.step(*_batch(), duration=1.0)
            if sim.step_count % period == 0:
                ends.append(sim.time)
        per = np.diff([0.0, *ends])
        want = period * plan.step_time(1.0, x / period, mode=mode)
        assert per[-3:] == pytest.approx([want] * 3, rel=1e-12), (mode, per)
        if mode != "delay_by_one":
            assert per == pytest.approx([want] * 20, rel=1e-12), (mode, per)


def test_dpsgd_plan_and_simulator_agree_on_r_s_period_and_its_time():
    """A cluster of 4 nodes whose ring exchange takes 1.6 steps of compute: ``plan`` picks
    the period with the strategies' policy from its row at period 1, the simulator given the
    row's two numbers picks the same (the largest median compute), and at that period a step
    takes in the simulator what ``plan`` predicts, overlapped and blocking."""
    cluster = plan.Cluster(nodes=4, gpus_per_node=1, inter_bandwidth=25e6)
    work = plan.Workload(params=1_000_000, compute_s=0.1, wire_bytes=2)
    for mode in ("overlap", "blocking"):
        row = plan.predict_dpsgd(cluster, work, "ring", mode=mode)
        assert row.exchange_s == pytest.approx(0.16) and row.compute_s == 0.1
        pick = plan.auto_period(row)
        compute = ComputeModel([row.compute_s] * 4)
        assert pick == agreed_auto_period(compute, row.exchange_s, AutoPeriod()) == 2
        at = plan.predict_dpsgd(cluster, work, "ring", mode=mode, period=pick)
        sim = DPSGDSimulator(_model(), nn.functional.mse_loss, "ring", 4, period=pick,
                             exchange_time=row.exchange_s, overlap=mode == "overlap")
        for _ in range(8):
            sim.step(*_batch(4), duration=row.compute_s)
        assert sim.time / 8 == pytest.approx(at.step_s, rel=1e-12), mode


def _shards(n: int) -> tuple[DataShards, tuple[torch.Tensor, torch.Tensor]]:
    x = torch.linspace(-1, 1, 16 * n)[:, None].repeat(1, 3)
    y = torch.zeros(16 * n, 2)
    return DataShards(x, y, n, batch_size=4), (x, y)


def test_run_dpsgd_auto_switches_after_its_measured_steps():
    """``gossip_every_n_steps="auto"``, compute 1, exchanges of 2.5: period 1 for the first
    10 steps (2 of warm-up, 8 measured), each step waiting for its exchange (steps 0-9 end
    at 2.5, 5, ..., 25), then period 3 (3 x 1 >= 1.1 x 2.5): step 11 posts its round after
    its local step (its period began before the switch) and ends at 29.5; from step 12 on a
    round every 3 steps, each posted at its period's first step and done 2.5 later, so a
    period takes 3 (the exchange hidden). 22 steps in 39.5."""
    shards, data = _shards(N)
    res = run_dpsgd(_model(), nn.functional.mse_loss, shards, data, "ring", duration=39.5,
                    lr=0.0, eval_every=1000.0, gossip_every_n_steps="auto", exchange_time=2.5)
    assert res.steps[-1] == 22 and res.time[-1] == 39.5
    # rounds: steps 0-9, then 11, 14, 17, 20 and 23 (posted at step 21, still in flight)
    assert res.extra == {"period": 3, "exchanges": 15, "exchange_time": 2.5}
    fixed = run_dpsgd(_model(), nn.functional.mse_loss, shards, data, "ring", duration=10.0,
                      lr=0.0, eval_every=1000.0)
    assert fixed.extra == {"period": 1, "exchanges": 10, "exchange_time": 0.0}
    assert fixed.steps[-1] == 10 and fixed.time[-1] == 10.0  # as before: no link time


def test_adpsgd_one_exchange_per_period_of_each_active():
    """x = 0 (exchanges land by steps alone), compute 1: an active starts an exchange after
    its steps ``p, 2p, ...``: ``20 // p`` in 20 steps, each active with its own period; the
    sum of the replicas is kept."""
    n = 6
    periods = [1, 1, 2, 1, 3, 1]
    sim = ADPSGDSimulator(_model(), nn.functional.mse_loss, n, lr=0.0, period=periods)
    active = [sim.pairing.is_active(r) for r in range(n)]
    assert active == [True, False, True, False, True, False]
    torch.manual_seed(2)
    x0 = torch.randn(n, sim.replicas.shape[1])
    sim.set_replicas(x0)
    sim.run_until(20.0, lambda r, s: _batch(len(r)))
    assert sim.local_steps.tolist() == [20] * n
    assert sim.exchanges.tolist() == [20, 0, 10, 0, 6, 0]
    torch.testing.assert_close(sim.replicas.sum(0), x0.sum(0), rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="one period per learner"):
        ADPSGDSimulator(_model(), nn.functional.mse_loss, n, period=[1, 2])
    with pytest.raises(ValueError, match="gossip_every_n_steps"):
        ADPSGDSimulator(_model(), nn.functional.mse_loss, n, period=0)


def test_adpsgd_auto_each_rank_its_own_period_and_the_link_serialises():
    """Two learners (0 active, 1 passive, 3 times slower), exchanges of 2.5: ``"auto"``
    gives each the policy's period for its own compute (3 and 1). The active steps every 1:
    at period 1 (its first 10 steps) it starts an exchange at steps 1, 4, 7, 10 (its gossip
    thread busy for 2.5 after each), then at period 3 at steps 13, 16, 19; each lands at its
    first step boundary after the exchange's end. The sum is kept."""
    compute = ComputeModel([1.0, 3.0])
    sim = ADPSGDSimulator(_model(), nn.functional.mse_loss, 2, lr=0.0, compute=compute,
                          period="auto", exchange_time=2.5)
    assert sim.periods.tolist() == auto_periods(compute, 2.5, AutoPeriod()).tolist() == [3, 1]
    assert sim.periods.tolist() == [choose_period(1.0, 2.5), choose_period(3.0, 2.5)]
    assert sim.auto_from == 10
    torch.manual_seed(3)
    x0 = torch.randn(2, sim.replicas.shape[1])
    sim.set_replicas(x0)
    sim.run_until(19.0, lambda r, s: _batch(len(r)))
    assert sim.local_steps.tolist() == [19, 6] and sim.exchanges.tolist() == [7, 0]
    assert sim.period_of(0) == 3
    torch.testing.assert_close(sim.replicas.sum(0), x0.sum(0), rtol=0, atol=1e-5)


def test_run_adpsgd_reports_the_periods_and_exchanges():
    shards, data = _shards(4)
    res = run_adpsgd(_model(), nn.functional.mse_loss, shards, data, "ring", duration=12.0,
                     lr=0.0, eval_every=6.0, gossip_every_n_steps=4)
    assert res.extra["periods"] == [4] * 4
    assert res.extra["exchanges"] == [3, 0, 3, 0]  # the actives', after steps 4, 8, 12


def test_plan_adpsgd_auto_is_each_rank_s_own_as_in_the_simulator():
    """``plan``'s adpsgd rows under ``"auto"``: each rank's period from its own compute, as
    the strategy (no collective) and the simulator pick them; a straggler's is shorter, the
    ranks of a node agree (hierarchical); without stragglers one period, the row's own."""
    c = plan.Cluster(nodes=2, gpus_per_node=2, inter_bandwidth=25e6)
    w = plan.Workload(params=1_000_000, compute_s=0.025, wire_bytes=2)
    slow = [1.0, 1.0, 4.0, 1.0]  # rank 2 (node 1) computes 4 times longer
    for hier, want in ((False, [4, 4, 1, 4]), (True, [4, 4, 1, 1])):
        row = plan.predict_adpsgd(c, w, hierarchical=hier, stragglers=slow)
        compute = ComputeModel(plan.adpsgd_rank_compute(c, w, hier, slow))
        picks = plan.adpsgd_auto_periods(c, w, hierarchical=hier, stragglers=slow)
        assert picks.tolist() == auto_periods(compute, row.exchange_s, AutoPeriod()).tolist()
        assert picks.tolist() == want, hier
        rows = plan.predict_periods(c, w, stragglers=slow)
        got = [r for r in rows if r.strategy.startswith("adpsgd") and
               ("hier" in r.strategy) == hier][0]
        assert got.period == max(want) and f"periods {min(want)}-{max(want)} by rank" in got.note
        assert got.step_s == plan.predict_adpsgd(c, w, hierarchical=hier, stragglers=slow,
                                                 period=want).step_s
    # one period for all ranks: the row of that period, as before
    assert plan.adpsgd_auto_periods(c, w).tolist() == [4] * 4
    flat = [r for r in plan.predict_periods(c, w) if r.strategy == "adpsgd (ring)"][0]
    assert flat.period == plan.auto_period(plan.predict_adpsgd(c, w)) == 4
    assert flat.step_s == plan.predict_adpsgd(c, w, period=[4] * 4).step_s
    with pytest.raises(ValueError, match="ranks of a node"):
        plan.predict_adpsgd(c, w, hierarchical=True, period=[1, 2, 1, 1])
