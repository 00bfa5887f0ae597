"""Run by ``scripts/test_wheel.sh`` with the installed wheel only (``torchrun --nproc-per-node
2``, cwd outside the repository, no PYTHONPATH): a 2-rank ``Trainer.fit`` under ``dpsgd`` and
``adpsgd``, and a Fabric loop under ``adpsgd``. Prints ``WHEEL-OK <rank> <module file>``."""

from __future__ import annotations

import sys
from pathlib import Path

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_gossip


class Regression(L.LightningModule):
    """A linear model on ``y = x w``."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(4, 1)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], _: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 4, generator=g)
    return TensorDataset(x, x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]))


def main() -> None:
    here = Path(lightning_gossip.__file__).resolve()
    assert "site-packages" in here.parts, f"lightning_gossip imported from {here}"
    root = Path(sys.argv[1])
    for strategy in ("dpsgd", "adpsgd"):
        model = Regression()
        trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_epochs=2,
                            default_root_dir=root / strategy, enable_progress_bar=False,
                            enable_model_summary=False, logger=False)
        trainer.fit(model, DataLoader(data(), batch_size=16))
        w = model.net.weight.detach().flatten()
        assert torch.isfinite(w).all() and trainer.global_step > 0, (strategy, w)
    fabric = L.Fabric(strategy="adpsgd", accelerator="cpu", devices=2)
    fabric.launch()
    net = nn.Linear(4, 1)
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    net, opt = fabric.setup(net, opt)
    for x, y in fabric.setup_dataloaders(DataLoader(data(), batch_size=16)):
        opt.zero_grad()
        fabric.backward(nn.functional.mse_loss(net(x), y))
        opt.step()
    fabric.strategy.finish()
    print(f"WHEEL-OK {fabric.global_rank} {here}", flush=True)


if __name__ == "__main__":
    main()
