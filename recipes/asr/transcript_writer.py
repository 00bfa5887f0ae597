"""Prediction callback: write transcripts in Kaldi ``text`` format."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import BasePredictionWriter


class TranscriptWriter(BasePredictionWriter):
    """Writes ``<output_dir>/text.<rank>`` with one ``utt-id transcript`` line per utterance.

    Every rank writes its own shard; ``cat text.* | sort`` gives the whole set.
    """

    def __init__(self, output_dir: str = "predictions") -> None:
        super().__init__(write_interval="epoch")
        self.output_dir = Path(output_dir)

    def write_on_epoch_end(self, trainer: Trainer, pl_module: LightningModule,
                           predictions: Sequence[Any], batch_indices: Sequence[Any]) -> None:
        self.output_dir.mkdir(parents=True, exist_ok=True)
        rows = sorted(pair for batch in predictions for pair in batch)
        path = self.output_dir / f"text.{trainer.global_rank}"
        path.write_text("".join(f"{utt} {text}\n" for utt, text in rows))
