"""Elastic ``adpsgd`` and ``dpsgd``: ranks that come late, a lost node that rejoins whole, and
a rank the shared cursor leaves without a batch (``testbed/elastic_fit.py``, started as ``srun``
starts tasks). The checks and the rest of the elastic tests: ``tests/test_elastic.py``."""

from __future__ import annotations

import json
import shlex
from collections import Counter
from pathlib import Path

import pytest

from testbed.launch import (
    fake_slurm_commands,
    launch_processes,
    relaunched_once,
    run_fake_slurm_each,
)
from tests.test_elastic import (
    EPOCHS,
    SCRIPT,
    check_each_sample_once,
    check_epoch_values,
    check_exits,
    live_learners,
    trained,
)


@pytest.mark.multiprocess
@pytest.mark.parametrize("strategy", ["adpsgd", pytest.param("dpsgd", marks=pytest.mark.slow)])
def test_a_lost_node_rejoins_a_hierarchical_fit(tmp_path: Path, strategy: str) -> None:
    """2 nodes of 2 ranks as ``srun`` starts them: rank 3 is killed, its node-mate 2 exits
    (RankExcluded) and node 0 goes on; both of node 1's tasks are then relaunched with their
    environments. The members admit the node whole (after both asked), at a step node 0's
    ranks agreed on (``dpsgd``: every member, at a multiple of ``JOIN_CHECK_EVERY``); the
    newcomers resume from the members' exact average, claim as a node under keys of their own,
    and all four finish with the same replica, every sample trained once per epoch among all
    processes. (``dpsgd`` in ``make test-slow``: a minute per case.)"""
    ranks = 4
    commands = fake_slurm_commands(SCRIPT, str(tmp_path), "3", "3", ntasks=ranks, nodes=2,
                                   env={"ELASTIC_FIT_STEP_S": "1.0", "ELASTIC_FIT_NODES": "2",
                                        "ELASTIC_FIT_STRATEGY": strategy})
    for slot in (2, 3):  # the relaunched tasks, once the first ones are gone
        commands.append(relaunched_once(commands[slot], tmp_path / "recovered", 2 * slot - 2))
    result = launch_processes(commands, timeout=300)
    out = result.stdout[-8000:]
    assert not result.timed_out, out
    assert result.returncodes[3] == -9 and result.returncodes[2] == 1, (result.returncodes, out)
    # launches 4 and 5 are the relaunched ranks 2 and 3, whose results are the slots'
    results = {i: tmp_path / f"done{i - 2 if i > 3 else i}.json" for i in (0, 1, 4, 5)}
    check_exits(result, results, out)
    assert "elastic fit: rank(s) 2, 3 joined at step" in result.stdout, out
    check_each_sample_once(tmp_path, ranks)
    done = {r: json.loads((tmp_path / f"done{r}.json").read_text()) for r in range(ranks)}
    assert done[2]["joined"] and done[3]["joined"] and not done[0]["joined"], done
    assert all(d["joins"][0][0] == [2, 3] for r, d in done.items() if r < 2), done
    assert len({round(d["sum"], 5) for d in done.values()}) == 1, done
    assert all(d["exchanges"] > 0 for d in done.values()), done  # node 1 gossips again
    check_epoch_values(list(done.values()))
    assert live_learners(tmp_path) == [4.0, 2.0, 4.0]


@pytest.mark.multiprocess
@pytest.mark.parametrize(("strategy", "late"), [("adpsgd", True), ("adpsgd", False),
                                                ("dpsgd", True)])
def test_a_fit_starts_with_the_ranks_that_came_and_a_late_one_joins(
        tmp_path: Path, strategy: str, late: bool) -> None:
    """``start_timeout=4``: ranks 0-2 start, rank 3 only once rank 0 has trained a batch (long
    after the start timeout): the three found the fit and train, rank 3 joins the running fit
    as a replacement would (its slot was never filled), and all four finish every epoch with
    the same replica, every sample trained once per epoch. ``late=False``: all four come in
    time and found the fit together (their groups built by name, as a newcomer's)."""
    ranks = 4
    env = {"ELASTIC_FIT_STEP_S": "0.5", "ELASTIC_FIT_START_TIMEOUT": "4",
           "ELASTIC_FIT_STRATEGY": strategy}
    commands = fake_slurm_commands(SCRIPT, str(tmp_path), "-1", "0", ntasks=ranks, env=env)
    if late:
        argv, slot_env = commands[3]
        commands[3] = (["bash", "-c", f"while [ ! -s {tmp_path}/rank0.jsonl ]; do sleep 0.2; "
                                      f"done; exec {shlex.join(argv)}"], slot_env)
    result = launch_processes(commands, timeout=300)
    out = result.stdout[-8000:]
    assert not result.timed_out, out
    check_exits(result, {r: tmp_path / f"done{r}.json" for r in range(ranks)}, out)
    check_each_sample_once(tmp_path, ranks)
    done = [json.loads((tmp_path / f"done{r}.json").read_text()) for r in range(ranks)]
    founders = [0, 1, 2] if late else [0, 1, 2, 3]
    assert [d["founders"] for d in done] == [founders] * (3 if late else 4) + (
        [None] if late else []), done
    assert [d["joined"] for d in done] == [False, False, False, late], done
    if late:
        assert "elastic fit: rank(s) 3 joined at step" in result.stdout, out
        assert all(d["joins"] and d["joins"][0][0] == [3] for d in done[:3]), done
        assert trained(tmp_path, 3), "the late rank trained no batch"
    assert len({round(d["sum"], 5) for d in done}) == 1, done
    check_epoch_values(done)
    learners = live_learners(tmp_path)
    assert learners[0] == len(founders) and learners[-1] == ranks, learners


@pytest.mark.multiprocess
@pytest.mark.parametrize("strategy", ["adpsgd", "dpsgd"])
def test_a_rank_the_cursor_leaves_without_a_batch_validates_with_the_others(
        tmp_path: Path, strategy: str) -> None:
    """3 ranks, 2 batches an epoch, nobody lost: some rank trains no batch in an epoch.
    Lightning validates after an epoch's last batch, so that rank must validate with the others
    from its epoch's end (under ``dpsgd`` the fit timed out before: it went on to the next
    epoch while the others averaged for validation), and take part in the reductions of the
    epoch's logged training values, which it never logged (before that fix: a collective
    mismatch, found under the real SLURM). Every rank validates every epoch, every sample is
    trained once per epoch, and all end with the same replica and epoch values."""
    samples, ranks = 8, 3
    result = run_fake_slurm_each(SCRIPT, str(tmp_path), "-1", "0", ntasks=ranks, timeout=180,
                                 env={"ELASTIC_FIT_STRATEGY": strategy,
                                      "ELASTIC_FIT_SAMPLES": str(samples)})
    out = result.stdout[-6000:]
    check_exits(result, {r: tmp_path / f"done{r}.json" for r in range(ranks)}, out)
    batches = {(r, e): 0 for r in range(ranks) for e in range(EPOCHS)}
    for epoch in range(EPOCHS):
        seen = Counter()
        for r in range(ranks):
            for rec in trained(tmp_path, r):
                if rec["epoch"] == epoch:
                    seen.update(rec["idx"])
                    batches[r, epoch] += 1
        assert seen == Counter(range(samples)), (epoch, seen)
    assert 0 in batches.values(), batches  # the case happened (2 batches, 3 ranks)
    done = [json.loads((tmp_path / f"done{r}.json").read_text()) for r in range(ranks)]
    assert [d["validations"] for d in done] == [EPOCHS] * ranks, (done, batches)
    assert len({round(d["sum"], 5) for d in done}) == 1, done
    assert len({d["val_loss"] for d in done}) == 1, done
    check_epoch_values(done, samples)
