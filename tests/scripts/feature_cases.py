"""Trainer features under ``ddp``, ``dpsgd`` and ``adpsgd``: several small fits in one launch.

    torchrun --nproc-per-node 2 tests/scripts/feature_cases.py OUT CASE [CASE ...]

A case is ``strategy:feature[:momentum[:seed[:lr]]]`` (defaults 0.9, 0, 0.01). Every fit
is a plain Lightning script as a user
writes it: a small regression (an MLP on ``y = f(x) + noise``), SGD with momentum, 3 epochs, 2
ranks. Writes ``OUT/<case>.rank<r>.json`` with the held-out loss of the final model (the consensus
under gossip) before and after, or the error a refused feature raised.
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import (
    EarlyStopping,
    LearningRateMonitor,
    ModelCheckpoint,
    StochasticWeightAveraging,
)
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_gossip  # noqa: F401  (registers the strategy names)

EPOCHS = 3


def data() -> tuple[TensorDataset, TensorDataset]:
    g = torch.Generator().manual_seed(1234)
    w = 2.0 * torch.randn(16, 1, generator=g)
    x = torch.randn(2048 + 512, 16, generator=g)
    y = x @ w + torch.sin(3 * x[:, :1]) + 0.3 * torch.randn(len(x), 1, generator=g)
    return TensorDataset(x[:2048], y[:2048]), TensorDataset(x[2048:], y[2048:])


class Regression(L.LightningModule):
    def __init__(self, momentum: float, lr: float, manual: bool = False, two: bool = False
                 ) -> None:
        super().__init__()
        self.lr = lr
        self.net = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 1))
        self.momentum = momentum
        self.automatic_optimization = not (manual or two)
        self.two = two

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        if not self.automatic_optimization:
            opts = self.optimizers()
            opts = opts if isinstance(opts, list) else [opts]
            for opt in opts:
                opt.zero_grad()
            self.manual_backward(loss)
            for opt in opts:
                opt.step()
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self(x), y), sync_dist=True)

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_loss", nn.functional.mse_loss(self(x), y), sync_dist=True)

    def predict_step(self, batch, batch_idx):
        return self(batch[0])

    def configure_optimizers(self):
        if self.two:
            return [torch.optim.SGD(self.net[0].parameters(), lr=self.lr, momentum=self.momentum),
                    torch.optim.SGD(self.net[2].parameters(), lr=self.lr, momentum=self.momentum)]
        opt = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
        return {"optimizer": opt, "lr_scheduler": sched}


def held_out(model: nn.Module, val: TensorDataset) -> float:
    with torch.no_grad():
        x, y = val.tensors
        return float(nn.functional.mse_loss(model.net(x), y))


def run(case: str, out: Path) -> dict:
    parts = case.split(":")
    strategy, feature = parts[0], parts[1]
    momentum = float(parts[2]) if len(parts) > 2 else 0.9
    seed = int(parts[3]) if len(parts) > 3 else 0
    lr = float(parts[4]) if len(parts) > 4 else 0.01
    L.seed_everything(seed, verbose=False)
    train, val = data()
    model = Regression(momentum, lr, manual=feature == "manual", two=feature == "manual2")
    start = held_out(model, val)
    kw: dict = dict(strategy=strategy, accelerator="cpu", devices=2, max_epochs=EPOCHS,
                    logger=False, enable_progress_bar=False, enable_model_summary=False,
                    enable_checkpointing=False, default_root_dir=out / case.replace(":", "_"),
                    limit_val_batches=0)
    callbacks: list = []
    if feature == "accumulate":
        kw["accumulate_grad_batches"] = 2
    elif feature in ("bf16-mixed", "16-mixed"):
        kw["precision"] = feature
    elif feature == "clip":
        kw["gradient_clip_val"] = 0.5
    elif feature == "early_stopping":
        callbacks.append(EarlyStopping("val_loss", patience=1))
        kw["limit_val_batches"] = 1.0
    elif feature == "val_check_interval":
        kw["val_check_interval"] = 0.5
        kw["limit_val_batches"] = 1.0
    elif feature == "evaluate_after":
        kw["limit_val_batches"] = 1.0
    elif feature == "lr_monitor":
        callbacks.append(LearningRateMonitor())
        kw["logger"] = L.pytorch.loggers.CSVLogger(out / case.replace(":", "_"))
    elif feature == "swa":
        callbacks.append(StochasticWeightAveraging(swa_lrs=0.005, swa_epoch_start=2))
    elif feature == "resume":
        kw["enable_checkpointing"] = True
        callbacks.append(ModelCheckpoint(save_last=True))
    elif feature == "compile":
        model = torch.compile(model)
    trainer = L.Trainer(callbacks=callbacks, **kw)
    loader = DataLoader(train, batch_size=32, shuffle=True)
    vloader = DataLoader(val, batch_size=128)
    row: dict = {"case": case, "start": start}
    try:
        if feature == "resume":
            kw["max_epochs"] = 2
            first = L.Trainer(callbacks=[ModelCheckpoint(save_last=True)], **kw)
            first.fit(model, loader, vloader)
            kw["max_epochs"] = EPOCHS
            trainer = L.Trainer(callbacks=[ModelCheckpoint(save_last=True)], **kw)
            trainer.fit(model, loader, vloader, ckpt_path="last")
        elif feature == "fit_twice":
            kw["max_epochs"] = 2
            L.Trainer(**kw).fit(model, loader, vloader)
            L.Trainer(**{**kw, "max_epochs": 1}).fit(model, loader, vloader)
        else:
            trainer.fit(model, loader, vloader)
        if feature == "evaluate_after":
            row["validate"] = trainer.validate(model, vloader, verbose=False)[0]["val_loss"]
            row["test"] = trainer.test(model, vloader, verbose=False)[0]["test_loss"]
            preds = trainer.predict(model, vloader)
            row["predict_rows"] = int(torch.cat(preds).shape[0])  # this rank's shard
            # Each rank predicts its shard (Lightning's DistributedSampler, no shuffling).
            shard = list(range(trainer.global_rank, len(val), trainer.world_size))
            row["predict"] = float(nn.functional.mse_loss(torch.cat(preds),
                                                          val.tensors[1][shard]))
        row["end"] = held_out(model, val)
        row["global_step"] = trainer.global_step  # (fit_twice, resume: of their last Trainer)
    except Exception as e:  # noqa: BLE001 - a refused feature is a result
        row["error"] = f"{type(e).__name__}: {e}"
        row["trace"] = traceback.format_exc()[-2000:]
    return row


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    for case in sys.argv[2:]:
        row = run(case, out)
        rank = int(__import__("os").environ.get("RANK", 0))
        (out / f"{case.replace(':', '_')}.rank{rank}.json").write_text(json.dumps(row))
        print("CASE", json.dumps({k: v for k, v in row.items() if k != "trace"}), flush=True)


if __name__ == "__main__":
    main()
