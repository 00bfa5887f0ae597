"""Rank script for tests/test_emergency_checkpoint.py and testbed/emergency_fuzz.py: one rank
is lost mid-fit (``SIGKILL`` or ``SIGSTOP``), the survivors write the emergency checkpoint.

Started the way ``srun`` starts tasks (``SLURM_*`` variables, no launcher that would end the
survivors). ``SPEC.json`` keys: ``out``, ``devices``, ``strategy`` (``dpsgd``/``adpsgd``),
``victim`` (rank), ``kind`` (``kill``/``stop``), ``step`` (the victim is lost after that
optimizer step, ``delay`` seconds later: a thread sends the signal, so it can fall anywhere in a
step), ``heartbeat_timeout``. Checkpoints go to ``OUT/ckpts`` (a ``ModelCheckpoint`` with
``save_last``). The victim writes ``OUT/victim.json`` (its pid, the wall time of the signal)
before the signal; every survivor writes ``OUT/rank<r>.json``: the exception, the ranks it
names, its replica when Lightning called ``on_exception``, and the wall time it was done. The
lowest survivor then kills a stopped victim (nobody else would).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_gossip


class Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(5, 2)

    def training_step(self, batch, batch_idx):
        time.sleep(0.02)  # a step that takes a little time, as a real one does
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


class Lose(Callback):
    """The victim loses itself after step ``step`` (+ ``delay`` s); every rank records."""

    def __init__(self, spec: dict, rank: int) -> None:
        self.spec, self.rank = spec, rank
        self.result: dict = {"rank": rank}

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        spec = self.spec
        if self.rank != spec["victim"] or trainer.global_step != spec["step"]:
            return
        sig = signal.SIGKILL if spec["kind"] == "kill" else signal.SIGSTOP
        out = Path(spec["out"])

        def lose() -> None:
            time.sleep(spec.get("delay", 0.0))
            (out / "victim.json").write_text(json.dumps(
                {"pid": os.getpid(), "t": time.time(), "global_step": trainer.global_step}))
            os.kill(os.getpid(), sig)

        threading.Thread(target=lose, daemon=True).start()

    def on_exception(self, trainer, module, exception):
        strategy = trainer.strategy
        from lightning_gossip.strategies.resilience import lost_peer

        lost = lost_peer(exception)  # adpsgd's gossip thread: a RuntimeError caused by it
        self.result.update(exception=type(exception).__name__, message=str(exception)[:600],
                           lost=type(lost).__name__ if lost is not None else None,
                           ranks=list(lost.ranks) if lost is not None else [],
                           global_step=trainer.global_step,
                           replica=strategy._flat.pack().tolist())


def run_lost(spec: dict, rank: int) -> None:
    """One fit in which ``spec["victim"]`` is lost; results into ``spec["out"]``; never
    returns (``sys.exit``: 3 when the fit failed, else 0)."""
    out = Path(spec["out"])
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    x = torch.randn(256, 5)
    data = TensorDataset(x, (x.sum(-1) > 0).long())
    kwargs = {"timeout": 120.0, "heartbeat_timeout": spec["heartbeat_timeout"],
              "consensus_every_n_steps": None}
    strategy = (lightning_gossip.DPSGDStrategy(**kwargs) if spec["strategy"] == "dpsgd"
                else lightning_gossip.ADPSGDStrategy(**kwargs))
    record = Lose(spec, rank)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=spec["devices"],
                        max_epochs=spec.get("epochs", 50),
                        callbacks=[record, ModelCheckpoint(dirpath=out / "ckpts", save_last=True)],
                        logger=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, default_root_dir=str(out))
    code = 0
    try:
        trainer.fit(Tiny(), DataLoader(data, batch_size=4, shuffle=True))
        record.result.setdefault("exception", None)
    except BaseException as e:  # noqa: BLE001 - the expected outcome: recorded
        record.result.setdefault("exception", type(e).__name__)
        code = 3
    record.result["t_done"] = time.time()
    (out / f"rank{rank}.json").write_text(json.dumps(record.result))
    victim = out / "victim.json"
    survivors = [r for r in range(spec["devices"]) if r != spec["victim"]]
    if victim.exists() and rank == survivors[0] and spec["kind"] == "stop":
        # the others may still be writing: give them their time, then end the frozen victim
        deadline = time.time() + 60
        while time.time() < deadline and not all(
                (out / f"rank{r}.json").exists() for r in survivors):
            time.sleep(0.2)
        os.kill(json.loads(victim.read_text())["pid"], signal.SIGKILL)
    sys.exit(code)  # an interpreter teardown with a lost peer's waits abandoned (issue 48)


if __name__ == "__main__":
    run_lost(json.loads(Path(sys.argv[1]).read_text()), int(os.environ["SLURM_PROCID"]))
