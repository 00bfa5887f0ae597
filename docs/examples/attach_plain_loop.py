"""Gossip in a plain PyTorch loop with one call: ``lightning_gossip.attach``.

    torchrun --nproc-per-node 2 docs/examples/attach_plain_loop.py [adpsgd|dpsgd]

An ordinary data-parallel loop (each rank trains on its shard of a small regression task). The
three lines marked ``# gossip`` are all that gossip adds: one to attach it to the model and the
optimizer, a block that evaluates the exact average of the replicas at each epoch end, and one
call that leaves that average on every rank at the end. Prints one JSON line per rank
(``docs/engines.md``; ``tests/test_attach.py`` runs this file under both strategies).
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from torch import nn

import lightning_gossip

EPOCHS, BATCH, LR = 3, 32, 0.05


def regression_shard(rank: int, world: int) -> tuple[torch.Tensor, ...]:
    """This rank's shard of ``y = x w + noise`` and a held-out set (the same on every rank)."""
    g = torch.Generator().manual_seed(1234)
    w = torch.randn(8, 1, generator=g)
    x = torch.randn(4096 + 512, 8, generator=g)
    y = x @ w + 0.1 * torch.randn(len(x), 1, generator=g)
    return x[rank:4096:world], y[rank:4096:world], x[4096:], y[4096:]


def main(strategy: str) -> dict:
    own_group = not dist.is_initialized()  # inside a larger program: use its process group
    if own_group:
        dist.init_process_group("gloo")  # torchrun's environment
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(rank)  # any start: attach() broadcasts rank 0's weights
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    x, y, x_val, y_val = regression_shard(rank, world)

    gossip = lightning_gossip.attach(model, optimizer, strategy=strategy)  # gossip
    losses = []
    for _ in range(EPOCHS):
        for i in range(0, len(x), BATCH):
            loss = nn.functional.mse_loss(model(x[i:i + BATCH]), y[i:i + BATCH])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()  # the hooks gossip here
        with torch.no_grad(), gossip.consensus():  # gossip: the exact average, for evaluation
            losses.append(float(nn.functional.mse_loss(model(x_val), y_val)))
    gossip.finish()  # gossip: every rank now holds the exact average of the replicas

    with torch.no_grad():
        final = float(nn.functional.mse_loss(model(x_val), y_val))
    row = {"rank": rank, "engine": f"attach-{strategy}", "consensus_loss": losses,
           "final_loss": final, "steps": gossip.step, "exchanges": gossip.stats.exchanges}
    print(json.dumps(row), flush=True)
    if own_group:
        dist.destroy_process_group()
    return row


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "adpsgd")
