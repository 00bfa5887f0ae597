"""The gossip period in the cost model (:mod:`lightning_gossip.plan.period`, the ``period``
of the gossip predictions) and the period section of ``lightning-gossip plan``, against
hand-computed cases. No wall-time asserts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lightning_gossip import plan
from lightning_gossip.cli import main
from lightning_gossip.gossip_period import choose_period

# 2 nodes x 2 GPUs, a 25 MB/s network, an intra-node link so fast it costs nothing
C22 = plan.Cluster(nodes=2, gpus_per_node=2, inter_bandwidth=25e6, intra_bandwidth=1e15)
W1M = plan.Workload(params=1_000_000, compute_s=0.1)  # 4 MB fp32
# C22 on hosts that move 100 MB/s of communication per rank and hide half the gossip
C22_HOST = plan.Cluster(nodes=2, gpus_per_node=2, inter_bandwidth=25e6, intra_bandwidth=1e15,
                        overlap=0.5, host_bandwidth=1e8)


def test_dpsgd_period_by_hand() -> None:
    # flat ring: the busiest node sends 8 MB per exchange, 0.32 s at 25 MB/s
    one = plan.predict_dpsgd(C22, W1M, "ring")
    assert (one.period, one.compute_s, one.exchange_s) == (1, 0.1, pytest.approx(0.32))
    four = plan.predict_dpsgd(C22, W1M, "ring", period=4)
    assert four.step_s == pytest.approx(0.1)  # 0.08 s per step, hidden
    assert four.exposed_s == pytest.approx(0.0)
    assert four.inter_bytes_per_node == pytest.approx(2e6)
    assert four.inter_bytes_per_rank == pytest.approx(1e6)
    assert four.consensus_steps == pytest.approx(4 * one.consensus_steps)
    assert (four.period, four.exchange_s) == (4, pytest.approx(0.32))  # the same exchange
    assert "2 peers every 4 steps" in four.note and "2 peers/step" in one.note
    assert plan.predict_dpsgd(C22, W1M, "ring", period=2).step_s == pytest.approx(0.16)
    blocking = plan.predict_dpsgd(C22, W1M, "ring", mode="blocking", period=4)
    assert blocking.step_s == pytest.approx(0.1 + 0.08)
    # hierarchical: one replica per node and exchange, 0.16 s
    hier = plan.predict_dpsgd(C22, W1M, "ring", hierarchical=True, period=2)
    assert hier.step_s == pytest.approx(0.1)
    assert hier.inter_bytes_per_rank == pytest.approx(1e6)
    assert hier.exchange_s == pytest.approx(0.16)


def test_dpsgd_period_with_host_terms() -> None:
    # hierarchical on C22_HOST: every step 8 MB of gradients in the node (0.08 s of host work);
    # per exchange 4 MB all-gathered and 4 MB across nodes (0.08 s), 0.16 s on the link
    one = plan.predict_dpsgd(C22_HOST, W1M, "ring", hierarchical=True, tolerance=None)
    assert one.step_s == pytest.approx(0.26 + 0.16 - 0.5 * 0.16)  # as test_plan's
    assert one.exchange_s == pytest.approx(0.16 + 0.08)
    assert one.compute_s == pytest.approx(0.1 + 0.08)  # what the exchange hides behind
    two = plan.predict_dpsgd(C22_HOST, W1M, "ring", hierarchical=True, tolerance=None,
                             period=2)
    # a period of 2 steps: 2 x 0.18 + 0.08 s of compute and host work, 0.16 s of link, half
    # of it hidden: (0.44 + 0.16 - 0.5 x 0.16) / 2 per step
    assert two.step_s == pytest.approx((0.44 + 0.16 - 0.5 * 0.16) / 2)
    # the same, flat: 16 MB of host work and 0.32 s of link per exchange
    flat = plan.predict_dpsgd(C22_HOST, W1M, "ring", tolerance=None, period=4)
    assert flat.step_s == pytest.approx((0.4 + 0.16 + 0.32 - 0.5 * 0.32) / 4)
    # delay_by_one hides behind the in-node all-reduce too (on a slow intra link)
    slow_intra = plan.Cluster(nodes=2, gpus_per_node=2, inter_bandwidth=25e6,
                              intra_bandwidth=1e8)
    over = plan.predict_dpsgd(slow_intra, W1M, "ring", hierarchical=True)
    late = plan.predict_dpsgd(slow_intra, W1M, "ring", hierarchical=True, mode="delay_by_one")
    assert over.compute_s == pytest.approx(0.1)
    assert late.compute_s == pytest.approx(0.1 + 2 * 1 * 2e6 / 1e8)  # + ring all-reduce
    with pytest.raises(ValueError, match="period must be an integer >= 1, got 0"):
        plan.predict_dpsgd(C22, W1M, period=0)


def test_adpsgd_period_by_hand() -> None:
    # ring pairing: an exchange of 0.16 s, half of them across nodes
    two = plan.predict_adpsgd(C22, W1M, period=2)
    assert two.step_s == pytest.approx(0.1)
    assert two.inter_bytes_per_rank == pytest.approx(0.5 * 0.5 * 4e6)  # 1 exchange / 2 steps
    assert "0.50 exchanges/step" in two.note
    assert (two.compute_s, two.exchange_s) == (pytest.approx(0.1), pytest.approx(0.16))
    assert plan.predict_adpsgd(C22, W1M, max_staleness=0, period=2).step_s == pytest.approx(
        0.1 + 0.08)
    # C22_HOST, compute 0.05 s: an exchange of 0.24 s costs the training thread 0.16 s; at
    # period 2 half of each per step: min(0.05 / (1 - 0.08 / 0.12), 0.05 + 0.08)
    w = plan.Workload(params=1_000_000, compute_s=0.05)
    assert plan.predict_adpsgd(C22_HOST, w, period=2).step_s == pytest.approx(0.13)
    assert plan.predict_adpsgd(C22_HOST, w).exchange_s == pytest.approx(0.24)
    with pytest.raises(ValueError, match="period must be an integer >= 1"):
        plan.predict_adpsgd(C22, W1M, period=True)


def test_ddp_has_no_period() -> None:
    for algorithm in ("ring", "tree", "hierarchical"):
        row = plan.predict_ddp(C22, W1M, algorithm)
        assert (row.period, row.compute_s, row.exchange_s) == (1, 0.0, 0.0)


def test_cluster_ratio_and_its_period() -> None:
    # the testbed of issue 47: 2.45M parameters, a bf16 replica of 4.9 MB at 200 Mbit/s
    c = plan.Cluster(nodes=2, gpus_per_node=2, inter_bandwidth=200e6 / 8)
    w = plan.Workload(params=2_450_000, compute_s=0.357)
    assert plan.replica_seconds(c, w) == pytest.approx(0.196)
    assert plan.cluster_ratio(c, w) == pytest.approx(0.196 / 0.357)
    assert plan.cluster_period(c, w) == 1
    # 12.5 Mbit/s and one rank's compute (0.163 s): R about 19
    slow = plan.Cluster(nodes=2, gpus_per_node=2, inter_bandwidth=12.5e6 / 8)
    w1 = plan.Workload(params=2_450_000, compute_s=0.163)
    assert plan.cluster_ratio(slow, w1) == pytest.approx(3.136 / 0.163)
    assert plan.cluster_period(slow, w1) == choose_period(0.163, 3.136) == 22
    # the wire dtype of the workload does not change R (its reference is a bf16 replica)
    assert plan.cluster_ratio(c, plan.Workload(params=2_450_000, compute_s=0.357,
                                               wire_bytes=4)) == plan.cluster_ratio(c, w)
    none = plan.Workload(params=2_450_000, compute_s=0.0)
    assert plan.cluster_ratio(c, none) == float("inf")
    assert plan.cluster_period(c, none) == 32


@pytest.mark.parametrize("margin", [1.0, 1.1])
def test_auto_is_the_smallest_period_the_model_hides(margin: float) -> None:
    """With ``overlap=1`` and free hosts, the period the policy picks from a row's exchange
    and compute is the smallest at which the model hides the exchange (margin 1), and the
    model hides it there whatever the margin >= 1."""
    for gbit in (0.05, 0.2, 0.5, 1.0, 3.0, 10.0):
        c = plan.Cluster(nodes=4, gpus_per_node=2, inter_bandwidth=gbit * 1e9 / 8,
                         intra_bandwidth=1e15)
        rows = plan.predict_periods(c, W1M, topology="ring", margin=margin)
        assert [r.strategy for r in rows] == [
            "dpsgd (ring, overlap)", "dpsgd hier (ring, overlap)", "adpsgd (ring)",
            "adpsgd hier"]
        for r in rows[:2]:  # dpsgd: the synchronous step of the model
            one = plan.predict_dpsgd(c, W1M, "ring", "hier" in r.strategy)
            assert r.period == plan.auto_period(one, margin) == choose_period(
                one.compute_s, one.exchange_s, margin=margin)
            assert r.exposed_s == pytest.approx(0.0, abs=1e-6)  # hidden (in-node: ~0)
            if margin == 1.0 and r.period > 1:
                shorter = plan.predict_dpsgd(c, W1M, "ring", "hier" in r.strategy,
                                             period=r.period - 1)
                assert shorter.exposed_s > 1e-6  # not hidden one step shorter
        fixed = plan.predict_periods(c, W1M, 5, topology="ring")
        assert [r.period for r in fixed] == [5, 5, 5, 5]
    with pytest.raises(ValueError, match="period must be an integer >= 1 or 'auto'"):
        plan.predict_periods(C22, W1M, "sometimes")


SMALL = ["plan", "--nodes", "2", "--gpus-per-node", "2", "--params", "1M", "--compute-ms",
         "100", "--inter-gbit", "0.2", "--inter-latency-us", "0", "--intra-gbyte", "1e6",
         "--intra-latency-us", "0", "--topology", "ring"]


def _rows(out: str) -> dict[str, str]:
    return {line.split("  ")[0].strip(): line for line in out.splitlines()}


def test_cli_prints_r_and_the_periods(capsys: pytest.CaptureFixture[str],
                                      tmp_path: Path) -> None:
    out_json = tmp_path / "plan.json"
    assert main([*SMALL, "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    # a bf16 replica of 1M parameters: 2 MB at 25 MB/s = 80 ms against 100 ms of compute
    assert "R = 0.80: one bf16 replica (2.0 MB) takes 80.0 ms over a node's 0.2 Gbit/s link" in out
    assert 'gossip_every_n_steps="auto" picks 1 for this R' in out
    rows = _rows(out)
    # fp32 exchanges: flat 8 MB (0.32 s, R 3.2 -> 3.52 with the margin: 4), others 4 MB
    flat = rows["dpsgd (ring, overlap) every 4"]
    assert "320.0" in flat and "3.20" in flat and "100.0" in flat and "2.0 MB" in flat
    assert "160.0" in rows["dpsgd hier (ring, overlap) every 2"]
    assert "adpsgd (ring) every 2" in rows and "adpsgd hier every 2" in rows
    assert "160.0" in rows["dpsgd hier (ring, overlap)"]  # the main table is unchanged
    period = json.loads(out_json.read_text())["period"]
    assert period["ratio"] == pytest.approx(0.8)
    assert period["replica_s"] == pytest.approx(0.08)
    assert (period["auto_period"], period["margin"], period["max_period"]) == (1, 1.1, 32)
    assert period["gossip_every_n_steps"] == "auto"
    assert [r["period"] for r in period["rows"]] == [4, 2, 2, 2]
    assert period["rows"][0]["inter_bytes_per_node"] == pytest.approx(2e6)


def test_cli_fixed_period_and_slow_links(capsys: pytest.CaptureFixture[str],
                                         tmp_path: Path) -> None:
    assert main([*SMALL, "--gossip-every-n-steps", "8"]) == 0
    out = capsys.readouterr().out
    assert "The gossip strategies at gossip_every_n_steps=8:" in out
    rows = _rows(out)
    assert "1.0 MB" in rows["dpsgd (ring, overlap) every 8"]  # 8 MB / 8
    assert "adpsgd hier every 8" in rows
    # 50 Mbit/s: R = 2 MB / 6.25 MB/s / 0.1 s = 3.2, 3.52 steps with the margin
    assert main([*SMALL, "--inter-gbit", "0.05"]) == 0
    out = capsys.readouterr().out
    assert "R = 3.20" in out and 'picks 4 for this R' in out
    # no compute: R is infinite, the longest period
    assert main([*SMALL, "--compute-ms", "0"]) == 0
    out = capsys.readouterr().out
    assert "R = inf" in out and "picks 32 for this R" in out
    cfg = tmp_path / "c.yaml"
    cfg.write_text("gossip_every_n_steps: 3\n")
    assert main([*SMALL, "--config", str(cfg)]) == 0
    assert "dpsgd hier (ring, overlap) every 3" in capsys.readouterr().out


def test_cli_bad_period(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as e:
        main([*SMALL, "--gossip-every-n-steps", "0"])
    assert e.value.code == 2
    assert "expected auto or an integer >= 1, got '0'" in capsys.readouterr().err
    cfg = tmp_path / "c.yaml"
    for text in ("gossip_every_n_steps: often\n", "gossip_every_n_steps: 2.5\n"):
        cfg.write_text(text)
        with pytest.raises(SystemExit) as e:
            main([*SMALL, "--config", str(cfg)])
        assert e.value.code == 2
        assert "gossip_every_n_steps: expected auto or an integer >= 1" in (
            capsys.readouterr().err)
