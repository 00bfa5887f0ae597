"""Rank script for tests/test_preemption.py: SLURM's requeue signal (``SIGUSR1``) reaches the
ranks at different steps, under Lightning's SLURM auto-requeue.

Started the way ``srun`` starts tasks (``SLURM_*`` variables: Lightning's ``SLURMEnvironment``
with ``auto_requeue=True`` numbers the ranks and installs its requeue handler), with a fake
``scontrol`` on ``PATH``. Runs one fit per strategy named in ``SPEC.json`` (``strategies``),
one after the other in the same processes: rank ``r`` sends itself ``SIGUSR1`` after optimizer
step ``signal_step + r * signal_spread`` (``adpsgd_epoch_end``: an ``adpsgd`` fit where
rank 0 is at its epoch-end meeting when the others take the signal, see
:class:`SignalAfterEpochEnd`; ``adpsgd_validation``: the same with a validation at the epoch
end, where rank 0 then is). Every rank writes ``OUT/<strategy>/rank<r>.json``: the
exception the fit ended with, Lightning's ``global_step`` and the strategy's ``step`` then, its
replica (flat, as a list) at that moment, and ``OUT/<strategy>`` is the ``default_root_dir``
(``hpc_ckpt_<n>.ckpt`` goes there). With ``lost`` (a spec of
``tests/scripts/emergency_ranks.py``), a last fit then loses a rank, results in ``OUT/lost``.
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
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_gossip


class Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(5, 2)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self.net(x), y), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


class Signal(Callback):
    """Sends SIGUSR1 to this rank after its step ``at``; records how the fit ended."""

    def __init__(self, at: int) -> None:
        self.at = at
        self.result: dict = {"signal_at_step": at}

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.global_step == self.at:
            os.kill(os.getpid(), signal.SIGUSR1)

    def on_exception(self, trainer, module, exception):
        strategy = trainer.strategy
        self.result.update(exception=type(exception).__name__, message=str(exception)[:500],
                           global_step=trainer.global_step, strategy_step=strategy.step,
                           replica=strategy._flat.pack().tolist())


class SignalAfterEpochEnd(Signal):
    """``adpsgd_epoch_end``: rank 0 (no signal) reaches its epoch end and waits at the meeting;
    the other ranks signal themselves after their batch ``at``, once rank 0 is past its last
    batch (a marker file), so they take the signal at their next batch start while rank 0 is
    in its epoch-end meeting."""

    def __init__(self, at: int, rank: int, marker: Path, last_batch: int) -> None:
        super().__init__(at)
        self.rank, self.marker, self.last_batch = rank, marker, last_batch

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if self.rank == 0:
            if batch_idx == self.last_batch:
                self.marker.touch()
            return
        if trainer.global_step == self.at:
            deadline = time.monotonic() + 60
            while not self.marker.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(1.0)  # rank 0 is at its epoch-end meeting by now
            os.kill(os.getpid(), signal.SIGUSR1)


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    rank = int(os.environ["SLURM_PROCID"])
    torch.manual_seed(0)
    x = torch.randn(96, 5)
    data = TensorDataset(x, (x.sum(-1) > 0).long())
    for name in spec["strategies"]:
        out = Path(spec["out"]) / name
        out.mkdir(parents=True, exist_ok=True)
        kwargs = {"timeout": spec.get("timeout", 60.0), "heartbeat_timeout": 10.0,
                  "consensus_every_n_steps": None}
        record = Signal(spec["signal_step"] + rank * spec["signal_spread"])
        if name == "dpsgd":
            strategy = lightning_gossip.DPSGDStrategy(**kwargs)
        elif name == "adpsgd":
            strategy = lightning_gossip.ADPSGDStrategy(**kwargs)
        else:  # adpsgd_epoch_end, adpsgd_validation: fixed shards, 96 / devices / 4 batches
            # per rank and epoch; the second validates at the epoch end (before the meeting)
            strategy = lightning_gossip.ADPSGDStrategy(shared_cursor=False, **kwargs)
            record = SignalAfterEpochEnd(spec["signal_step"], rank, out / "rank0_at_epoch_end",
                                         len(data) // spec["devices"] // 4 - 1)
        trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=spec["devices"],
                            max_epochs=spec.get("epochs", 20), callbacks=[record], logger=False,
                            enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, num_sanity_val_steps=0,
                            limit_val_batches=2 if name == "adpsgd_validation" else 0,
                            default_root_dir=str(out))
        try:
            trainer.fit(Tiny(), DataLoader(data, batch_size=4, shuffle=True),
                        DataLoader(data, batch_size=4))
            record.result.setdefault("exception", None)
        except SystemExit as e:  # SIGTERMException: every rank stops, requeued
            record.result["exit_code"] = e.code
        except BaseException as e:  # noqa: BLE001 - reported, then the next strategy is skipped
            record.result.setdefault("exception", type(e).__name__)
            (out / f"rank{rank}.json").write_text(json.dumps(record.result))
            raise
        (out / f"rank{rank}.json").write_text(json.dumps(record.result))
    if "lost" in spec:  # then a fit that loses a rank (tests/scripts/emergency_ranks.py)
        from emergency_ranks import run_lost

        run_lost({**spec["lost"], "out": str(Path(spec["out"]) / "lost"),
                  "devices": spec["devices"]}, rank)


if __name__ == "__main__":
    main()
