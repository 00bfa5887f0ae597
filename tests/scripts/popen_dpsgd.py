"""Started once; Lightning's popen launcher re-runs it for rank 1. Strategy chosen by name."""

import json
import sys
from pathlib import Path

import lightning as L
import torch
from gossip_cases import Recorder, Tiny
from torch.utils.data import DataLoader, TensorDataset

import lightning_gossip  # noqa: F401  (registers "dpsgd")

out = Path(sys.argv[1])
torch.manual_seed(0)
model = Tiny(lr=0.0)
data = TensorDataset(torch.randn(32, 5), torch.randint(0, 2, (32,)))
rec = Recorder(offset=1.0)
trainer = L.Trainer(strategy="dpsgd", accelerator="cpu", devices=2, max_epochs=1, callbacks=[rec],
                    logger=False, enable_checkpointing=False, enable_progress_bar=False,
                    enable_model_summary=False)
trainer.strategy.final_average = False
trainer.fit(model, DataLoader(data, batch_size=4))
print(type(trainer.strategy).__name__)
out.mkdir(parents=True, exist_ok=True)
(out / f"rank{trainer.global_rank}.json").write_text(json.dumps({"x0": rec.x0, "steps": rec.steps}))
