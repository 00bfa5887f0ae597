"""Rank script of ``tests/test_multinode_user.py``: multi-node D-PSGD used as a user would.

Plain Lightning runs (2 nodes x 2 processes under ``torchrun --nnodes 2``): checkpoints with
early stopping and a resume, bf16 wire with bf16-mixed precision, clipping and accumulation,
periodic global averages under ``max_time``, BatchNorm with a frozen parameter and a branch
some ranks do not use, validate/test around fit, a rank that raises. Each scenario writes
``OUT/<scenario>/rank<r>.json``.

    python -m torch.distributed.run --nnodes 2 --node-rank K --nproc-per-node 2 \\
        tests/scripts/multinode_user.py OUT SCENARIO [SCENARIO ...]
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, EarlyStopping, ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_gossip.flat import FlatState
from lightning_gossip.strategies import ADPSGDStrategy, DPSGDStrategy

CRASH_RANK, CRASH_STEP = 1, 3


class Net(pl.LightningModule):
    """A small regression net: optional BatchNorm, a frozen layer, a branch used by some ranks."""

    def __init__(self, bn: bool = False, odd_branch: bool = False, crash: bool = False) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16) if bn else nn.Identity(),
                                  nn.ReLU(), nn.Linear(16, 1))
        self.branch = nn.Linear(8, 1)  # used only on steps where (rank + batch) is even
        self.frozen = nn.Linear(8, 1)
        self.frozen.requires_grad_(False)
        self.odd_branch = odd_branch
        self.crash = crash
        self.momentum = 0.9

    def forward(self, x: torch.Tensor, use_branch: bool = False) -> torch.Tensor:
        out = self.body(x) + self.frozen(x)
        return out + self.branch(x) if use_branch else out

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.crash and self.global_rank == CRASH_RANK and self.global_step == CRASH_STEP:
            Path(sys.argv[1], "crash_time").write_text(str(time.time()))
            raise RuntimeError(f"user error on rank {CRASH_RANK} at step {CRASH_STEP}")
        x, y = batch
        use = self.odd_branch and (self.global_rank + batch_idx) % 2 == 0
        loss = nn.functional.mse_loss(self(x, use), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self(x), y), sync_dist=True)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("test_loss", nn.functional.mse_loss(self(x), y), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        params = [p for p in self.parameters() if p.requires_grad]
        return torch.optim.SGD(params, lr=0.05, momentum=self.momentum,
                               weight_decay=1e-3)


def loader(n: int = 128, seed: int = 0) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    y = x[:, :1] * 2 - x[:, 1:2] + 0.1 * torch.randn(n, 1, generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=4)


class Record(Callback):
    """Weights (flat) at train start and after every optimizer step."""

    def __init__(self) -> None:
        self.start: list[float] = []
        self.steps: list[list[float]] = []

    def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        self.start = FlatState(module).pack().tolist()

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, *a: Any) -> None:
        self.steps.append(FlatState(module).pack().tolist())


def trainer(out: Path, strategy: Any, callbacks: list | None = None, **kw: Any) -> pl.Trainer:
    kw.setdefault("max_epochs", 1)
    return pl.Trainer(accelerator="cpu", devices=2, num_nodes=2, strategy=strategy,
                      callbacks=callbacks or [], default_root_dir=str(out), logger=False,
                      enable_progress_bar=False, enable_model_summary=False, **kw)


def hier(**kw: Any) -> DPSGDStrategy:
    kw.setdefault("final_average", False)
    return DPSGDStrategy(hierarchical=True, timeout=120, **kw)


def write(out: Path, rank: int, data: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(json.dumps(data))


def checkpoint_resume(out: Path) -> dict:
    """(1) checkpoints every 3 steps and at epoch ends, early stopping, then resume."""
    torch.manual_seed(0)
    model, rec = Net(bn=True), Record()
    every = ModelCheckpoint(dirpath=out / "ckpt", every_n_train_steps=3, save_last=True,
                            save_top_k=-1)
    best = ModelCheckpoint(dirpath=out / "best", monitor="val_loss", save_top_k=1)
    stop = EarlyStopping(monitor="val_loss", patience=1, min_delta=10.0)
    t = trainer(out, hier(), [every, best, stop, rec], max_epochs=4)
    t.fit(model, loader(), loader(32, seed=1))
    first = {"global_step": t.global_step, "epoch": t.current_epoch,
             "final": FlatState(model).pack().tolist(), "last": str(every.last_model_path),
             "best": str(best.best_model_path)}
    ckpt = torch.load(out / "ckpt" / "last.ckpt", map_location="cpu", weights_only=False)
    ref = Net(bn=True)
    ref.load_state_dict(ckpt["state_dict"])
    torch.manual_seed(1)  # a different init: the resume must overwrite it
    model2, rec2 = Net(bn=True), Record()
    t2 = trainer(out, hier(), [rec2], max_epochs=first["epoch"] + 2)
    t2.fit(model2, loader(), loader(32, seed=1), ckpt_path=str(out / "ckpt" / "last.ckpt"))
    return {"first": first, "ckpt": FlatState(ref).pack().tolist(),
            "ckpt_step": ckpt["global_step"], "resumed_start": rec2.start,
            "resumed_steps": rec2.steps, "resumed_global_step": t2.global_step}


def bf16_mixed(out: Path) -> dict:
    """(2) bf16 wire, bf16-mixed precision, clipping, accumulation 2."""
    torch.manual_seed(0)
    model, rec = Net(bn=True), Record()
    t = trainer(out, hier(wire_dtype="bf16"), [rec], precision="bf16-mixed",
                gradient_clip_val=0.5, accumulate_grad_batches=2, max_epochs=2)
    t.fit(model, loader())
    return {"global_step": t.global_step, "steps": rec.steps, "start": rec.start}


def max_time(out: Path, strategy: str, every: int | None = 2, momentum: float = 0.9,
             branch: bool = True) -> dict:
    """(3) global averages every 2 steps, stopped by max_time."""
    torch.manual_seed(0)
    model, rec = Net(), Record()
    model.momentum = momentum
    model.branch.requires_grad_(branch)  # a trainable parameter that never gets a gradient
    s = (hier(global_average_every_n_steps=every) if strategy == "dpsgd"
         else ADPSGDStrategy(global_average_every_n_steps=every, final_average=False,
                             timeout=120))
    t = trainer(out, s, [rec], max_time={"seconds": 15}, max_epochs=10_000)
    began = time.time()
    t.fit(model, loader(512))
    return {"global_step": t.global_step, "seconds": time.time() - began,
            "final": FlatState(model).pack().tolist(), "steps": rec.steps[-3:]}


def unused_branch(out: Path) -> dict:
    """(4) BatchNorm, a frozen layer, a branch only some ranks of a node use in a step."""
    torch.manual_seed(0)
    model, rec = Net(bn=True, odd_branch=True), Record()
    t = trainer(out, hier(), [rec])
    t.fit(model, loader())
    return {"global_step": t.global_step, "steps": rec.steps, "start": rec.start}


def eval_around_fit(out: Path) -> dict:
    """(5) validate and test before and after fit."""
    torch.manual_seed(0)
    model = Net(bn=True)
    t = trainer(out, hier())
    res = {"validate_before": t.validate(model, loader(32, seed=1)),
           "test_before": t.test(model, loader(32, seed=2))}
    t.fit(model, loader())
    res["validate_after"] = t.validate(model, loader(32, seed=1))
    res["test_after"] = t.test(model, loader(32, seed=2))
    res["final"] = FlatState(model).pack().tolist()
    res["global_step"] = t.global_step
    return res


def crash(out: Path) -> dict:
    """(6) rank 1 raises at step 3."""
    torch.manual_seed(0)
    t = trainer(out, hier(), max_epochs=3)
    t.fit(Net(crash=True), loader())
    return {"global_step": t.global_step}


SCENARIOS = {
    "ckpt": checkpoint_resume, "bf16": bf16_mixed,
    "time_dpsgd": lambda o: max_time(o, "dpsgd"), "time_adpsgd": lambda o: max_time(o, "adpsgd"),
    "time_adpsgd_noga": lambda o: max_time(o, "adpsgd", None),
    "time_adpsgd_sgd": lambda o: max_time(o, "adpsgd", 2, 0.0),
    "time_adpsgd_nobranch": lambda o: max_time(o, "adpsgd", 2, 0.9, False),
    "unused": unused_branch, "eval": eval_around_fit, "crash": crash,
}


def main() -> None:
    out = Path(sys.argv[1])
    for name in sys.argv[2:]:
        began = time.time()
        data = SCENARIOS[name](out / name)
        data["wall_s"] = time.time() - began
        import os
        write(out / name, int(os.environ["RANK"]), data)


if __name__ == "__main__":
    main()
