"""Rank script for the strategy tests: runs several small fits in one launch (start-up dominates).

Launched by torchrun (every rank runs this file). Each case is a ``tests.cases.Case`` (the one
definition the tests use too), read from the JSON file the test wrote; results go to
``OUT/<case>/rank<r>.json``. With ``lr = 0`` the recorded weights after every optimizer step
let the test compare with the mixing-matrix product computed in NumPy.

    python -m torch.distributed.run --nproc-per-node 4 tests/scripts/gossip_cases.py OUT CASES.json
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.utils.data import DataLoader, Subset, TensorDataset

import lightning_gossip
from lightning_gossip.flat import FlatState
from tests.cases import Case, read_cases


class Tiny(L.LightningModule):
    def __init__(self, lr: float, manual: bool = False, width: int = 3, batchnorm: bool = False,
                 halve_lr_every_epoch: bool = False):
        super().__init__()
        self.halve_lr_every_epoch = halve_lr_every_epoch
        layers: list[nn.Module] = [nn.Linear(5, width)]
        if batchnorm:
            layers.append(nn.BatchNorm1d(width))
        layers += [nn.Tanh(), nn.Linear(width, 2)]
        self.net = nn.Sequential(*layers)
        self.lr = lr
        self.automatic_optimization = not manual

    def training_step(self, batch, batch_idx):
        x, y = batch[0], batch[1]
        loss = nn.functional.cross_entropy(self.net(x), y)
        if not self.automatic_optimization:
            opt = self.optimizers()
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch[0], batch[1]
        acc = (self.net(x).argmax(-1) == y).float().mean()
        self.log("val_acc", acc, sync_dist=True)

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=self.lr)
        if not self.halve_lr_every_epoch:
            return opt
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)}


class Indexed(TensorDataset):
    """Returns ``(x, y, index)`` so a test can see which samples each rank processed."""

    def __getitem__(self, i):
        return (*super().__getitem__(i), i)


class Disturb(Callback):
    """Per-step delays (seeded, different on each rank), a slow rank, injected failures."""

    def __init__(self, case: Case, rank: int):
        self.case, self.rank = case, rank
        self.rng = random.Random(case.delay_seed * 100 + rank)
        self.indices: list[list[int]] = []
        self.left_early: list[int] | None = None  # (shared_cursor="balanced")

    def on_train_epoch_end(self, trainer, module):
        claims = getattr(getattr(trainer.strategy, "cursor", None), "claims", None)
        if getattr(claims, "balance", None) is not None:
            self.left_early = list(claims.balance.left_early)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        c = self.case
        if len(batch) > 2:
            self.indices.append([int(i) for i in batch[2]])
        if c.delay_ms:
            time.sleep(self.rng.uniform(0, c.delay_ms) / 1000)
        if c.slow_rank == self.rank:
            time.sleep(c.slow_ms / 1000)
        fail = c.raise_at
        if fail and fail["rank"] == self.rank and trainer.global_step >= fail["step"]:
            raise RuntimeError(f"injected failure on rank {self.rank}")
        if c.stop_at is not None and trainer.global_step >= c.stop_at:
            trainer.should_stop = True  # on every rank, as EarlyStopping's reduced decision
        nan = c.nan_at
        if nan and nan["rank"] == self.rank and trainer.global_step == nan["step"]:
            flat = FlatState(module)
            flat.copy_(torch.full((flat.numel,), float("nan")))


class Validations(Callback):
    """Counts the validations of the fit on this rank (not the sanity check)."""

    def __init__(self) -> None:
        self.count = 0

    def on_validation_end(self, trainer, module):
        self.count += not trainer.sanity_checking


class Recorder(Callback):
    """Adds a rank-dependent offset at train start, records the flat weights after each step."""

    def __init__(self, offset: float):
        self.offset = offset
        self.x0: list[float] = []
        self.steps: list[list[float]] = []
        self.start_weights: list[float] = []

    def on_train_start(self, trainer, module):
        flat = FlatState(module)
        self.start_weights = flat.pack().tolist()
        if self.offset:
            g = torch.Generator().manual_seed(1000 + trainer.global_rank)
            flat.add_(self.offset * torch.randn(flat.numel, generator=g))
        self.x0 = flat.pack().tolist()

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.steps.append(FlatState(module).pack().tolist())


class DigitsMLP(L.LightningModule):
    """A small real task: scikit-learn's bundled handwritten digits, a one-hidden-layer MLP."""

    def __init__(self, lr: float):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
        self.lr = lr

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_acc", (self.net(x).argmax(-1) == y).float().mean(), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def digits_loaders(batch_size: int):
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x / 16.0, dtype=torch.float32)
    y = torch.tensor(y)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    train, val = perm[:1400], perm[1400:]
    return (DataLoader(TensorDataset(x[train], y[train]), batch_size=batch_size, shuffle=True),
            DataLoader(TensorDataset(x[val], y[val]), batch_size=256))


def run_case(case: Case, out: Path) -> None:
    """Run ``case`` on this rank; print a ``TIMING`` line (its CPU and wall seconds)."""
    cpu0, wall0 = time.process_time(), time.monotonic()
    try:
        _run_case(case, out)
    finally:
        timing(case.name, time.process_time() - cpu0, time.monotonic() - wall0)


def timing(what: str, cpu_s: float, wall_s: float) -> None:
    """``TIMING {json}``: where a launch's CPU goes (``tests/README.md``), never asserted."""
    rank = int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", 0)))
    print("TIMING " + json.dumps({"rank": rank, "what": what, "cpu_s": round(cpu_s, 2),
                                  "wall_s": round(wall_s, 2)}), flush=True)


def _run_case(case: Case, out: Path) -> None:
    rank = int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", 0)))
    world = int(os.environ.get("WORLD_SIZE", os.environ.get("SLURM_NTASKS", 1)))
    nodes = case.num_nodes
    torch.manual_seed(case.seed + (rank if case.different_init else 0))
    width = case.width
    if case.mismatch_rank == rank:
        width += 1
    if case.task == "digits":
        model: L.LightningModule = DigitsMLP(case.lr)
        loader, val_loader = digits_loaders(case.batch_size)
    else:
        model = Tiny(case.lr, case.manual, width, case.batchnorm, case.halve_lr_every_epoch)
        g = torch.Generator().manual_seed(rank)
        n = case.batches * case.batch_size
        data = Indexed(torch.randn(n * world, 5, generator=g),
                       torch.randint(0, 2, (n * world,), generator=g))
        train = data if case.train_samples is None else Subset(data, range(case.train_samples))
        loader = DataLoader(train, batch_size=case.batch_size)
        val_loader = DataLoader(data, batch_size=case.batch_size)
    strategy: str | L.pytorch.strategies.Strategy = case.strategy
    kwargs = dict(case.strategy_kwargs)
    if case.auto_period is not None:
        from lightning_gossip.gossip_period import AutoPeriod
        kwargs["gossip_every_n_steps"] = AutoPeriod(**case.auto_period)
    if case.strategy == "dpsgd":
        strategy = lightning_gossip.DPSGDStrategy(**kwargs)
    elif case.strategy == "adpsgd":
        strategy = lightning_gossip.ADPSGDStrategy(**kwargs)
    recorder = Recorder(case.offset)
    disturb = Disturb(case, rank)
    validations = Validations()
    if os.environ.get("LG_DEBUG"):  # LG_DEBUG=<seconds>: gossip debug log, then a stack dump
        import logging
        logging.basicConfig(level=logging.DEBUG, format="%(relativeCreated)d %(message)s")
        logging.getLogger("lightning_gossip").setLevel(logging.DEBUG)
        import faulthandler
        faulthandler.dump_traceback_later(int(os.environ["LG_DEBUG"]), exit=False)
    name = case.name
    logger = L.pytorch.loggers.CSVLogger(out / name, name="logs", version=0) if case.log else False
    trainer = L.Trainer(
        strategy=strategy, accelerator="cpu", devices=world // nodes, num_nodes=nodes,
        max_epochs=case.epochs, limit_val_batches=case.val_batches,
        accumulate_grad_batches=case.accumulate, precision=case.precision,
        callbacks=[recorder, disturb, validations], logger=logger, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, log_every_n_steps=1,
        default_root_dir=out / name,
    )
    resume = str(out / case.resume_case / "model.ckpt") if case.resume_case else None
    trainer.fit(model, loader, val_loader if case.val_batches else None, ckpt_path=resume)
    consensus = getattr(trainer.strategy, "last_consensus_distance", None)
    result = {
        "rank": trainer.global_rank, "world_size": trainer.world_size,
        "global_step": trainer.global_step,
        "cluster_env": type(getattr(trainer.strategy, "cluster_environment", None)).__name__,
        "gossip_step": getattr(trainer.strategy, "step", None),
        "x0": recorder.x0, "steps": recorder.steps, "start_weights": recorder.start_weights,
        "final": FlatState(model).pack().tolist(),
        "consensus_distance": consensus,
        "val_acc": float(trainer.callback_metrics.get("val_acc", float("nan"))),
        "indices": disturb.indices,
        "validations": validations.count,
        "left_early": disturb.left_early,
        "lr": trainer.optimizers[0].param_groups[0]["lr"],
        "gossip_stats": getattr(trainer.strategy, "gossip_stats", {}),
        "period_switches": [sw.as_dict() for sw in getattr(
            getattr(trainer.strategy, "auto_period", None), "switches", [])],
    }
    if case.save_checkpoint:
        ckpt = out / name / "model.ckpt"
        trainer.save_checkpoint(ckpt)
        result["after_save"] = FlatState(model).pack().tolist()
    (out / name).mkdir(parents=True, exist_ok=True)
    (out / name / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))


def main() -> None:
    timing("start-up", time.process_time(), float("nan"))
    out = Path(sys.argv[1])
    for case in read_cases(Path(sys.argv[2])):
        run_case(case, out)


if __name__ == "__main__":
    main()
