"""The communication budget, ``gossip_every_n_steps``: D-PSGD mixes with the matrices of the
exchange steps only (overlapped, blocking, delay-by-one, a stop mid-period, bf16, hierarchical),
AD-PSGD conserves the sum of the replicas with one exchange per period, the counters count what
was sent, and bad input fails at construction.

The fits run in the shared 2x2 launch (``world4``, ``tests/period_cases.py``); the pure
schedule and agreement checks need no process.
"""

from __future__ import annotations

import csv
import sys

import numpy as np
import pytest

from lightning_gossip import topology as T
from lightning_gossip.gossip_period import DEFAULT_MARGIN, DEFAULT_MAX_PERIOD, choose_period
from lightning_gossip.hierarchy import NodeLayout
from lightning_gossip.pairing import ColumnPairing, Pairing
from lightning_gossip.sync_gossip import NO_STOP, RoundSchedule, StopAgreement
from tests import period_cases as P
from tests.cases import FP32, assert_conserved_and_contracting, expected_mixing

WORLD = 4


def _exchange_steps(steps: int, period: int, overlap: bool) -> list[int]:
    """The exchange steps of the rounds a rank posts in ``steps`` steps."""
    if overlap:
        return [t + period - 1 for t in range(steps) if t % period == 0]
    return [t for t in range(steps) if (t + 1) % period == 0]


@pytest.mark.parametrize("case", [P.PD_OVERLAP, P.PD_BLOCKING, P.PD_DELAY, P.PD_STOP],
                         ids=lambda c: c.name)
def test_dpsgd_mixes_with_the_matrices_of_the_exchange_steps_only(world_run, case):
    results = case.results(world_run(WORLD), WORLD)
    kw = case.strategy_kwargs
    delay = kw.get("delay_by_one", False)
    overlap = kw.get("overlap", True) or delay
    topo = T.build(kw["topology"], WORLD, kw["seed"])
    x0 = np.array([r["x0"] for r in results], dtype=np.float64)
    steps = len(results[0]["steps"])
    assert steps == (case.stop_at or case.batches) and all(len(r["steps"]) == steps
                                                         for r in results)
    assert all(r["global_step"] == r["gossip_step"] == steps for r in results)
    want = P.expected_rounds(x0, topo.mixing_matrix, steps, P.PERIOD, overlap, delay)
    for t in range(steps):
        got = np.array([r["steps"][t] for r in results])
        np.testing.assert_allclose(got, want[t], **FP32, err_msg=f"{case.name} step {t}")
    np.testing.assert_allclose(np.array([r["final"] for r in results]), want[-1], **FP32)
    # the replicas disagreed, mixed, and not as a round every step would have mixed them
    every_step = expected_mixing(x0, kw["topology"], steps, seed=kw["seed"],
                                 delay_by_one=delay)
    assert np.abs(x0 - x0.mean(0)).max() > 0.1 and np.abs(want[-1] - x0).max() > 1e-3
    assert max(np.abs(w - e).max() for w, e in zip(want, every_step)) > 1e-3
    # the counters: one round per period begun (overlapped) or ended (blocking)
    rounds = _exchange_steps(steps, P.PERIOD, overlap)
    numel = x0.shape[1]
    for r in results:
        stats = r["gossip_stats"]
        sends = sum(len(topo.peers(r["rank"], e).send_to) for e in rounds)
        assert stats["exchanges"] == len(rounds), (case.name, stats)
        assert stats["messages"] == sends and stats["sent_bytes"] == sends * numel * 4


@pytest.mark.parametrize("case", [P.PD_BF16, P.PD_BF16_32], ids=lambda c: c.name)
def test_bf16_rounds_keep_the_mean_and_send_a_period_th_of_the_bytes(world_run, case):
    results = case.results(world_run(WORLD), WORLD)
    period = case.strategy_kwargs["gossip_every_n_steps"]
    x0 = np.array([r["x0"] for r in results], dtype=np.float64)
    final = np.array([r["final"] for r in results], dtype=np.float64)
    np.testing.assert_allclose(final.mean(0), x0.mean(0), rtol=0, atol=1e-6)
    spread = [np.abs(x - x.mean(0)).max() for x in (x0, final)]
    assert spread[1] < 0.5 * spread[0], spread
    steps, numel = case.batches, x0.shape[1]
    rounds = list(range(period - 1, steps, period))  # 3, 7, 11 (period 4); 31, 63 (32)
    for r in results:  # a ring of 4: 2 peers; bf16: 2 bytes a value
        stats = r["gossip_stats"]
        assert stats["exchanges"] == steps // period == len(rounds)
        # per step and peer: 1/period of a bf16 replica
        assert stats["sent_bytes"] == len(rounds) * 2 * numel * 2
        assert stats["sent_bytes"] / steps / 2 == numel * 2 / period
        # the replica moves after the exchange steps only (lr = 0)
        moved = [t for t in range(1, steps) if r["steps"][t] != r["steps"][t - 1]]
        assert moved == rounds and r["steps"][0] == r["x0"], moved


def test_hierarchical_rounds_every_2_steps_follow_the_node_matrix(world_run):
    case = P.PD_HIER
    results = case.results(world_run(WORLD), WORLD)
    for node in (0, 1):  # the node's ranks hold one replica
        assert results[2 * node]["steps"] == results[2 * node + 1]["steps"]
    rows = slice(None, None, 2)
    x0 = np.array([r["x0"] for r in results], dtype=np.float64)[rows]
    steps = len(results[0]["steps"])
    assert steps == case.batches == 7
    want = P.expected_rounds(x0, lambda t: np.array(P.W2), steps, period=2)
    for t in range(steps):
        got = np.array([r["steps"][t] for r in results])[rows]
        np.testing.assert_allclose(got, want[t], **FP32, err_msg=f"step {t}")
    np.testing.assert_allclose(np.array([r["final"] for r in results])[rows], want[-1], **FP32)
    assert np.abs(x0[0] - x0[1]).max() > 0.1
    for r in results:  # rounds 1, 3, 5 and 7 (posted at step 6, applied at the end)
        assert r["gossip_stats"]["exchanges"] == 4


@pytest.mark.parametrize("case", [P.AD_PERIOD, P.AD_PERIOD_DELAY], ids=lambda c: c.name)
def test_adpsgd_conserves_the_sum_with_one_exchange_per_period(world_run, case):
    run = world_run(WORLD) / case.name
    assert_conserved_and_contracting(run, WORLD)
    results = case.results(world_run(WORLD), WORLD)
    kw = case.strategy_kwargs
    period = kw["gossip_every_n_steps"]
    pairing = Pairing(kw.get("pairing", "ring"), WORLD, kw.get("seed", 0))
    numel = len(results[0]["x0"])
    active = [r["gossip_stats"] for r in results if pairing.is_active(r["rank"])]
    passive = [r["gossip_stats"] for r in results if not pairing.is_active(r["rank"])]
    assert len(active) == len(passive) == 2
    for s in active:  # one snapshot, so at most one exchange, per period of its own steps
        assert s["steps"] >= 3 * period
        if kw.get("max_staleness", 4) == 0:  # it waited for every one: exactly one per period
            assert s["exchanges"] == s["steps"] // period, s
        else:
            assert 1 <= s["exchanges"] <= s["steps"] // period, s
    for s in active + passive:
        assert s["sent_bytes"] == s["exchanges"] * numel * 4
    assert sum(s["exchanges"] for s in passive) == sum(s["exchanges"] for s in active)


def test_hierarchical_adpsgd_keeps_nodes_identical_and_the_sum_with_a_period(world_run):
    case = P.AH_PERIOD
    results = case.results(world_run(WORLD), WORLD)
    for node in (0, 1):  # the node's ranks hold one replica, after every step
        assert results[2 * node]["steps"] == results[2 * node + 1]["steps"]
        assert results[2 * node]["final"] == results[2 * node + 1]["final"]
    assert_conserved_and_contracting(world_run(WORLD) / case.name, WORLD)
    active = {r: ColumnPairing(Pairing("ring", 2, 0), NodeLayout(2, 2, r // 2, r % 2))
              .is_active(r) for r in range(WORLD)}
    assert sorted(active.values()) == [False, False, True, True]
    for r in results:  # every local rank gossips its slice: an active one once per period
        s = r["gossip_stats"]
        if active[r["rank"]]:
            assert s["steps"] >= 3 * P.PERIOD and s["exchanges"] == s["steps"] // P.PERIOD, s
    by_role = [sum(r["gossip_stats"]["exchanges"] for r in results if active[r["rank"]] == a)
               for a in (True, False)]
    assert by_role[0] == by_role[1] > 0


# ----------------------------------------------------------------------------------------------
# gossip_every_n_steps="auto": the period picked from the fit's first steps (PeriodDriver)
# ----------------------------------------------------------------------------------------------
def _switches(results: list[dict]) -> list[list[dict]]:
    return [r["period_switches"] for r in results]


def _assert_agreed(results: list[dict], settings: dict) -> list[dict]:
    """Every rank switched at the same steps to the same periods, from the same values: the
    maxima over the ranks of the medians each rank reported, and the period is the policy's
    for them. Returns rank 0's switches."""
    switches = _switches(results)
    first = switches[0]
    assert first, "no decision"
    agreed = ("period", "compute_s", "exchange_s", "ratio", "hidden", "margin", "step")
    for mine in switches[1:]:  # (the sample counts are each rank's own)
        assert [(s["step"], [s["decision"][k] for k in agreed]) for s in mine] == [
            (s["step"], [s["decision"][k] for k in agreed]) for s in first]
    for k, s in enumerate(first):
        d = s["decision"]
        assert d["compute_s"] == max(sw[k]["local_compute_s"] for sw in switches) > 0
        assert d["exchange_s"] == max(sw[k]["local_exchange_s"] for sw in switches) > 0
        assert d["period"] == choose_period(d["compute_s"], d["exchange_s"],
                                             margin=settings.get("margin", DEFAULT_MARGIN),
                                             max_period=settings.get("max_period",
                                                                     DEFAULT_MAX_PERIOD))
    return first


def _exchange_steps_with_switches(steps: int, switches: list[dict]) -> list[int]:
    """The exchange steps of a fit that started at period 1 and switched as ``switches`` say."""
    period, out, pending = 1, [], list(switches)
    for t in range(steps):
        while pending and pending[0]["step"] <= t:
            period = pending.pop(0)["decision"]["period"]
        if (t + 1) % period == 0:
            out.append(t)
    return out


def _assert_mixed_at(results: list[dict], steps_: list[int], matrix, rows=slice(None),
                     in_flight: tuple[int, ...] = ()) -> None:
    """lr = 0: the replicas after every step are the product of the matrices of the exchange
    steps ``steps_`` so far (whatever step posted each round, nothing else moves them); the
    final ones also of the rounds ``in_flight`` at the end (posted, applied by the quiesce)."""
    x = np.array([r["x0"] for r in results], dtype=np.float64)[rows]
    for t in range(len(results[0]["steps"])):
        if t in steps_:
            x = matrix(t) @ x
        got = np.array([r["steps"][t] for r in results])[rows]
        np.testing.assert_allclose(got, x, **FP32, err_msg=f"step {t}")
    for e in in_flight:
        x = matrix(e) @ x
    np.testing.assert_allclose(np.array([r["final"] for r in results])[rows], x, **FP32)


def test_auto_dpsgd_agrees_on_the_policys_period_and_mixes_exactly(world_run):
    case = P.PD_AUTO
    results = case.results(world_run(WORLD), WORLD)
    first = _assert_agreed(results, case.auto_period)
    # due after 4 steps (1 of warm-up, 3 measured), then 4 later, taken where a period ends:
    # after step 3 (period 1), after step 8 (step 7 is mid-period at period 3); switched from
    # the next step on
    assert [s["step"] for s in first] == [4, 9]
    assert [s["decision"]["period"] for s in first] == [3, 3]  # margin 1e6: max_period
    steps = case.batches
    used = _exchange_steps_with_switches(steps, first)
    assert used == [0, 1, 2, 3, 5, 8, 11]
    topo = T.build("random_ring", WORLD, 5)
    _assert_mixed_at(results, used, topo.mixing_matrix)
    for r in results:
        assert r["gossip_stats"]["exchanges"] == len(used)
        assert r["gossip_stats"]["exchanges_timed"] == len(used)
    # the metrics: rank 0 logged every decision
    rows = list(csv.DictReader(open(world_run(WORLD) / case.name / "logs" / "version_0"
                                    / "metrics.csv")))
    logged = [r for r in rows if r.get("gossip/period")]
    assert [float(r["gossip/period"]) for r in logged] == [3.0] * 2
    for row, s in zip(logged, first):
        d = s["decision"]
        assert float(row["gossip/comm_compute_ratio"]) == pytest.approx(d["ratio"])
        assert float(row["gossip/compute_ms"]) == pytest.approx(d["compute_s"] * 1e3)
        assert float(row["gossip/exchange_ms"]) == pytest.approx(d["exchange_s"] * 1e3)


def test_auto_periods_follow_the_policy_not_a_fixed_choice(world_run):
    fast = P.PD_AUTO_FAST  # margin 1e-6: any exchange hides behind one step
    results = fast.results(world_run(WORLD), WORLD)
    first = _assert_agreed(results, fast.auto_period)
    assert [s["decision"]["period"] for s in first] == [1, 1]
    slow = _switches(P.PD_AUTO.results(world_run(WORLD), WORLD))[0]
    assert slow[0]["decision"]["period"] != first[0]["decision"]["period"]
    topo = T.build("random_ring", WORLD, 5)
    _assert_mixed_at(results, list(range(fast.batches)), topo.mixing_matrix)
    default = P.PD_AUTO_DEFAULT  # "auto": after 2 steps of warm-up and 8 measured
    results = default.results(world_run(WORLD), WORLD)
    first = _assert_agreed(results, {})
    assert [s["step"] for s in first] == [10]
    used = _exchange_steps_with_switches(default.batches, first)
    _assert_mixed_at(results, used, topo.mixing_matrix)


def test_auto_hierarchical_nodes_agree_and_mix_with_the_node_matrix(world_run):
    case = P.PH_AUTO
    results = case.results(world_run(WORLD), WORLD)
    first = _assert_agreed(results, case.auto_period)
    assert [(s["step"], s["decision"]["period"]) for s in first] == [(4, 2), (8, 2)]
    for node in (0, 1):  # the node's ranks hold one replica
        assert results[2 * node]["steps"] == results[2 * node + 1]["steps"]
    used = _exchange_steps_with_switches(case.batches, first)
    assert used == [0, 1, 2, 3, 5, 7]
    _assert_mixed_at(results, used, lambda t: np.array(P.W2), rows=slice(None, None, 2))


def test_auto_adpsgd_decides_per_rank_and_conserves_the_sum(world_run):
    case = P.AD_AUTO
    assert_conserved_and_contracting(world_run(WORLD) / case.name, WORLD)
    results = case.results(world_run(WORLD), WORLD)
    settings = case.auto_period
    for r in results:  # every rank decided for itself, from its own medians
        switches = r["period_switches"]
        assert r["gossip_stats"]["steps"] == 18
        # due after 4 steps; a passive rank that has no exchange by then decides later
        assert switches and switches[0]["step"] >= 4, r["rank"]
        for s in switches:
            d = s["decision"]
            assert (d["compute_s"], d["exchange_s"]) == (s["local_compute_s"],
                                                         s["local_exchange_s"])
            assert d["period"] == choose_period(d["compute_s"], d["exchange_s"],
                                                margin=settings["margin"],
                                                max_period=settings["max_period"]) == 3
        assert r["gossip_stats"]["exchange_s"] > 0


# ----------------------------------------------------------------------------------------------
# Pure: the schedule, the agreed stop along the rounds, bad input
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("overlap,delay", [(True, False), (False, False), (True, True)])
def test_a_period_of_one_is_the_schedule_of_every_step(overlap, delay):
    s = RoundSchedule(1, overlap, delay)
    for t in range(6):
        assert s.is_round(t) and s.post_step(t) == t and s.apply_step(t) == t + delay
        assert s.started_at(t) == (t if overlap else None)
        assert s.first_round_posted_from(t) == t


def _replay(agreement: StopAgreement, schedule: RoundSchedule, rank: int, first: int) -> int:
    """Message-level replay of the side messages: every rank's first step whose posts carry the
    stop; the step at whose batch start every rank knows it."""
    n = agreement.world_size
    carries = {rank: first}
    for e in range(first, first + 10 * n * schedule.period):
        if not schedule.is_round(e) or schedule.post_step(e) < first:
            continue
        senders = [i for i, k in carries.items() if k <= schedule.post_step(e)]
        for i in senders:
            for j in agreement.peers(i, e)[0]:
                carries.setdefault(j, schedule.apply_step(e) + 1)
        if len(carries) == n:
            break
    assert len(carries) == n
    return max(carries.values())


@pytest.mark.parametrize("topology,period,overlap,delay", [
    ("ring", 3, True, False), ("ring", 4, False, False), ("random_ring", 4, True, True),
    ("random_ring", 32, True, False), ("one_peer_exponential", 3, True, False),
])
def test_the_agreed_stop_spreads_along_the_exchange_steps(topology, period, overlap, delay):
    n = 4 if topology == "one_peer_exponential" else 6
    schedule = RoundSchedule(period, overlap, delay)
    agreement = StopAgreement(T.build(topology, n, 0), NodeLayout(n, 1, 0, 0), delay, schedule)
    for rank in range(n):
        for first in (0, 5, 17):
            stop = agreement.stop_step_for(rank, first)
            assert stop == _replay(agreement, schedule, rank, first)
            assert first < stop <= first + (2 if delay else 1) * (n + 1) * period


def test_a_period_that_aliases_a_periodic_topology_is_refused():
    topo = T.build("one_peer_exponential", 4)  # hops 1, 2, 1, 2, ...: period 2
    RoundSchedule(3).check_connects(topo)
    with pytest.raises(ValueError, match="never connect the ranks"):
        RoundSchedule(4).check_connects(topo)


@pytest.mark.parametrize("value", [0, -1, 2.0, True, "3", None])
def test_bad_periods_are_rejected_at_construction(value):
    from lightning_gossip import ADPSGDStrategy, DPSGDStrategy
    from lightning_gossip.fabric import FabricADPSGDStrategy, FabricDPSGDStrategy
    from lightning_gossip.plain_loop import Gossip

    for make in (DPSGDStrategy, ADPSGDStrategy, FabricDPSGDStrategy, FabricADPSGDStrategy):
        with pytest.raises(ValueError, match="gossip_every_n_steps must be a positive integer"):
            make(gossip_every_n_steps=value)
    with pytest.raises(ValueError, match="gossip_every_n_steps must be a positive integer"):
        Gossip(None, None, "dpsgd", gossip_every_n_steps=value)  # before any process group


def test_elastic_with_a_period_or_auto_is_refused_clearly():
    from lightning_gossip import ADPSGDStrategy, DPSGDStrategy
    from lightning_gossip.gossip_period import AutoPeriod

    for make in (DPSGDStrategy, ADPSGDStrategy):
        assert make(gossip_every_n_steps="auto").gossip_every_n_steps == "auto"
        with pytest.raises(ValueError, match=r"\(elastic=True, gossip_every_n_steps=4\) is not"):
            make(gossip_every_n_steps=4, elastic=True)
        for auto in ("auto", AutoPeriod(max_period=4)):
            with pytest.raises(ValueError, match=r"elastic=True, gossip_every_n_steps=.*\) is not"):
                make(gossip_every_n_steps=auto, elastic=True)
        make(gossip_every_n_steps=1, elastic=True)  # the default goes with elastic
        assert make().gossip_every_n_steps == 1
    assert DPSGDStrategy(gossip_every_n_steps=32, wire_dtype="bf16").gossip_every_n_steps == 32
    from lightning_gossip.fabric import FabricADPSGDStrategy, FabricDPSGDStrategy

    for fabric in (FabricDPSGDStrategy, FabricADPSGDStrategy):  # handed to Gossip at setup
        assert fabric(gossip_every_n_steps=8).gossip_options()["gossip_every_n_steps"] == 8
        assert fabric().gossip_options()["gossip_every_n_steps"] == 1
        auto = fabric(gossip_every_n_steps="auto").gossip_options()["gossip_every_n_steps"]
        assert auto == "auto"


@pytest.mark.parametrize(("given", "period"), [("4", 4), ("auto", "auto")])
def test_lightning_cli_takes_the_period_by_class_path(tmp_path, monkeypatch, given, period):
    from recipes.imagenet.cli import main

    monkeypatch.setattr(sys, "argv", ["recipes.imagenet"])  # only ``args`` count
    cli = main(["--config", "recipes/imagenet/configs/digits.yaml",
                "--trainer.strategy=lightning_gossip.DPSGDStrategy",
                f"--trainer.strategy.gossip_every_n_steps={given}", "--trainer.devices=1",
                "--trainer.accelerator=cpu", f"--trainer.default_root_dir={tmp_path}"],
               run=False)
    assert type(cli.trainer.strategy).__name__ == "DPSGDStrategy"
    assert cli.trainer.strategy.gossip_every_n_steps == period


# ----------------------------------------------------------------------------------------------
# attach() (a plain PyTorch loop, no Lightning): the optimizer hooks drive the same engines
# ----------------------------------------------------------------------------------------------
def _attached_ranks(rank: int, world: int) -> dict:
    """On every rank: three loops with ``attach`` (lr = 0, rank-dependent weights, no initial
    broadcast): dpsgd overlapped and blocking every 3 steps for 10 steps, then (``set_period``)
    every 2 steps for 4 more; adpsgd every 2 steps for 12, then every 3 for 12 more."""
    import torch

    from lightning_gossip import FlatState, attach
    from lightning_gossip.gossip_period import AutoPeriod

    out: dict = {}
    for name, kw in (("overlap", {"strategy": "dpsgd"}),
                     ("blocking", {"strategy": "dpsgd", "overlap": False}),
                     ("adpsgd", {"strategy": "adpsgd", "max_staleness": 0})):
        torch.manual_seed(100 + rank)
        model = torch.nn.Linear(5, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        period = 2 if name == "adpsgd" else P.PERIOD
        gossip = attach(model, opt, topology="random_ring", seed=5, broadcast=False,
                        gossip_every_n_steps=period, timeout=120, **kw)
        flat = FlatState(model)
        steps, x0, parts = [], flat.pack().tolist(), []
        for count, new_period in ((10, 2), (4, None)) if name != "adpsgd" else ((12, 3),
                                                                                (12, None)):
            for _ in range(count):
                opt.zero_grad()
                model(torch.ones(3, 5)).sum().backward()
                opt.step()
                steps.append(flat.pack().tolist())
            gossip.quiesce()
            parts.append({"final": flat.pack().tolist(), "stats": dict(vars(gossip.stats))})
            if new_period is not None:
                gossip.engine.set_period(new_period)
        out[name] = {"x0": x0, "steps": steps, "parts": parts}
        gossip.close()
    for name, kw in (("auto_dpsgd", {"strategy": "dpsgd"}),  # "auto", its settings injected
                     ("auto_adpsgd", {"strategy": "adpsgd", "max_staleness": 0})):
        torch.manual_seed(100 + rank)
        model = torch.nn.Linear(5, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        gossip = attach(model, opt, topology="random_ring", seed=5, broadcast=False,
                        gossip_every_n_steps=AutoPeriod(**ATTACH_AUTO), timeout=120, **kw)
        flat = FlatState(model)
        steps, x0 = [], flat.pack().tolist()
        for _ in range(10):
            opt.zero_grad()
            model(torch.ones(3, 5)).sum().backward()
            opt.step()
            steps.append(flat.pack().tolist())
        gossip.quiesce()
        out[name] = {"x0": x0, "steps": steps, "final": flat.pack().tolist(),
                     "stats": dict(vars(gossip.stats)),
                     "switches": [sw.as_dict() for sw in gossip.auto.switches]}
        gossip.close()
    return out


#: attach(gossip_every_n_steps=AutoPeriod(...)): due after 4 steps, never re-checked; a margin
#: of 1e6 picks max_period
ATTACH_AUTO = {"warmup_steps": 1, "measure_steps": 3, "recheck_every": None, "max_period": 3,
               "margin": 1e6}


@pytest.mark.multiprocess
def test_attach_takes_the_period_for_both_engines(attach_runs):
    results = [r["attached"] for r in attach_runs]
    topo = T.build("random_ring", WORLD, 5)
    for name, overlap in (("overlap", True), ("blocking", False)):
        rs = [r[name] for r in results]
        x0 = np.array([r["x0"] for r in rs], dtype=np.float64)
        first = P.expected_rounds(x0, topo.mixing_matrix, 10, P.PERIOD, overlap)
        # set_period(2) after the quiesce at step 10: rounds at steps 11 and 13
        then = P.expected_rounds(first[-1], topo.mixing_matrix, 4, 2, overlap, start=10)
        want = first[:-1] + then[:-1]
        for t in range(14):
            np.testing.assert_allclose(np.array([r["steps"][t] for r in rs]), want[t], **FP32,
                                       err_msg=f"{name} step {t}")
        for part, final in ((0, first[-1]), (1, then[-1])):
            np.testing.assert_allclose(np.array([r["parts"][part]["final"] for r in rs]),
                                       final, **FP32)
        rounds = len(_exchange_steps(10, P.PERIOD, overlap)) + 2
        assert all(r["parts"][1]["stats"]["exchanges"] == rounds for r in rs)
        assert np.abs(x0 - x0.mean(0)).max() > 0.1
    rs = [r["adpsgd"] for r in results]
    x0 = np.array([r["x0"] for r in rs], dtype=np.float64)
    pairing = Pairing("ring", WORLD, 5)  # attach's seed
    for part, done in ((0, 12 // 2), (1, 12 // 2 + 12 // 3)):  # max_staleness 0: exactly
        final = np.array([r["parts"][part]["final"] for r in rs], dtype=np.float64)
        np.testing.assert_allclose(final.sum(0), x0.sum(0), rtol=0, atol=1e-5)
        assert np.abs(final - final.mean(0)).max() < np.abs(x0 - x0.mean(0)).max()
        stats = [r["parts"][part]["stats"] for r in rs]
        active = [s for k, s in enumerate(stats) if pairing.is_active(k)]
        assert [s["exchanges"] for s in active] == [done] * 2, active
        assert sum(s["exchanges"] for s in stats) == 2 * 2 * done
    # "auto": dpsgd ranks agree (one all-reduce on attach's meeting group) and mix exactly
    rs = [r["auto_dpsgd"] for r in results]
    first = _assert_agreed([{"period_switches": r["switches"]} for r in rs], ATTACH_AUTO)
    assert [(s["step"], s["decision"]["period"]) for s in first] == [(4, 3)]
    used = _exchange_steps_with_switches(10, first)
    assert used == [0, 1, 2, 3, 5, 8]  # and round 11, posted at step 9, quiesced at the end
    _assert_mixed_at(rs, used, topo.mixing_matrix, in_flight=(11,))
    assert all(r["stats"]["exchanges"] == r["stats"]["exchanges_timed"] == 7 for r in rs)
    # adpsgd: every rank decided for itself; the sum is kept
    rs = [r["auto_adpsgd"] for r in results]
    x0 = np.array([r["x0"] for r in rs], dtype=np.float64)
    final = np.array([r["final"] for r in rs], dtype=np.float64)
    np.testing.assert_allclose(final.sum(0), x0.sum(0), rtol=0, atol=1e-5)
    for r in rs:
        assert [s["decision"]["period"] for s in r["switches"]] == [3], r["switches"]
        s = r["switches"][0]
        assert (s["decision"]["compute_s"], s["decision"]["exchange_s"]) == (
            s["local_compute_s"], s["local_exchange_s"])


# ----------------------------------------------------------------------------------------------
# "auto" under dpsgd: a late peer's compute is not exchange time; a requeue that training
# survives does not end the re-checks (attach, real gloo processes)
# ----------------------------------------------------------------------------------------------
SLOW_S = 0.5
"""Rank 0's extra compute per step in the straggler fit (a sleep before its forward)."""

#: the straggler fit: decided once, after 6 steps (1 of warm-up), with the default margin
SLOW_AUTO = {"warmup_steps": 1, "measure_steps": 5, "recheck_every": None}
#: the requeue fit: a margin of 1e6 picks max_period (3) at every decision, re-checked every 4
REQUEUE_AUTO = {"warmup_steps": 1, "measure_steps": 3, "recheck_every": 4, "max_period": 3,
                "margin": 1e6}
REQUEUE_STEPS = 24
REQUEUE_AT = 7
"""Rank 0 proposes a requeue before step 7 (as the strategy does on SLURM's signal)."""


def _auto_measure_ranks(rank: int, world: int) -> dict:
    """On every rank, two dpsgd loops with ``attach`` and ``gossip_every_n_steps=AutoPeriod``
    (lr = 0, rank-dependent weights): ``slow``, 8 steps where rank 0 sleeps ``SLOW_S`` before
    every forward (a straggler's compute); ``requeue``, 24 steps where rank 0 proposes a
    requeue before step 7 on the engine, as ``AgreedStops`` does when SLURM's signal comes
    (nothing acts on it here: a requeue whose ``scontrol`` failed, training goes on)."""
    import time

    import torch

    from lightning_gossip import FlatState, attach
    from lightning_gossip.gossip_period import AutoPeriod

    out: dict = {}
    for name, settings, steps in (("slow", SLOW_AUTO, 8),
                                  ("requeue", REQUEUE_AUTO, REQUEUE_STEPS)):
        torch.manual_seed(100 + rank)
        model = torch.nn.Linear(5, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        gossip = attach(model, opt, strategy="dpsgd", topology="random_ring", seed=5,
                        broadcast=False, gossip_every_n_steps=AutoPeriod(**settings),
                        timeout=120)
        flat = FlatState(model)
        xs, x0, proposal = [], flat.pack().tolist(), None
        for t in range(steps):
            if name == "slow" and rank == 0:
                time.sleep(SLOW_S)
            if name == "requeue" and rank == 0 and t == REQUEUE_AT:
                proposal = gossip.engine.propose_stop("requeue", gossip.step)
            opt.zero_grad()
            model(torch.ones(3, 5)).sum().backward()
            opt.step()
            xs.append(flat.pack().tolist())
        gossip.quiesce()
        out[name] = {"x0": x0, "steps": xs, "final": flat.pack().tolist(),
                     "stats": dict(vars(gossip.stats)), "proposal": proposal,
                     "switches": [sw.as_dict() for sw in gossip.auto.switches],
                     "postponed": [list(p) for p in gossip.auto.postponed],
                     "agreement": list(gossip.engine.agreement.values())}
        gossip.close()
    return out


def _attach_ranks(rank: int, world: int) -> dict:
    """The attach loops of this file on every rank, in one launch (process start-up is most of
    a launch): :func:`_attached_ranks`, then :func:`_auto_measure_ranks`."""
    return {"attached": _attached_ranks(rank, world), "auto": _auto_measure_ranks(rank, world)}


@pytest.fixture(scope="module")
def attach_runs(tmp_path_factory) -> list[dict]:
    """What :func:`_attach_ranks` returned on each of ``WORLD`` gloo ranks."""
    from tests.scripts.engine_ranks import spawn_ranks

    return spawn_ranks(_attach_ranks, WORLD, tmp_path_factory.mktemp("attach"), timeout=600)


@pytest.fixture(scope="module")
def auto_measure(attach_runs) -> list[dict]:
    """Each rank's :func:`_auto_measure_ranks` loops (``slow``, ``requeue``)."""
    return [r["auto"] for r in attach_runs]


@pytest.mark.multiprocess
def test_auto_dpsgd_does_not_count_a_late_peer_s_compute_as_exchange(auto_measure):
    """Rank 0 computes ``SLOW_S`` longer per step. Its neighbours post every round that much
    earlier and wait for its data inside the round; timed from their own posting, that wait
    made the exchange as long as the step (R about 1, period 2, for a 12-value model). The
    exchange is timed from the arrival of the last peer's stop message (posted before its
    data), and the wait is kept apart: the period is 1. The compute (the maximum over the
    ranks) includes the sleep by construction; the exchange of 12 values is far below it."""
    rs = [r["slow"] for r in auto_measure]
    first = _assert_agreed([{"period_switches": r["switches"]} for r in rs], SLOW_AUTO)
    assert [s["step"] for s in first] == [6]
    d = first[0]["decision"]
    assert d["compute_s"] >= SLOW_S  # rank 0's median step: its sleep, forward and backward
    assert d["period"] == 1 and DEFAULT_MARGIN * d["exchange_s"] <= d["compute_s"], d
    waited = sum(r["stats"]["peer_wait_seconds"] for r in rs)
    assert waited > sum(r["stats"]["exchange_seconds"] for r in rs), [r["stats"] for r in rs]
    assert all(r["stats"]["exchanges_timed"] == 8 for r in rs)
    _assert_mixed_at(rs, list(range(8)), T.build("random_ring", WORLD, 5).mixing_matrix)


@pytest.mark.multiprocess
def test_auto_dpsgd_postpones_past_a_pending_requeue_then_rechecks(auto_measure):
    """A requeue proposed at step 7 is agreed for a later step ``p`` along the rounds of
    period 3: the decision due at step 8 is postponed to ``p`` on every rank (switching
    before would break the agreement); after ``p`` (a requeue whose ``scontrol`` failed:
    training goes on) every rank forgets the proposal and the re-checks go on every 4 steps.
    (Before: once a stop or requeue was proposed, the period was never re-checked again.)
    The replicas (lr = 0) are the product of the matrices of the exchange steps throughout."""
    rs = [r["requeue"] for r in auto_measure]
    p = rs[0]["proposal"]
    assert p is not None and p > 8  # the rounds of period 3 take it past the check at 8
    first = _assert_agreed([{"period_switches": r["switches"]} for r in rs], REQUEUE_AUTO)
    ends = [t for t in range(4, REQUEUE_STEPS) if (t + 1) % 3 == 0]  # period 3 from step 4
    checks = [min(t for t in ends if t >= p)]  # the first period end at or after p
    while any(t >= checks[-1] + 4 for t in ends):  # then every 4 steps, at a period end
        checks.append(min(t for t in ends if t >= checks[-1] + 4))
    assert [s["step"] for s in first] == [4] + [t + 1 for t in checks]
    assert all(s["decision"]["period"] == 3 for s in first)
    for r in rs:
        assert r["postponed"] == [[8, p]], r["postponed"]
        assert r["agreement"] == [NO_STOP, NO_STOP]  # forgotten on every rank
    used = _exchange_steps_with_switches(REQUEUE_STEPS, first)
    _assert_mixed_at(rs, used, T.build("random_ring", WORLD, 5).mixing_matrix)
