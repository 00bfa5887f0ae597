"""Elastic ``adpsgd`` and ``dpsgd`` (issue 31): a rank killed mid-epoch costs the others a few
seconds, not the fit (``testbed/elastic_fit.py``; 4 ranks started as ``srun`` starts tasks).

Checks: the survivors end with exit code 0 after every epoch; in the epoch of the loss every
sample was trained exactly once among the survivors and the victim's batches trained before
it died (its claimed, untrained batches went back to the shared cursor), in the later epochs
exactly once among the survivors; every survivor recorded the same loss, ends with the same
replica (the final average over the survivors) and rank 0's logger saw ``gossip/live_learners``
go from 4 to 3; the warning names the lost rank; validation with a ``sync_dist`` metric and
``ModelCheckpoint`` ran over the survivors (``last.ckpt`` exists). The loss of rank 0 (the
store's host) falls back to the emergency checkpoint."""

from __future__ import annotations

import csv
import json
import random
import re
import shlex
from collections import Counter
from pathlib import Path

import pytest

from testbed.elastic_fuzz import EXIT_ABORT, fuzz_case, run_case
from testbed.launch import (
    fake_slurm_commands,
    launch_processes,
    relaunched_once,
    run_fake_slurm_each,
)

SCRIPT = "testbed.elastic_fit"
SAMPLES, EPOCHS = 192, 3  # as in the script


def check_exits(result, done: dict[int, Path], out: str) -> None:
    """Each process ``i`` of ``done`` (launch index -> its results file) exited with 0 after
    writing its results (a signal, the abort at exit included, is a failure: issue 48)."""
    failed = [i for i in done if result.returncodes[i] != 0 or not done[i].exists()]
    errors = [line for line in result.stdout.splitlines()  # "[rank1]: RuntimeError: ..."
              if any(re.match(rf"\[rank{i}\]: [\w.]+: ", line) for i in failed)]
    assert not failed, (result.returncodes, errors[-6:], out)
    assert EXIT_ABORT not in result.stdout, out


def check_epoch_values(done: list[dict], samples: int = SAMPLES) -> None:
    """The last epoch's training values, reduced over the live ranks at its end, are the same
    on every rank: ``train_samples`` (a ``sync_dist`` sum) counts every sample once, and the
    torchmetrics ``train_mean`` agrees (a rank without a batch took part in both)."""
    assert [d["train_samples"] for d in done] == [samples] * len(done), done
    assert len({d["train_mean"] for d in done}) == 1, done


def check_each_sample_once(out: Path, ranks: int) -> None:
    """In every epoch every sample was trained exactly once among the processes that wrote the
    slots' records (a victim's batches before its loss and its replacement's included)."""
    for epoch in range(EPOCHS):
        seen = Counter(i for r in range(ranks) for rec in trained(out, r)
                       if rec["epoch"] == epoch for i in rec["idx"])
        assert set(seen) == set(range(SAMPLES)), (epoch, sorted(set(range(SAMPLES)) - set(seen)))
        assert max(seen.values()) == 1, (epoch, [i for i, n in seen.items() if n > 1])


def live_learners(out: Path) -> list[float]:
    """The ``gossip/live_learners`` values rank 0's CSV logger saw, in order."""
    with open(out / "logs" / "version_0" / "metrics.csv") as f:
        return [float(row["gossip/live_learners"]) for row in csv.DictReader(f)
                if row.get("gossip/live_learners")]


def trained(out: Path, rank: int) -> list[dict]:
    path = out / f"rank{rank}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.multiprocess
@pytest.mark.parametrize("strategy", ["adpsgd", "dpsgd"])
def test_survives_a_rank_killed_mid_epoch(tmp_path: Path, strategy: str) -> None:
    """``dpsgd``: the survivors' topology is rebuilt over them at a step they agree on, and
    they leave every epoch at the same step (the rounds a rank ran past the shared cursor's
    end are gossip-only)."""
    victim, ranks = 2, 4
    # batch 3: a rank slowed by a loaded machine may claim fewer than 7 batches of epoch 0
    result = run_fake_slurm_each(SCRIPT, str(tmp_path), str(victim), "3", ntasks=ranks,
                                 timeout=300, env={"ELASTIC_FIT_STRATEGY": strategy})
    survivors = [r for r in range(ranks) if r != victim]
    out = result.stdout[-6000:]
    assert result.returncodes[victim] == -9, out
    check_exits(result, {r: tmp_path / f"done{r}.json" for r in survivors}, out)
    assert "elastic fit: rank(s) 2 lost" in result.stdout, out
    check_each_sample_once(tmp_path, ranks)
    victim_batches = trained(tmp_path, victim)
    assert len(victim_batches) == 3 and {rec["epoch"] for rec in victim_batches} == {0}
    done = [json.loads((tmp_path / f"done{r}.json").read_text()) for r in survivors]
    assert all(d["losses"] == [[victim]] for d in done), done
    assert len({round(d["sum"], 5) for d in done}) == 1, done
    check_epoch_values(done)
    live = live_learners(tmp_path)
    assert live == [4.0, 3.0], live
    assert (tmp_path / "ckpts" / "last.ckpt").exists()


@pytest.mark.multiprocess
@pytest.mark.parametrize(("strategy", "nodes"), [
    ("adpsgd", 2), ("dpsgd", 2), *(pytest.param(s, 3, marks=pytest.mark.slow)
                                   for s in ("adpsgd", "dpsgd"))])
def test_a_hierarchical_fit_goes_on_without_the_node_of_a_lost_rank(
        tmp_path: Path, strategy: str, nodes: int) -> None:
    """``hierarchical=True`` on 2 (``make test-slow``: 3) nodes of 2 ranks, as ``srun`` starts
    them: rank 3 is killed, its node-mate 2 learns that its node left and exits
    (RankExcluded), and node 0 goes on (3 nodes: nodes 0 and 2 go on gossiping over new column
    groups, ``dpsgd`` from a step they agree on); node 1's untrained claims came back (every
    sample once per epoch), Lightning's collectives ran over the live ranks. (4 processes in
    ``make test``: 6 beside the suite's other workers starved the heartbeats of
    timing-sensitive tests.)"""
    ranks = 2 * nodes
    result = run_fake_slurm_each(SCRIPT, str(tmp_path), "3", "3", ntasks=ranks, nodes=nodes,
                                 timeout=300, env={"ELASTIC_FIT_NODES": str(nodes),
                                                   "ELASTIC_FIT_STRATEGY": strategy})
    out, survivors = result.stdout[-8000:], [r for r in range(ranks) if r not in (2, 3)]
    assert result.returncodes[3] == -9 and result.returncodes[2] == 1, (result.returncodes, out)
    assert "RankExcluded: rank 2: rank(s) 3 of its node were lost" in result.stdout, out
    check_exits(result, {r: tmp_path / f"done{r}.json" for r in survivors}, out)
    assert "elastic fit: rank(s) 2, 3 lost" in result.stdout, out
    check_each_sample_once(tmp_path, ranks)
    assert {rec["epoch"] for r in (2, 3) for rec in trained(tmp_path, r)} == {0}
    done = [json.loads((tmp_path / f"done{r}.json").read_text()) for r in survivors]
    assert all(d["losses"] == [[2, 3]] for d in done), done
    assert len({round(d["sum"], 5) for d in done}) == 1, done
    if nodes > 2:  # the engine over nodes 0 and 2 (one node left: no gossip)
        assert all(d["exchanges"] > 0 for d in done), done
    check_epoch_values(done)
    assert live_learners(tmp_path) == [float(ranks), float(ranks - 2)]
    assert (tmp_path / "ckpts" / "last.ckpt").exists()


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
@pytest.mark.parametrize(("strategy", "victims"), [("adpsgd", (2,)), ("adpsgd", (2, 3)),
                                                   ("dpsgd", (2, 3))])
def test_a_replacement_takes_the_lost_ranks_slot_and_trains(
        tmp_path: Path, strategy: str, victims: tuple[int, ...]) -> None:
    """Rank 2 (or ranks 2 and 3, at the same batch) is killed mid-epoch; once the survivors
    went on, a replacement is started with the last victim's environment (as ``srun``
    relaunching the task would): it is admitted at the survivors' next step boundary
    (``dpsgd``: the next multiple of ``JOIN_CHECK_EVERY``, every member at the same step, the
    topology rebuilt over the new members), resumes from the lowest survivor's state (the
    survivors' exact average), takes batches from the shared cursor, and all finish every epoch
    with the same final replica; every sample is trained once per epoch among all processes.
    With two victims the fit goes on with slot 2 free after the join (the newcomer's default
    group numbers the ranks 0, 1, 3 from 0).

    A newcomer admitted as the shared cursor runs out trains no batch in that epoch: it
    validates late with the members (``Phases.end_epoch``). Before that fix the fit ended with
    a collective mismatch in 2 of 7 runs."""
    ranks, slot = 4, victims[-1]
    # 1 s steps: the fit lasts while the replacement starts
    commands = fake_slurm_commands(SCRIPT, str(tmp_path), ",".join(map(str, victims)), "3",
                                   ntasks=ranks, env={"ELASTIC_FIT_STEP_S": "1.0",
                                                      "ELASTIC_FIT_STRATEGY": strategy})
    commands.append(relaunched_once(commands[slot], tmp_path / "recovered"))
    result = launch_processes(commands, timeout=300)
    out = result.stdout[-8000:]
    assert not result.timed_out, out
    assert [result.returncodes[v] for v in victims] == [-9] * len(victims), (
        result.returncodes, out)
    # launch 4 is the replacement, whose results are the slot's
    live = [r for r in range(ranks) if r not in victims or r == slot]
    results = {i: tmp_path / f"done{slot if i == 4 else i}.json"
               for i in (*[r for r in live if r != slot], 4)}
    check_exits(result, results, out)
    assert f"elastic fit: rank(s) {slot} joined at step" in result.stdout, out
    check_each_sample_once(tmp_path, ranks)
    done = {r: json.loads((tmp_path / f"done{r}.json").read_text()) for r in live}
    assert done[slot]["joined"] and not done[0]["joined"], done
    lost_at = json.loads((tmp_path / "victim.json").read_text())["t"]
    assert any(rec["t"] > lost_at for rec in trained(tmp_path, slot))  # the replacement's
    assert all(d["joins"] and d["joins"][0][0] == [slot] for r, d in done.items()
               if r != slot), done
    assert len({round(d["sum"], 5) for d in done.values()}) == 1, done
    check_epoch_values(list(done.values()))
    learners = live_learners(tmp_path)
    # two victims may be found in one agreement or in two (they die a step apart)
    assert learners[0] == 4 and learners[-1] == len(live), learners
    assert min(learners) == ranks - len(victims), learners


@pytest.mark.multiprocess
def test_a_join_asked_while_members_wait_at_the_epochs_end_is_admitted(tmp_path: Path) -> None:
    """``adpsgd``: rank 2 is killed in epoch 0; in epoch 1 rank 1 pauses 15 s in a batch, so
    ranks 0 and 3 run out of batches and wait for it at the epoch's end, and the replacement of
    rank 2 asks to join during the pause. A member that has arrived at its epoch's end must not
    begin the admission (the others may have gone on to the epoch's meetings: the SLURM hang of
    5 Dec 2026); rank 1, still training, begins it at its next step boundary and the arrived
    members take part. All four finish every epoch; the join came in epoch 1; every sample once
    per epoch among all processes; the same final replica."""
    victim, ranks, pause_s = 2, 4, 20
    commands = fake_slurm_commands(SCRIPT, str(tmp_path), str(victim), "3", ntasks=ranks,
                                   env={"ELASTIC_FIT_PAUSE": f"1,1,5,{pause_s}"})
    commands.append(relaunched_once(commands[victim], tmp_path / "paused"))
    result = launch_processes(commands, timeout=300)
    out = result.stdout[-8000:]
    assert not result.timed_out, out
    assert result.returncodes[victim] == -9, (result.returncodes, out)
    check_exits(result, {i: tmp_path / f"done{victim if i == 4 else i}.json" for i in (0, 1, 3, 4)},
                out)
    paused = float((tmp_path / "paused").read_text())
    joined = [rec["t"] for rec in trained(tmp_path, victim)
              if rec["t"] > json.loads((tmp_path / "victim.json").read_text())["t"]]
    assert joined and min(joined) > paused, (joined, paused)  # the replacement came at the pause
    check_each_sample_once(tmp_path, ranks)
    done = [json.loads((tmp_path / f"done{r}.json").read_text()) for r in range(ranks)]
    assert all(d["joins"] and d["joins"][0][0] == [victim] for r, d in enumerate(done)
               if r != victim), done
    # no member began the admission while rank 1 paused (ranks 0 and 3 waited at the end)
    began = min(d["joins"][0][3] for r, d in enumerate(done) if r != victim)
    assert began > paused + pause_s - 1, (began - paused, done)
    assert len({round(d["sum"], 5) for d in done}) == 1, done
    check_epoch_values(done)


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


@pytest.mark.multiprocess
def test_a_frozen_rank_that_wakes_up_learns_it_was_left_behind(tmp_path: Path) -> None:
    """Rank 1 freezes (``SIGSTOP``) mid-epoch; after the survivors' recovery the lowest one
    wakes it up (``SIGCONT``). It must not rejoin through the old groups nor wait for a peer
    that went on without it: it fails with ``RankExcluded`` within seconds (exit status 1,
    never a signal: its gossip waits abandoned on the others do not abort its exit), and the
    survivors finish (0), every sample once among them."""
    result = run_case(tmp_path, {"ranks": 3, "victim": 1, "kind": "cont", "epoch": 0,
                                 "batch": 8})
    assert result["finished"] and not result["hang"], result
    assert result["codes"] == [0, 1, 0] and result["statuses_ok"], result
    assert result["aborts"] == 0, result
    log = (tmp_path / "log.txt").read_text()  # noticed at a step boundary or in a gossip wait
    assert "lightning_gossip.errors.RankExcluded: rank 1 " in log, result
    assert "counted this rank lost" in log, result
    assert result["once"] and result["same_replica"] and result["orphans"] == [], result


@pytest.mark.multiprocess
def test_the_loss_of_the_store_host_falls_back_to_the_emergency_checkpoint(tmp_path: Path) -> None:
    """Rank 0 hosts the rendezvous store (Lightning's launcher, ``srun``): its loss is not
    survivable, so the survivors do what a non-elastic fit does (docs/faults.md): name the
    store's host, write the emergency checkpoint and fail, rather than hang."""
    result = run_fake_slurm_each(SCRIPT, str(tmp_path), "0", "6", ntasks=3, timeout=300)
    out = result.stdout[-6000:]
    assert result.returncodes == [-9, 1, 1], (result.returncodes, out)
    assert "the rendezvous store hosted by rank 0 is unreachable" in result.stdout, out
    assert list((tmp_path / "ckpts").glob("emergency-*.ckpt")), out
    assert not (tmp_path / "done1.json").exists()


@pytest.mark.slow
@pytest.mark.multiprocess
def test_fuzzed_losses_every_fit_finishes(tmp_path: Path) -> None:
    """``make test-slow``: 8 seeded cases of ``testbed.elastic_fuzz`` (3-4 ranks, a random
    victim other than rank 0, killed or frozen, epoch 0 or 1, batch 1-10, ``adpsgd`` or
    ``dpsgd``; a quarter of them two of 4 ranks killed at the same batch): every process ends
    with the status it must have (a survivor 0, a killed victim -9, a woken one 1), no abort at
    exit, no hang, no orphan, every sample once per epoch, the same final replica."""
    rng = random.Random(31)
    for i in range(8):
        case = fuzz_case(rng, ("adpsgd", "dpsgd"), pairs=0.25)
        out = tmp_path / f"run{i}"
        result = run_case(out, case)
        assert result["finished"] and not result["hang"], (result,
                                                           (out / "log.txt").read_text()[-4000:])
        assert result["orphans"] == [] and result["once"] and result["same_replica"], result
        assert result["statuses_ok"] and result["aborts"] == 0, result


@pytest.mark.slow
@pytest.mark.multiprocess
def test_fuzzed_node_losses_every_hierarchical_fit_finishes(tmp_path: Path) -> None:
    """``make test-slow``: 8 seeded cases of ``testbed.elastic_fuzz --nodes`` (hierarchical
    ``adpsgd`` and ``dpsgd``, 2 and 3 nodes of 2 ranks, a random victim off node 0, killed or
    frozen): the live nodes' ranks end with 0, no hang, no orphan, every sample once per epoch,
    the same final replica."""
    rng = random.Random(32)
    for i, nodes in enumerate((2, 2, 3, 3, 3, 3, 3, 3)):
        out = tmp_path / f"run{i}"
        result = run_case(out, fuzz_case(rng, ("adpsgd", "dpsgd"), nodes=nodes))
        assert result["finished"] and result["lost"] and not result["hang"], (result,
                                                           (out / "log.txt").read_text()[-4000:])
        assert result["orphans"] == [] and result["once"] and result["same_replica"], result
        assert result["statuses_ok"] and result["aborts"] == 0, result


@pytest.mark.parametrize("name", ["ADPSGDStrategy", "DPSGDStrategy"])
def test_elastic_needs_a_heartbeat_a_topology_name_and_no_start_timeout_to_be_hierarchical(
        name: str) -> None:
    import numpy as np

    import lightning_gossip

    cls = getattr(lightning_gossip, name)
    with pytest.raises(ValueError, match=rf"{name}\(elastic=True\) needs a heartbeat_timeout"):
        cls(elastic=True, heartbeat_timeout=None)
    hierarchical = [{"start_timeout": 10.0}, {"node_allreduce": "overlapped"}]
    for options in hierarchical:
        with pytest.raises(ValueError, match=rf"{name}\(elastic=True, hierarchical=True\) is "
                                             "not supported yet"):
            cls(elastic=True, hierarchical=True, **options)
    assert cls(elastic=True, hierarchical=True).elastic
    if name == "DPSGDStrategy":  # the survivors rebuild it by name
        with pytest.raises(ValueError, match="by its name: give a name, not ndarray"):
            cls(elastic=True, topology=np.full((4, 4), 0.25))
