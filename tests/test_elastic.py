"""Elastic ``adpsgd`` and ``dpsgd`` (issue 31): a rank killed mid-epoch costs the others a few
seconds, not the fit (``testbed/elastic_fit.py``; 4 ranks started as ``srun`` starts tasks).

Checks: the survivors end with exit code 0 after every epoch; in the epoch of the loss every
sample was trained exactly once among the survivors and the victim's batches trained before
it died (its claimed, untrained batches went back to the shared cursor), in the later epochs
exactly once among the survivors; every survivor recorded the same loss, ends with the same
replica (the final average over the survivors) and rank 0's logger saw ``gossip/live_learners``
go from 4 to 3; the warning names the lost rank; validation with a ``sync_dist`` metric and
``ModelCheckpoint`` ran over the survivors (``last.ckpt`` exists). The loss of rank 0 (the
store's host) falls back to the emergency checkpoint.

The elastic tests are three files, each a few minutes of launches, so that ``make test``'s
workers (``--dist loadfile``: a file runs on one worker) share them: this one (losses),
``test_elastic_replacements.py`` (a replacement joins) and ``test_elastic_joins.py`` (a late
rank, a whole node, a rank without a batch). The checks they share are defined here."""

from __future__ import annotations

import csv
import json
import random
import re
from collections import Counter
from pathlib import Path

import pytest

from testbed.elastic_fuzz import EXIT_ABORT, fuzz_case, run_case
from testbed.launch import run_fake_slurm_each

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
