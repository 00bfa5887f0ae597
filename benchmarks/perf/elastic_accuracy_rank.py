"""Rank program of ``benchmarks/perf/elastic_accuracy.py``: a real workload trained by an
elastic strategy, one rank lost at mid-run or none, and the final metric written.

Started the way ``srun`` starts tasks (``SLURM_*`` variables)::

    python -m benchmarks.perf.elastic_accuracy_rank OUT WORKLOAD SEED VICTIM [STRATEGY]

``WORKLOAD``: ``digits`` (an MLP 64-128-10 on scikit-learn's digits, 80/20 split, SGD with
momentum, 16 epochs; the metric: top-1 % of the exact replica average on the 360 held-out
images, rank 0) or ``asr`` (the recipe itself, through its LightningCLI, with the demo's
``configs/synth.yaml`` on the race's corpus ``data/asr-race``; the metric: the last epoch's dev
WER % as the recipe logs it). ``VICTIM`` -1: nobody is lost; otherwise that rank ``SIGKILL``\\ s
itself at the start of batch :data:`LOSS_BATCH` of the middle epoch (:class:`LoseRank`).
``STRATEGY``: ``adpsgd`` (default) or ``dpsgd``, always ``elastic=True``,
``heartbeat_timeout`` :data:`HEARTBEAT_S`. ``SLURM_NNODES`` > 1: ``hierarchical=True`` on
that many nodes (``adpsgd``; a lost rank's node leaves). Rank 0 writes ``OUT/result.json``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback

ROOT = Path(__file__).resolve().parents[2]
HEARTBEAT_S = 5.0
LOSS_BATCH = 10
EPOCHS = {"digits": 16, "asr": 10}
ASR_CORPUS = ROOT / "data" / "asr-race"
NODES = int(os.environ.get("SLURM_NNODES", "1"))
DEVICES = int(os.environ.get("SLURM_NTASKS", "1")) // NODES


class LoseRank(Callback):
    """Rank ``victim`` kills itself (``SIGKILL``) at the start of batch ``batch`` of epoch
    ``epoch``, after writing the wall time to ``out/victim.json``: a node lost mid-epoch.
    A plain callback, so the recipe's CLI takes it (``--trainer.callbacks+={"class_path":
    "benchmarks.perf.elastic_accuracy_rank.LoseRank", ...}``)."""

    def __init__(self, victim: int, epoch: int, batch: int, out: str) -> None:
        self.victim, self.epoch, self.batch, self.out = victim, epoch, batch, Path(out)

    def on_train_batch_start(self, trainer: L.Trainer, module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if (trainer.global_rank == self.victim and trainer.current_epoch == self.epoch
                and batch_idx == self.batch):
            (self.out / "victim.json").write_text(json.dumps({"t": time.time()}))
            os.kill(os.getpid(), signal.SIGKILL)


def strategy_kwargs(seed: int) -> dict[str, Any]:
    """The strategy's options (``seed``: its pairing or topology and the shared cursor's order)."""
    return {"elastic": True, "heartbeat_timeout": HEARTBEAT_S, "timeout": 300, "seed": seed,
            **({"hierarchical": True} if NODES > 1 else {})}


def digits(out: Path, seed: int, victim: int, name: str) -> dict[str, Any]:
    """The digits fit; rank 0's result (top-1 % of the averaged replica)."""
    from lightning.pytorch.loggers import CSVLogger
    from torch.utils.data import DataLoader

    import lightning_gossip
    from benchmarks.common.workloads import Classifier, digits_80_20

    class Digits(Classifier):
        def validation_step(self, batch: Any, batch_idx: int) -> None:
            inputs, target = batch
            self.log("val_acc", (self.net(inputs).argmax(-1) == target).float().mean(),
                     sync_dist=True)

    L.seed_everything(seed, verbose=False)
    train, x_test, y_test = digits_80_20()
    cls = {"adpsgd": lightning_gossip.ADPSGDStrategy, "dpsgd": lightning_gossip.DPSGDStrategy}
    strategy = cls[name](**strategy_kwargs(seed))
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", num_nodes=NODES,
                        devices=DEVICES, max_epochs=EPOCHS["digits"],
                        logger=CSVLogger(out, name="logs", version=0),
                        callbacks=[LoseRank(victim, EPOCHS["digits"] // 2, LOSS_BATCH, str(out))],
                        enable_progress_bar=False, enable_model_summary=False)
    model = Digits([64, 128, 10], lr=0.05)
    val = torch.utils.data.TensorDataset(x_test, y_test)
    trainer.fit(model, DataLoader(train, batch_size=8, shuffle=True),
                DataLoader(val, batch_size=120))
    return {"metric": "test top-1 %", "value": round(100 * model.accuracy(x_test, y_test), 3),
            "higher_is_better": True, "steps": trainer.global_step}


def asr(out: Path, seed: int, victim: int, name: str) -> dict[str, Any]:
    """The recipe through its CLI; rank 0's result (the last epoch's dev WER %)."""
    from recipes.asr.cli import main as cli

    strategy = {"class_path": f"lightning_gossip.{name.upper()}Strategy",
                "init_args": strategy_kwargs(seed)}
    lose = {"class_path": "benchmarks.perf.elastic_accuracy_rank.LoseRank",
            "init_args": {"victim": victim, "epoch": EPOCHS["asr"] // 2, "batch": LOSS_BATCH,
                          "out": str(out)}}
    run = cli(["fit", "--config", str(ROOT / "recipes" / "asr" / "configs" / "synth.yaml"),
               f"--seed_everything={seed}", f"--data.seed={seed}",
               f"--trainer.strategy={json.dumps(strategy)}",
               f"--trainer.devices={DEVICES}", f"--trainer.num_nodes={NODES}",
               f"--trainer.max_epochs={EPOCHS['asr']}",
               f"--trainer.default_root_dir={out}",
               f"--trainer.logger.init_args.save_dir={out}",
               f"--trainer.callbacks+={json.dumps(lose)}",
               "--trainer.enable_progress_bar=false",
               f"--data.train_dir={ASR_CORPUS / 'train'}", f"--data.val_dir={ASR_CORPUS / 'dev'}",
               "--data.test_dir=null", f"--model.report_dir={out / 'report'}"])
    wer = float(run.trainer.callback_metrics["val_wer"])
    return {"metric": "dev WER %", "value": round(100 * wer, 3), "higher_is_better": False,
            "steps": run.trainer.global_step}


def main() -> None:
    out, workload, seed, victim = (Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]),
                                   int(sys.argv[4]))
    name = sys.argv[5] if len(sys.argv) > 5 else "adpsgd"
    t0 = time.time()
    result = {"digits": digits, "asr": asr}[workload](out, seed, victim, name)
    if int(os.environ["SLURM_PROCID"]) == 0:
        (out / "result.json").write_text(json.dumps(dict(
            result, workload=workload, seed=seed, victim=victim, strategy=name,
            fit_s=round(time.time() - t0, 1))))


if __name__ == "__main__":
    main()
