"""Indicative step time of ``node_allreduce="after_backward"`` against ``"overlapped"``
(hierarchical dpsgd and adpsgd with a bf16 wire, 2 torchrun nodes x 2 ranks, gloo, CPU) on a
2-layer BLSTM of about the ASR race's size (2.8 M parameters), random data, Adam.

Per case: the median step time (wall time between ``on_train_batch_end`` calls, the first 3
dropped) and the median time the training thread spends in the node's gradient all-reduce
outside backward (``NodeAverager.average_gradients``, or the overlapped form's finish: the
buckets not yet started, the wait, the copy back), averaged over ranks; two rounds, the cases
alternating. A quick check, not a benchmark: no idle-machine check, no repeats beyond two.

    python -m benchmarks.perf.node_overlap_time launch OUT [STEPS]
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_gossip
from lightning_gossip import overlapped_allreduce
from lightning_gossip.node_averaging import NodeAverager

EXPOSED: list[float] = []
_avg = NodeAverager.average_gradients
_fin = overlapped_allreduce.OverlappedAllReduce._finish


def _timed(fn):
    def run(self, *a, **k):
        t = time.perf_counter()
        out = fn(self, *a, **k)
        EXPOSED.append(time.perf_counter() - t)
        return out
    return run


NodeAverager.average_gradients = _timed(_avg)
overlapped_allreduce.OverlappedAllReduce._finish = _timed(_fin)


class BLSTM(L.LightningModule):
    """2 bidirectional LSTM layers of 256 over 320 features, a 40-class output per frame."""

    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(320, 256, num_layers=2, bidirectional=True, batch_first=True)
        self.out = nn.Linear(512, 40)

    def training_step(self, batch, i):
        x, y = batch
        h, _ = self.lstm(x)
        return nn.functional.cross_entropy(self.out(h).reshape(-1, 40), y.reshape(-1))

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


class Times(Callback):
    """The wall time at every batch end."""

    def __init__(self):
        self.t: list[float] = []

    def on_train_batch_end(self, *a):
        self.t.append(time.perf_counter())


def worker(out: Path, steps: int) -> None:
    """One rank: every case twice, in turn; writes OUT/rank<r>.json."""
    rank = int(os.environ["RANK"])
    torch.manual_seed(rank)
    x = torch.randn(steps * 8 * 4, 50, 320)
    y = torch.randint(0, 40, (steps * 8 * 4, 50))
    res = {}
    for _round in range(2):
        for strat in ("dpsgd", "adpsgd"):
            for mode in ("after_backward", "overlapped"):
                cls = lightning_gossip.DPSGDStrategy if strat == "dpsgd" else \
                    lightning_gossip.ADPSGDStrategy
                kw = {"timeout": 120} if strat == "adpsgd" else {}
                s = cls(hierarchical=True, wire_dtype="bf16", node_allreduce=mode,
                        consensus_every_n_steps=None, **kw)
                times = Times()
                EXPOSED.clear()
                trainer = L.Trainer(strategy=s, accelerator="cpu", devices=2, num_nodes=2,
                                    max_steps=steps, callbacks=[times], logger=False,
                                    enable_progress_bar=False, enable_model_summary=False,
                                    enable_checkpointing=False, limit_val_batches=0)
                trainer.fit(BLSTM(), DataLoader(TensorDataset(x, y), batch_size=8))
                d = [b - a for a, b in zip(times.t, times.t[1:])][3:]
                key = f"{strat}_{mode}"
                res.setdefault(key, {"step_s": [], "exposed_s": []})
                res[key]["step_s"].append(statistics.median(d))
                res[key]["exposed_s"].append(statistics.median(EXPOSED[3:]))
    (out / f"rank{rank}.json").write_text(json.dumps(res))


def launch(out: Path, steps: int) -> None:
    """Start 2 torchrun nodes of 2 ranks and print the table."""
    from testbed.launch import base_env, free_port, launch_processes, torchrun_command
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    cmds = [(torchrun_command(Path(__file__), "worker", str(out), str(steps), nprocs=2, nnodes=2,
                              node_rank=n, port=port), base_env()) for n in range(2)]
    r = launch_processes(cmds, 3000)
    (out / "output.txt").write_text(r.stdout)
    print("rc", r.returncode)
    ranks = [json.loads((out / f"rank{i}.json").read_text()) for i in range(4)]
    for key in ranks[0]:
        step = [statistics.mean(r[key]["step_s"][k] for r in ranks) for k in range(2)]
        exp = [statistics.mean(r[key]["exposed_s"][k] for r in ranks) for k in range(2)]
        print(f"{key:24s} step s (round 1, 2): {step[0]:.3f} {step[1]:.3f}   "
              f"exposed node all-reduce s: {exp[0]:.4f} {exp[1]:.4f}")


if __name__ == "__main__":
    if sys.argv[1] == "worker":
        worker(Path(sys.argv[2]), int(sys.argv[3]))
    else:
        launch(Path(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else 20)
