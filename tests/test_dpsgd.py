"""D-PSGD on real processes (gloo): exact mixing, features, checkpoints, launchers, errors.

The fits run once per world size (``world_run``); every rank writes JSON and the assertions
compare it with NumPy computed from the same topology objects.
"""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import pytest
import torch

from testbed.launch import check, read_rank_results, run_lightning
from tests.cases import (
    CONV_ADPSGD,
    CONV_DDP,
    CONV_DPSGD,
    DP_ACCUMULATE,
    DP_BF16,
    DP_DELAY_BY_ONE,
    DP_FINAL_AVERAGE,
    DP_LOGGING,
    DP_MANUAL,
    DP_RESUME,
    DP_RING,
    DP_TRAIN_CKPT,
    DP_WS1,
    EXACT_4,
    EXACT_5,
    Case,
    all_cases,
    assert_case_exact,
    expected_mixing,
)
from tests.shared_runs import DP_NODES, output, returncode


def _ids(case: Case) -> str:
    return case.name


@pytest.mark.parametrize("case", EXACT_4, ids=_ids)
def test_exact_mixing_4_ranks(world_run, case):
    assert_case_exact(case.results(world_run(4), 4), case)


@pytest.mark.parametrize("case", EXACT_5, ids=_ids)
def test_exact_mixing_5_ranks(world_run, case):
    assert_case_exact(case.results(world_run(5), 5), case)


def test_delay_by_one_applies_the_previous_steps_exchange(world_run):
    assert DP_DELAY_BY_ONE.exact_delay_by_one
    assert_case_exact(DP_DELAY_BY_ONE.results(world_run(4), 4), DP_DELAY_BY_ONE)


@pytest.mark.parametrize("case", [DP_ACCUMULATE, DP_MANUAL, DP_BF16], ids=_ids)
def test_mixing_is_exact_with_training_features(world_run, case):
    results = case.results(world_run(4), 4)
    if case.accumulate > 1:  # 8 batches, accumulate 2: 4 optimizer steps, x_t fixed between
        assert case.batches == 8 and case.accumulate == 2
        assert results[0]["global_step"] == 4 and results[0]["gossip_step"] == 4
        for r in results:
            r["steps"] = r["steps"][1::2]
    assert_case_exact(results, case)


def test_consensus_distance_is_logged_and_exact(world_run):
    run = world_run(4) / DP_LOGGING.name
    results = DP_LOGGING.results(world_run(4), 4)
    x0 = np.array([r["x0"] for r in results], dtype=np.float64)
    want = expected_mixing(x0, DP_LOGGING.exact_topology, len(results[0]["steps"]), seed=5)
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
    train = DP_TRAIN_CKPT.results(world_run(4), 4)
    finals = np.array([r["final"] for r in train])
    assert np.abs(finals - finals.mean(0)).max() > 1e-4  # replicas differ (no final average)
    for r in train:  # saving did not touch the live replicas
        np.testing.assert_array_equal(r["after_save"], r["final"])
    ckpt = torch.load(world_run(4) / DP_TRAIN_CKPT.name / "model.ckpt", weights_only=False)
    sd = ckpt["state_dict"]
    names = ["net.0.weight", "net.0.bias", "net.1.weight", "net.1.bias", "net.3.weight",
             "net.3.bias", "net.1.running_mean", "net.1.running_var"]
    flat = np.concatenate([sd[n].flatten().numpy() for n in names])
    np.testing.assert_allclose(flat, finals.mean(0), rtol=0, atol=1e-6)
    assert DP_RESUME.resume_case == DP_TRAIN_CKPT.name
    for r in DP_RESUME.results(world_run(4), 4):
        np.testing.assert_allclose(r["start_weights"], flat, rtol=0, atol=1e-7)
        assert r["global_step"] == 16 and r["gossip_step"] == 16


def test_final_average_leaves_every_rank_with_the_same_model(world_run):
    results = DP_FINAL_AVERAGE.results(world_run(4), 4)
    finals = np.array([r["final"] for r in results])
    np.testing.assert_allclose(finals, np.broadcast_to(finals[0], finals.shape), rtol=0, atol=1e-7)
    assert np.abs(finals[0] - np.array(results[0]["start_weights"])).max() > 1e-3  # it trained


def test_convergence_close_to_ddp_on_real_digits(world_run):
    acc = {k: case.results(world_run(4), 4)[0]["val_acc"]
           for k, case in (("ddp", CONV_DDP), ("dpsgd", CONV_DPSGD), ("adpsgd", CONV_ADPSGD))}
    assert acc["ddp"] > 0.9, acc
    assert acc["dpsgd"] >= acc["ddp"] - 0.03, acc
    assert acc["adpsgd"] >= acc["ddp"] - 0.03, acc


def test_world_sizes_1_2_3(world_run):
    r = DP_WS1.results(world_run(1), 1)[0]
    assert r["world_size"] == 1 and r["global_step"] == 6
    assert DP_RING.exact_topology == "ring"
    for world in (2, 3):
        assert_case_exact(DP_RING.results(world_run(world), world), DP_RING)


@pytest.mark.multiprocess
def test_popen_launcher_with_the_registered_strategy_name(tmp_path):
    script = Path(__file__).parent / "scripts" / "popen_dpsgd.py"
    out = check(run_lightning(script, str(tmp_path)))
    results = read_rank_results(tmp_path, 2)
    x0 = np.array([r["x0"] for r in results])
    # two ranks: left == right, weights 1/2, so one step gives the exact average
    np.testing.assert_allclose(np.array([r["steps"][0] for r in results]),
                               np.broadcast_to(x0.mean(0), x0.shape), rtol=0, atol=2e-6)
    assert "DPSGDStrategy" in out


def test_two_nodes_of_two_processes_with_torchrun(world_run):
    """The 4-rank launch is 2 torchrun nodes of 2 processes (``tests/shared_runs.py``)."""
    results = DP_NODES.results(world_run(4), 4)
    assert sorted(r["rank"] for r in results) == [0, 1, 2, 3]
    assert {r["cluster_env"] for r in results} == {"TorchElasticEnvironment"}
    assert_case_exact(results, DP_NODES)


def test_slurm_environment_gives_the_ranks(world_run):
    """The 3-rank launch is started as srun would (``SLURM_*`` variables, no torchrun)."""
    folder = world_run(3)
    assert "GLOBAL_RANK: 2" in output(folder)
    for case in all_cases(3):
        assert {r["cluster_env"] for r in case.results(folder, 3)} == {"SLURMEnvironment"}
    # the fits ran as under torchrun: dpsgd exact, adpsgd conserves the sum
    # (test_world_sizes_1_2_3, test_adpsgd.py::test_sum_conserved_and_consensus_contracts)


def test_mismatched_replicas_fail_on_every_rank_naming_the_parameter(world_run):
    """The last case of the 5-rank launch: rank 1's model is one unit wider."""
    folder = world_run(5)
    assert returncode(folder) != 0
    text = output(folder)
    msg = "model replicas differ between ranks: parameter/buffer 'net.0.weight'"
    assert text.count(msg) >= 2, text[-4000:]


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
