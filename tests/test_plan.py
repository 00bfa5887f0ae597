"""The cost model (:mod:`lightning_gossip.plan`) against hand-computed cases, and the
``lightning-gossip plan`` command: its table, its errors, its imports. No wall-time asserts."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from lightning_gossip import plan, topology
from lightning_gossip.cli import main

ROOT = Path(__file__).resolve().parents[1]

# 2 nodes x 2 GPUs, a 25 MB/s network, an intra-node link so fast it costs nothing
C22 = plan.Cluster(nodes=2, gpus_per_node=2, inter_bandwidth=25e6, intra_bandwidth=1e15)
W1M = plan.Workload(params=1_000_000, compute_s=0.1)  # 4 MB fp32


def test_link_and_collectives_by_hand() -> None:
    assert plan.link_time(0, 1.0, 5.0) == 0.0
    assert plan.link_time(1e6, 1e6, 0.5) == pytest.approx(1.5)
    # ring: 2 (n - 1) rounds of nbytes / n: 8 rounds of 1 MB at 1 MB/s + 8 x 0.1 s
    assert plan.ring_allreduce_time(5e6, 5, 1e6, 0.1) == pytest.approx(8 * 1.1)
    assert plan.ring_allreduce_time(5e6, 1, 1e6, 0.1) == 0.0
    # tree over 5 ranks: depth 3, 2 x 3 latencies + 2 x 5 s
    assert plan.tree_allreduce_time(5e6, 5, 1e6, 0.1) == pytest.approx(10.6)
    # hierarchical, 2 nodes x 4 GPUs, 8 MB: intra reduce-scatter + all-gather, 2 x 3 rounds of
    # 2 MB at 1 GB/s = 12 ms; inter: four 2 MB shards over 2 nodes through one 100 MB/s
    # interface (25 MB/s each): 2 rounds of 1 MB = 80 ms
    c = plan.Cluster(nodes=2, gpus_per_node=4, inter_bandwidth=100e6, intra_bandwidth=1e9)
    assert plan.hierarchical_allreduce_time(8e6, c) == pytest.approx(0.012 + 0.08)


def test_step_time_modes() -> None:
    assert plan.step_time(1.0, 3.0, 0.5, "blocking") == 4.5
    assert plan.step_time(1.0, 3.0, 0.5, "overlap") == 3.5
    assert plan.step_time(1.0, 0.2, 0.5, "overlap") == 1.5  # fully hidden
    assert plan.step_time(1.0, 3.0, 0.5, "delay_by_one") == 3.0
    assert plan.step_time(1.0, 1.2, 0.5, "delay_by_one") == 1.5
    with pytest.raises(ValueError, match="mode must be one of overlap"):
        plan.step_time(1.0, 1.0, 0.0, "sometimes")


def test_partial_overlap_by_hand() -> None:
    # overlap = fraction of min(compute, gossip) hidden; 1 is the GPU model, 0 blocking
    assert plan.step_time(1.0, 3.0, 0.5, "overlap", overlap=0.0) == 4.5
    assert plan.step_time(1.0, 3.0, 0.5, "overlap", overlap=0.25) == pytest.approx(4.25)
    assert plan.step_time(1.0, 0.2, 0.5, "overlap", overlap=0.5) == pytest.approx(1.6)
    assert plan.step_time(1.0, 3.0, 0.5, "delay_by_one", overlap=0.5) == pytest.approx(3.75)
    assert plan.step_time(1.0, 3.0, 0.5, "blocking", overlap=0.5) == 4.5
    for mode in plan.MODES:
        assert plan.step_time(1.0, 3.0, 0.5, mode, overlap=0.0) == pytest.approx(4.5)
    with pytest.raises(ValueError, match=r"overlap must be in \[0, 1\]"):
        plan.step_time(1.0, 1.0, 0.0, "overlap", overlap=-0.1)
    with pytest.raises(ValueError, match=r"overlap must be in \[0, 1\], got 2"):
        plan.Cluster(nodes=2, gpus_per_node=1, inter_bandwidth=1e9, overlap=2)
    with pytest.raises(ValueError, match="host_bandwidth"):
        plan.Cluster(nodes=2, gpus_per_node=1, inter_bandwidth=1e9, host_bandwidth=0.0)


# C22 on hosts that move 100 MB/s of communication per rank and hide half the gossip
C22_HOST = plan.Cluster(nodes=2, gpus_per_node=2, inter_bandwidth=25e6, intra_bandwidth=1e15,
                        overlap=0.5, host_bandwidth=1e8)


def test_host_terms_by_hand() -> None:
    assert C22.host_time(1e9) == 0.0  # default: free (NCCL on GPUs)
    assert C22_HOST.host_time(4e6) == pytest.approx(0.04)
    # ddp ring over 4 ranks: a rank sends and receives 2 x 3/4 x 4 MB = 12 MB: +0.12 s
    ddp = plan.predict_ddp(C22_HOST, W1M, "ring")
    assert ddp.step_s == pytest.approx(0.1 + 0.24 + 0.12)
    assert ddp.exposed_s == pytest.approx(0.36)
    # flat dpsgd, ring: 2 peers, 2 x 2 x 4 MB = 16 MB of host work (0.16 s) added to compute;
    # gossip 0.32 s, half of min(0.26, 0.32) hidden
    flat = plan.predict_dpsgd(C22_HOST, W1M, "ring", tolerance=None)
    assert flat.step_s == pytest.approx(0.26 + 0.32 - 0.5 * 0.26)
    blocking = plan.predict_dpsgd(C22_HOST, W1M, "ring", mode="blocking", tolerance=None)
    assert blocking.step_s == pytest.approx(0.26 + 0.32)
    # hierarchical: inside the node 4 x 1/2 x 4 MB (gradients) + 2 x 1/2 x 4 MB (all-gather),
    # between nodes 2 x 4 MB / 2: 16 MB, 0.16 s; gossip 4 MB at 25 MB/s, half of it hidden
    hier = plan.predict_dpsgd(C22_HOST, W1M, "ring", hierarchical=True, tolerance=None)
    assert hier.step_s == pytest.approx(0.26 + 0.16 - 0.5 * 0.16)
    assert hier.inter_bytes_per_rank == pytest.approx(2e6)  # bytes do not change


def test_adpsgd_host_terms_by_hand() -> None:
    w = plan.Workload(params=1_000_000, compute_s=0.05)
    # exchange: link 0.16 s (ring pairing, half cross) + host 8 MB at 100 MB/s = 0.24 s; it
    # costs the training thread 0.08 + (1 - 0.5) x 0.16 = 0.16 s; s = 0.05 + 0.16 s / 0.24 s
    # -> s = 0.05 / (1 - 2/3) = 0.15 (< 0.05 + 0.16, and > 0.24 / max_staleness)
    p = plan.predict_adpsgd(C22_HOST, w)
    assert p.step_s == pytest.approx(0.15)
    assert p.inter_bytes_per_rank == pytest.approx(0.15 / 0.24 * 0.5 * 4e6)
    # compute long enough for one exchange per step: s = compute + 0.16
    slow = plan.Workload(params=1_000_000, compute_s=0.2)
    assert plan.predict_adpsgd(C22_HOST, slow).step_s == pytest.approx(0.36)
    # blocking (max_staleness=0): compute + the whole exchange
    assert plan.predict_adpsgd(C22_HOST, w, max_staleness=0).step_s == pytest.approx(0.29)
    # no overlap and a free host: the training thread pays the link time of its exchanges
    c = plan.Cluster(nodes=2, gpus_per_node=2, inter_bandwidth=25e6, intra_bandwidth=1e15,
                     overlap=0.0)
    assert plan.predict_adpsgd(c, w).step_s == pytest.approx(0.05 + 0.16)


def test_staleness_bound_by_hand() -> None:
    # the waits repeat every 3 exchanges and max_staleness + 2 steps (plan.staleness_bound)
    assert plan.staleness_bound(0.3, 4) == pytest.approx(0.15)  # 2 steps per exchange
    assert plan.staleness_bound(0.3, 1) == pytest.approx(0.3)
    assert plan.staleness_bound(0.3, 7) == pytest.approx(0.1)
    assert plan.staleness_bound(0.3, 0) == 0.3
    assert plan.staleness_bound(0.3, None) == 0.0
    with pytest.raises(ValueError, match="max_staleness"):
        plan.staleness_bound(0.3, -1)
    # 4 x 1 at 25 MB/s, no compute: one exchange of 4 MB takes 0.16 s; at the bound a rank
    # makes 2 steps per exchange (0.08 s each) and sends half a replica per step
    c = plan.Cluster(nodes=4, gpus_per_node=1, inter_bandwidth=25e6, intra_bandwidth=1e15)
    p = plan.predict_adpsgd(c, plan.Workload(params=1_000_000, compute_s=0.0))
    assert p.step_s == pytest.approx(0.08)
    assert p.inter_bytes_per_rank == pytest.approx(2e6)
    assert "0.50 exchanges/step" in p.note
    # no bound: compute only (none here); max_staleness=0: the whole exchange
    w = plan.Workload(params=1_000_000, compute_s=0.01)
    assert plan.predict_adpsgd(c, w, max_staleness=None).step_s == pytest.approx(0.01)
    assert plan.predict_adpsgd(c, w, max_staleness=0).step_s == pytest.approx(0.17)


def _engine_rules(compute: float, exchange: float, bound: int, until: float = 300.0) -> float:
    """Mean step of one rank under the AD-PSGD engine's rules (async_gossip.engine.after_step,
    mailbox.leave_snapshot/take_snapshot, loops.ActiveLoop), stepped event by event: after a
    step, leave a snapshot unless the last one is still untaken, then wait while
    ``steps - gossiped > bound``; the gossip thread takes a waiting snapshot as soon as it is
    idle and, ``exchange`` later, sets ``gossiped`` to the steps that snapshot covered."""
    t, steps, gossiped, fresh, fresh_step = 0.0, 0, 0, False, 0
    train_at, ex_at, covered, waiting = compute, None, 0, False
    while t < until:
        events = ([(train_at, 0)] if not waiting else []) + ([(ex_at, 1)] if ex_at else [])
        t, kind = min(events)
        if kind == 0:
            steps += 1
            if not fresh:
                fresh, fresh_step = True, steps
            waiting = steps - gossiped > bound
            train_at = t + compute
        else:
            gossiped, ex_at = max(gossiped, covered), None
            if waiting and steps - gossiped <= bound:
                waiting, train_at = False, t + compute
        if ex_at is None and fresh:
            fresh, covered, ex_at = False, fresh_step, t + exchange
    return t / steps


def test_staleness_bound_matches_engine_rules() -> None:
    # fast compute: the rank runs at the bound, 3 exchanges per m + 2 steps
    for m in range(1, 7):
        assert _engine_rules(0.001, 1.0, m) == pytest.approx(plan.staleness_bound(1.0, m),
                                                             rel=0.02)
    # slow compute: the bound does not bind
    assert _engine_rules(0.8, 1.0, 4) == pytest.approx(0.8, rel=0.02)


def test_exchange_efficiency_by_hand() -> None:
    # d = 0.5 per process: a node of L processes gets 1 - 0.5 ** L of its interface
    def cl(nodes: int, gpus: int) -> plan.Cluster:
        return plan.Cluster(nodes=nodes, gpus_per_node=gpus, inter_bandwidth=25e6,
                            intra_bandwidth=1e15, exchange_efficiency=0.5)
    assert cl(4, 1).exchange_bandwidth == pytest.approx(12.5e6)
    assert cl(2, 2).exchange_bandwidth == pytest.approx(18.75e6)
    assert cl(2, 8).exchange_bandwidth == pytest.approx(25e6 * (1 - 0.5 ** 8))
    w = plan.Workload(params=1_000_000, compute_s=0.1)
    # 4 x 1, ring: a node exchanges 2 x 4 MB at 12.5 MB/s = 0.64 s (0.32 s at full duplex)
    flat = plan.predict_dpsgd(cl(4, 1), w, "ring", tolerance=None)
    assert flat.step_s == pytest.approx(0.64)
    assert flat.inter_bytes_per_rank == pytest.approx(8e6)  # bytes do not change
    # 2 x 2 hierarchical: a node sends one 4 MB replica at 18.75 MB/s (blocking: + compute)
    hier = plan.predict_dpsgd(cl(2, 2), w, "ring", hierarchical=True, mode="blocking",
                              tolerance=None)
    assert hier.step_s == pytest.approx(0.1 + 4e6 / 18.75e6)
    # adpsgd, 4 x 1: an exchange of 4 MB at 12.5 MB/s = 0.32 s
    assert plan.adpsgd_exchange_time(cl(4, 1), w)[0] == pytest.approx(0.32)
    # ddp's ring keeps the full rate
    assert plan.predict_ddp(cl(4, 1), w).step_s == pytest.approx(0.1 + 6 * 1e6 / 25e6)
    with pytest.raises(ValueError, match=r"exchange_efficiency must be in \(0, 1\]"):
        plan.Cluster(nodes=2, gpus_per_node=1, inter_bandwidth=1e9, exchange_efficiency=0.0)


def test_ddp_host_constant_by_hand() -> None:
    # gossip host 100 MB/s, ddp's all-reduce 400 MB/s: ddp ring over 2 x 2 (12 MB) + 0.03 s
    c = plan.Cluster(nodes=2, gpus_per_node=2, inter_bandwidth=25e6, intra_bandwidth=1e15,
                     host_bandwidth=1e8, ddp_host_bandwidth=4e8)
    assert c.ddp_host_time(12e6) == pytest.approx(0.03)
    assert plan.predict_ddp(c, W1M).step_s == pytest.approx(0.1 + 0.24 + 0.03)
    free = plan.Cluster(nodes=2, gpus_per_node=2, inter_bandwidth=25e6, host_bandwidth=1e8,
                        ddp_host_bandwidth=float("inf"))
    assert free.ddp_host_time(12e6) == 0.0
    assert C22_HOST.ddp_host_time(12e6) == C22_HOST.host_time(12e6)  # None: host_bandwidth
    # dpsgd keeps the gossip host constant: the flat ring of test_host_terms_by_hand, overlap 1
    assert plan.predict_dpsgd(c, W1M, "ring", tolerance=None).step_s == pytest.approx(0.32)
    with pytest.raises(ValueError, match="ddp_host_bandwidth"):
        plan.Cluster(nodes=2, gpus_per_node=1, inter_bandwidth=1e9, ddp_host_bandwidth=0.0)


def test_cross_node_sends() -> None:
    # complete over 2 x 2: each rank sends to the 2 ranks of the other node: 4 per node
    assert plan.cross_node_sends(topology.build("complete", 4), 2) == (4.0, 3)
    # one node: nothing crosses
    assert plan.cross_node_sends(topology.build("ring", 4), 4)[0] == 0.0


def test_ddp_by_hand() -> None:
    ring = plan.predict_ddp(C22, W1M, "ring")  # 6 rounds of 1 MB at 25 MB/s
    assert ring.step_s == pytest.approx(0.1 + 0.24)
    assert ring.exposed_s == pytest.approx(0.24)
    assert ring.inter_bytes_per_node == pytest.approx(1.5 * 4e6)
    assert ring.inter_bytes_per_rank == pytest.approx(0.75 * 4e6)
    assert ring.consensus_steps == 0
    hier = plan.predict_ddp(C22, W1M, "hierarchical")  # 2 shards of 2 MB, 1 round each
    assert hier.step_s == pytest.approx(0.1 + 2 * 2e6 / 25e6)
    tree = plan.predict_ddp(C22, W1M, "tree")
    assert tree.step_s == pytest.approx(0.1 + 2 * 4e6 / 25e6)
    slow = plan.predict_ddp(C22, W1M, "ring", stragglers=[1.0, 1.0, 2.0, 1.0])
    assert slow.step_s == pytest.approx(0.2 + 0.24)
    with pytest.raises(ValueError, match="algorithm must be"):
        plan.predict_ddp(C22, W1M, "butterfly")


def test_dpsgd_by_hand() -> None:
    # flat ring over 0-1-2-3: the busiest node sends 2 replicas off-node: 8 MB at 25 MB/s
    flat = plan.predict_dpsgd(C22, W1M, "ring", mode="blocking", tolerance=None)
    assert flat.step_s == pytest.approx(0.1 + 0.32)
    assert flat.inter_bytes_per_node == pytest.approx(8e6)
    assert flat.consensus_steps is None
    assert plan.predict_dpsgd(C22, W1M, "ring", mode="overlap").step_s == pytest.approx(0.32)
    # hierarchical: one peer node, a node sends one replica (2 MB per rank), bf16 halves it
    hier = plan.predict_dpsgd(C22, W1M, "ring", hierarchical=True, mode="overlap")
    assert hier.step_s == pytest.approx(0.16)
    assert hier.inter_bytes_per_rank == pytest.approx(2e6)
    assert hier.consensus_steps == 1  # 2 nodes: one exact average per step
    bf16 = plan.Workload(params=1_000_000, compute_s=0.1, wire_bytes=2)
    h16 = plan.predict_dpsgd(C22, bf16, "ring", hierarchical=True, mode="delay_by_one")
    assert h16.step_s == pytest.approx(0.1)  # 80 ms hidden behind the step
    assert h16.exposed_s == pytest.approx(0.0, abs=1e-6)  # intra link ~free
    assert h16.inter_bytes_per_rank == pytest.approx(1e6)
    # consensus steps are those of `topologies` (analysis.predicted_consensus_steps)
    c = plan.Cluster(nodes=8, gpus_per_node=1, inter_bandwidth=1e9)
    p = plan.predict_dpsgd(c, W1M, "ring")
    ms_gap = topology.build("ring", 8).mean_square_gap()
    from lightning_gossip.analysis import predicted_consensus_steps

    assert p.consensus_steps == pytest.approx(predicted_consensus_steps(ms_gap))


def test_adpsgd_by_hand() -> None:
    # ring pairing on 2 x 2: half the exchanges cross, both ranks of a node swap 4 MB at once
    assert plan.adpsgd_exchange_time(C22, W1M) == (pytest.approx(0.16), 0.5)
    p = plan.predict_adpsgd(C22, W1M)  # 0.16 s / max_staleness 4 < 0.1 s: compute-bound
    assert p.step_s == pytest.approx(0.1)
    assert p.exposed_s == pytest.approx(0.0)
    assert p.inter_bytes_per_rank == pytest.approx(0.1 / 0.16 * 0.5 * 4e6)
    assert plan.predict_adpsgd(C22, W1M, max_staleness=1).step_s == pytest.approx(0.16)
    assert plan.predict_adpsgd(C22, W1M, max_staleness=0).step_s == pytest.approx(0.26)
    # random pairing: 2 of the 3 other ranks are on the other node
    assert plan.adpsgd_exchange_time(C22, W1M, "random")[1] == pytest.approx(2 / 3)
    # stragglers: the rates add up: 4 / (3 / 0.1 + 1 / 0.4)
    f = [1.0, 1.0, 1.0, 4.0]
    assert plan.predict_adpsgd(C22, W1M, stragglers=f).step_s == pytest.approx(4 / 32.5)
    # hierarchical: the node is the unit: node 1 runs at its slowest GPU (0.4 s)
    h = plan.predict_adpsgd(C22, W1M, hierarchical=True, stragglers=f)
    assert h.step_s == pytest.approx(2 / (1 / 0.1 + 1 / 0.4))
    with pytest.raises(ValueError, match="one factor per rank"):
        plan.predict_adpsgd(C22, W1M, stragglers=[1.0])


def test_straggler_factors_and_bad_input() -> None:
    # ranks 0 and 3 (local rank 0 of each node) first, then rank 1
    assert plan.straggler_factors(6, 3, 0.5, 2.0).tolist() == [2.0, 2.0, 1, 2.0, 1, 1]
    with pytest.raises(ValueError, match="nodes must be an integer >= 1, got 0"):
        plan.Cluster(nodes=0, gpus_per_node=1, inter_bandwidth=1e9)
    with pytest.raises(ValueError, match=r"inter_bandwidth \(bytes/s\) must be a finite"):
        plan.Cluster(nodes=2, gpus_per_node=1, inter_bandwidth=-1.0)
    with pytest.raises(ValueError, match="params must be"):
        plan.Workload(params=0, compute_s=0.1)
    with pytest.raises(ValueError, match="wire_bytes must be"):
        plan.Workload(params=10, compute_s=0.1, wire_bytes=3)
    with pytest.raises(ValueError, match="straggler fraction"):
        plan.straggler_factors(4, 2, 1.5, 2.0)


def test_predict_all_rows() -> None:
    rows = plan.predict_all(C22, W1M, topology="ring")
    assert [r.strategy for r in rows] == [
        "ddp (ring)", "ddp (tree)", "ddp (hierarchical)", "dpsgd (ring, overlap)",
        "dpsgd hier (ring, overlap)", "adpsgd (ring)", "adpsgd hier"]
    assert all(r.step_s >= W1M.compute_s - 1e-12 for r in rows)
    json.dumps([r.as_dict() for r in rows])


SMALL = ["plan", "--nodes", "2", "--gpus-per-node", "2", "--params", "1M", "--compute-ms",
         "100", "--inter-gbit", "0.2", "--inter-latency-us", "0", "--intra-gbyte", "1e6",
         "--intra-latency-us", "0", "--topology", "ring"]


def test_cli_small_case(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out_json = tmp_path / "plan.json"
    assert main([*SMALL, "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    lines = {line.split("  ")[0].strip(): line for line in out.splitlines()}
    assert "340.0" in lines["ddp (ring)"]  # 100 ms + 6 x 1 MB at 25 MB/s
    assert "3.0 MB" in lines["ddp (ring)"]
    assert "160.0" in lines["dpsgd hier (ring, overlap)"]
    assert "2.0 MB" in lines["dpsgd hier (ring, overlap)"]
    assert "adpsgd hier" in lines
    rows = json.loads(out_json.read_text())["rows"]
    assert rows[0]["step_s"] == pytest.approx(0.34)


def test_cli_config_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("nodes: 2\ngpus_per_node: 2\nparams: 1000000\ncompute_ms: 100\n"
                   "inter_gbit: 0.2\ninter_latency_us: 0\nintra_gbyte: 1.0e+6\n"
                   "intra_latency_us: 0\n")
    assert main(["plan", "--config", str(cfg), "--compute-ms", "0"]) == 0  # the flag wins
    out = capsys.readouterr().out
    assert "240.0" in out  # ddp ring with no compute
    cfg.write_text("nodes: 2\nbandwidth: 3\n")
    with pytest.raises(SystemExit) as e:
        main(["plan", "--config", str(cfg)])
    assert e.value.code == 2
    assert "unknown option(s) bandwidth" in capsys.readouterr().err
    # the host constants as YAML keys: the ddp ring of test_host_terms_by_hand
    cfg.write_text("nodes: 2\ngpus_per_node: 2\nparams: 1000000\ncompute_ms: 100\n"
                   "inter_gbit: 0.2\ninter_latency_us: 0\nintra_gbyte: 1.0e+6\n"
                   "intra_latency_us: 0\noverlap: 0.5\nhost_gbyte: 0.1\n")
    assert main(["plan", "--config", str(cfg), "--topology", "ring"]) == 0
    out = capsys.readouterr().out
    lines = {line.split("  ")[0].strip(): line for line in out.splitlines()}
    assert "460.0" in lines["ddp (ring)"]
    assert "450.0" in lines["dpsgd (ring, overlap)"]  # 0.26 + 0.32 - 0.5 x 0.26
    assert "overlap 0.5, host 0.1 GB/s" in out


def test_cli_host_flags(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*SMALL, "--overlap", "0", "--host-gbyte", "0.1"]) == 0
    out = capsys.readouterr().out
    lines = {line.split("  ")[0].strip(): line for line in out.splitlines()}
    assert "460.0" in lines["ddp (ring)"]  # 100 ms + 240 ms link + 120 ms host
    assert "580.0" in lines["dpsgd (ring, overlap)"]  # nothing hidden: 260 + 320 ms
    # the calibrated emulated-cluster constants: ddp's host free, exchanges at 0.75 of 25 MB/s
    assert main([*SMALL, "--host-gbyte", "0.1", "--ddp-host-gbyte", "1e9",
                 "--exchange-efficiency", "0.5"]) == 0
    out = capsys.readouterr().out
    lines = {line.split("  ")[0].strip(): line for line in out.splitlines()}
    assert "340.0" in lines["ddp (ring)"]  # 100 ms + 240 ms link + 12 us host
    # overlap: 4 MB at 18.75 MB/s = 213.3 ms against 100 + 160 ms of compute and host
    assert "260.0" in lines["dpsgd hier (ring, overlap)"]
    assert "exchange efficiency 0.5" in out


@pytest.mark.parametrize(("argv", "message"), [
    (["--nodes", "0"], "--nodes: expected a positive integer, got 0"),
    (["--inter-gbit", "-25"], "--inter-gbit: expected a positive number, got -25"),
    (["--stragglers", "half"], "--stragglers: expected FRACTION:SLOWDOWN"),
    (["--stragglers", "0.1:0.5"], "straggler slowdown must be a finite number >= 1"),
    (["--overlap", "1.5"], "--overlap: expected a number in [0, 1], got 1.5"),
    (["--host-gbyte", "0"], "--host-gbyte: expected a positive number, got 0"),
    (["--exchange-efficiency", "0"], "--exchange-efficiency: expected a number in (0, 1]"),
    (["--ddp-host-gbyte", "-1"], "--ddp-host-gbyte: expected a positive number, got -1"),
])
def test_cli_bad_input(argv: list[str], message: str,
                       capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["plan", *argv])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_cli_config_bad_value(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("nodes: 0\n")
    with pytest.raises(SystemExit):
        main(["plan", "--config", str(cfg)])
    assert "nodes must be an integer >= 1, got 0" in capsys.readouterr().err
    for text, message in [("overlap: 2\n", "overlap must be in [0, 1], got 2"),
                          ("host_gbyte: -1\n", "host_gbyte must be a positive number")]:
        cfg.write_text(text)
        with pytest.raises(SystemExit):
            main(["plan", "--config", str(cfg)])
        assert message in capsys.readouterr().err


def test_cli_imports_neither_torch_nor_lightning() -> None:
    code = textwrap.dedent(
        f"""
        import contextlib, io, json, sys
        from lightning_gossip.cli import main
        with contextlib.redirect_stdout(io.StringIO()):
            rc = main({SMALL!r})
        heavy = sorted({{m.split(".")[0] for m in sys.modules}}
                       & {{"torch", "lightning", "pytorch_lightning", "matplotlib"}})
        print(json.dumps({{"rc": rc, "heavy": heavy}}))
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result == {"rc": 0, "heavy": []}


def test_cli_plot(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "steps.png"
    argv = [*SMALL, "--gpus-per-node", "1", "--plot", str(png)]
    assert main(argv) == 0
    assert png.stat().st_size > 0
    assert f"wrote {png}" in capsys.readouterr().out


def _cluster_results(path: Path, rate: float, steps: dict[str, float]) -> None:
    """A fake benchmarks/perf/cluster.py results file: 2 x 2 ranks, 1M parameters."""
    kinds = {"ddp": ("ddp", {}), "dpsgd_hier": ("dpsgd", {"hierarchical": True}),
             "adpsgd": ("adpsgd", {})}
    path.write_text(json.dumps({
        "config": {"nodes": 2, "procs": 2, "rate": rate},
        "params": 1_000_000,
        "machine_before": {"loadavg_1_5_15": [1.0, 1.0, 1.0]},
        "cases": [
            {"case": name, "strategy": kinds[name][0], "kwargs": kinds[name][1],
             "status": "ok", "steps_per_rank": [20] * 4, "epochs": 2, "epoch_s": 10 * step,
             "tx_bytes_per_step_per_rank": [2e6] * 2}
            for name, step in steps.items()
        ] + [{"case": "adpsgd_hier", "status": "unavailable"}],
    }))


def test_plan_vs_cluster_script(tmp_path: Path) -> None:
    cal, val = tmp_path / "cluster_a.json", tmp_path / "cluster_b.json"
    _cluster_results(cal, 200.0, {"ddp": 0.34, "dpsgd_hier": 0.2, "adpsgd": 0.1})
    _cluster_results(val, 1000.0, {"ddp": 0.15, "dpsgd_hier": 0.1, "adpsgd": 0.09})
    script = [sys.executable, "-m", "benchmarks.perf.plan_vs_cluster"]
    out_json = tmp_path / "plan_vs_cluster.json"
    proc = subprocess.run(
        [*script, "--results", str(cal), str(val), "--calibrate", "cluster_a",
         "--intra-gbyte", "1e6", "--json", str(out_json)],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = {(line.split(" | ")[0], line.split(" | ")[2]): line
            for line in proc.stdout.splitlines() if line.startswith("| 2x2@")}
    assert set(rows) == {("| 2x2@200", c) for c in ("ddp", "dpsgd_hier", "adpsgd")} | {
        ("| 2x2@1000", c) for c in ("ddp", "dpsgd_hier", "adpsgd")}
    assert "| 340 | 340 | +0% |" in rows["| 2x2@200", "ddp"]  # ddp calibrates the compute
    assert "| 150 | 150 | +0% |" in rows["| 2x2@1000", "ddp"]
    assert "| cal |" in rows["| 2x2@200", "adpsgd"]
    assert "| val |" in rows["| 2x2@1000", "adpsgd"]
    assert "host constants (fitted on 2x2@200)" in proc.stdout
    assert "ranking, measured (fastest first): adpsgd, dpsgd_hier, ddp" in proc.stdout
    data = json.loads(out_json.read_text())
    assert 0.0 <= data["overlap"] <= 1.0 and data["calibrate"] == ["cluster_a"]
    assert 0.0 < data["exchange_efficiency"] <= 1.0
    assert {r["role"] for r in data["cases"]} == {"cal", "val"}
    # given constants instead of a fit: the GPU defaults reproduce the GPU model's column
    proc = subprocess.run(
        [*script, "--results", str(cal), "--intra-gbyte", "1e6",
         "--overlap", "1", "--host-gbyte", "inf"],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "host constants (given): overlap = 1, host bandwidth = free" in proc.stdout
    assert "exchange efficiency = 1 per process" in " ".join(proc.stdout.split())
    hier = next(line for line in proc.stdout.splitlines() if "| dpsgd_hier |" in line)
    cells = [c.strip() for c in hier.split("|")]
    assert cells[5] == cells[7] and cells[6] == cells[8]  # model == GPU model, same error
    # a term left out of the fit: ddp's host constant is the gossip one, exchanges at full rate
    proc = subprocess.run(
        [*script, "--results", str(cal), "--intra-gbyte", "1e6",
         "--without", "ddp_host", "efficiency"],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = " ".join(proc.stdout.split())
    assert "the same (ddp), exchange efficiency = 1 per process" in summary
