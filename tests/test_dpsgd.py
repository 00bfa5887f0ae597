"""D-PSGD on real processes (gloo): exact mixing, features, checkpoints, launchers, errors.

The fits run once per world size (``world_run``); every rank writes JSON and the assertions
compare it with NumPy computed from the same topology objects.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.cases import EXACT_TOPOLOGIES, assert_exact, expected_mixing, launch
from tests.launch import check, read_rank_results, run_fake_slurm, run_lightning


@pytest.mark.parametrize("topo", EXACT_TOPOLOGIES)
@pytest.mark.parametrize("mode", ["overlap", "blocking"])
def test_exact_mixing_4_ranks(world_run, topo, mode):
    assert_exact(read_rank_results(world_run(4) / f"dp_{topo}_{mode}", 4), topo)


@pytest.mark.parametrize("case", [f"dp_{t}_overlap" for t in EXACT_TOPOLOGIES]
                         + ["dp_random_ring_blocking"])
def test_exact_mixing_5_ranks(world_run, case):
    topo = case[3:].rsplit("_", 1)[0]
    assert_exact(read_rank_results(world_run(5) / case, 5), topo)


def test_delay_by_one_applies_the_previous_steps_exchange(world_run):
    assert_exact(read_rank_results(world_run(4) / "dp_delay_by_one", 4), "random_ring",
                 delay_by_one=True)


@pytest.mark.parametrize("case", ["dp_accumulate", "dp_manual", "dp_bf16"])
def test_mixing_is_exact_with_training_features(world_run, case):
    results = read_rank_results(world_run(4) / case, 4)
    if case == "dp_accumulate":  # 8 batches, accumulate 2: 4 optimizer steps, x_t fixed between
        assert results[0]["global_step"] == 4 and results[0]["gossip_step"] == 4
        for r in results:
            r["steps"] = r["steps"][1::2]
    assert_exact(results, "random_ring")


def test_consensus_distance_is_logged_and_exact(world_run):
    run = world_run(4) / "dp_logging"
    results = read_rank_results(run, 4)
    x0 = np.array([r["x0"] for r in results], dtype=np.float64)
    want = expected_mixing(x0, "random_ring", len(results[0]["steps"]), seed=5)
    rows = list(csv.DictReader(open(run / "logs" / "version_0" / "metrics.csv")))
    logged = {int(r["step"]): float(r["gossip/consensus_distance"])
              for r in rows if r.get("gossip/consensus_distance")}
    assert sorted(logged) == [2, 4, 6]  # every 2 steps, at "steps done"
    for step, value in logged.items():
        x = want[step - 1]
        mean = x.mean(0)
        expect = np.mean([np.sum((xi - mean) ** 2) / np.sum(mean ** 2) for xi in x])
        assert value == pytest.approx(expect, rel=1e-4)
    assert logged[2] > logged[4] > logged[6] > 0


def test_checkpoint_holds_the_consensus_and_resume_restores_it_everywhere(world_run):
    train = read_rank_results(world_run(4) / "dp_train_ckpt", 4)
    finals = np.array([r["final"] for r in train])
    assert np.abs(finals - finals.mean(0)).max() > 1e-4  # replicas differ (no final average)
    for r in train:  # saving did not touch the live replicas
        np.testing.assert_array_equal(r["after_save"], r["final"])
    ckpt = torch.load(world_run(4) / "dp_train_ckpt" / "model.ckpt", weights_only=False)
    sd = ckpt["state_dict"]
    names = ["net.0.weight", "net.0.bias", "net.1.weight", "net.1.bias", "net.3.weight",
             "net.3.bias", "net.1.running_mean", "net.1.running_var"]
    flat = np.concatenate([sd[n].flatten().numpy() for n in names])
    np.testing.assert_allclose(flat, finals.mean(0), rtol=0, atol=1e-6)
    for r in read_rank_results(world_run(4) / "dp_resume", 4):
        np.testing.assert_allclose(r["start_weights"], flat, rtol=0, atol=1e-7)
        assert r["global_step"] == 16 and r["gossip_step"] == 16


def test_final_average_leaves_every_rank_with_the_same_model(world_run):
    results = read_rank_results(world_run(4) / "dp_final_average", 4)
    finals = np.array([r["final"] for r in results])
    np.testing.assert_allclose(finals, np.broadcast_to(finals[0], finals.shape), rtol=0, atol=1e-7)
    assert np.abs(finals[0] - np.array(results[0]["start_weights"])).max() > 1e-3  # it trained


def test_convergence_close_to_ddp_on_real_digits(world_run):
    acc = {k: read_rank_results(world_run(4) / f"conv_{k}", 4)[0]["val_acc"]
           for k in ("ddp", "dpsgd", "adpsgd")}
    assert acc["ddp"] > 0.9, acc
    assert acc["dpsgd"] >= acc["ddp"] - 0.03, acc
    assert acc["adpsgd"] >= acc["ddp"] - 0.03, acc


def test_world_sizes_1_2_3(world_run):
    r = read_rank_results(world_run(1) / "dp_ws1", 1)[0]
    assert r["world_size"] == 1 and r["global_step"] == 6
    for world in (2, 3):
        assert_exact(read_rank_results(world_run(world) / "dp_ring", world), "ring")


def test_popen_launcher_with_the_registered_strategy_name(tmp_path):
    script = Path(__file__).parent / "scripts" / "popen_dpsgd.py"
    out = check(run_lightning(script, str(tmp_path)))
    results = read_rank_results(tmp_path, 2)
    x0 = np.array([r["x0"] for r in results])
    # two ranks: left == right, weights 1/2, so one step gives the exact average
    np.testing.assert_allclose(np.array([r["steps"][0] for r in results]),
                               np.broadcast_to(x0.mean(0), x0.shape), rtol=0, atol=2e-6)
    assert "DPSGDStrategy" in out


def test_two_nodes_of_two_processes_with_torchrun(tmp_path):
    cases = {"nodes": {"strategy_kwargs": {"final_average": False, "seed": 5}, "offset": 1.0,
                       "num_nodes": 2}}
    launch(tmp_path, cases, nprocs=2, nnodes=2)
    results = read_rank_results(tmp_path / "nodes", 4)
    assert sorted(r["rank"] for r in results) == [0, 1, 2, 3]
    assert {r["cluster_env"] for r in results} == {"TorchElasticEnvironment"}
    assert_exact(results, "random_ring")


def test_slurm_environment_gives_the_ranks(tmp_path):
    cases = {"dp": {"strategy_kwargs": {"final_average": False, "topology": "ring"}, "offset": 1.0},
             "ad": {"strategy": "adpsgd", "offset": 1.0, "epochs": 2,
                    "strategy_kwargs": {"final_average": False, "timeout": 60}}}
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    script = Path(__file__).parent / "scripts" / "gossip_cases.py"
    out = check(run_fake_slurm(script, str(tmp_path), str(tmp_path / "cases.json"), ntasks=3))
    assert "GLOBAL_RANK: 2" in out
    dp = read_rank_results(tmp_path / "dp", 3)
    assert {r["cluster_env"] for r in dp} == {"SLURMEnvironment"}
    assert_exact(dp, "ring")
    ad = read_rank_results(tmp_path / "ad", 3)
    x0, final = (np.array([r[k] for r in ad]) for k in ("x0", "final"))
    np.testing.assert_allclose(final.sum(0), x0.sum(0), rtol=0, atol=1e-5)


def test_mismatched_replicas_fail_on_every_rank_naming_the_parameter(tmp_path):
    result = launch(tmp_path, {"mismatch": {"strategy_kwargs": {}, "mismatch_rank": 1}}, nprocs=2,
                    expect_ok=False, timeout=180)
    assert result.returncode != 0
    msg = "model replicas differ between ranks: parameter/buffer 'net.0.weight'"
    assert result.stdout.count(msg) >= 2, result.stdout[-4000:]


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
