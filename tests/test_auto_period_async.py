"""``gossip_every_n_steps="auto"`` under ``adpsgd``: the exchange time it measures is the swap
itself, not the wait for a partner that answers late, nor a slow partner's compute; the waits
are kept apart (``GossipStats.peer_wait_s``) and reported with every decision
(``PeriodSwitch.local_peer_wait_s``, the ``gossip/peer_wait_ms`` metric).

The fits run on 4 real gloo processes (``attach``, lr = 0, ring pairing: ranks 0 and 2 are
active, 1 and 3 passive, each passive answers both actives); the driver's bookkeeping of the
waits is checked without processes.
"""

from __future__ import annotations

import csv
import time

import numpy as np
import pytest

from lightning_gossip.gossip_period import DEFAULT_MARGIN, AutoPeriod, choose_period
from lightning_gossip.gossip_period.auto import PeriodDriver
from tests import period_cases as P

WORLD = 4
COMPUTE_S = 0.2
"""Every rank's compute per step: a sleep before its forward (so the compute is known to be at
least this long)."""
LATE_S = 0.6
"""The ``late`` fit: every passive rank answers every request this late (a sleep before it
serves it, as when it serves another active first): 3 steps of compute."""
SLOW_S = 0.4
"""The ``slow`` fit: the passive ranks' extra compute per step (a straggling partner)."""
STEPS = 8
#: decided once, after 6 steps (1 of warm-up), with the default margin
SETTINGS = {"warmup_steps": 1, "measure_steps": 5, "recheck_every": None}


def _ranks(rank: int, world: int) -> dict:
    """On every rank, two adpsgd fits with ``attach`` and ``gossip_every_n_steps="auto"``
    (``SETTINGS``), lr = 0 and rank-dependent weights, no staleness bound: ``slow``, where the
    passive ranks compute ``SLOW_S`` longer per step; ``late``, where they answer every request
    ``LATE_S`` late (``PassiveLoop.exchange`` sleeps first: the active has posted its side and
    waits)."""
    import torch

    from lightning_gossip import FlatState, attach
    from lightning_gossip.async_gossip import PassiveLoop

    serve = PassiveLoop.exchange

    def late(self: PassiveLoop, peer: int) -> None:
        time.sleep(LATE_S)
        serve(self, peer)

    out: dict = {}
    for name in ("slow", "late"):
        PassiveLoop.exchange = late if name == "late" else serve  # type: ignore[method-assign]
        torch.manual_seed(100 + rank)
        model = torch.nn.Linear(5, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        gossip = attach(model, opt, strategy="adpsgd", seed=5, broadcast=False,
                        max_staleness=None, gossip_every_n_steps=AutoPeriod(**SETTINGS),
                        timeout=120)
        flat = FlatState(model)
        x0, active = flat.pack().tolist(), gossip.engine.active
        for _ in range(STEPS):
            time.sleep(COMPUTE_S + (SLOW_S if name == "slow" and not active else 0.0))
            opt.zero_grad()
            model(torch.ones(3, 5)).sum().backward()
            opt.step()
        gossip.quiesce()
        out[name] = {"x0": x0, "final": flat.pack().tolist(), "active": active,
                     "stats": dict(vars(gossip.stats)),
                     "switches": [sw.as_dict() for sw in gossip.auto.switches]}
        gossip.close()
    PassiveLoop.exchange = serve  # type: ignore[method-assign]
    return out


@pytest.fixture(scope="module")
def fits(tmp_path_factory) -> list[dict]:
    from tests.scripts.engine_ranks import spawn_ranks

    return spawn_ranks(_ranks, WORLD, tmp_path_factory.mktemp("auto_async"), timeout=300)


def _decision(r: dict) -> dict:
    """The rank's one decision, checked to be the policy's for its own medians."""
    assert len(r["switches"]) == 1, r["switches"]
    s = r["switches"][0]
    d = s["decision"]
    assert (d["compute_s"], d["exchange_s"]) == (s["local_compute_s"], s["local_exchange_s"])
    assert d["period"] == choose_period(d["compute_s"], d["exchange_s"])
    return s


def _assert_conserved(rs: list[dict]) -> None:
    """lr = 0: the exchanges moved the replicas towards each other and kept their sum."""
    x0 = np.array([r["x0"] for r in rs], dtype=np.float64)
    final = np.array([r["final"] for r in rs], dtype=np.float64)
    np.testing.assert_allclose(final.sum(0), x0.sum(0), rtol=0, atol=1e-5)
    assert np.abs(final - final.mean(0)).max() < np.abs(x0 - x0.mean(0)).max()


@pytest.mark.multiprocess
def test_a_partner_that_answers_late_does_not_lengthen_the_period(fits):
    """Each passive answers every request ``LATE_S`` (3 steps of compute) after the active
    posted its side. Timed from the active's own posting, the exchange held that wait, and
    R about 3 made the actives pick a period of 4 or more; timed from the partner's posted
    marker, it is the swap of 12 values, far below a step: period 1 on every rank. The waits
    are kept apart and make up most of the actives' time in exchanges; counted in, they would
    have asked for a longer period."""
    rs = [r["late"] for r in fits]
    _assert_conserved(rs)
    assert [r["active"] for r in rs] == [True, False, True, False]
    for r in rs:
        s = _decision(r)
        d = s["decision"]
        assert d["compute_s"] >= COMPUTE_S  # the median step: its sleep, forward and backward
        assert d["period"] == 1 and DEFAULT_MARGIN * d["exchange_s"] <= d["compute_s"], r
        st = r["stats"]
        assert st["exchanges"] > 0 and st["peer_wait_s"] >= 0
        if r["active"]:
            assert st["peer_wait_s"] > st["exchange_s"], st
            counted_in = (st["peer_wait_s"] + st["exchange_s"]) / st["exchanges"]
            assert choose_period(d["compute_s"], counted_in) > 1, (st, d)
            assert s["local_peer_wait_s"] > d["exchange_s"], s
    # the passive ranks answered every request of both actives
    assert sum(r["stats"]["exchanges"] for r in rs if r["active"]) == sum(
        r["stats"]["exchanges"] for r in rs if not r["active"])


@pytest.mark.multiprocess
def test_a_slow_partner_s_compute_is_not_exchange_time(fits):
    """The passive ranks compute ``SLOW_S`` longer per step: their gossip threads answer at
    once all the same, so the actives' exchanges, and their periods, do not change (period 1
    everywhere); the passives' own medians carry their longer compute."""
    rs = [r["slow"] for r in fits]
    _assert_conserved(rs)
    for r in rs:
        d = _decision(r)["decision"]
        assert d["period"] == 1, r
        assert d["compute_s"] >= COMPUTE_S + (0.0 if r["active"] else SLOW_S)
        assert r["stats"]["exchanges"] > 0


# ----------------------------------------------------------------------------------------------
# The driver's peer wait per decision (no process: an engine of the driver's protocol)
# ----------------------------------------------------------------------------------------------
class _Engine:
    """What the driver asks of an ``adpsgd`` engine: the period, at any step."""

    def __init__(self) -> None:
        self.periods: list[int] = []

    def quiesce(self) -> None:
        """Nothing in flight here."""

    def set_period(self, period: int) -> None:
        self.periods.append(period)

    def period_ends(self, step: int) -> bool:
        return True


def test_each_decision_reports_the_mean_peer_wait_since_the_previous_one():
    """The engine's cumulative counters (exchanges, their seconds, the waits kept out of them)
    given at every step: each switch reports the mean wait per exchange of the exchanges since
    the previous decision, the counters the engine started with left out; a window without an
    exchange reports 0."""
    driver = PeriodDriver(AutoPeriod(warmup_steps=0, measure_steps=2, recheck_every=2),
                          agree=False)
    driver.counts_from(3, 9.0, 30.0)  # an earlier fit's counters
    engine = _Engine()
    # (exchanges, exchange seconds, peer wait seconds) after steps 0..5
    counters = [(4, 9.1, 30.5), (6, 9.3, 31.5), (7, 9.4, 31.5), (8, 9.5, 33.5),
                (8, 9.5, 33.5), (8, 9.5, 33.5)]
    for step, (n, x, w) in enumerate(counters):
        driver.left(time.perf_counter())
        driver.step_done(engine, step, n, x, w)
    waits = [s.local_peer_wait_s for s in driver.switches]
    assert [s.step for s in driver.switches] == [2, 4, 6]
    # decision 1: 3 exchanges, 1.5 s of waits; 2: 2 exchanges, 2.0 s; 3: none
    assert waits == [pytest.approx(0.5), pytest.approx(1.0), 0.0]
    assert all(s.as_dict()["local_peer_wait_s"] == w for s, w in zip(driver.switches, waits))


def test_the_peer_wait_is_logged_with_every_decision(world_run):
    """Rank 0 logs ``gossip/peer_wait_ms`` next to the decision's other metrics: its
    ``local_peer_wait_s`` of that switch (dpsgd, 4 ranks: ``pd_auto`` of the shared launch)."""
    case = P.PD_AUTO
    results = case.results(world_run(WORLD), WORLD)
    switches = results[0]["period_switches"]
    rows = list(csv.DictReader(open(world_run(WORLD) / case.name / "logs" / "version_0"
                                    / "metrics.csv")))
    logged = [r for r in rows if r.get("gossip/period")]
    assert len(logged) == len(switches) == 2
    for row, s in zip(logged, switches):
        assert s["local_peer_wait_s"] >= 0
        assert float(row["gossip/peer_wait_ms"]) == pytest.approx(s["local_peer_wait_s"] * 1e3)
    assert all(r["gossip_stats"]["peer_wait_seconds"] >= 0 for r in results)
