"""One rank of an emulated-cluster case (started by ``benchmarks/cluster.py`` through torchrun).

Usage (inside a node's namespace, by torchrun)::

    python benchmarks/cluster_worker.py SPEC.json

For every case of the spec, in order, in the same processes (start-up is paid once), it trains
an MLP of about ``model_mb`` MB on scikit-learn's digits (80/20 split, fixed seed) with the
case's strategy for ``epochs`` epochs, then averages the replicas exactly and measures held-out
accuracy. Local rank 0 of every node reads its node's link counters
(``/sys/class/net/<GLOO_SOCKET_IFNAME>/statistics``, this namespace's view) when training
starts and after every rank has finished training, so the bytes counted are those of the
training steps (plus one barrier), not of start-up or of the evaluation. Every rank writes
``<case>/rank<r>.json`` next to the spec when the case is done.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def hidden_width(model_mb: float, in_features: int = 64, classes: int = 10) -> int:
    """Width ``w`` of a 2-hidden-layer MLP whose fp32 parameters take about ``model_mb`` MB.

    >>> hidden_width(4.0)
    962
    """
    params = model_mb * 1e6 / 4
    # in*w + w + w*w + w + w*classes + classes = params
    b = in_features + 2 + classes
    return max(8, int((-b + math.sqrt(b * b + 4 * (params - classes))) / 2))


def param_count(width: int, in_features: int = 64, classes: int = 10) -> int:
    """Parameters of the 2-hidden-layer MLP of ``width``.

    >>> param_count(962)
    998566
    """
    return in_features * width + width + width * width + width + width * classes + classes


def read_counters(iface: str) -> dict[str, int]:
    """This namespace's byte/packet counters of ``iface``."""
    base = Path("/sys/class/net") / iface / "statistics"
    return {k: int((base / k).read_text()) for k in ("tx_bytes", "rx_bytes", "tx_packets",
                                                        "rx_packets")}


def main(spec_path: Path) -> None:
    """Run the cases listed in ``spec_path``, in order, on this rank; one result file each."""
    import lightning as L
    import numpy as np
    import torch
    import torch.distributed as dist
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.strategies import DDPStrategy
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    import lightning_gossip

    spec = json.loads(spec_path.read_text())
    out = spec_path.parent
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank, node = int(os.environ["LOCAL_RANK"]), int(os.environ["GROUP_RANK"])
    iface = os.environ["GLOO_SOCKET_IFNAME"]
    torch.set_num_threads(1)
    timeout = timedelta(seconds=float(spec["pg_timeout_s"]))
    dist.init_process_group("gloo", timeout=timeout)  # Lightning reuses it

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int64)
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=0.2, random_state=0, stratify=y)
    train = TensorDataset(torch.from_numpy(x_tr), torch.from_numpy(y_tr))
    x_te_t, y_te_t = torch.from_numpy(x_te), torch.from_numpy(y_te)
    width = int(spec["width"])

    class MLP(L.LightningModule):
        """64 -> width -> width -> 10, ReLU, SGD with momentum."""

        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(64, width), nn.ReLU(), nn.Linear(width, width),
                                     nn.ReLU(), nn.Linear(width, 10))

        def forward(self, inputs: torch.Tensor) -> torch.Tensor:
            return self.net(inputs)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            inputs, target = batch
            return nn.functional.cross_entropy(self(inputs), target)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=spec["lr"], momentum=0.9)

    class Meter(Callback):
        """Epoch times on every rank; link counters at train start on local rank 0."""

        def __init__(self) -> None:
            self.epoch_s: list[float] = []
            self.start: float | None = None
            self.train_start: float | None = None
            self.counters_start: dict[str, int] | None = None
            self.samples = 0

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            self.train_start = time.perf_counter()
            if local_rank == 0:
                self.counters_start = read_counters(iface)

        def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
            self.start = time.perf_counter()

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                               batch_idx: int) -> None:
            self.samples += len(batch[0])

        def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
            assert self.start is not None
            self.epoch_s.append(time.perf_counter() - self.start)

    def run_one(case: dict[str, Any]) -> None:
        kind, kwargs = case["strategy"], dict(case["kwargs"])
        case_dir = out / case["name"]
        if kind == "ddp":
            strategy: Any = DDPStrategy(process_group_backend="gloo", timeout=timeout)
        else:
            cls = {"dpsgd": lightning_gossip.DPSGDStrategy,
                   "adpsgd": lightning_gossip.ADPSGDStrategy}[kind]
            # Replicas are averaged below, after the counters are read, so the bytes counted
            # are those of the training steps only.
            kwargs.update(final_average=False, consensus_every_n_steps=None,
                          process_group_backend="gloo", timeout=timeout)
            strategy = cls(**kwargs)

        L.seed_everything(0, workers=True, verbose=False)
        model = MLP()
        meter = Meter()
        trainer = L.Trainer(
            accelerator="cpu", devices=int(spec["procs"]), num_nodes=int(spec["nodes"]),
            strategy=strategy, max_epochs=int(spec["epochs"]), max_steps=int(spec["max_steps"]),
            logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
            callbacks=[meter], default_root_dir=str(case_dir / "lightning"),
        )
        loader = DataLoader(train, batch_size=int(spec["batch_size"]), shuffle=True)
        fit_t0 = time.perf_counter()
        trainer.fit(model, loader)
        fit_end = time.perf_counter()
        steps = int(trainer.global_step)
        dist.barrier()  # every rank has finished training (and gossip has quiesced)
        all_done = time.perf_counter()
        counters_end = read_counters(iface) if local_rank == 0 else None

        # Exact average of the replicas (what final_average=True gives), then accuracy.
        with torch.no_grad():
            flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
            local_acc = float((model(x_te_t).argmax(1) == y_te_t).float().mean())
            dist.all_reduce(flat)
            flat /= world
            offset = 0
            for p in model.parameters():
                p.copy_(flat[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
            acc = float((model(x_te_t).argmax(1) == y_te_t).float().mean())
        result = {
            "rank": rank, "node": node, "local_rank": local_rank, "steps": steps,
            "epoch_s": meter.epoch_s, "samples": meter.samples,
            "train_s": all_done - (meter.train_start or fit_t0),
            "fit_s": fit_end - fit_t0,
            "counters_start": meter.counters_start, "counters_end": counters_end,
            "accuracy": acc, "local_accuracy": local_acc,
            "train_samples": len(train), "test_samples": len(y_te),
            "params": sum(p.numel() for p in model.parameters()),
        }
        case_dir.mkdir(parents=True, exist_ok=True)
        tmp = case_dir / f".rank{rank}.json"
        tmp.write_text(json.dumps(result))
        tmp.rename(case_dir / f"rank{rank}.json")  # the driver sees whole files only

    for case in spec["cases"]:
        dist.barrier()
        print(f"[worker rank {rank}] case {case['name']}", flush=True)
        run_one(case)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main(Path(sys.argv[1]))
