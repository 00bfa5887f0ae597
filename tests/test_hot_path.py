"""The dpsgd hot path: no collective on the world group inside a training step, SIGTERM stops
every rank at the same step (agreed through the gossip messages), and the communication thread
that finishes the rounds.

The multi-process cases launch ``tests/scripts/hot_path_ranks.py`` with torchrun (real gloo
ranks); the counting there wraps ``torch.distributed``'s functions without changing them.
"""

from __future__ import annotations

import json
import os
import signal
import threading
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
import torch

from lightning_gossip.errors import GossipTimeout, NonFiniteFromPeer
from lightning_gossip.exchange import CommWorker
from lightning_gossip.hierarchy import NodeLayout
from lightning_gossip.sync_gossip import StopAgreement
from lightning_gossip.topology import build
from testbed.launch import (
    ROOT,
    base_env,
    free_port,
    launch_processes,
    torchrun_command,
)

SCRIPT = ROOT / "tests/scripts/hot_path_ranks.py"


# ----------------------------------------------------------------------------------------------
# The agreed stop step (pure: the topology at every step)
# ----------------------------------------------------------------------------------------------
def _agreement(topology: str, n: int, delay_by_one: bool = False, devices: int = 1,
               seed: int = 0) -> StopAgreement:
    """The agreement of ``n`` ranks in nodes of ``devices`` (the topology over the nodes)."""
    nodes = n // devices
    return StopAgreement(build(topology, nodes, seed), NodeLayout(nodes, devices, 0, 0),
                         delay_by_one=delay_by_one)


def _spread(r: StopAgreement, rank: int, first: int) -> int:
    """Message-level replay: every rank's known value, round by round; the first step at whose
    batch start every rank knows it."""
    n, lag = r.world_size, r.lag
    knows_after: dict[int, int] = {rank: first - lag}
    t = first
    while len(knows_after) < n:
        senders = {i for i, k in knows_after.items() if k + lag <= t}
        for i in senders:
            for j in r.peers(i, t)[0]:
                knows_after.setdefault(j, t)
        t += 1
    return max(knows_after.values()) + lag


@pytest.mark.parametrize("topology,n,delay,devices", [
    ("ring", 4, False, 1), ("ring", 6, True, 1), ("random_ring", 8, False, 1),
    ("random_ring", 8, True, 1), ("exponential", 8, False, 1), ("ring", 8, False, 2),
])
def test_stop_step_reaches_every_rank_in_time(topology, n, delay, devices):
    r = _agreement(topology, n, delay, devices)
    lag = 2 if delay else 1
    for rank in range(n):
        for first in (0, 3, 17):
            s = r.stop_step_for(rank, first)
            assert s == _spread(r, rank, first)
            assert first + lag <= s <= first + lag * (n - 1)


def test_stop_step_on_a_ring_of_four():
    r = _agreement("ring", 4)
    assert r.stop_step_for(1, 3) == 5  # ranks 0 and 2 hear it in round 3, rank 3 in round 4
    assert _agreement("ring", 4, delay_by_one=True).stop_step_for(1, 3) == 7


# ----------------------------------------------------------------------------------------------
# The communication thread
# ----------------------------------------------------------------------------------------------
def test_comm_worker_runs_jobs_in_order_and_reraises_on_the_caller():
    worker = CommWorker()
    seen: list[int] = []
    gate = threading.Event()
    first = worker.submit(lambda: (gate.wait(10), seen.append(1)), (), "first")
    second = worker.submit(lambda: seen.append(2), (), "second")

    def boom() -> None:
        raise NonFiniteFromPeer(3, 0)

    third = worker.submit(boom, (3,), "third")
    with pytest.raises(GossipTimeout, match="first"):
        first.result(timedelta(seconds=0.2))
    gate.set()
    second.result(timedelta(seconds=10))
    assert seen == [1, 2]
    with pytest.raises(NonFiniteFromPeer, match="rank 3"):
        third.result(timedelta(seconds=10))
    worker.close()
    assert not worker.alive


# ----------------------------------------------------------------------------------------------
# Real ranks
# ----------------------------------------------------------------------------------------------
def _launch(tmp_path: Path, name: str, spec: dict, nprocs: int) -> list[dict]:
    out = tmp_path / name
    out.mkdir()
    path = out / "spec.json"
    path.write_text(json.dumps({**spec, "out": str(out), "devices": nprocs}))
    cmd = torchrun_command(SCRIPT, str(path), nprocs=nprocs, port=free_port())
    launched = launch_processes([(cmd, base_env())], timeout=600)
    text = launched.stdout
    assert not launched.timed_out, text[-12000:]
    assert launched.returncodes == [0], text[-12000:]
    results = []
    for r in range(nprocs):
        f = out / f"rank{r}.json"
        assert f.exists(), f"rank {r} wrote no result:\n{text[-12000:]}"
        results.append(json.loads(f.read_text()))
    results.append({"checkpoint": str(out / "on_exception.ckpt"), "output": text})
    return results


SIGTERM_CASES = [
    # (name, ranks, strategy kwargs, SIGTERM rank, after step, expected stop step)
    # (blocking rounds here, overlapped ones in the other case)
    ("ring-blocking", 4, {"topology": "ring", "overlap": False}, 1, 3, 5),
    ("random-ring-delay-by-one", 3, {"delay_by_one": True}, 2, 4, None),
    # a round every 3rd step (rounds 2, 5, 8, 11): posted from step 4 on, the proposal leaves
    # in round 8 (posted at step 6) for ranks 0 and 2, in round 11 (posted at 9) for rank 3
    ("ring-period-3", 4, {"topology": "ring", "gossip_every_n_steps": 3}, 1, 4, 12),
]


@pytest.mark.multiprocess
@pytest.mark.parametrize("name,n,kwargs,rank,step,expected", SIGTERM_CASES,
                         ids=[c[0] for c in SIGTERM_CASES])
def test_sigterm_to_one_rank_stops_every_rank_at_the_same_step(tmp_path, name, n, kwargs,
                                                                rank, step, expected):
    """SIGTERM to one rank mid-fit: every rank raises Lightning's ``SIGTERMException`` at the
    same step (no rank fails, none hangs), the ``OnExceptionCheckpoint`` holds that step, and
    no collective ran on the default group during the training steps."""
    *ranks, extra = _launch(tmp_path, name, {"strategy_kwargs": kwargs,
                                             "sigterm": {"rank": rank, "step": step}}, n)
    text = extra["output"]
    assert ranks[rank].get("sigterm_sent_at_step") == step, ranks
    if expected is None:
        r = _agreement("random_ring", n, delay_by_one=True)
        expected = r.stop_step_for(rank, step)
    for res in ranks:
        assert res["exception"] == "SIGTERMException", (res, text[-8000:])
        assert res["global_step"] == res["strategy_step"] == expected, ranks
        assert res["stop_at"] == expected, ranks
        assert res["exit_code"] in (None, 0), ranks
    ckpt = torch.load(extra["checkpoint"], map_location="cpu", weights_only=False)
    assert ckpt["global_step"] == expected
    # no collective on the world group between the first batch and the stop ...
    for res in ranks:
        assert res["default_in_steps"] == {}, ranks
        assert res["other_groups_in_steps"] > 0  # ... while the counting saw the gossip
        assert res["default_outside"] > 0  # ... and the set-up's world-group calls


@pytest.mark.slow  # make test: the SIGTERM cases count the same (blocking and overlapped)
@pytest.mark.multiprocess
def test_no_world_group_collective_during_dpsgd_steps(tmp_path):
    """Twelve blocking dpsgd steps on 2 ranks: zero calls on the default group."""
    *ranks, _ = _launch(tmp_path, "count-blocking", {
        "strategy_kwargs": {"overlap": False}, "steps": 12}, 2)
    for res in ranks:
        assert res["exception"] is None
        assert res["final_global_step"] == 12
        assert res["default_in_steps"] == {}, ranks
        assert res["other_groups_in_steps"] > 0


# ----------------------------------------------------------------------------------------------
# Sharded rounds are mixed on the communication thread (2 nodes x 2 processes, real gloo)
# ----------------------------------------------------------------------------------------------
#: The rank script: lr = 0 fits of 2 x 2 hierarchical dpsgd that record on which thread every
#: sharded round was mixed (``ShardedExchange.delta``) and on which thread and group every
#: all-gather / all-reduce ran (the wrappers call ``torch.distributed`` unchanged).
_SHARDED_SCRIPT = '''
import functools, json, os, signal, sys, threading
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_gossip.flat import FlatState
from lightning_gossip.sync_gossip.sharded import ShardedExchange
from lightning_gossip.strategies import DPSGDStrategy

CALLS = []  # [what, thread name, group label or gather flag]
CURRENT = {}


def label(group):
    s = CURRENT.get("strategy")
    groups = getattr(s, "_groups", None)
    if groups is None or group is None:
        return "other"
    if group is groups.node:
        return "node"
    if groups.node_gossip is not None and group is groups.node_gossip:
        return "node_gossip"
    return "other"


def recording(name, fn):
    @functools.wraps(fn)
    def call(*args, **kwargs):
        CALLS.append([name, threading.current_thread().name, label(kwargs.get("group"))])
        return fn(*args, **kwargs)
    return call


for _name in ("all_gather", "all_reduce", "broadcast"):
    setattr(dist, _name, recording(_name, getattr(dist, _name)))
_delta = ShardedExchange.delta


def delta(self, *args, **kwargs):
    CALLS.append(["delta", threading.current_thread().name, bool(kwargs.get("gather", True))])
    return _delta(self, *args, **kwargs)


ShardedExchange.delta = delta


class TrainingThreadGather(DPSGDStrategy):
    """What an NCCL node group does: the training thread all-gathers."""

    def _gather_on_worker(self):
        return False


class Tiny(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Linear(5, 2)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


class Record(Callback):
    def __init__(self):
        self.x0, self.steps = None, []

    def on_train_start(self, trainer, module):
        flat = FlatState(module)
        g = torch.Generator().manual_seed(1000 + trainer.node_rank)  # one replica per node
        flat.add_(torch.randn(flat.numel, generator=g))
        self.x0 = flat.pack().tolist()

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.steps.append(FlatState(module).pack().tolist())


class Freeze(Callback):
    """Rank 3 (node 1, local rank 1) stops itself (SIGSTOP) after step 2."""

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.global_rank == 3 and trainer.global_step == 2:
            os.kill(os.getpid(), signal.SIGSTOP)


def frozen(out, rank, w2):
    """A long lr = 0 fit in which rank 3 freezes: what each rank raised."""
    (out / f"pid{rank}").write_text(str(os.getpid()))
    x = torch.randn(4000, 5)
    data = TensorDataset(x, (x.sum(-1) > 0).long())
    strategy = DPSGDStrategy(hierarchical=True, topology=w2, final_average=False,
                             consensus_every_n_steps=None, timeout=600.0,
                             heartbeat_timeout=5.0)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=2, num_nodes=2,
                        max_steps=1000, callbacks=[Freeze()], logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0)
    try:
        trainer.fit(Tiny(), DataLoader(data, batch_size=4))
        error = None
    except BaseException as e:
        error = f"{type(e).__name__}: {e}"
    (out / f"frozen-rank{rank}.json").write_text(json.dumps({"error": error}))
    sys.stdout.flush()
    sys.exit(1 if error else 0)


def main():
    out = Path(sys.argv[1])
    rank = int(os.environ["RANK"])
    w2 = [[0.75, 0.25], [0.25, 0.75]]
    cases = [("worker", DPSGDStrategy, {}), ("training_gather", TrainingThreadGather, {}),
             ("blocking", DPSGDStrategy, {"overlap": False}),
             ("bf16_delay", DPSGDStrategy, {"wire_dtype": "bf16", "delay_by_one": True})]
    for name, cls, kwargs in cases:
        CALLS.clear()
        torch.manual_seed(0)
        x = torch.randn(16, 5)
        data = TensorDataset(x, (x.sum(-1) > 0).long())
        strategy = cls(hierarchical=True, topology=w2, final_average=False,
                       consensus_every_n_steps=None, timeout=300.0, **kwargs)
        CURRENT["strategy"] = strategy
        record = Record()
        trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=2, num_nodes=2,
                            max_steps=4, callbacks=[record], logger=False,
                            enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, limit_val_batches=0)
        trainer.fit(Tiny(), DataLoader(data, batch_size=4))
        result = {"x0": record.x0, "steps": record.steps, "calls": list(CALLS),
                  "comm_thread": f"lightning-gossip-comm-{rank}"}
        (out / f"{name}-rank{rank}.json").write_text(json.dumps(result))
    if sys.argv[2:] == ["freeze"]:  # last: the launch ends in it
        CALLS.clear()
        CURRENT.clear()
        frozen(out, rank, w2)


if __name__ == "__main__":
    main()
'''

SHARDED_CASES = ("worker", "training_gather", "blocking", "bf16_delay")


@pytest.fixture(scope="module")
def sharded_run(tmp_path_factory) -> tuple[Path, str]:
    """One launch of 2 torchrun nodes x 2 processes: the four lr = 0 fits, then the long fit in
    which rank 3 freezes (it ends the launch); the folder and the output."""
    out = tmp_path_factory.mktemp("sharded")
    script = out / "sharded_ranks.py"
    script.write_text(_SHARDED_SCRIPT)
    port = free_port()
    commands = [(torchrun_command(script, str(out), "freeze", nprocs=2,
                                  nnodes=2, node_rank=node, port=port), base_env())
                for node in range(2)]
    try:
        launched = launch_processes(commands, timeout=900, reap_stopped=True)
    finally:
        pid = out / "pid3"
        if pid.exists():  # a stopped rank may be outside the killed process groups
            try:
                os.kill(int(pid.read_text()), signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert not launched.timed_out, launched.stdout[-12000:]
    return out, launched.stdout


@pytest.mark.multiprocess
def test_sharded_rounds_are_mixed_on_the_communication_thread(sharded_run):
    """2 nodes x 2 processes (hierarchical, lr = 0): every sharded round is waited on, mixed
    and all-gathered on the communication thread, whose all-gathers use the node's second
    group only (the training thread keeps the node group: no group sees two threads); with
    the training thread all-gathering (the NCCL path) the replicas are bit-identical; in every
    mode the nodes' ranks stay bit-identical and the node replicas follow ``W2`` exactly."""
    folder, text = sharded_run
    nodes, devices = 2, 2
    w2 = np.array([[0.75, 0.25], [0.25, 0.75]])
    missing = [f"{name}-rank{r}" for name in SHARDED_CASES for r in range(nodes * devices)
               if not (folder / f"{name}-rank{r}.json").exists()]
    assert not missing, (missing, text[-8000:])
    runs = {name: [json.loads((folder / f"{name}-rank{r}.json").read_text())
                   for r in range(nodes * devices)]
            for name in SHARDED_CASES}
    for name, ranks in runs.items():
        for res in ranks:
            comm, calls = res["comm_thread"], res["calls"]
            deltas = [c for c in calls if c[0] == "delta"]
            assert len(deltas) >= 4 and all(c[1] == comm for c in deltas), (name, calls)
            on_node = [c for c in calls if c[2] == "node"]
            on_gossip = [c for c in calls if c[2] == "node_gossip"]
            assert all(c[1] == "MainThread" for c in on_node), (name, calls)
            gathers = [c for c in calls if c[0] == "all_gather" and c[2] != "other"]
            assert len(gathers) == len(deltas), (name, calls)
            if name == "training_gather":
                assert not on_gossip and all(c[2] is False for c in deltas), (name, calls)
                assert all(c[2] == "node" for c in gathers), (name, calls)
            else:
                assert all(c[1] == comm for c in on_gossip), (name, calls)
                assert all(c[2] == "node_gossip" for c in gathers), (name, calls)
        steps = np.array([r["steps"] for r in ranks], dtype=np.float64).transpose(1, 0, 2)
        for t, x in enumerate(steps):
            for node in range(nodes):
                mates = x[node * devices:(node + 1) * devices]
                assert (mates == mates[0]).all(), f"{name}: node {node} differs at step {t}"
        if name == "bf16_delay":
            continue
        x0 = np.array([r["x0"] for r in ranks], dtype=np.float64)[::devices]
        want = x0
        for t, x in enumerate(steps):
            want = w2 @ want
            np.testing.assert_allclose(x[::devices], want, rtol=0, atol=2e-6,
                                       err_msg=f"{name}: step {t}")
    same = [r["steps"] for r in runs["worker"]] == [r["steps"] for r in runs["training_gather"]]
    assert same, "the training thread's all-gather gave other replicas"


@pytest.mark.multiprocess
def test_frozen_peer_of_a_sharded_round_is_named(tmp_path):
    """A rank frozen (SIGSTOP) in a run of sharded rounds (a compressed wire: every round is
    finished by the communication thread) is named by the ranks that wait on it, after about
    ``heartbeat_timeout``: the job's wait watches its peers as a flat round's does."""
    from tests.test_faults import run_case

    hb = 5.0
    spec = {"strategy": "dpsgd", "strategy_kwargs": {"wire_dtype": "bf16"}, "epochs": 1000,
            "samples": 64, "heartbeat_timeout": hb, "timeout": 600,
            "fault": {"kind": "freeze", "rank": 2, "step": 3}}
    events, survivors, text = run_case(tmp_path, "freeze-dpsgd-bf16", spec, "torchrun",
                                       nprocs=3, frozen=2)
    assert not survivors, text[-8000:]
    named = [r for r in (0, 1)
             if ("error", r) in events and "rank(s) 2" in events[("error", r)]["message"]]
    assert named, text[-8000:]


@pytest.mark.multiprocess
def test_frozen_node_mate_in_sharded_rounds_is_named(sharded_run):
    """2 nodes x 2 processes (hierarchical): rank 3 freezes (SIGSTOP). A rank that waits on it
    (its node mate in the all-gather on the communication thread or the gradient all-reduce,
    its column peer in the exchange) names it after about ``heartbeat_timeout``, and the
    launch ends (no rank hangs at exit in the abandoned all-gather)."""
    folder, text = sharded_run
    errors = {r: json.loads(f.read_text())["error"]
              for r in range(3) if (f := folder / f"frozen-rank{r}.json").exists()}
    named = [r for r, e in errors.items() if e and "rank(s) 3" in e]
    assert named, (errors, text[-8000:])
    print("\nrank 3 frozen (2 x 2 hierarchical): " + "; ".join(
        f"rank {r}: {errors.get(r)}" for r in range(3)))
