"""The AD-PSGD engine alone (no Lightning) on a real gloo group of 2 ranks.

One launch runs every case (:func:`engine_cases`); the tests below check what each rank
reported. With no local learning between steps (lr = 0) the protocol must conserve the sum of
the two replicas to fp32 rounding, and one complete pairwise average makes them equal.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_gossip.async_gossip import AsyncGossip, GossipStats
from lightning_gossip.flat import FlatState
from lightning_gossip.pairing import Pairing
from tests.scripts.engine_ranks import spawn_ranks

pytestmark = pytest.mark.multiprocess

WORLD = 2
STEPS, PHASES = 5, 2
TIMEOUT = timedelta(seconds=60)
# (name, AsyncGossip keywords) of the conserving cases
CASES = {
    "plain": dict(max_staleness=None),
    "delay_by_one": dict(max_staleness=None, delay_by_one=True),
    "staleness0": dict(max_staleness=0),
    "staleness0_delay_by_one": dict(max_staleness=0, delay_by_one=True),
    "default": dict(),
}


def _replica(rank: int) -> tuple[nn.Module, FlatState]:
    """A small model whose values differ by rank (far apart, so averaging is visible)."""
    model = nn.Sequential(nn.Linear(6, 4), nn.BatchNorm1d(4))
    g = torch.Generator().manual_seed(100 + rank)
    with torch.no_grad():
        for t in FlatState(model).tensors:
            t.copy_(torch.randn(t.shape, generator=g) * (1 + rank) + 3.0 * rank)
    return model, FlatState(model)


def _gossip_threads(rank: int) -> int:
    return sum(t.name == f"lightning-gossip-{rank}" and t.is_alive()
               for t in threading.enumerate())


def _engine(flat: FlatState, rank: int, world: int, **kwargs) -> AsyncGossip:
    # Fresh groups per engine: a thread left in a receive cannot see another case's messages.
    control = dist.new_group(backend="gloo", timeout=TIMEOUT)
    data = dist.new_group(backend="gloo", timeout=TIMEOUT)
    return AsyncGossip(flat, rank, Pairing("ring", world), control_group=control,
                       data_group=data, timeout=TIMEOUT, **kwargs)


def _conserving_case(rank: int, world: int, kwargs: dict) -> dict:
    _, flat = _replica(rank)
    x0 = flat.pack().clone()
    engine = _engine(flat, rank, world, **kwargs)
    engine.start()
    in_phase = []
    for _ in range(PHASES):
        dist.barrier()  # all ranks open a phase together, as the strategy does
        engine.before_step(0)  # opens the phase (the later steps' before_step: no-ops)
        in_phase.append(engine.in_phase)
        for t in range(STEPS):
            engine.before_step(t)
            engine.after_step(t)  # lr = 0: nothing changes locally between boundaries
        engine.quiesce()
        in_phase.append(engine.in_phase)
    engine.close()
    assert isinstance(engine.stats, GossipStats)
    return {"x0": x0.tolist(), "x": flat.pack().tolist(), "stats": vars(engine.stats),
            "in_phase": in_phase, "threads_after_stop": _gossip_threads(rank)}


def _nan_case(rank: int, world: int) -> dict:
    """Rank 1 holds NaN: rank 0's thread fails and its training thread hears of it."""
    model, flat = _replica(rank)
    if rank == 1:
        flat.copy_(torch.full((flat.numel,), float("nan")))
    engine = _engine(flat, rank, world, max_staleness=0)
    engine.start()
    dist.barrier()
    engine.before_step(0)
    error = None
    if rank == 0:
        try:
            for t in range(3):
                engine.after_step(t)  # waits for its exchange (max_staleness=0), then raises
        except RuntimeError as e:
            error = str(e)
    dist.barrier()
    engine.close()  # rank 1's thread is still in a receive: close() does not wait for it
    return {"error": error, "threads_after_stop": _gossip_threads(rank) if rank == 0 else 0}


IDLE_STEPS = 6
"""The passive's steps in the idle case, against the active's one (its bound: 1)."""


def _idle_case(rank: int, world: int) -> dict:
    """The active rank (0) steps once and then idles (as at an elastic epoch end, waiting for
    its peers); the passive (1) takes IDLE_STEPS steps with ``max_staleness=1``: each of its
    steps past the bound waits for an exchange, which only the idle active's can bring."""
    _, flat = _replica(rank)
    x0 = flat.pack().clone()
    engine = _engine(flat, rank, world, max_staleness=1)
    engine.start()
    dist.barrier()
    engine.before_step(0)
    done = torch.zeros(1)
    if rank == 0:
        engine.after_step(0)
        passive_done = dist.irecv(done, src=1)  # default group: not the gossip's
        deadline = time.monotonic() + TIMEOUT.total_seconds()
        while not passive_done.is_completed() and time.monotonic() < deadline:
            engine.idle()
            time.sleep(0.005)
    else:
        for t in range(IDLE_STEPS):
            engine.after_step(t)
        dist.send(done, dst=0)
    engine.quiesce()
    engine.close()
    return {"x0": x0.tolist(), "x": flat.pack().tolist(), "stats": vars(engine.stats)}


def engine_cases(rank: int, world: int) -> dict:
    """Every case in one launch (process start-up dominates)."""
    out = {name: _conserving_case(rank, world, kw) for name, kw in CASES.items()}
    out["nan"] = _nan_case(rank, world)
    out["idle"] = _idle_case(rank, world)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    return spawn_ranks(engine_cases, WORLD, Path(tmp_path_factory.mktemp("engine")))


@pytest.mark.parametrize("case", list(CASES))
def test_sum_conserved_and_replicas_averaged(results, case):
    r0, r1 = results[0][case], results[1][case]
    x0 = [torch.tensor(r["x0"]) for r in (r0, r1)]
    x = [torch.tensor(r["x"]) for r in (r0, r1)]
    assert float((x0[0] - x0[1]).abs().max()) > 1.0  # the replicas started far apart
    # The sum of the replicas is conserved to fp32 rounding ...
    torch.testing.assert_close(x[0] + x[1], x0[0] + x0[1], rtol=0, atol=2e-5)
    # ... and one complete pairwise average leaves both at the mean.
    mean = (x0[0] + x0[1]) / 2
    torch.testing.assert_close(x[0], mean, rtol=0, atol=2e-5)
    torch.testing.assert_close(x[1], mean, rtol=0, atol=2e-5)
    assert r0["in_phase"] == [True, False] * PHASES


@pytest.mark.parametrize("case", list(CASES))
def test_stats_and_stop(results, case):
    s0, s1 = results[0][case]["stats"], results[1][case]["stats"]
    assert s0["steps"] == s1["steps"] == STEPS * PHASES
    # every exchange is one pairwise average: both sides count it; at least one per phase
    assert PHASES <= s0["exchanges"] == s1["exchanges"] <= STEPS * PHASES
    if CASES[case].get("max_staleness", 4) == 0:
        # The active rank waits at every step until its snapshot of that step is exchanged.
        assert s0["exchanges"] == STEPS * PHASES
        assert s0["staleness_waits"] == STEPS * PHASES
        assert s0["staleness_wait_s"] > 0
    if CASES[case].get("max_staleness", 4) is None:
        assert s0["staleness_waits"] == s1["staleness_waits"] == 0
        assert s0["staleness_wait_s"] == s1["staleness_wait_s"] == 0
    assert results[0][case]["threads_after_stop"] == 0
    assert results[1][case]["threads_after_stop"] == 0


def test_error_in_the_gossip_thread_reaches_the_training_thread_naming_the_peer(results):
    error = results[0]["nan"]["error"]
    assert error is not None
    assert "rank 0: the gossip thread failed" in error
    assert "non-finite" in error and "from rank 1" in error
    assert results[0]["nan"]["threads_after_stop"] == 0


def test_an_idle_active_rank_keeps_exchanging_for_a_passive_still_stepping(results):
    """``AsyncGossip.idle`` (an elastic fit's wait at an epoch end): the passive's steps past
    its staleness bound were released by the idle active's exchanges, and the sum of the
    replicas is conserved through them."""
    s0, s1 = results[0]["idle"]["stats"], results[1]["idle"]["stats"]
    assert (s0["steps"], s1["steps"]) == (1, IDLE_STEPS)
    assert s1["staleness_waits"] >= 1  # it was held at the bound, and let go
    # One step of rank 0 leaves one snapshot: without idle() one exchange, covering at most
    # the passive's first steps, and its later steps would wait until the timeout.
    assert s0["exchanges"] == s1["exchanges"] >= 2
    x0 = [torch.tensor(results[r]["idle"]["x0"]) for r in (0, 1)]
    x = [torch.tensor(results[r]["idle"]["x"]) for r in (0, 1)]
    torch.testing.assert_close(x[0] + x[1], x0[0] + x0[1], rtol=0, atol=2e-5)
