"""Multi-node D-PSGD on real processes (gloo): 2 simulated nodes x 2 processes.

``hierarchical=True``: bit-identical replicas inside each node after every step, node replicas
that follow the node-level mixing matrix exactly (lr = 0), a short convergence run; compressed
wire (``wire_dtype``): mean conserved, consensus reached; ``global_average_every_n_steps``:
equal replicas right after those steps. Bad input fails at set-up (no processes needed).
"""

from __future__ import annotations

import numpy as np
import pytest

from lightning_gossip.hierarchy import NodeLayout, check_layout
from lightning_gossip.strategies import ADPSGDStrategy, DPSGDStrategy
from tests import multinode as M
from tests.cases import consensus_by_epoch
from tests.shared_runs import output

multiprocess = pytest.mark.multiprocess
FP32 = dict(rtol=0, atol=2e-6)


@pytest.fixture(scope="module")
def run(shared_run):
    """The 2 x 2 torchrun launch (``world4`` of ``tests/shared_runs.py``)."""
    return shared_run("world4")


def _steps(results: list[dict]) -> np.ndarray:
    """(steps, ranks, numel) weights after every optimizer step."""
    return np.array([r["steps"] for r in results], dtype=np.float64).transpose(1, 0, 2)


def _assert_identical_in_nodes(results: list[dict]) -> None:
    for t, x in enumerate(_steps(results)):
        for node in range(M.NODES):
            ranks = x[node * M.DEVICES:(node + 1) * M.DEVICES]
            assert (ranks == ranks[0]).all(), f"node {node} ranks differ after step {t}"
    finals = np.array([r["final"] for r in results])
    for node in range(M.NODES):
        assert (finals[node * M.DEVICES:(node + 1) * M.DEVICES] == finals[node * M.DEVICES]).all()


def _node_rows(x: np.ndarray) -> np.ndarray:
    """The replica of each node (its first rank's)."""
    return x[:: M.DEVICES]


@multiprocess
@pytest.mark.parametrize("case", [M.HIER_EXACT, M.HIER_BLOCKING, M.HIER_DELAY],
                         ids=lambda c: c.name)
def test_node_replicas_follow_the_node_mixing_matrix(run, case):
    results = M.results(run, case)
    assert all(r["world_size"] == M.WORLD for r in results)
    _assert_identical_in_nodes(results)
    x0 = _node_rows(np.array([r["x0"] for r in results], dtype=np.float64))
    steps = _steps(results)
    delay = case.strategy_kwargs.get("delay_by_one", False)
    want = M.node_mixing(x0, np.array(M.W2), len(steps), delay_by_one=delay)
    for t, x in enumerate(steps):
        np.testing.assert_allclose(_node_rows(x), want[t], **FP32, err_msg=f"step {t}")
    final = _node_rows(np.array([r["final"] for r in results]))
    np.testing.assert_allclose(final, want[-1], **FP32)
    assert np.abs(x0[0] - x0[1]).max() > 0.1 and np.abs(want[-1] - x0).max() > 1e-3


@multiprocess
def test_training_keeps_node_ranks_bit_identical(run):
    results = M.results(run, M.HIER_TRAIN)
    assert results[0]["global_step"] == M.HIER_TRAIN.batches
    _assert_identical_in_nodes(results)
    finals = np.array([r["final"] for r in results])
    assert np.abs(finals[0] - finals[M.DEVICES]).max() > 0  # nodes differ: gossip, not DDP
    assert np.abs(finals[0] - np.array(results[0]["start_weights"])).max() > 1e-3  # it trained


@multiprocess
@pytest.mark.parametrize("case", [M.BF16_RING, M.BF16_RANDOM_RING, M.FP16_RING, M.HIER_BF16],
                         ids=lambda c: c.name)
def test_compressed_wire_keeps_the_mean_and_reaches_consensus(run, case):
    results = M.results(run, case)
    hier = case.strategy_kwargs.get("hierarchical", False)
    if hier:
        _assert_identical_in_nodes(results)
    pick = _node_rows if hier else (lambda x: x)
    x0 = pick(np.array([r["x0"] for r in results], dtype=np.float64))
    d0 = M.relative_consensus(x0)
    dists = []
    for t, x in enumerate(_steps(results)):
        x = pick(x)
        np.testing.assert_allclose(x.mean(0), x0.mean(0), rtol=0, atol=1e-5,
                                   err_msg=f"mean moved at step {t}")
        dists.append(M.relative_consensus(x))
    assert d0 > 0.1
    assert dists[-1] < 1e-4 * d0, (d0, dists)
    assert dists[len(dists) // 2] < 1e-2 * d0, dists  # it got there by contracting


@multiprocess
@pytest.mark.parametrize("case", [M.GA_FLAT, M.GA_HIER], ids=lambda c: c.name)
def test_global_average_makes_replicas_equal(run, case):
    results = M.results(run, case)
    steps = _steps(results)
    for t, x in enumerate(steps):
        spread = np.abs(x - x[0]).max()
        if (t + 1) % M.EVERY == 0:
            assert spread == 0, f"replicas differ right after global average at step {t + 1}"
        elif t + 1 < M.EVERY:
            assert spread > 1e-3, f"replicas already equal at step {t + 1}"


@multiprocess
def test_adpsgd_global_average_at_epoch_end(run):
    results = M.results(run, M.AD_GA)
    x0 = np.array([r["x0"] for r in results], dtype=np.float64)
    final = np.array([r["final"] for r in results], dtype=np.float64)
    assert np.abs(x0 - x0[0]).max() > 0.1
    assert (final == final[0]).all()  # averaged at the last epoch end
    np.testing.assert_allclose(final[0], x0.mean(0), rtol=0, atol=1e-5)  # lr = 0: the mean
    dists = consensus_by_epoch(run / M.AD_GA.name)
    assert dists == [0.0, 0.0], dists  # logged after the average at both epoch ends


@multiprocess
def test_hierarchical_digits_converges(run):
    acc = {c.name: M.results(run, c)[0]["val_acc"] for c in (M.CONV_HIER, M.CONV_HIER_BF16)}
    print("digits held-out accuracy (2 nodes x 2):", acc)
    assert acc["conv_hier"] > 0.9, acc
    assert acc["conv_hier_bf16"] > 0.9, acc


@multiprocess
def test_fake_slurm_two_nodes_hierarchical_fit(shared_run):
    folder = shared_run("slurm2x2")
    results = M.results(folder, M.SLURM_TRAIN)
    assert {r["cluster_env"] for r in results} == {"SLURMEnvironment"}
    assert [r["rank"] for r in results] == list(range(M.WORLD))
    _assert_identical_in_nodes(results)
    _assert_identical_in_nodes(M.results(folder, M.SLURM_BF16))
    # bytes each rank sends per step: hierarchical = flat / devices; bf16 = fp32 / 2
    per_step = {c.name: [r["gossip_stats"]["sent_bytes"] / r["gossip_stats"]["exchanges"]
                         for r in M.results(folder, c)]
                for c in (M.SLURM_TRAIN, M.SLURM_BF16, M.SLURM_FLAT)}
    print("gossip bytes per rank per step:", per_step)
    hier, bf16, flat = (per_step[c.name] for c in (M.SLURM_TRAIN, M.SLURM_BF16, M.SLURM_FLAT))
    assert all(b == h / 2 for b, h in zip(bf16, hier))
    # a ring of 2 nodes: one peer node; the flat random ring of 4 ranks: two peers
    assert all(h <= f / M.DEVICES for h, f in zip(hier, flat))


@multiprocess
def test_one_node_is_plain_data_parallelism(shared_run):
    folder = shared_run("world2")
    results = M.results(folder, M.ONE_NODE, world=2)
    steps = _steps(results)
    assert len(steps) == M.ONE_NODE.batches
    assert all((x == x[0]).all() for x in steps)  # one replica, as with DDP
    assert np.abs(steps[-1][0] - np.array(results[0]["x0"])).max() > 1e-3  # it trained
    assert "plain data parallelism" in output(folder)  # the warning (rank 0 only)


@multiprocess
def test_one_process_per_node_is_the_flat_strategy(shared_run):
    folder = shared_run("nodes2x1")
    hier = M.results(folder, M.ONE_PROC_HIER, world=2)
    flat = M.results(folder, M.ONE_PROC_FLAT, world=2)
    assert np.abs(np.array(hier[0]["x0"]) - np.array(hier[1]["x0"])).max() > 0.1
    for h, f in zip(hier, flat):
        assert h["x0"] == f["x0"] and h["steps"] == f["steps"] and h["final"] == f["final"]


# -- set-up checks (no processes) ---------------------------------------------------------------
@pytest.mark.parametrize("entries, match", [
    ([(0, 0, 0), (1, 0, 1), (2, 1, 0)], "node 1 has 1 rank"),
    ([(0, 0, 0), (1, 0, 1), (2, 0, 2), (3, 1, 0)], "node 0 has 3 rank"),
    ([(0, 0, 0), (1, 1, 0), (2, 0, 1), (3, 1, 1)], "rank 1 is on node 1"),
])
def test_bad_node_layouts_are_named(entries, match):
    with pytest.raises(ValueError, match=match):
        check_layout(entries, num_nodes=2, devices=2)


def test_good_layout_and_column_peers():
    check_layout([(r, r // 2, r % 2) for r in range(6)], num_nodes=3, devices=2)
    from lightning_gossip.topology import build

    layout = NodeLayout(num_nodes=4, devices=3, node=2, local=1)
    peers = layout.column_peers(build("ring", 4).peers(2))
    assert peers.rank == 7
    assert sorted(peers.send_to) == [4, 10] and sorted(peers.recv_ranks) == [4, 10]


def test_constructor_rejects_bad_options():
    with pytest.raises(ValueError, match="wire_dtype"):
        DPSGDStrategy(wire_dtype="int8")
    with pytest.raises(ValueError, match="global_average_every_n_steps"):
        DPSGDStrategy(global_average_every_n_steps=0)
    s = DPSGDStrategy(hierarchical=True, wire_dtype="bf16", global_average_every_n_steps=5)
    assert s.hierarchical and s.wire_dtype == "bf16" and s.global_average_every_n_steps == 5
    assert ADPSGDStrategy(global_average_every_n_steps=2).global_average_every_n_steps == 2
    with pytest.raises(ValueError, match="global_average_every_n_steps"):
        ADPSGDStrategy(global_average_every_n_steps=-1)
    assert ADPSGDStrategy(hierarchical=True).hierarchical  # adpsgd has it too
    with pytest.raises(ValueError, match="wire_dtype"):
        ADPSGDStrategy(wire_dtype="int8")


def test_a_topology_over_more_nodes_than_exist_is_an_error():
    s = DPSGDStrategy(hierarchical=True, topology=np.full((4, 4), 0.25))
    with pytest.raises(ValueError, match="must be over 2 nodes.*for 4 ranks but the run has 2"):
        s.resolve_topology(nodes=2, devices=2)
    assert s.resolve_topology(nodes=4, devices=2).world_size == 4  # over nodes
    assert DPSGDStrategy(topology=np.full((4, 4), 0.25)).resolve_topology(2, 2).world_size == 4
    assert DPSGDStrategy(hierarchical=True).resolve_topology(3, 1).world_size == 3
