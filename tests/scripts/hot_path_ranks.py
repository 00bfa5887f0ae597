"""Rank script for tests/test_hot_path.py: a dpsgd fit with SIGTERM sent to one rank, counting
the communication calls on the default (world) group while the training steps run.

Run under torchrun: ``python -m torch.distributed.run ... hot_path_ranks.py SPEC.json``.
``SPEC.json`` keys: ``out`` (folder), ``strategy_kwargs`` (for ``DPSGDStrategy``), ``sigterm``
(``{"rank", "step"}``: that rank sends SIGTERM to itself after that many optimizer steps),
``steps`` (``max_steps``). Every rank writes ``OUT/rank<r>.json``: the exception the fit ended
with, the step it stopped at (``global_step`` and the strategy's ``step`` when Lightning called
``on_exception``), the stop step the rank agreed on, and the counts of ``torch.distributed``
calls on the default group inside and outside the training steps, and on other groups.

The counting wraps the public ``torch.distributed`` functions by name, calling the originals
unchanged: a call counts as "default group" when its ``group`` is ``None`` or ``WORLD``.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import sys
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback, OnExceptionCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_gossip

COUNTED = ("broadcast", "all_reduce", "all_gather", "all_gather_into_tensor", "reduce",
           "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single",
           "gather", "scatter", "barrier", "monitored_barrier", "broadcast_object_list",
           "all_gather_object", "gather_object", "scatter_object_list", "send", "recv",
           "isend", "irecv", "batch_isend_irecv")


class Counter:
    """Counts ``torch.distributed`` calls by group while :attr:`in_steps` says where we are."""

    def __init__(self) -> None:
        self.in_steps = False
        self.default_in_steps: dict[str, int] = {}
        self.default_outside = 0
        self.other_groups_in_steps = 0

    def wrap(self) -> None:
        for name in COUNTED:
            original = getattr(dist, name, None)
            if original is not None:
                setattr(dist, name, self._counting(name, original))

    def _counting(self, name: str, fn):
        @functools.wraps(fn)
        def counted(*args, **kwargs):
            group = kwargs.get("group")
            if name == "batch_isend_irecv":
                ops = args[0] if args else kwargs.get("p2p_op_list", [])
                group = ops[0].group if ops else None
            default = group is None or group is dist.group.WORLD
            if default and self.in_steps:
                self.default_in_steps[name] = self.default_in_steps.get(name, 0) + 1
            elif default:
                self.default_outside += 1
            elif self.in_steps:
                self.other_groups_in_steps += 1
            return fn(*args, **kwargs)

        return counted


COUNTER = Counter()


class Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(5, 2)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


class Record(Callback):
    """Opens the counting window at the first batch, closes it on exception, sends SIGTERM."""

    def __init__(self, sigterm: dict | None) -> None:
        self.sigterm = sigterm or {}
        self.result: dict = {}

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        COUNTER.in_steps = True

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        s = self.sigterm
        if s and s["rank"] == trainer.global_rank and trainer.global_step == s["step"]:
            self.result["sigterm_sent_at_step"] = trainer.global_step
            os.kill(os.getpid(), signal.SIGTERM)

    def on_exception(self, trainer, module, exception):
        COUNTER.in_steps = False
        self.result.update(exception=type(exception).__name__,
                           global_step=trainer.global_step,
                           strategy_step=trainer.strategy.step,
                           stop_at=trainer.strategy.engine.agreement.stop_at)

    def on_train_end(self, trainer, module):
        COUNTER.in_steps = False


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    out = Path(spec["out"])
    rank = int(os.environ["RANK"])
    COUNTER.wrap()
    torch.manual_seed(0)
    x = torch.randn(64, 5)
    data = TensorDataset(x, (x.sum(-1) > 0).long())
    strategy = lightning_gossip.DPSGDStrategy(consensus_every_n_steps=None, timeout=300.0,
                                             **spec.get("strategy_kwargs", {}))
    record = Record(spec.get("sigterm"))
    callbacks: list[Callback] = [OnExceptionCheckpoint(dirpath=str(out)), record]
    callbacks.reverse()  # record first: its on_exception closes the window before the save
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=spec["devices"],
                        max_steps=spec.get("steps", 1000), max_epochs=-1, callbacks=callbacks,
                        logger=False, enable_checkpointing=True, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0)
    exit_code = None
    try:
        trainer.fit(Tiny(), DataLoader(data, batch_size=4, shuffle=True))
        record.result.setdefault("exception", None)
    except SystemExit as e:  # SIGTERMException
        exit_code = e.code
    record.result.update(rank=rank, exit_code=exit_code,
                         default_in_steps=COUNTER.default_in_steps,
                         default_outside=COUNTER.default_outside,
                         other_groups_in_steps=COUNTER.other_groups_in_steps,
                         final_global_step=trainer.global_step)
    (out / f"rank{rank}.json").write_text(json.dumps(record.result))


if __name__ == "__main__":
    main()
