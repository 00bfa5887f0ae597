"""Rank script for the restart test (``tests/test_faults.py``): a fit that resumes from ``last``.

Run under torchrun (every rank runs it, ``--max-restarts`` > 0): ``python restart_ranks.py
SPEC.json``. ``SPEC.json`` holds a dict:

* ``strategy``: ``"dpsgd"`` or ``"adpsgd"``; ``epochs``; ``samples`` (training set size);
  ``data_seed`` (the global torch seed of round 0; another one after a restart);
* ``checkpoint_dir``: ``ModelCheckpoint(dirpath, every_n_train_steps=every, save_last=True)``
  (``every`` from ``every_n_train_steps``; ``0`` or absent: at epoch ends) and
  ``fit(ckpt_path="last")``;
* ``kill``: ``{"rank", "step"}``: that rank SIGKILLs itself after optimizer step ``step`` of
  restart round 0 (``TORCHELASTIC_RESTART_COUNT``);
* ``raise``: ``{"rank", "step"}``: that rank raises a ``RuntimeError`` after step ``step``;
* ``hierarchical``: the strategy's ``hierarchical`` (a node of several processes); ``nodes``:
  the trainer's ``num_nodes`` (default 1).

Every rank prints ``EVENT {json}`` lines: ``start`` (the global step and epoch training starts
from: non-zero after a resume), ``fault`` and ``done`` (``steps``, ``epochs``, held-out
accuracy ``val_acc`` on a fixed learnable rule, ``restart`` round).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_gossip


def _rank() -> int:
    env = os.environ
    return int(env.get("RANK", env.get("SLURM_PROCID", env.get("LOCAL_RANK", "0"))))


def _restart() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def event(name: str, **fields: object) -> None:
    """Print one ``EVENT`` line for the test."""
    print("EVENT " + json.dumps({"event": name, "rank": _rank(), "time": time.time(),
                                 "restart": _restart(), **fields}), flush=True)


class Classifier(L.LightningModule):
    """A small MLP on 10 features; the labels follow a fixed, mildly non-linear rule (held-out
    accuracy about 0.93 after 240 steps, within +-0.01 between data orders)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(10, 16), nn.Tanh(), nn.Linear(16, 2))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.5)


class Kill(Callback):
    """Reports where training starts; SIGKILLs its rank at the planned step of round 0."""

    def __init__(self, kill: dict | None, raises: dict | None = None) -> None:
        self.kill = kill or {}
        self.raises = raises or {}
        self.start: tuple[int, int] = (0, 0)

    def on_train_start(self, trainer, module) -> None:
        self.start = (trainer.global_step, trainer.current_epoch)
        event("start", step=trainer.global_step, epoch=trainer.current_epoch)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        r = self.raises
        if r and r["rank"] == trainer.global_rank and trainer.global_step == r["step"]:
            raise RuntimeError(f"injected failure on rank {r['rank']} at step {r['step']}")
        k = self.kill
        if (k and _restart() == 0 and k["rank"] == trainer.global_rank
                and trainer.global_step == k["step"]):
            event("fault", step=trainer.global_step, epoch=trainer.current_epoch)
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    g = torch.Generator().manual_seed(0)
    rule = torch.randn(10, generator=g)
    n = spec.get("samples", 512)
    x, x_val = torch.randn(n, 10, generator=g), torch.randn(2000, 10, generator=g)
    label = lambda t: ((t @ rule) + 0.8 * t[:, 0] * t[:, 1] > 0).long()  # noqa: E731
    # other randomness differs after a restart, as in a real run (the shuffling order of
    # Lightning's DistributedSampler depends only on its seed and the epoch)
    torch.manual_seed(spec.get("data_seed", 1) + 1000 * _restart())
    cls = (lightning_gossip.ADPSGDStrategy if spec.get("strategy") == "adpsgd"
           else lightning_gossip.DPSGDStrategy)
    strategy = cls(timeout=spec.get("timeout", 300.0),
                   heartbeat_timeout=spec.get("heartbeat_timeout", 60.0),
                   **({"hierarchical": True} if spec.get("hierarchical") else {}))
    every = spec.get("every_n_train_steps", 0) or None
    kill = Kill(spec.get("kill"), spec.get("raise"))
    checkpoint = ModelCheckpoint(dirpath=spec["checkpoint_dir"], save_last=True,
                                 every_n_train_steps=every, every_n_epochs=None if every else 1)
    trainer = L.Trainer(
        strategy=strategy, accelerator="cpu", devices=int(os.environ.get("LOCAL_WORLD_SIZE",
                                                       os.environ.get("SLURM_NTASKS_PER_NODE", 2))),
        num_nodes=int(spec.get("nodes", 1)),
        max_epochs=spec.get("epochs", 4), callbacks=[kill, checkpoint], logger=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
    )
    model = Classifier()
    trainer.fit(model, DataLoader(TensorDataset(x, label(x)), batch_size=8, shuffle=True),
                ckpt_path="last")
    with torch.no_grad():
        acc = float((model.net(x_val).argmax(-1) == label(x_val)).float().mean())
    event("done", steps=trainer.global_step, epochs=trainer.current_epoch, val_acc=acc,
          start_step=kill.start[0], start_epoch=kill.start[1])


if __name__ == "__main__":
    main()
