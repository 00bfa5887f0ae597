"""AD-PSGD in a plain PyTorch training loop: no Lightning, the library's engine only.

    torchrun --nproc-per-node 2 docs/examples/adpsgd_plain_loop.py

Every rank trains its own replica on its own shard of a small regression task; the engine's
background thread averages it with one peer at a time. At the end of every epoch the ranks
meet (``quiesce``) and evaluate the exact average of the replicas. Prints one JSON line per
rank at the end (``docs/engines.md``; ``tests/test_engines.py`` runs this file).
"""

from __future__ import annotations

import json
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from lightning_gossip import AsyncGossip, FlatState, Pairing
from lightning_gossip.consensus import all_average

EPOCHS, BATCH, LR = 3, 32, 0.05
TIMEOUT = timedelta(seconds=60)  # every wait of the engine ends by then, naming the peer


def regression_shard(rank: int, world: int) -> tuple[torch.Tensor, ...]:
    """This rank's shard of ``y = x w + noise`` and a held-out set (the same on every rank)."""
    g = torch.Generator().manual_seed(1234)
    w = torch.randn(8, 1, generator=g)
    x = torch.randn(4096 + 512, 8, generator=g)
    y = x @ w + 0.1 * torch.randn(len(x), 1, generator=g)
    return x[rank:4096:world], y[rank:4096:world], x[4096:], y[4096:]


@torch.no_grad()
def consensus_loss(model: nn.Module, flat: FlatState, x: torch.Tensor, y: torch.Tensor) -> float:
    """Held-out loss of the exact average of the replicas; this rank's replica is kept."""
    mine = flat.pack().clone()
    flat.copy_(all_average(mine))  # a collective: every rank calls it
    loss = float(nn.functional.mse_loss(model(x), y))
    flat.copy_(mine)
    return loss


def main() -> None:
    own_group = not dist.is_initialized()  # inside a larger program: use its process group
    if own_group:
        dist.init_process_group("gloo", timeout=TIMEOUT)  # torchrun's environment
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same initial weights on every rank
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    x, y, x_val, y_val = regression_shard(rank, world)

    flat = FlatState(model)  # the replica as one flat vector (parameters and float buffers)
    # Two groups of the engine's own, created on every rank in the same order.
    control = dist.new_group(backend="gloo", timeout=TIMEOUT)
    data = dist.new_group(backend="gloo", timeout=TIMEOUT)
    engine = AsyncGossip(flat, rank, Pairing("ring", world), control_group=control,
                         data_group=data, timeout=TIMEOUT, max_staleness=4)
    engine.start()
    losses = [consensus_loss(model, flat, x_val, y_val)]
    t = 0  # the step counter (the same verbs as SyncGossip's; AsyncGossip counts its own)
    for _ in range(EPOCHS):
        dist.barrier()  # all ranks open a gossip phase together
        for i in range(0, len(x), BATCH):
            engine.before_step(t)  # the epoch's first step opens the phase
            loss = nn.functional.mse_loss(model(x[i:i + BATCH]), y[i:i + BATCH])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            engine.after_step(t)  # add the peers' deltas, leave a snapshot, bound staleness
            t += 1
        engine.quiesce()  # every in-flight exchange finished and applied, on every rank
        losses.append(consensus_loss(model, flat, x_val, y_val))
    engine.close()
    stats = engine.stats
    print(json.dumps({"rank": rank, "engine": "AsyncGossip", "consensus_loss": losses,
                      "steps": stats.steps, "exchanges": stats.exchanges}), flush=True)
    if own_group:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
