"""Decent-DP as the race sets it up (``benchmarks/race/decentdp_case.py``), on real ranks.

Run by ``tests/test_race_decentdp.py`` through torchrun on 2 faked nodes of 2 ranks (gloo,
loopback)::

    torchrun --nnodes 2 --nproc-per-node 2 ... decentdp_ranks.py TOPOLOGY

1. **Mixing, exactly** (rate 0: Decent-DP's decentralized Adam changes nothing, only its
   gossip moves the replicas): the replicas are made different after the first (tracing) step;
   every later step must keep their mean (the topology's mixing is doubly stochastic) and,
   on 2x2 ranks, both ``alternating-exp-ring`` (a node average, then a global one) and
   ``ring`` (pairs in the node, then pairs across) reach the mean exactly within two steps.
2. **Training**: the same set-up at a positive rate on a regression task (each rank its own
   data) lowers the loss of the replicas' average, and the replicas stay close.

Prints ``OK topology=... mean_drift=... spread=... loss=a->b`` on rank 0.
"""

from __future__ import annotations

import functools
import sys

import torch
import torch.distributed as dist
from torch import nn

from benchmarks.race.decentdp_case import _accum_adamw


def flat(module: nn.Module) -> torch.Tensor:
    """The module's parameters, flattened (a copy)."""
    return torch.cat([p.detach().reshape(-1).clone() for p in module.parameters()])


def gathered(x: torch.Tensor, world: int) -> torch.Tensor:
    """Every rank's ``x`` (collective), stacked."""
    out = [torch.zeros_like(x) for _ in range(world)]
    dist.all_gather(out, x)
    return torch.stack(out)


def wrap(model: nn.Module, topology: str, lr: float) -> nn.Module:
    """Decent-DP around ``model`` as the race builds it (its optimizer, 2 ranks per node)."""
    from decent_dp.ddp import DecentralizedDataParallel

    return DecentralizedDataParallel(
        model, optim_fn=functools.partial(_accum_adamw, lr=lr, accum_iter=4),
        topology=topology, grad_clip_norm=5.0, _local_world_size=2)


def mixing(topology: str, rank: int, world: int) -> tuple[float, float]:
    """(largest drift of the replicas' mean, largest distance of a replica to the mean at the
    end) over 6 steps at rate 0 from different replicas."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    ddp = wrap(model, topology, lr=0.0)
    x = torch.randn(32, 8, generator=torch.Generator().manual_seed(100 + rank))
    ddp(x).pow(2).mean().backward()  # step 1: Decent-DP traces the parameters' order
    with torch.no_grad():  # different replicas (before Decent-DP copies them into its buckets)
        gen = torch.Generator().manual_seed(rank)
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen))
    start = gathered(flat(model), world).mean(0)
    drift = 0.0
    for _ in range(6):
        ddp(x).pow(2).mean().backward()  # mixes, then steps at rate 0
        replicas = gathered(flat(model), world)
        drift = max(drift, float((replicas.mean(0) - start).abs().max()))
    spread = float((replicas - replicas.mean(0)).abs().max())
    return drift, spread


def training(topology: str, rank: int, world: int) -> tuple[float, float, float]:
    """(loss of the average before, after 60 steps, largest replica distance to the mean)."""
    torch.manual_seed(0)
    model = nn.Linear(8, 1)
    ddp = wrap(model, topology, lr=0.05)
    truth = torch.randn(8, 1, generator=torch.Generator().manual_seed(7))
    gen = torch.Generator().manual_seed(200 + rank)

    def average_loss() -> float:
        mean = gathered(flat(model), world).mean(0)
        probe = torch.randn(256, 8, generator=torch.Generator().manual_seed(9))
        weight, bias = mean[:8].reshape(1, 8), mean[8:]
        return float(((probe @ weight.T + bias) - probe @ truth).pow(2).mean())

    before = average_loss()
    for _ in range(60):
        x = torch.randn(16, 8, generator=gen)
        (ddp(x) - x @ truth).pow(2).mean().backward()
    replicas = gathered(flat(model), world)
    return before, average_loss(), float((replicas - replicas.mean(0)).abs().max())


def main() -> None:
    topology = sys.argv[1]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    drift, spread = mixing(topology, rank, world)
    before, after, train_spread = training(topology, rank, world)
    if rank == 0:
        assert drift < 1e-5, f"the replicas' mean moved by {drift}"
        assert spread < 1e-5, f"the replicas did not reach their mean: {spread}"
        assert after < 0.1 * before, f"the average's loss {before} -> {after}"
        print(f"OK topology={topology} mean_drift={drift:.2e} spread={spread:.2e} "
              f"loss={before:.4f}->{after:.4f} train_spread={train_spread:.3e}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
