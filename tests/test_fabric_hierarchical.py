"""Hierarchical gossip (super-learners) under Fabric and ``attach`` (``docs/fabric.md``,
``docs/engines.md``): the ranks of a node hold bit-identical replicas after every step, the node
replicas follow the node-level mixing matrices exactly (``dpsgd``, lr=0) or keep their sum
(``adpsgd``, lr=0), and ``finish()`` leaves the exact average everywhere.

The multi-process checks run in one launch of 2 torchrun nodes of 2 processes
(``tests/scripts/fabric_hier_ranks.py``); the option checks need no process.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from testbed.launch import ROOT, check, run_torchrun

DRIVER = ROOT / "tests" / "scripts" / "fabric_hier_ranks.py"
NODES, DEVICES = 2, 2
WORLD = NODES * DEVICES
FP32 = dict(rtol=0, atol=1e-6)
FRONTS = ["fabric", "attach"]


# -- without processes --------------------------------------------------------------------------
def test_fabric_classes_take_hierarchical_and_node_allreduce() -> None:
    from lightning_gossip.fabric import FabricADPSGDStrategy, FabricDPSGDStrategy

    for cls in (FabricDPSGDStrategy, FabricADPSGDStrategy):
        strategy = cls(hierarchical=True, node_allreduce="overlapped")
        assert strategy.gossip_options()["hierarchical"] is True
        assert strategy.node_allreduce == "overlapped"
        with pytest.raises(ValueError, match="set hierarchical=True too"):
            cls(node_allreduce="overlapped")
        with pytest.raises(ValueError, match="node_allreduce must be one of"):
            cls(hierarchical=True, node_allreduce="sometimes")


def test_attach_outside_torchrun_asks_for_the_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without torchrun's variables the layout cannot be read: the error says what to pass
    (raised before any collective, so every rank of such a launch raises it)."""
    from lightning_gossip.node_averaging import node_layout

    for name in ("LOCAL_WORLD_SIZE", "GROUP_RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ValueError, match=r"LOCAL_WORLD_SIZE is not set.*layout=.*NodeLayout"):
        node_layout(0, 4)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    monkeypatch.setenv("GROUP_RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(ValueError, match="nodes of equal size"):
        node_layout(0, 4)


# -- one launch of 2 nodes x 2 processes ----------------------------------------------------------
@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("fabric_hier")
    check(run_torchrun(DRIVER, str(out), nprocs=DEVICES, nnodes=NODES, timeout=900))
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


def _case(results: list[dict], name: str) -> list[dict]:
    return [r[name] for r in results]


def _steps(ranks: list[dict]) -> np.ndarray:
    """(steps, ranks, numel): every rank's replica after every optimizer step."""
    return np.array([r["steps"] for r in ranks], dtype=np.float64).transpose(1, 0, 2)


def _assert_identical_in_nodes(ranks: list[dict]) -> None:
    for t, x in enumerate(_steps(ranks)):
        for node in range(NODES):
            rows = x[node * DEVICES:(node + 1) * DEVICES]
            assert (rows == rows[0]).all(), f"node {node}'s ranks differ after step {t}"


def _node_rows(x: np.ndarray) -> np.ndarray:
    """The replica of each node (its first rank's)."""
    return x[::DEVICES]


def _pair(step: int) -> np.ndarray:
    """The driver's two-node ``W_t`` (``a_t = 0.1 (t mod 3 + 1)``)."""
    a = 0.1 * (step % 3 + 1)
    return np.array([[1 - a, a], [a, 1 - a]])


@pytest.mark.multiprocess
@pytest.mark.parametrize("front", FRONTS)
def test_layout_is_two_nodes_of_two(results: list[dict], front: str) -> None:
    for kind in ("dpsgd", "adpsgd"):
        layouts = [r["layout"] for r in _case(results, f"{front}-exact-{kind}")]
        assert layouts == [[NODES, DEVICES, r // DEVICES, r % DEVICES] for r in range(WORLD)]


@pytest.mark.multiprocess
@pytest.mark.parametrize("front", FRONTS)
def test_dpsgd_node_replicas_follow_the_node_mixing_matrices(results: list[dict],
                                                             front: str) -> None:
    """lr=0: after step t the node replicas are exactly ``W_t ... W_0 X0`` over the nodes, and
    the ranks of a node hold the same replica bit for bit."""
    ranks = _case(results, f"{front}-exact-dpsgd")
    _assert_identical_in_nodes(ranks)
    x0 = _node_rows(np.array([r["x0"] for r in ranks], dtype=np.float64))
    assert np.abs(x0[0] - x0[1]).min() > 0.05  # the node replicas differed
    want = x0
    for t, x in enumerate(_steps(ranks)):
        want = _pair(t) @ want
        np.testing.assert_allclose(_node_rows(x), want, **FP32, err_msg=f"step {t}")
    assert all(r["exchanges"] == len(r["steps"]) for r in ranks)  # one round per step
    final = np.array([r["final"] for r in ranks])
    np.testing.assert_allclose(final, np.repeat(x0.mean(0, keepdims=True), WORLD, 0), **FP32)


@pytest.mark.multiprocess
@pytest.mark.parametrize("front", FRONTS)
def test_adpsgd_keeps_the_sum_of_the_node_replicas(results: list[dict], front: str) -> None:
    """lr=0: pairwise averages between the nodes keep the sum of the node replicas once the
    exchanges in flight are applied (``quiesce``); the ranks of a node add the same gathered
    deltas at every step, so they stay bit-identical."""
    ranks = _case(results, f"{front}-exact-adpsgd")
    _assert_identical_in_nodes(ranks)
    x0 = _node_rows(np.array([r["x0"] for r in ranks], dtype=np.float64))
    assert np.abs(x0[0] - x0[1]).min() > 0.05
    x = np.array([r["x"] for r in ranks], dtype=np.float64)
    np.testing.assert_allclose(_node_rows(x).sum(0), x0.sum(0), **FP32)
    assert (x[:DEVICES] == x[0]).all() and (x[DEVICES:] == x[DEVICES]).all()
    assert np.abs(_node_rows(x) - x0).max() > 1e-3  # the nodes gossiped
    assert all(r["exchanges"] > 0 for r in ranks)
    final = np.array([r["final"] for r in ranks])
    np.testing.assert_allclose(final, np.repeat(x0.mean(0, keepdims=True), WORLD, 0), **FP32)


@pytest.mark.multiprocess
@pytest.mark.parametrize("front", FRONTS)
@pytest.mark.parametrize("kind", ["dpsgd", "adpsgd"])
def test_training_keeps_the_ranks_of_a_node_identical(results: list[dict], front: str,
                                                      kind: str) -> None:
    """lr > 0, a different batch on every rank: only the node's gradient average keeps its
    ranks bit-identical (Fabric: with two accumulated micro-batches through
    ``fabric.no_backward_sync``; dpsgd with the overlapped node all-reduce)."""
    ranks = _case(results, f"{front}-train-{kind}")
    _assert_identical_in_nodes(ranks)
    x = np.array([r["x"] for r in ranks], dtype=np.float64)
    start = np.array(ranks[0]["start"])
    assert np.abs(x[0] - start).max() > 1e-3  # it trained
    if kind == "dpsgd":  # W_t never averages fully: the nodes' different data keeps them apart
        assert np.abs(x[0] - x[DEVICES]).max() > 0
    final = np.array([r["final"] for r in ranks])
    assert (final == final[0]).all()
