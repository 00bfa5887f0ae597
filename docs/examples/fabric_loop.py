"""A Lightning Fabric training loop with gossip: ``Fabric(strategy="adpsgd")``.

    python docs/examples/fabric_loop.py [adpsgd|dpsgd|adpsgd_random|ddp]

Fabric starts the two processes itself (or run it under ``torchrun --nproc-per-node 2``). The
loop is Fabric's usual one; gossip adds the evaluation of the exact average of the replicas
(``fabric.strategy.consensus()``) and ``fabric.strategy.finish()`` at the end, which leaves
that average on every rank. Prints one JSON line per rank (``docs/fabric.md``;
``tests/test_fabric.py`` runs this file under ``adpsgd``, ``dpsgd`` and ``ddp``).
"""

from __future__ import annotations

import json
import sys
from contextlib import nullcontext
from typing import Any

import torch
from lightning.fabric import Fabric
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_gossip  # registers "dpsgd", "adpsgd", "adpsgd_random" with Fabric

EPOCHS, BATCH, LR = 6, 32, 0.05


def regression_data() -> tuple[TensorDataset, torch.Tensor, torch.Tensor]:
    """``y = x w + noise``: 4096 training samples and 512 held-out ones."""
    g = torch.Generator().manual_seed(1234)
    w = torch.randn(8, 1, generator=g)
    x = torch.randn(4096 + 512, 8, generator=g)
    y = x @ w + 0.1 * torch.randn(len(x), 1, generator=g)
    return TensorDataset(x[:4096], y[:4096]), x[4096:], y[4096:]


def train(fabric: Fabric, epochs: int = EPOCHS) -> dict[str, Any]:
    """Train, evaluating the held-out loss (of the consensus model under gossip) each epoch."""
    gossip = isinstance(fabric.strategy, lightning_gossip.fabric.FabricGossipStrategy)
    fabric.seed_everything(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    model, optimizer = fabric.setup(model, optimizer)
    train_set, x_val, y_val = regression_data()
    loader = fabric.setup_dataloaders(DataLoader(train_set, batch_size=BATCH, shuffle=True))
    # the last two epochs at a tenth of the learning rate: the held-out loss settles
    schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=epochs - 2, gamma=0.1)
    x_val, y_val = fabric.to_device((x_val, y_val))
    losses, steps = [], 0
    for epoch in range(epochs):
        loader.sampler.set_epoch(epoch)
        model.train()
        for x, y in loader:
            loss = nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            fabric.backward(loss)
            optimizer.step()  # the gossip step too
            steps += 1
        schedule.step()
        model.eval()
        with torch.no_grad(), (fabric.strategy.consensus() if gossip else nullcontext()):
            losses.append(float(nn.functional.mse_loss(model(x_val), y_val)))
    if gossip:
        fabric.strategy.finish()  # every rank now holds the exact average of the replicas
    with torch.no_grad():
        final = float(nn.functional.mse_loss(model(x_val), y_val))
    return {"rank": fabric.global_rank, "losses": losses, "final_loss": final, "steps": steps}


def main(strategy: str = "adpsgd") -> None:
    fabric = Fabric(strategy=strategy, accelerator="cpu", devices=2)
    fabric.launch()
    row = train(fabric)
    print(json.dumps({"engine": f"fabric-{strategy}", **row}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "adpsgd")
