"""AD-PSGD on real processes (gloo): conservation, consensus, no deadlock, failures, data.

Every launch runs several fits; the assertions compare the ranks' JSON results here.
``LG_SLOW=1`` repeats the randomized no-deadlock runs more times (``LG_REPEATS``, default 5).
"""

from __future__ import annotations

import csv
import os
from pathlib import Path

import numpy as np
import pytest

from tests.launch import read_rank_results
from tests.test_dpsgd import launch

LR0 = {"strategy": "adpsgd", "offset": 1.0, "epochs": 3, "log": True}
NO_AVG = {"final_average": False, "consensus_every_n_steps": 1, "timeout": 60}


def cases_for(world: int) -> dict:
    return {
        "ring_lr0": {**LR0, "strategy_kwargs": {**NO_AVG, "topology": "ring"}},
        "random_lr0": {**LR0, "strategy_kwargs": {**NO_AVG, "topology": "random", "seed": 3}},
        "delay_lr0": {**LR0, "strategy_kwargs": {**NO_AVG, "delay_by_one": True}},
        # random per-rank delays, validation every epoch, staleness bound hit, real training
        "stress": {"strategy": "adpsgd", "lr": 0.3, "epochs": 3, "val_batches": 2, "delay_ms": 15,
                   "delay_seed": 1, "batches": 10, "batchnorm": True,
                   "strategy_kwargs": {"max_staleness": 0, "timeout": 60, "topology": "random"}},
    }


def consensus_by_epoch(run: Path) -> list[float]:
    rows = list(csv.DictReader(open(run / "logs" / "version_0" / "metrics.csv")))
    return [float(r["gossip/consensus_distance"]) for r in rows if r.get("gossip/consensus_distance")]


def assert_conserved_and_contracting(run: Path, world: int) -> None:
    results = read_rank_results(run, world)
    x0 = np.array([r["x0"] for r in results], dtype=np.float64)
    final = np.array([r["final"] for r in results], dtype=np.float64)
    assert np.abs(x0 - x0.mean(0)).max() > 0.1  # replicas really started apart
    np.testing.assert_allclose(final.sum(0), x0.sum(0), rtol=0, atol=5e-6 * world)
    assert sum(r["gossip_stats"]["exchanges"] for r in results) > 0
    d0 = np.mean([np.sum((x - x0.mean(0)) ** 2) for x in x0]) / np.sum(x0.mean(0) ** 2)
    per_epoch = consensus_by_epoch(run)
    assert len(per_epoch) == 3
    assert per_epoch[0] < d0 and all(a >= b - 1e-12 for a, b in zip(per_epoch, per_epoch[1:]))
    assert per_epoch[-1] < 0.05 * d0


def assert_stress_ok(run: Path, world: int) -> None:
    results = read_rank_results(run, world)
    finals = np.array([r["final"] for r in results])
    np.testing.assert_allclose(finals, np.broadcast_to(finals[0], finals.shape), rtol=0, atol=1e-6)
    assert np.isfinite(results[0]["val_acc"])
    steps = [r["global_step"] for r in results]
    assert sum(steps) == 3 * 10 * world  # shared cursor: every batch of every epoch used once
    assert any(r["gossip_stats"]["staleness_waits"] > 0 for r in results)  # the bound was hit


@pytest.fixture(scope="module")
def four_rank_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("adpsgd4")
    cases = cases_for(4)
    cases["straggler"] = {"strategy": "adpsgd", "epochs": 2, "batches": 12, "slow_rank": 1,
                          "slow_ms": 60, "strategy_kwargs": {"timeout": 60}}
    cases["convergence"] = {"strategy": "adpsgd", "task": "digits", "lr": 0.05, "epochs": 4,
                            "val_batches": 1.0, "different_init": False, "strategy_kwargs": {}}
    launch(tmp, cases, nprocs=4)
    return tmp


@pytest.mark.parametrize("case", ["ring_lr0", "random_lr0", "delay_lr0"])
def test_sum_conserved_and_consensus_contracts_4_ranks(four_rank_run, case):
    assert_conserved_and_contracting(four_rank_run / case, 4)


def test_no_deadlock_with_random_delays_validation_and_staleness_4_ranks(four_rank_run):
    assert_stress_ok(four_rank_run / "stress", 4)


def test_shared_cursor_fast_ranks_take_more_and_every_sample_once(four_rank_run):
    results = read_rank_results(four_rank_run / "straggler", 4)
    n = 12 * 4 * 4  # batches x batch size x world
    for epoch in range(2):
        seen = []
        for r in results:
            # batches of one epoch are consecutive in each rank's list
            per_rank = r["indices"]
            counts = [len(b) for b in per_rank]
            assert all(c == 4 for c in counts)
        all_idx = sorted(i for r in results for b in r["indices"] for i in b)
        seen = all_idx
    assert seen == sorted(list(range(n)) * 2)  # every sample exactly once in each of 2 epochs
    steps = {r["rank"]: r["global_step"] for r in results}
    assert all(steps[1] < steps[k] for k in (0, 2, 3)), steps


def test_convergence_close_to_ddp(four_rank_run, tmp_path):
    acc = read_rank_results(four_rank_run / "convergence", 4)[0]["val_acc"]
    common = {"task": "digits", "lr": 0.05, "epochs": 4, "val_batches": 1.0,
              "different_init": False, "strategy": "ddp"}
    launch(tmp_path, {"ddp": common}, nprocs=4)
    ddp = read_rank_results(tmp_path / "ddp", 4)[0]["val_acc"]
    assert ddp > 0.9
    assert acc >= ddp - 0.03, (acc, ddp)


@pytest.mark.parametrize("world", [2, 3, 5])
def test_sum_conserved_and_no_deadlock_other_world_sizes(tmp_path, world):
    cases = cases_for(world)
    if world != 5:
        cases = {k: cases[k] for k in ("ring_lr0", "stress")}
    launch(tmp_path, cases, nprocs=world)
    for case in cases:
        if case == "stress":
            assert_stress_ok(tmp_path / case, world)
        else:
            assert_conserved_and_contracting(tmp_path / case, world)


@pytest.mark.skipif(os.environ.get("LG_SLOW") != "1", reason="set LG_SLOW=1 for the soak test")
def test_no_deadlock_soak(tmp_path):
    repeats = int(os.environ.get("LG_REPEATS", "5"))
    for world in (3, 4, 5):
        cases = {f"stress{i}": {**cases_for(world)["stress"], "delay_seed": i} for i in range(repeats)}
        launch(tmp_path / str(world), cases, nprocs=world)
        for case in cases:
            assert_stress_ok(tmp_path / str(world) / case, world)


def test_a_rank_that_raises_fails_every_rank_with_the_message(tmp_path):
    cases = {"fail": {"strategy": "adpsgd", "epochs": 5, "batches": 20, "lr": 0.1,
                      "raise_at": {"rank": 2, "step": 4}, "strategy_kwargs": {"timeout": 60}}}
    result = launch(tmp_path, cases, nprocs=3, expect_ok=False)  # the launch has a timeout
    assert result.returncode != 0
    assert "injected failure on rank 2" in result.stdout


def test_non_finite_values_from_a_peer_are_reported_with_its_rank(tmp_path):
    cases = {"nan": {"strategy": "adpsgd", "epochs": 3, "batches": 20, "lr": 0.1,
                     "nan_at": {"rank": 1, "step": 3}, "strategy_kwargs": {"timeout": 60}}}
    result = launch(tmp_path, cases, nprocs=2, expect_ok=False)
    assert result.returncode != 0
    assert "received non-finite values (NaN/Inf) in the replica from rank 1" in result.stdout


def test_bad_arguments_and_unsupported_trainer_settings():
    import lightning as L

    from lightning_gossip import ADPSGDStrategy

    with pytest.raises(ValueError, match="valid choices: ring, random"):
        ADPSGDStrategy(topology="torus")
    with pytest.raises(ValueError, match="max_staleness"):
        ADPSGDStrategy(max_staleness=-1)
    strategy = ADPSGDStrategy()
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=1, val_check_interval=0.5,
                        logger=False)
    with pytest.raises(ValueError, match="validates at epoch ends only"):
        strategy._check_trainer(trainer)
