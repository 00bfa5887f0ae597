"""D-PSGD on real processes (gloo): exact mixing, features, checkpoints, launchers, errors.

Each launch runs several fits (process start-up dominates), every rank writes JSON, and the
assertions run here against NumPy computed from the same topology objects.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from lightning_gossip import topology as T
from tests.launch import check, read_rank_results, run_lightning, run_torchrun

SCRIPT = Path(__file__).parent / "scripts" / "gossip_cases.py"
FP32 = dict(rtol=0, atol=2e-6)


def launch(tmp: Path, cases: dict, nprocs: int, nnodes: int = 1, expect_ok: bool = True):
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "cases.json").write_text(json.dumps(cases))
    result = run_torchrun(SCRIPT, str(tmp), str(tmp / "cases.json"), nprocs=nprocs, nnodes=nnodes)
    if expect_ok:
        check(result)
    return result


def expected_mixing(x0: np.ndarray, name: str, steps: int, seed: int = 0,
                    delay_by_one: bool = False) -> list[np.ndarray]:
    """X after each step for lr = 0: prod_t W_t X0, or the delay-by-one recursion."""
    topo = T.build(name, x0.shape[0], seed)
    xs, prev, x = [], None, x0.copy()
    for t in range(steps):
        w = topo.mixing_matrix(t)
        if delay_by_one:
            new = x if prev is None else x + (topo.mixing_matrix(t - 1) - np.eye(len(x))) @ prev
            prev, x = x, new
        else:
            x = w @ x
        xs.append(x)
    if delay_by_one:  # the last exchange is applied when training ends
        xs.append(x + (topo.mixing_matrix(steps - 1) - np.eye(len(x))) @ prev)
    return xs


def assert_exact(results: list[dict], name: str, seed: int = 0, delay_by_one: bool = False):
    x0 = np.array([r["x0"] for r in results], dtype=np.float64)
    steps = len(results[0]["steps"])
    assert steps >= 3 and all(len(r["steps"]) == steps for r in results)
    want = expected_mixing(x0, name, steps, seed, delay_by_one)
    for t in range(steps):
        got = np.array([r["steps"][t] for r in results])
        np.testing.assert_allclose(got, want[t], **FP32, err_msg=f"{name} step {t}")
    final = np.array([r["final"] for r in results])
    np.testing.assert_allclose(final, want[-1], **FP32)
    # the replicas really disagreed, and mixing is not a no-op
    assert np.abs(x0 - x0.mean(0)).max() > 0.1
    assert np.abs(want[-1] - x0).max() > 1e-3


EXACT = {f"{topo}_{mode}": {"strategy_kwargs": {"topology": topo, "overlap": mode == "overlap",
                                                "final_average": False, "seed": 5},
                            "offset": 1.0}
         for topo in ("ring", "random_ring", "one_peer_exponential")
         for mode in ("overlap", "blocking")}


@pytest.fixture(scope="module")
def four_rank_run(tmp_path_factory):
    """One 4-rank launch: exactness for 3 topologies x overlap, the training features, a real
    training run with checkpoint + consensus logging, then a resume from that checkpoint."""
    tmp = tmp_path_factory.mktemp("dpsgd4")
    base = {"final_average": False, "topology": "random_ring", "seed": 5}
    cases = dict(EXACT)
    cases["delay_by_one"] = {"strategy_kwargs": {**base, "delay_by_one": True}, "offset": 1.0}
    cases["accumulate"] = {"strategy_kwargs": base, "offset": 1.0, "accumulate": 2, "batches": 8}
    cases["manual"] = {"strategy_kwargs": base, "offset": 1.0, "manual": True}
    cases["bf16"] = {"strategy_kwargs": base, "offset": 1.0, "precision": "bf16-mixed"}
    cases["logging"] = {"strategy_kwargs": {**base, "consensus_every_n_steps": 2}, "offset": 1.0,
                        "log": True}
    cases["train_ckpt"] = {"strategy_kwargs": {"final_average": False, "consensus_every_n_steps": 3},
                           "lr": 0.5, "save_checkpoint": True, "batchnorm": True, "batches": 8}
    cases["final_average"] = {"strategy_kwargs": {}, "lr": 0.5, "batchnorm": True}
    cases["resume"] = {"strategy_kwargs": {"final_average": False}, "lr": 0.5, "batchnorm": True,
                       "batches": 8, "epochs": 2, "resume_from": str(tmp / "train_ckpt" / "model.ckpt")}
    launch(tmp, cases, nprocs=4)
    return tmp


@pytest.mark.parametrize("case", sorted(EXACT))
def test_exact_mixing_4_ranks(four_rank_run, case):
    results = read_rank_results(four_rank_run / case, 4)
    assert_exact(results, EXACT[case]["strategy_kwargs"]["topology"], seed=5)


def test_delay_by_one_applies_the_previous_steps_exchange(four_rank_run):
    assert_exact(read_rank_results(four_rank_run / "delay_by_one", 4), "random_ring", 5, True)


@pytest.mark.parametrize("case", ["accumulate", "manual", "bf16"])
def test_mixing_is_exact_with_training_features(four_rank_run, case):
    results = read_rank_results(four_rank_run / case, 4)
    if case == "accumulate":  # 8 batches, accumulate 2: 4 optimizer steps, x_t fixed in between
        assert results[0]["global_step"] == 4 and results[0]["gossip_step"] == 4
        for r in results:
            r["steps"] = r["steps"][1::2]
    assert_exact(results, "random_ring", seed=5)


def test_consensus_distance_is_logged_and_exact(four_rank_run):
    results = read_rank_results(four_rank_run / "logging", 4)
    x0 = np.array([r["x0"] for r in results], dtype=np.float64)
    want = expected_mixing(x0, "random_ring", len(results[0]["steps"]), seed=5)
    rows = list(csv.DictReader(open(four_rank_run / "logging" / "logs" / "version_0" / "metrics.csv")))
    logged = {int(r["step"]): float(r["gossip/consensus_distance"])
              for r in rows if r.get("gossip/consensus_distance")}
    assert sorted(logged) == [2, 4, 6]
    for step, value in logged.items():
        x = want[step - 1]
        mean = x.mean(0)
        expect = np.mean([np.sum((xi - mean) ** 2) / np.sum(mean ** 2) for xi in x])
        assert value == pytest.approx(expect, rel=1e-4)
    assert logged[2] > logged[4] > logged[6] > 0


def test_checkpoint_holds_the_consensus_and_resume_restores_it_everywhere(four_rank_run):
    train = read_rank_results(four_rank_run / "train_ckpt", 4)
    finals = np.array([r["final"] for r in train])
    assert np.abs(finals - finals.mean(0)).max() > 1e-4  # replicas differ (no final average)
    for r in train:  # saving did not touch the live replicas
        np.testing.assert_array_equal(r["after_save"], r["final"])
    ckpt = torch.load(four_rank_run / "train_ckpt" / "model.ckpt", weights_only=False)
    sd = ckpt["state_dict"]
    names = ["net.0.weight", "net.0.bias", "net.1.weight", "net.1.bias", "net.3.weight",
             "net.3.bias", "net.1.running_mean", "net.1.running_var"]
    flat = np.concatenate([sd[n].flatten().numpy() for n in names])
    np.testing.assert_allclose(flat, finals.mean(0), rtol=0, atol=1e-6)
    resumed = read_rank_results(four_rank_run / "resume", 4)
    for r in resumed:
        np.testing.assert_allclose(r["start_weights"], flat, rtol=0, atol=1e-7)
        assert r["global_step"] == 16 and r["gossip_step"] == 16


def test_final_average_leaves_every_rank_with_the_same_model(four_rank_run):
    results = read_rank_results(four_rank_run / "final_average", 4)
    finals = np.array([r["final"] for r in results])
    np.testing.assert_allclose(finals, np.broadcast_to(finals[0], finals.shape), rtol=0, atol=1e-7)
    assert np.abs(finals[0] - np.array(results[0]["start_weights"])).max() > 1e-3  # it trained


def test_exact_mixing_5_ranks_and_convergence_close_to_ddp(tmp_path):
    cases = {f"{topo}_overlap": {"strategy_kwargs": {"topology": topo, "final_average": False,
                                                     "seed": 5}, "offset": 1.0}
             for topo in ("ring", "random_ring", "one_peer_exponential")}
    cases["random_ring_blocking"] = {"strategy_kwargs": {"overlap": False, "final_average": False,
                                                         "seed": 5}, "offset": 1.0}
    launch(tmp_path / "five", cases, nprocs=5)
    for case, spec in cases.items():
        assert_exact(read_rank_results(tmp_path / "five" / case, 5),
                     spec["strategy_kwargs"].get("topology", "random_ring"), seed=5)


def test_convergence_close_to_ddp(tmp_path):
    common = {"task": "digits", "lr": 0.05, "epochs": 4, "val_batches": 1.0, "seed": 0,
              "different_init": False}
    cases = {"ddp": {**common, "strategy": "ddp"},
             "dpsgd": {**common, "strategy_kwargs": {"topology": "random_ring"}}}
    launch(tmp_path, cases, nprocs=4)
    acc = {k: read_rank_results(tmp_path / k, 4)[0]["val_acc"] for k in cases}
    assert acc["ddp"] > 0.9, acc
    assert acc["dpsgd"] >= acc["ddp"] - 0.03, acc


def test_world_sizes_1_2_3_and_popen_launcher_with_strategy_name(tmp_path):
    one = {"ws1": {"strategy_kwargs": {}, "lr": 0.1}}
    launch(tmp_path / "one", one, nprocs=1)
    r = read_rank_results(tmp_path / "one" / "ws1", 1)[0]
    assert r["world_size"] == 1 and r["global_step"] == 6
    three = {"ws3": {"strategy_kwargs": {"topology": "ring", "final_average": False}, "offset": 1.0}}
    launch(tmp_path / "three", three, nprocs=3)
    assert_exact(read_rank_results(tmp_path / "three" / "ws3", 3), "ring")
    # Lightning's own popen launcher, strategy by registered name, 2 ranks (left == right)
    out = check(run_lightning(Path(__file__).parent / "scripts" / "popen_dpsgd.py", str(tmp_path / "two")))
    results = read_rank_results(tmp_path / "two", 2)
    x0 = np.array([r["x0"] for r in results])
    np.testing.assert_allclose(np.array([r["steps"][0] for r in results]),
                               np.full_like(x0, 0) + x0.mean(0), **FP32)
    assert "DPSGDStrategy" in out


def test_two_nodes_of_two_processes_with_torchrun(tmp_path):
    cases = {"nodes": {"strategy_kwargs": {"final_average": False, "seed": 5}, "offset": 1.0,
                       "num_nodes": 2}}
    launch(tmp_path, cases, nprocs=2, nnodes=2)
    results = read_rank_results(tmp_path / "nodes", 4)
    assert sorted(r["rank"] for r in results) == [0, 1, 2, 3]
    assert_exact(results, "random_ring", seed=5)


def test_mismatched_replicas_fail_on_every_rank_naming_the_parameter(tmp_path):
    cases = {"mismatch": {"strategy_kwargs": {}, "mismatch_rank": 1}}
    result = launch(tmp_path, cases, nprocs=2, expect_ok=False)
    assert result.returncode != 0
    assert result.stdout.count("model replicas differ between ranks: parameter/buffer 'net.0.weight'") >= 2, result.stdout[-4000:]


def test_topology_for_the_wrong_world_size_is_a_clear_error(tmp_path):
    cases = {"wrong": {"strategy_kwargs": {"topology": [[0.5, 0.5, 0.0], [0.5, 0.0, 0.5], [0.0, 0.5, 0.5]]}}}
    result = launch(tmp_path, cases, nprocs=2, expect_ok=False)
    assert result.returncode != 0
    assert "topology 'custom' is for 3 ranks but the run has 2" in result.stdout


def test_bad_arguments_are_rejected_at_construction():
    from lightning_gossip import DPSGDStrategy

    with pytest.raises(ValueError, match="valid choices"):
        DPSGDStrategy(topology="hypercube")
    with pytest.raises(ValueError, match="evaluate"):
        DPSGDStrategy(evaluate="best")
    with pytest.raises(ValueError, match="consensus_every_n_steps"):
        DPSGDStrategy(consensus_every_n_steps=0)
    with pytest.raises(ValueError, match="timeout"):
        DPSGDStrategy(timeout=-1)
    with pytest.raises(ValueError, match="process_group_backend"):
        DPSGDStrategy(process_group_backend="mpi")
