"""Rank script for tests/test_faults.py: one small fit with one injected fault.

Run under Lightning's launcher (``python fault_cases.py SPEC.json``, it starts the other ranks)
or torchrun (every rank runs it). ``SPEC.json`` holds a dict (keys below, all optional). Every
rank prints ``EVENT {json}`` lines (``time`` is ``time.time()``, comparable between ranks of one
machine) and writes its pid to ``OUT/pid<rank>``:

* ``start``: training started; ``fault``: the fault was injected; ``error``: the fit raised
  (``message`` names the culprit); ``done``: the fit finished (``steps``: optimizer steps taken);
  ``exit``: the interpreter is exiting (``atexit``).

Faults (``fault``: ``{"kind", "rank", "step"}``): ``raise`` (an exception in a training step),
``freeze`` (SIGSTOP of itself), ``freeze_idle`` (adpsgd: SIGSTOP of itself once its gossip
thread has finished its exchanges, so that no peer is left waiting on it), ``sigterm`` (SIGTERM
to itself), ``sigint_launcher`` (SIGINT to the launcher: the parent process under torchrun,
itself under Lightning's launcher), ``sigkill`` (SIGKILL of itself), ``nan`` (its weights become
NaN). A fault with ``"restart": k`` fires only in torchrun's restart round k. With ``"hook"``
(``on_validation_start`` or ``on_train_end``) it fires in that callback hook instead of after a
batch: callbacks run before the strategy's hook of the same name, so its peers then wait in a
sync point (the consensus evaluation, the final average).

Restarts: ``checkpoint_dir`` adds ``ModelCheckpoint(dirpath, save_last=True)`` (epoch ends) and
``fit(ckpt_path="last")``; ``done`` then reports the held-out accuracy ``val_acc`` (the task is
a fixed linear rule, so it is learnable) and the epoch training started from.

Every rank whose fit raised also writes ``OUT/error<rank>`` after its ``error`` line. With
``await_peer_errors_s`` the rank whose fault fired waits, after its fit raised and before it
exits, until every other rank has written that file (at most that many seconds): a launcher
that stops the remaining ranks once one has exited can then not stop a peer before it has
failed on its own and named the culprit. With ``await_errors_of`` (a list of ranks) every rank
whose fit raised waits so for those ranks (a fault that fires no error, such as a freeze).
"""

from __future__ import annotations

import atexit
import json
import os
import random
import signal
import sys
import threading
import time
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_gossip


def event(name: str, **fields) -> None:
    """Print one ``EVENT`` line for the test."""
    rank = int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")))
    print("EVENT " + json.dumps({"event": name, "rank": rank, "time": time.time(), **fields}),
          flush=True)


class Tiny(L.LightningModule):
    """A linear classifier; ``sleep_s`` per step makes a rank slow."""

    def __init__(self, sleep_s: float = 0.0):
        super().__init__()
        self.net = nn.Linear(5, 2)
        self.sleep_s = sleep_s

    def training_step(self, batch, batch_idx):
        if self.sleep_s:
            time.sleep(self.sleep_s)
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self.net(x), y), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


class Fault(Callback):
    """Injects the fault of the spec on its rank at its step."""

    def __init__(self, fault: dict | None, delay_ms: float = 0.0, seed: int = 0):
        self.fault = fault or {}
        self.fired = False
        self.delay_ms = delay_ms
        self.rng = random.Random(seed)

    def on_train_start(self, trainer, module):
        self.start_epoch = trainer.current_epoch
        event("start", epoch=trainer.current_epoch, step=trainer.global_step)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if self.delay_ms:
            time.sleep(self.rng.uniform(0, self.delay_ms) / 1000)
        if trainer.global_step == self.fault.get("step"):
            self.maybe_fire(trainer, module, None)

    def on_validation_start(self, trainer, module):
        self.maybe_fire(trainer, module, "on_validation_start")

    def on_train_end(self, trainer, module):
        self.maybe_fire(trainer, module, "on_train_end")

    def maybe_fire(self, trainer, module, hook: str | None) -> None:
        """Inject the fault if this is its rank, restart round and hook (``None``: a batch)."""
        f = self.fault
        if not f or f["rank"] != trainer.global_rank or f.get("hook") != hook:
            return
        if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) != f.get("restart", 0):
            return
        self.fault = {}  # once
        self.fired = True
        event("fault", kind=f["kind"], hook=hook)
        if f["kind"] == "raise":
            raise RuntimeError(f"injected failure on rank {trainer.global_rank}")
        if f["kind"] == "freeze":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif f["kind"] == "freeze_idle":
            # The training thread is here, so no new snapshot comes: wait until the gossip
            # thread has exchanged the last one (its delta posted: ``gossiped`` reaches the
            # steps that snapshot covered), then freeze holding the lock (no other exchange
            # can start).
            shared = trainer.strategy.engine._shared
            box = shared.mailbox
            with shared.cv:
                while box.fresh_ready or box.gossiped < box.fresh_step:
                    shared.cv.wait(0.01)
                os.kill(os.getpid(), signal.SIGSTOP)
        elif f["kind"] == "sigterm":
            os.kill(os.getpid(), signal.SIGTERM)
        elif f["kind"] == "nan":
            with torch.no_grad():
                for p in module.parameters():
                    p.fill_(float("nan"))
        elif f["kind"] == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif f["kind"] == "sigint_launcher":
            launcher = os.getppid() if "TORCHELASTIC_RUN_ID" in os.environ else os.getpid()
            os.kill(launcher, signal.SIGINT)


def await_peer_errors(out: Path, rank: int, ranks: list[int], limit_s: float) -> None:
    """Wait until every rank of ``ranks`` but ``rank`` has written ``OUT/error<r>`` (at most
    ``limit_s``)."""
    deadline = time.monotonic() + limit_s
    peers = [r for r in ranks if r != rank]
    while time.monotonic() < deadline and not all((out / f"error{r}").exists() for r in peers):
        time.sleep(0.1)


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    out = Path(spec["out"])
    torchrun = "TORCHELASTIC_RUN_ID" in os.environ
    rank = int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")))
    (out / f"pid{rank}").write_text(str(os.getpid()))
    atexit.register(lambda: event("exit", threads=[
        t.name for t in threading.enumerate()
        if t is not threading.main_thread() and t.is_alive() and not t.daemon]))
    torch.manual_seed(0)
    n = spec.get("samples", 64)
    rule = torch.randn(5)
    x, x_val = torch.randn(n, 5), torch.randn(512, 5)
    data = TensorDataset(x, (x @ rule > 0).long())
    kwargs = dict(spec.get("strategy_kwargs", {}))
    kwargs.setdefault("heartbeat_timeout", spec.get("heartbeat_timeout", 60.0))
    if spec.get("mismatch_rank") == rank:
        kwargs["seed"] = kwargs.get("seed", 0) + 1
    cls = (lightning_gossip.ADPSGDStrategy if spec.get("strategy", "adpsgd") == "adpsgd"
           else lightning_gossip.DPSGDStrategy)
    strategy = cls(timeout=spec.get("timeout", 300.0), **kwargs)
    sleep_s = spec.get("slow_s", 0.0) if spec.get("slow_rank") == rank else 0.0
    callbacks: list[Callback] = [Fault(spec.get("fault"), spec.get("delay_ms", 0.0),
                                       seed=spec.get("seed", 0) * 100 + rank)]
    if spec.get("early_stopping"):
        from lightning.pytorch.callbacks import EarlyStopping

        callbacks.append(EarlyStopping("val_loss", patience=1))
    if spec.get("checkpoint_dir"):
        from lightning.pytorch.callbacks import ModelCheckpoint

        # not save_top_k=0: Lightning 2.6 then writes last.ckpt only at the end of fit
        callbacks.append(ModelCheckpoint(dirpath=spec["checkpoint_dir"], save_last=True,
                                         every_n_epochs=1))
    trainer = L.Trainer(
        strategy=strategy, accelerator="cpu", devices=spec.get("devices", 2),
        max_epochs=spec.get("epochs", 2), max_time=spec.get("max_time"),
        callbacks=callbacks, logger=False, enable_checkpointing=bool(spec.get("checkpoint_dir")),
        enable_progress_bar=False, enable_model_summary=False,
        limit_val_batches=spec.get("val_batches", 0),
    )
    del torchrun
    model = Tiny(sleep_s)
    try:
        trainer.fit(model, DataLoader(data, batch_size=4, shuffle=True),
                    DataLoader(data, batch_size=8) if spec.get("val_batches") else None,
                    ckpt_path="last" if spec.get("checkpoint_dir") else None)
    except BaseException as e:
        event("error", type=type(e).__name__, message=str(e)[:2000])
        (out / f"error{rank}").touch()
        awaited = spec.get("await_errors_of")  # every rank that raised waits for these
        if spec.get("await_peer_errors_s") and (callbacks[0].fired or awaited):
            await_peer_errors(out, rank, awaited or list(range(spec.get("devices", 2))),
                              spec["await_peer_errors_s"])
        raise
    with torch.no_grad():
        acc = float((model.net(x_val).argmax(-1) == (x_val @ rule > 0).long()).float().mean())
    checksum = float(sum(p.double().sum() for p in model.parameters()))
    event("done", steps=trainer.global_step, epochs=trainer.current_epoch, val_acc=acc,
          checksum=checksum, delay_ms=spec.get("delay_ms", 0),
          start_epoch=callbacks[0].start_epoch,
          restart=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))


if __name__ == "__main__":
    main()
