"""The dpsgd hot path: no collective on the world group inside a training step, SIGTERM stops
every rank at the same step (agreed through the gossip messages), and the communication thread
that finishes the rounds.

The multi-process cases launch ``tests/scripts/hot_path_ranks.py`` with torchrun (real gloo
ranks); the counting there wraps ``torch.distributed``'s functions without changing them.
"""

from __future__ import annotations

import json
import threading
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from lightning_gossip.exchange import CommWorker, GossipTimeout, NonFiniteFromPeer
from lightning_gossip.hierarchy import NodeLayout
from lightning_gossip.strategies.dpsgd_rounds import _RoundsMixin
from lightning_gossip.topology import build
from tests.launch import ROOT, base_env, free_port, launch_processes, torchrun_command

SCRIPT = ROOT / "tests/scripts/hot_path_ranks.py"


# ----------------------------------------------------------------------------------------------
# The agreed stop step (pure: the topology at every step)
# ----------------------------------------------------------------------------------------------
class _Rounds(_RoundsMixin):
    def __init__(self, topology: str, n: int, delay_by_one: bool = False, devices: int = 1,
                 seed: int = 0) -> None:
        self.world_size = n
        self.delay_by_one = delay_by_one
        self.topology = build(topology, n // devices, seed)
        self.layout = NodeLayout(n // devices, devices, 0, 0)


def _spread(r: _Rounds, rank: int, first: int) -> int:
    """Message-level replay: every rank's known value, round by round; the first step at whose
    batch start every rank knows it."""
    n, lag = r.world_size, r._rounds_lag()
    knows_after: dict[int, int] = {rank: first - lag}
    t = first
    while len(knows_after) < n:
        senders = {i for i, k in knows_after.items() if k + lag <= t}
        for i in senders:
            for j in r._stop_peers(i, t)[0]:
                knows_after.setdefault(j, t)
        t += 1
    return max(knows_after.values()) + lag


@pytest.mark.parametrize("topology,n,delay,devices", [
    ("ring", 4, False, 1), ("ring", 6, True, 1), ("random_ring", 8, False, 1),
    ("random_ring", 8, True, 1), ("exponential", 8, False, 1), ("ring", 8, False, 2),
])
def test_stop_step_reaches_every_rank_in_time(topology, n, delay, devices):
    r = _Rounds(topology, n, delay, devices)
    lag = 2 if delay else 1
    for rank in range(n):
        for first in (0, 3, 17):
            s = r.stop_step_for(rank, first)
            assert s == _spread(r, rank, first)
            assert first + lag <= s <= first + lag * (n - 1)


def test_stop_step_on_a_ring_of_four():
    r = _Rounds("ring", 4)
    assert r.stop_step_for(1, 3) == 5  # ranks 0 and 2 hear it in round 3, rank 3 in round 4
    assert _Rounds("ring", 4, delay_by_one=True).stop_step_for(1, 3) == 7


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
    ("ring-overlap", 4, {"topology": "ring"}, 1, 3, 5),
    ("random-ring-delay-by-one", 3, {"delay_by_one": True}, 2, 4, None),
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
        r = _Rounds("random_ring", n, delay_by_one=True)
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
