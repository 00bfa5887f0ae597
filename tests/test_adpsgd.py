"""AD-PSGD on real processes (gloo): conservation, consensus, no deadlock, failures, data.

The fits run once per world size (``world_run``); assertions compare the ranks' JSON here.
``make test-slow`` adds a soak test that repeats the randomized no-deadlock run (``LG_REPEATS``
times per world size, default 5).
"""

from __future__ import annotations

import json
import os

import pytest

from tests.cases import (
    AD_ONE_BATCH,
    AD_STRAGGLER,
    AD_STRESS,
    AD_WS1,
    adpsgd_lr0_cases,
    assert_conserved_and_contracting,
    assert_stress_ok,
    launch,
    stress_repeats,
)
from tests.shared_runs import AD_NAN, AD_RAISES, output, returncode


@pytest.mark.parametrize("world", [2, 3, 4, 5])
def test_sum_conserved_and_consensus_contracts(world_run, world):
    names = ["ad_ring_lr0"] + (["ad_random_lr0", "ad_delay_lr0"] if world in (4, 5) else [])
    assert [c.name for c in adpsgd_lr0_cases(world)] == names
    for case in adpsgd_lr0_cases(world):
        assert_conserved_and_contracting(world_run(world) / case.name, world)


@pytest.mark.parametrize("world", [2, 3, 4, 5])
def test_no_deadlock_with_random_delays_validation_and_staleness(world_run, world):
    assert_stress_ok(world_run(world) / AD_STRESS.name, world)


def test_world_size_1_trains_locally(world_run):
    r = AD_WS1.results(world_run(1), 1)[0]
    assert r["global_step"] == 6


def test_shared_cursor_fast_ranks_take_more_and_every_sample_once(world_run):
    results = AD_STRAGGLER.results(world_run(4), 4)
    n = 12 * 4 * 4  # batches x batch size x world
    assert all(len(b) == 4 for r in results for b in r["indices"])
    seen = sorted(i for r in results for b in r["indices"] for i in b)
    assert seen == sorted(list(range(n)) * 2)  # every sample exactly once in each of 2 epochs
    steps = {r["rank"]: r["global_step"] for r in results}
    assert all(steps[1] < steps[k] for k in (0, 2, 3)), steps


def test_a_rank_without_batches_in_an_epoch_validates_with_the_others(world_run):
    """One batch per epoch among 3 ranks: Lightning validates and steps the epoch's schedulers
    after an epoch's last batch, so the two ranks that claimed none would skip the validation
    the third runs (and meet it in another collective) and fall behind on the learning rate;
    they find it at its validation's meeting and validate with it, and step theirs."""
    results = AD_ONE_BATCH.results(world_run(3), 3)
    assert sum(r["global_step"] for r in results) == 3, results  # one batch per epoch
    assert [r["validations"] for r in results] == [3, 3, 3], results
    assert [r["lr"] for r in results] == [0.1 * 0.5**3] * 3, results
    assert len({r["val_acc"] for r in results}) == 1, results  # the same synced value
    assert len({json.dumps(r["final"]) for r in results}) == 1  # the final average


@pytest.mark.slow
@pytest.mark.multiprocess
def test_no_deadlock_soak(tmp_path):
    repeats = int(os.environ.get("LG_REPEATS", "5"))
    for world in (3, 4, 5):
        cases = stress_repeats(repeats)
        launch(tmp_path / str(world), cases, nprocs=world, timeout=3600)
        for case in cases:
            assert_stress_ok(tmp_path / str(world) / case.name, world)


def test_a_rank_that_raises_fails_every_rank_with_the_message(world_run):
    """The last case of the 3-rank launch: rank 2 raises at step 4."""
    folder = world_run(3)
    assert AD_RAISES.raise_at == {"rank": 2, "step": 4}
    assert returncode(folder) != 0
    assert "injected failure on rank 2" in output(folder)


def test_non_finite_values_from_a_peer_are_reported_with_its_rank(world_run):
    """The last case of the 2-rank launch: rank 1's weights become NaN at step 3."""
    folder = world_run(2)
    assert AD_NAN.nan_at == {"rank": 1, "step": 3}
    assert returncode(folder) != 0
    text = output(folder)
    assert "received non-finite values (NaN/Inf) in the replica from rank 1" in text, text[-4000:]


def test_bad_arguments_and_unsupported_trainer_settings():
    import lightning as L

    from lightning_gossip import ADPSGDStrategy

    with pytest.raises(ValueError, match="valid choices: ring, random"):
        ADPSGDStrategy(pairing="torus")
    with pytest.raises(ValueError, match="max_staleness"):
        ADPSGDStrategy(max_staleness=-1)
    strategy = ADPSGDStrategy()
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=1, val_check_interval=0.5,
                        logger=False)
    with pytest.raises(ValueError, match="validates at epoch ends only"):
        strategy.phases.check_trainer(trainer, sync_batchnorm=False)
