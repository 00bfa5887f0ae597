"""Rank script for ``tests/test_preemption.py::test_a_resumed_fit_draws_each_sample_once``:
an ``adpsgd`` fit with the shared cursor, resumed from a checkpoint, draws each sample of its
epoch once.

Started as ``srun`` starts tasks (2 tasks, ``SLURM_*`` variables). A first fit trains epoch 0
and writes ``OUT/last.ckpt``; a second fit resumes from it and trains epoch 1. The samples are
their own indices (``TensorDataset(arange(64), ...)``, batches of 4), so every rank records
exactly which samples it trained in each epoch of each fit: ``OUT/rank<r>.json`` =
``{"first": {epoch: [samples]}, "resumed": {epoch: [samples]}}``. The module's
``configure_optimizers`` reads ``trainer.estimated_stepping_batches`` (as the recipes' learning
rate schedules do), so the resumed fit builds its training loader before the checkpoint's loop
progress is restored.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_gossip

SAMPLES, BATCH = 64, 4


class Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(1, 2)

    def training_step(self, batch, batch_idx):
        index, label = batch
        return nn.functional.cross_entropy(self.net(index.float()[:, None]), label)

    def train_dataloader(self):
        data = TensorDataset(torch.arange(SAMPLES), torch.zeros(SAMPLES, dtype=torch.long))
        return DataLoader(data, batch_size=BATCH, shuffle=True)

    def configure_optimizers(self):
        # as the recipes' schedules do: Lightning then sets up the training loader (and its
        # iterator, which prefetches a batch) here, before it restores the loops' progress
        self.total_steps = self.trainer.estimated_stepping_batches
        return torch.optim.SGD(self.parameters(), lr=0.01)


class Drawn(Callback):
    """The samples of every trained batch, by epoch."""

    def __init__(self) -> None:
        self.samples: dict[int, list[int]] = {}

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.samples.setdefault(trainer.current_epoch, []).extend(batch[0].tolist())


def main() -> None:
    out = Path(sys.argv[1])
    rank = int(os.environ["SLURM_PROCID"])
    result = {}
    for name, epochs, ckpt in (("first", 1, None), ("resumed", 2, out / "last.ckpt")):
        drawn = Drawn()
        strategy = lightning_gossip.ADPSGDStrategy(heartbeat_timeout=10.0,
                                                   consensus_every_n_steps=None)
        trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_epochs=epochs,
                            callbacks=[drawn, ModelCheckpoint(dirpath=out, save_last=True)],
                            logger=False, enable_progress_bar=False, enable_model_summary=False,
                            default_root_dir=str(out))
        trainer.fit(Tiny(), ckpt_path=ckpt)
        result[name] = drawn.samples
    (out / f"rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
