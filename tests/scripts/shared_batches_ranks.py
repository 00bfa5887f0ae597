"""Rank script: the ASR recipe's length buckets shared between ranks under adpsgd, a slow rank.

Launched by torchrun (every rank runs this file); one launch runs, in the same processes:

* ``adpsgd``: 3 epochs with the batch-size warm-up of ``swb2000.yaml`` (per-rank batch 2 -> 4
  over 2 epochs, ``reload_dataloaders_every_n_epochs=1``), validation every epoch, a checkpoint
  every epoch; rank ``SLOW_RANK`` sleeps after every training batch;
* ``resume``: ``adpsgd`` again from the last checkpoint, for one more epoch;
* ``dpsgd``: 2 epochs without reloading, the sharded buckets (synchronous).

Each rank writes ``OUT/rank<r>.json``: per fit and epoch the utterance ids of its training
batches in order, its validation runs, and the warnings raised on this rank.

    python -m torch.distributed.run --nproc-per-node 3 tests/scripts/shared_batches_ranks.py \\
        OUT CORPUS
"""

from __future__ import annotations

import json
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

import lightning_gossip
from recipes.asr.datamodule import KaldiDataModule
from recipes.asr.recognizer import SpeechRecognizer

SLOW_RANK = 1
SLOW_S = 0.4


class Recorder(Callback):
    """Utterance ids per training epoch, validation runs; the slow rank sleeps per batch."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.epochs: dict[int, list[list[str]]] = {}
        self.validations: list[dict[str, int]] = []
        self._val_batches = 0

    def on_train_batch_end(self, trainer: L.Trainer, module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.epochs.setdefault(trainer.current_epoch, []).append(list(batch.utt_ids))
        if self.rank == SLOW_RANK:
            time.sleep(SLOW_S)

    def on_validation_epoch_start(self, trainer: L.Trainer, module: Any) -> None:
        self._val_batches = 0

    def on_validation_batch_end(self, *args: Any, **kwargs: Any) -> None:
        self._val_batches += 1

    def on_validation_epoch_end(self, trainer: L.Trainer, module: Any) -> None:
        if not trainer.sanity_checking:
            self.validations.append({"epoch": trainer.current_epoch,
                                     "batches": self._val_batches})


def fit(name: str, corpus: Path, out: Path, rank: int, *, strategy: Any, max_epochs: int,
        reload: int, ckpt_path: str | None = None) -> dict[str, Any]:
    torch.manual_seed(0)
    data = KaldiDataModule(train_dir=str(corpus / "train"), val_dir=str(corpus / "dev"),
                           batch_size=4, batch_size_warmup_epochs=2, initial_batch_size=2,
                           eval_batch_size=4, cache_features=True, seed=3)
    model = SpeechRecognizer(num_layers=1, hidden_size=16, lr=0.005, warmup_steps=0)
    recorder = Recorder(rank)
    checkpoint = ModelCheckpoint(dirpath=out / "ckpt", save_last=True, save_top_k=0)
    trainer = L.Trainer(
        strategy=strategy, accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]),
        max_epochs=max_epochs, reload_dataloaders_every_n_epochs=reload,
        use_distributed_sampler=False, num_sanity_val_steps=0, logger=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[recorder, checkpoint],
        default_root_dir=out / name)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, datamodule=data, ckpt_path=ckpt_path)
    return {"epochs": {str(e): b for e, b in recorder.epochs.items()},
            "validations": recorder.validations, "global_step": trainer.global_step,
            "last_epoch_batches": model.last_epoch_batches,
            "warnings": sorted({str(w.message) for w in caught})}


def main() -> None:
    out, corpus = Path(sys.argv[1]), Path(sys.argv[2])
    rank = int(os.environ["RANK"])
    results: dict[str, Any] = {"rank": rank}

    def adpsgd() -> lightning_gossip.ADPSGDStrategy:
        return lightning_gossip.ADPSGDStrategy(process_group_backend="gloo",
                                               consensus_every_n_steps=None, timeout=120)

    results["adpsgd"] = fit("adpsgd", corpus, out, rank, strategy=adpsgd(), max_epochs=3,
                            reload=1)
    results["resume"] = fit("resume", corpus, out, rank, strategy=adpsgd(), max_epochs=4,
                            reload=1, ckpt_path=str(out / "ckpt" / "last.ckpt"))
    results["dpsgd"] = fit("dpsgd", corpus, out, rank, max_epochs=2, reload=0,
                           strategy=lightning_gossip.DPSGDStrategy(
                               process_group_backend="gloo", consensus_every_n_steps=None))
    (out / f"rank{rank}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main()
