"""Rank program of tests/test_elastic.py, testbed/elastic_fuzz.py and
benchmarks/perf/elastic_loss.py: an elastic ``adpsgd`` fit (``ELASTIC_FIT_STRATEGY=dpsgd``: an
elastic ``dpsgd`` fit) that loses one rank mid-epoch.

Started the way ``srun`` starts tasks (``SLURM_*`` variables):
``python -m testbed.elastic_fit OUT VICTIM BATCH [KIND EPOCH]`` (``VICTIM`` -1: nobody is lost;
``2,3``: both are lost at the same batch).
``ELASTIC_FIT_PAUSE``: a rank pauses in one batch (:data:`PAUSE`); ``ELASTIC_FIT_NODES``:
hierarchical ``adpsgd`` on that many nodes (:data:`NODES`);
``ELASTIC_FIT_START_TIMEOUT``: the fit starts with the ranks that came within it. A survivor writes
``OUT/recovered`` after the recovery (a replacement of the victim, started
with its environment, may then join: ``python -m testbed.elastic_fit OUT -1 0``). The victim
writes ``OUT/victim.json`` (the wall time, its pid) and ``SIGKILL``\\ s (``KIND``
``kill``, default) or ``SIGSTOP``\\ s (``stop``, ``cont``: frozen) itself at the start of its
``BATCH``-th training batch of epoch ``EPOCH`` (default 0): its earlier batches are trained,
the current one and the loader's prefetched ones are claimed but not trained. At its first batch
after the recovery the lowest survivor kills a frozen victim (``stop``) or wakes it up
(``cont``: it must learn that it was counted lost, and exit).

The samples carry their index; every rank appends ``{"epoch", "idx", "t"}`` to
``OUT/rank<r>.jsonl`` for each batch it trained. Each survivor writes ``OUT/done<r>.json`` at
the end: its final replica's sum, its steps, the recoveries (step, wall time begun, seconds), the
joins (ranks, step, seconds, wall time begun), its last gossip engine's exchanges, the last
validation loss and the validations it ran, and the last epoch's ``train_samples``
(the samples the live ranks trained in it, a ``sync_dist`` sum) and ``train_mean`` (a
torchmetrics mean of the training loss). ``ELASTIC_FIT_SAMPLES``: the training set's size
(default 192). Validation with a ``sync_dist`` value and a torchmetrics metric, the training
epoch's values, a ``ModelCheckpoint`` (``save_last``) and a CSV logger run every epoch, so
Lightning's collectives run over the survivors.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torchmetrics
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_gossip

SAMPLES = int(os.environ.get("ELASTIC_FIT_SAMPLES", "192"))
"""The training set (fewer than 4 per rank: some rank gets no batch in an epoch)."""
BATCH_SIZE, EPOCHS = 4, 3
STEP_S = float(os.environ.get("ELASTIC_FIT_STEP_S", "0.03"))
"""Seconds each training step sleeps (longer: a replacement has time to start and join)."""
STRATEGY = os.environ.get("ELASTIC_FIT_STRATEGY", "adpsgd")
"""``adpsgd`` or ``dpsgd``: the elastic strategy."""
NODES = int(os.environ.get("ELASTIC_FIT_NODES", "1"))
"""Nodes (``SLURM_NNODES``; more than one: ``adpsgd`` with ``hierarchical=True``)."""
START_TIMEOUT = os.environ.get("ELASTIC_FIT_START_TIMEOUT")
"""``start_timeout`` of the strategy (seconds; unset: every rank meets at the start)."""
PAUSE = [float(v) for v in os.environ.get("ELASTIC_FIT_PAUSE", "").split(",") if v]
"""``rank,epoch,batch,seconds``: that rank writes ``OUT/paused`` at the start of that batch and
sleeps (the others run out of batches and wait for it at the epoch's end)."""


class Indexed(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(6, 2)
        # a torchmetrics metric logged as an object: Lightning computes it at the epoch's end,
        # gathering over its process group, which must be the live ranks' after a loss
        self.val_mean = torchmetrics.MeanMetric()
        self.train_mean = torchmetrics.MeanMetric()

    def training_step(self, batch, batch_idx):
        time.sleep(STEP_S)  # a step that takes a little time, as a real one does
        x, y, _ = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        # epoch-level values, reduced over the live ranks at the epoch's end (a rank that
        # trained no batch in the epoch takes part too): a metric's mean, and the samples
        # trained (every sample once per epoch: the training set's size)
        self.train_mean.update(loss.detach())
        self.log("train_mean", self.train_mean, on_step=False, on_epoch=True)
        self.log("train_samples", float(len(y)), on_step=False, on_epoch=True, sync_dist=True,
                 reduce_fx="sum")
        return loss

    def validation_step(self, batch, batch_idx):
        x, y, _ = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("val_loss", loss, sync_dist=True)
        self.val_mean.update(loss)
        self.log("val_mean", self.val_mean)

    def configure_optimizers(self):
        # builds the training loader during the strategy's set-up, as a schedule sized by it
        # does (the recipes): the elastic strategies must build it again afterwards
        self.trainer.estimated_stepping_batches  # noqa: B018
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


class Record(Callback):
    """Appends the indices of every trained batch; the victim kills itself at its batch."""

    def __init__(self, out: Path, rank: int, victims: frozenset[int], batch: int, kind: str,
                 epoch: int) -> None:
        self.file = open(out / f"rank{rank}.jsonl", "a")  # noqa: SIM115 - open for the fit
        self.out = out
        self.rank, self.victims, self.batch, self.kind = rank, victims, batch, kind
        self.epoch, self.victim = epoch, min(victims)  # (``stop``, ``cont``: one victim)
        self.validations = 0  # during the fit, the sanity check not counted

    def on_validation_end(self, trainer, module):
        self.validations += trainer.state.fn == "fit" and not trainer.sanity_checking

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if PAUSE and [self.rank, trainer.current_epoch, batch_idx] == [int(v) for v in PAUSE[:3]]:
            (self.out / "paused").write_text(str(time.time()))
            time.sleep(PAUSE[3])
        if (self.rank in self.victims and trainer.current_epoch == self.epoch
                and batch_idx == self.batch):
            record = {"t": time.time(), "pid": os.getpid(), "kind": self.kind}
            (self.out / "victim.json").write_text(json.dumps(record))
            os.kill(os.getpid(), signal.SIGKILL if self.kind == "kill" else signal.SIGSTOP)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        survivors = trainer.strategy.survivors
        if survivors is not None and survivors.losses and not (self.out / "recovered").exists():
            (self.out / "recovered").write_text(str(time.time()))  # a replacement may start
        if (self.kind in ("stop", "cont") and survivors is not None and survivors.losses
                and self.rank == min(survivors.live) and self.victim not in survivors.live):
            # the frozen victim was left behind: end it (a scheduler would, some time), or
            # (cont) let it wake up, to learn that it was counted lost
            pid = json.loads((self.out / "victim.json").read_text())["pid"]
            os.kill(pid, signal.SIGKILL if self.kind == "stop" else signal.SIGCONT)
            self.kind = "done"
        idx = batch[2].tolist()
        record = {"epoch": trainer.current_epoch, "idx": idx, "t": time.time()}
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()


def records(out: Path, rank: int) -> list[dict[str, Any]]:
    """The batches ``rank`` trained (``OUT/rank<r>.jsonl``), in order."""
    path = out / f"rank{rank}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def outcome(out: Path, ranks: int, victim: int | list[int],
            left: tuple[int, ...] = ()) -> dict[str, Any]:
    """What a finished launch's records say: ``once`` (every sample of every epoch trained
    exactly once among all ranks, the victims' trained batches counted), the survivors'
    ``val_loss`` and, with a victim (or several, killed at the same batch), ``detect_s`` (the
    loss to the first recovery), ``recover_s`` (the longest recovery), ``stall_s`` (the longest
    time a survivor finished no batch, from the loss on) and ``step_s`` (the survivors' median
    batch interval before the loss). ``left``: ranks that left with the victims (a hierarchical
    fit's node-mates): the batches they trained before the survivors' recovery began count, and
    they are no survivors."""
    victims = set(victim) if isinstance(victim, list) else {victim} - {-1}
    survivors = [r for r in range(ranks) if r not in victims and r not in left]
    done = [json.loads((out / f"done{r}.json").read_text()) for r in survivors]
    lost = json.loads((out / "victim.json").read_text())["t"] if victims else 0.0
    # a woken victim's later batches were never mixed in, nor were those its node-mates
    # trained with it once it woke up (after the survivors' recovery began)
    recovered = min((rec["began"] for d in done for rec in d["recoveries"]), default=lost)
    trained = {r: [rec for rec in records(out, r) if r not in victims or rec["t"] < lost]
               for r in range(ranks) if r not in left}
    trained.update({r: [rec for rec in records(out, r) if rec["t"] < recovered] for r in left})
    once = all(Counter(i for recs in trained.values() for rec in recs if rec["epoch"] == e
                       for i in rec["idx"]) == Counter(range(SAMPLES)) for e in range(EPOCHS))
    result: dict[str, Any] = {"once": once, "val_loss": done[0]["val_loss"],
                              "same_replica": len({round(d["sum"], 5) for d in done}) == 1,
                              "losses": done[0]["losses"]}
    if not victims:
        return result
    ends = {r: sorted(rec["t"] for rec in trained[r]) for r in survivors}
    before = sorted(b - a for r in survivors for a, b in zip(ends[r], ends[r][1:]) if b < lost)
    stall = max(max((b - max(a, lost) for a, b in zip(ends[r], ends[r][1:]) if b > lost),
                    default=0.0) for r in survivors)
    recoveries = [rec for d in done for rec in d["recoveries"]]
    result.update(detect_s=round(min(rec["began"] for rec in recoveries) - lost, 2),
                  recover_s=round(max(rec["took_s"] for rec in recoveries), 2),
                  stall_s=round(stall, 2),
                  step_s=round(before[len(before) // 2], 3) if before else None)
    return result


STARTED = time.time()  # after the imports: a replacement's start, imports excluded


def main() -> None:
    out, batch = Path(sys.argv[1]), int(sys.argv[3])
    victims = frozenset(int(v) for v in sys.argv[2].split(","))  # -1: none
    kind, epoch = (sys.argv[4], int(sys.argv[5])) if len(sys.argv) > 5 else ("kill", 0)
    rank = int(os.environ["SLURM_PROCID"])
    g = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, 6, generator=g)
    data = TensorDataset(x, (x[:, 0] > 0).long(), torch.arange(SAMPLES))
    elastic = {"adpsgd": lightning_gossip.ADPSGDStrategy,
               "dpsgd": lightning_gossip.DPSGDStrategy}[STRATEGY]
    start = {} if START_TIMEOUT is None else {"start_timeout": float(START_TIMEOUT)}
    if NODES > 1:
        start["hierarchical"] = True
    strategy = elastic(elastic=True, heartbeat_timeout=3.0, timeout=120, **start)
    trainer = L.Trainer(
        strategy=strategy, accelerator="cpu", num_nodes=NODES,
        devices=int(os.environ["SLURM_NTASKS"]) // NODES,
        max_epochs=EPOCHS, logger=CSVLogger(out, name="logs", version=0),
        callbacks=[record := Record(out, rank, victims, batch, kind, epoch),
                   ModelCheckpoint(out / "ckpts", save_last=True, monitor="val_loss")],
        enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1)
    model = Indexed()
    trainer.fit(model, DataLoader(data, batch_size=BATCH_SIZE, shuffle=True),
                DataLoader(data, batch_size=32))
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    survivors = strategy.survivors
    (out / f"done{rank}.json").write_text(json.dumps({
        "sum": float(flat.sum()), "steps": trainer.global_step,
        "losses": [] if survivors is None else [list(map(int, lost))
                                               for _, lost, _, _ in survivors.losses],
        "recoveries": [] if survivors is None else [{"step": step, "began": began, "took_s": took}
                                                   for step, _, began, took in survivors.losses],
        "val_loss": float(trainer.callback_metrics["val_loss"]),
        "train_samples": float(trainer.callback_metrics["train_samples"]),
        "train_mean": float(trainer.callback_metrics["train_mean"]),
        "validations": record.validations,
        "exchanges": strategy.gossip_stats.get("exchanges", 0),  # (the last engine's)
        "joins": [] if survivors is None else [[list(map(int, new)), step, took, wall]
                                               for step, new, wall, took in survivors.joins],
        "joined": getattr(strategy, "elastic_parts", None) is not None
        and strategy.elastic_parts.newcomer is not None,
        "founders": None if getattr(strategy.elastic_parts, "founders", None) is None
        else list(strategy.elastic_parts.founders.founded),
        "started": STARTED,
    }))


if __name__ == "__main__":
    main()
