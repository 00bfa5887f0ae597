"""The in-process simulator: exact D-PSGD updates, AD-PSGD invariants, determinism, scale."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from lightning_gossip import topology
from lightning_gossip.sim import (
    ADPSGDSimulator,
    ComputeModel,
    DataShards,
    DPSGDSimulator,
    Mixer,
    digits_problem,
    run_adpsgd,
    run_dpsgd,
)

slow = pytest.mark.slow


def _linear(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))


def _batches(n: int, t: int, b: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(t)
    return torch.randn(n, b, 3, generator=g), torch.randn(n, b, 2, generator=g)


@pytest.mark.parametrize("name", sorted(topology.TOPOLOGIES))
@pytest.mark.parametrize("n", [4, 9, 16])
def test_mixer_equals_dense_matrix(name, n):
    topo = topology.build(name, n, seed=5)
    mixer = Mixer(topo, dtype=torch.float64)
    x = torch.randn(n, 7, dtype=torch.float64)
    for t in range(3):
        np.testing.assert_allclose(mixer.mix(x, t).numpy(), topo.mixing_matrix(t) @ x.numpy(),
                                   atol=1e-12)


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_dpsgd_step_is_the_documented_update(overlap, momentum):
    """Replay the update with torch.optim.SGD per learner and the dense W_t in NumPy."""
    n, lr = 6, 0.3
    topo = topology.build("random_ring", n, seed=2)
    sim = DPSGDSimulator(_linear(), nn.functional.mse_loss, topo, n, lr=lr, momentum=momentum,
                         overlap=overlap)
    start = torch.randn(n, sim.replicas.shape[1]) * 0.5
    sim.set_replicas(start)
    models = [_linear() for _ in range(n)]
    opts = [torch.optim.SGD(m.parameters(), lr=lr, momentum=momentum) for m in models]
    for i, m in enumerate(models):
        torch.nn.utils.vector_to_parameters(start[i].clone(), m.parameters())
    for t in range(4):
        x, y = _batches(n, t)
        sim.step(x, y)
        before = torch.stack([torch.nn.utils.parameters_to_vector(m.parameters()) for m in models])
        for i, (m, opt) in enumerate(zip(models, opts)):
            opt.zero_grad()
            nn.functional.mse_loss(m(x[i]), y[i]).backward()
            opt.step()
        after = torch.stack([torch.nn.utils.parameters_to_vector(m.parameters()) for m in models])
        w = torch.as_tensor(topo.mixing_matrix(t), dtype=torch.float32)
        new = after + (w @ before - before) if overlap else w @ after
        for i, m in enumerate(models):
            torch.nn.utils.vector_to_parameters(new[i].detach().clone(), m.parameters())
        torch.testing.assert_close(sim.replicas, new.detach(), rtol=1e-5, atol=1e-6)


def test_delay_by_one_applies_last_steps_mixing():
    n = 5
    sim = DPSGDSimulator(_linear(), nn.functional.mse_loss, "ring", n, lr=0.0, delay_by_one=True)
    x0 = torch.randn(n, sim.replicas.shape[1])
    sim.set_replicas(x0)
    w = torch.as_tensor(topology.build("ring", n).mixing_matrix(0), dtype=torch.float32)
    sim.step(*_batches(n, 0))
    torch.testing.assert_close(sim.replicas, x0)  # nothing from step -1
    sim.step(*_batches(n, 1))
    torch.testing.assert_close(sim.replicas, w @ x0)  # step 0's change, computed from x0
    sim.quiesce()
    torch.testing.assert_close(sim.replicas, w @ x0 + (w @ x0 - x0), rtol=1e-5, atol=1e-6)


def test_lr0_dpsgd_is_the_matrix_product_and_keeps_the_mean():
    n = 8
    sim = DPSGDSimulator(_linear(), nn.functional.mse_loss, "one_peer_exponential", n, lr=0.0)
    x0 = torch.randn(n, sim.replicas.shape[1], dtype=torch.float32)
    sim.set_replicas(x0)
    for t in range(3):
        sim.step(*_batches(n, t))
    # a power-of-two one-peer exponential graph averages exactly in log2(n) steps
    torch.testing.assert_close(sim.replicas, x0.mean(0).expand_as(x0), rtol=1e-5, atol=1e-6)


def test_buffers_are_mixed():
    class WithBuffer(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 2)
            self.register_buffer("scale", torch.ones(2))

        def forward(self, x):
            return self.lin(x) * self.scale

    n = 4
    sim = DPSGDSimulator(WithBuffer(), nn.functional.mse_loss, "ring", n, lr=0.1)
    sim.buffers = torch.arange(n, dtype=torch.float32)[:, None].repeat(1, 2)
    sim.step(*_batches(n, 0))
    w = torch.as_tensor(topology.build("ring", n).mixing_matrix(0), dtype=torch.float32)
    torch.testing.assert_close(sim.buffers[:, 0], w @ torch.arange(n, dtype=torch.float32))
    assert set(sim.state_dict(1)) == {"lin.weight", "lin.bias", "scale"}


def test_batchnorm_is_rejected_with_a_clear_error():
    with pytest.raises(ValueError, match="BatchNorm"):
        DPSGDSimulator(nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3)),
                       nn.functional.mse_loss, "ring", 4)


@pytest.mark.parametrize("kwargs, match", [
    (dict(world_size=0), "world_size"),
    (dict(world_size=4, lr=-1.0), "lr"),
    (dict(world_size=5, topology="torus"), "torus"),
    (dict(world_size=4, topology="nope"), "unknown topology"),
])
def test_bad_arguments(kwargs, match):
    kwargs = {"topology": "ring", **kwargs}
    with pytest.raises(ValueError, match=match):
        DPSGDSimulator(_linear(), nn.functional.mse_loss, **kwargs)


def test_wrong_batch_shape():
    sim = DPSGDSimulator(_linear(), nn.functional.mse_loss, "ring", 4)
    with pytest.raises(ValueError, match="one minibatch per learner"):
        sim.step(*_batches(3, 0))


# steps an exchange stays in flight: 0 (atomic), 1 (default: overlapped), 2 (delay_by_one)
IN_FLIGHT = {0: dict(overlap=False), 1: {}, 2: dict(delay_by_one=True)}


@pytest.mark.parametrize("delay", [0, 1, 2])
@pytest.mark.parametrize("pairing", ["ring", "random"])
def test_adpsgd_conserves_the_sum_at_lr0(delay, pairing):
    n = 7
    compute = ComputeModel.with_slow(n, slow=2, slow_factor=2.5, jitter=0.3, seed=1)
    sim = ADPSGDSimulator(_linear(), nn.functional.mse_loss, n, lr=0.0, pairing=pairing,
                          compute=compute, seed=3, **IN_FLIGHT[delay])
    assert sim.steps_in_flight == delay
    x0 = torch.randn(n, sim.replicas.shape[1], dtype=torch.float32)
    sim.set_replicas(x0)
    spread0 = float(sim.absolute_consensus_distance())

    def batches(ranks, steps):
        return _batches(len(ranks), 0)

    sim.run_until(40.0, batches)
    torch.testing.assert_close(sim.replicas.sum(0), x0.sum(0), rtol=1e-5, atol=1e-5)
    assert float(sim.absolute_consensus_distance()) < 0.05 * spread0
    assert sim.exchanges[list(sim.pairing.passives)].sum() == 0  # only actives start exchanges
    assert sim.local_steps[-1] < sim.local_steps[0]  # slow learners did fewer steps


def test_adpsgd_staleness_comes_from_slow_learners():
    n = 8
    lockstep = ADPSGDSimulator(_linear(), nn.functional.mse_loss, n, lr=0.1, overlap=False,
                               pairing="random")
    lockstep.run_until(6.0, lambda r, s: _batches(len(r), int(s[0])))
    assert lockstep.mean_staleness == 0.0  # all averages land at step boundaries
    slow_passive = ComputeModel.with_slow(n, slow=1, slow_factor=3.0)  # rank 7 is passive
    sim = ADPSGDSimulator(_linear(), nn.functional.mse_loss, n, lr=0.1, overlap=False,
                          compute=slow_passive, pairing="ring")
    sim.run_until(6.0, lambda r, s: _batches(len(r), int(s[0])))
    # rank 7 is averaged by rank 0 (partners 7, 1, 7, ...) during each of its 3-unit steps
    assert sim.staleness_sum > 0 and sim.mean_staleness < 1


def test_adpsgd_uses_the_shared_pairing():
    n = 6
    sim = ADPSGDSimulator(_linear(), nn.functional.mse_loss, n, lr=0.0, pairing="ring",
                          overlap=False)
    x0 = torch.zeros(n, sim.replicas.shape[1])
    x0[1] = 6.0  # only rank 1 (passive) holds mass; rank 0 talks to 5 then 1 (ring pairing)
    sim.set_replicas(x0)
    sim.run_until(1.0, lambda r, s: _batches(len(r), 0))
    assert sim.pairing.partner(0, 0) == 5 and sim.pairing.partner(2, 0) == 1
    # at t = 1: rank 0 averaged with 5 (both 0), rank 2 with 1, rank 4 with 3
    torch.testing.assert_close(sim.replicas[:, 0], torch.tensor([0, 3, 3, 0, 0, 0.0]))


def test_runs_are_deterministic_for_a_seed():
    model, loss_fn, x, y = digits_problem(hidden=8, seed=1)
    shards = DataShards(x, y, 12, batch_size=4, seed=1)
    compute = ComputeModel.with_slow(12, slow=1, slow_factor=3.0, jitter=0.2, seed=1)
    a = [run_dpsgd(model, loss_fn, shards, (x, y), "random_ring", 6, 0.3, seed=1,
                   eval_every=3).loss for _ in range(2)]
    b = [run_adpsgd(model, loss_fn, shards, (x, y), "random", 6, 0.3, seed=1, compute=compute,
                    eval_every=3).loss for _ in range(2)]
    assert a[0] == a[1] and b[0] == b[1]
    assert a[0][-1] < a[0][0] and b[0][-1] < b[0][0]


def test_slow_learner_slows_synchronous_steps():
    model, loss_fn, x, y = digits_problem(hidden=8)
    shards = DataShards(x, y, 8, batch_size=4)
    compute = ComputeModel.with_slow(8, slow=1, slow_factor=4.0)
    sync = run_dpsgd(model, loss_fn, shards, (x, y), "ring", 12, 0.1, compute=compute,
                     eval_every=100)
    asyn = run_adpsgd(model, loss_fn, shards, (x, y), "random", 12, 0.1, compute=compute,
                      eval_every=100)
    assert sync.steps[-1] == 3  # 12 time units / 4 per synchronous step
    assert asyn.steps[-1] == pytest.approx((7 * 12 + 3) / 8)


def test_data_shards():
    x, y = torch.arange(40.0)[:, None], torch.arange(40) % 4
    iid = DataShards(x, y, 4, batch_size=3, seed=0)
    xb, yb = iid.batch(np.arange(4), np.array([0, 0, 0, 0]))
    again, _ = iid.batch(np.array([2]), np.array([0]))
    torch.testing.assert_close(xb[2], again[0])  # a function of (seed, rank, step)
    assert len(set(np.concatenate([iid.order[s:s + n] for s, n in zip(iid.starts, iid.lengths)])
                   .tolist())) == 40
    sorted_ = DataShards(x, y, 4, batch_size=50, partition="sorted")
    _, yb = sorted_.batch(np.arange(4), np.zeros(4, dtype=int))
    assert [set(r.tolist()) for r in yb] == [{0}, {1}, {2}, {3}]
    with pytest.raises(ValueError, match="partition"):
        DataShards(x, y, 4, 3, partition="nope")
    with pytest.raises(ValueError, match="learners"):
        DataShards(x, y, 41, 3)


def test_1024_learners_step():
    """Scale sanity: one synchronous step of 1,024 learners on the digits MLP (no timing)."""
    model, loss_fn, x, y = digits_problem(hidden=32)
    n = 1024
    shards = DataShards(x, y, n, batch_size=8)
    sim = DPSGDSimulator(model, loss_fn, "random_ring", n, lr=0.5)
    for t in range(2):
        sim.step(*shards.batch(np.arange(n), np.full(n, t)))
    assert sim.replicas.shape[0] == n and torch.isfinite(sim.replicas).all()
    assert float(sim.absolute_consensus_distance()) > 0
    ad = ADPSGDSimulator(model, loss_fn, n, lr=0.5, pairing="random")
    ad.run_until(1.0, shards.batch)
    assert ad.total_steps == n


@slow
def test_1024_learners_train():
    model, loss_fn, x, y = digits_problem(hidden=32)
    shards = DataShards(x, y, 1024, batch_size=8)
    r = run_dpsgd(model, loss_fn, shards, (x, y), "random_ring", 50, 0.5, eval_every=25)
    assert r.loss[-1] < r.loss[0]
