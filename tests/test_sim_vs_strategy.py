"""The simulator reproduces the real DPSGDStrategy step by step (4 gloo ranks, fp32 tolerance).

One torchrun launch runs every case (tests/scripts/sim_strategy_cases.py); each rank records its
weights after every optimizer step. The simulator starts from the recorded post-offset weights,
is fed each rank's minibatches in the same order and must land on the same weights.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from lightning_gossip.sim import DPSGDSimulator
from testbed.launch import ROOT, check, read_rank_results, run_torchrun
from tests.scripts import sim_strategy_cases as cases_mod

pytestmark = pytest.mark.multiprocess

WORLD = 4
CASES = {
    # lr = 0: pure mixing of rank-dependent replicas on the randomized ring
    "mix_random_ring": dict(topology="random_ring", seed=3, lr=0.0, offset=0.5, steps=6,
                            batch_size=4),
    # a real gradient, overlapped form (the default), time-varying topology, SGD with momentum
    "grad_random_ring_overlap": dict(topology="random_ring", seed=7, lr=0.2, momentum=0.9,
                                     offset=0.3, steps=6, batch_size=4),
    # a real gradient, blocking form, fixed ring
    "grad_ring_blocking": dict(topology="ring", seed=0, lr=0.2, offset=0.3, steps=6,
                               batch_size=4, overlap=False),
    # a real gradient with the delay-by-one exchange
    "grad_exponential_delay": dict(topology="exponential", seed=1, lr=0.2, offset=0.3, steps=6,
                                   batch_size=4, delay_by_one=True),
}


@pytest.fixture(scope="module")
def strategy_runs(tmp_path_factory):
    pytest.importorskip("lightning_gossip.strategies.dpsgd")
    out = tmp_path_factory.mktemp("sim_vs_strategy")
    cases_file = out / "cases.json"
    cases_file.write_text(json.dumps(CASES))
    check(run_torchrun(ROOT / "tests/scripts/sim_strategy_cases.py", str(out), str(cases_file),
                       nprocs=WORLD, timeout=300))
    return {name: read_rank_results(out / name, WORLD) for name in CASES}


def _flat(named: dict[str, list], names: list[str]) -> np.ndarray:
    return np.concatenate([np.asarray(named[k], dtype=np.float64) for k in names])


@pytest.mark.parametrize("name", list(CASES))
def test_simulator_matches_strategy(strategy_runs, name):
    case = CASES[name]
    ranks = strategy_runs[name]
    steps, bs = case["steps"], case["batch_size"]
    assert all(len(r["steps"]) == steps for r in ranks)
    net = cases_mod.make_net(case["seed"])
    names = list(net.state_dict())  # the simulator's flat layout: parameters in state_dict order
    sim = DPSGDSimulator(
        net, torch.nn.functional.cross_entropy, case["topology"], WORLD, lr=case["lr"],
        momentum=case.get("momentum", 0.0), seed=case["seed"],
        overlap=case.get("overlap", True), delay_by_one=case.get("delay_by_one", False),
    )
    x0 = np.stack([_flat(r["x0"], names) for r in ranks])
    sim.set_replicas(torch.as_tensor(x0, dtype=torch.float32))
    data = [cases_mod.rank_data(r, steps, bs) for r in range(WORLD)]
    xs = torch.stack([d[0].view(steps, bs, -1) for d in data], 1)  # (steps, n, B, IN)
    ys = torch.stack([d[1].view(steps, bs) for d in data], 1)
    if case["lr"] == 0.0:
        assert np.ptp(x0, axis=0).max() > 0.1  # the replicas really disagree
    for t in range(steps):
        sim.step(xs[t], ys[t])
        real = np.stack([_flat(r["steps"][t], names) for r in ranks])
        np.testing.assert_allclose(sim.replicas.double().numpy(), real, rtol=1e-5, atol=2e-6,
                                   err_msg=f"{name}: step {t}")
    moved = np.abs(np.stack([_flat(r["steps"][-1], names) for r in ranks]) - x0).max()
    assert moved > 1e-3  # something happened


def test_lr0_mixing_is_the_matrix_product(strategy_runs):
    """Independent of the simulator: with lr = 0, rank weights follow prod_t W_t @ X0."""
    from lightning_gossip.topology import build

    case = CASES["mix_random_ring"]
    ranks = strategy_runs["mix_random_ring"]
    names = list(cases_mod.make_net(case["seed"]).state_dict())
    x = np.stack([_flat(r["x0"], names) for r in ranks])
    topo = build(case["topology"], WORLD, case["seed"])
    for t in range(case["steps"]):
        x = topo.mixing_matrix(t) @ x
        real = np.stack([_flat(r["steps"][t], names) for r in ranks])
        np.testing.assert_allclose(real, x, rtol=1e-5, atol=2e-6)
