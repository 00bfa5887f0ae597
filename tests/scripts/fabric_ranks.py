"""Every multi-process check of the Fabric strategies and of ``attach`` in one launch of two
ranks (process start-up dominates): ``tests/test_fabric.py``.

    torchrun --nproc-per-node 2 tests/scripts/fabric_ranks.py OUT_DIR

1. ``docs/examples/attach_plain_loop.py`` under ``adpsgd`` and ``dpsgd``.
2. Exactness under Fabric with lr=0 and rank-dependent replicas: ``dpsgd`` with a time-varying
   2-rank topology (the replicas after k steps are ``prod_t W_t X0``), ``adpsgd`` (the sum of
   the replicas is kept); the same two under ``attach``.
3. ``docs/examples/fabric_loop.py``'s loop under ``ddp``, ``adpsgd`` and ``dpsgd``.
4. The periodic global average with an outer optimizer under Fabric, lr=0: ``dpsgd`` (outer lr
   0.5: every replica ends at ``anchor + 0.5 (mean(X0) - anchor)``) and ``adpsgd`` (outer lr 1,
   momentum 0: the plain average); the gossip state through ``fabric.save`` / ``fabric.load``.

Writes ``OUT_DIR/rank<r>.json``: ``{case: result}``.
"""

from __future__ import annotations

import json
import runpy
import sys
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from lightning.fabric import Fabric
from torch import nn

import lightning_gossip
from lightning_gossip.fabric import FabricADPSGDStrategy, FabricDPSGDStrategy
from lightning_gossip.flat import FlatState
from lightning_gossip.topology import Topology

ROOT = Path(__file__).resolve().parents[2]
STEPS = {"dpsgd": 5, "adpsgd": 40}


class Pair(Topology):
    """Two ranks, ``W_t = [[1 - a_t, a_t], [a_t, 1 - a_t]]`` with ``a_t = 0.1 (t mod 3 + 1)``."""

    name = "pair"
    is_time_varying = True

    def mixing_matrix(self, step: int = 0) -> np.ndarray:
        a = 0.1 * (step % 3 + 1)
        return np.array([[1 - a, a], [a, 1 - a]])


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 1))


def _offset(model: nn.Module, rank: int) -> None:
    """Rank-dependent replicas (after the strategy's broadcast of rank 0's weights)."""
    with torch.no_grad():
        for k, p in enumerate(model.parameters()):
            p.add_((rank + 1) * 0.1 * (k + 1) + 0.01 * torch.arange(p.numel()).view_as(p))


def _steps(model: nn.Module, optimizer: torch.optim.Optimizer, n: int, fabric: Fabric | None,
           ) -> None:
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    for _ in range(n):
        loss = nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        fabric.backward(loss) if fabric is not None else loss.backward()
        optimizer.step()


def fabric_exactness(kind: str, rank: int) -> dict:
    strategy = (FabricDPSGDStrategy(topology=Pair(2)) if kind == "dpsgd"
                else FabricADPSGDStrategy(max_staleness=2))
    fabric = Fabric(strategy=strategy, accelerator="cpu", devices=2)
    fabric.launch()
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0, momentum=0.9)
    model, optimizer = fabric.setup(model, optimizer)
    module = model.module
    _offset(module, rank)
    flat = FlatState(module)
    x0 = flat.pack().tolist()
    _steps(model, optimizer, STEPS[kind], fabric)
    fabric.strategy.quiesce()
    out = {"x0": x0, "x": flat.pack().tolist(), "steps": STEPS[kind],
           "exchanges": fabric.strategy.gossip_stats.exchanges}
    fabric.strategy.finish()
    out["final"] = flat.pack().tolist()
    return out


def attach_exactness(kind: str, rank: int) -> dict:
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0, momentum=0.9)
    options = {"topology": Pair(2)} if kind == "dpsgd" else {"max_staleness": 2}
    gossip = lightning_gossip.attach(model, optimizer, strategy=kind, **options)
    _offset(model, rank)
    x0 = gossip.flat.pack().tolist()
    _steps(model, optimizer, STEPS[kind], None)
    gossip.quiesce()
    out = {"x0": x0, "x": gossip.flat.pack().tolist(), "steps": STEPS[kind],
           "exchanges": gossip.stats.exchanges}
    gossip.finish()
    out["final"] = gossip.flat.pack().tolist()
    return out


def fabric_outer(kind: str, rank: int, out_dir: Path) -> dict:
    every = STEPS["dpsgd"] if kind == "dpsgd" else 10
    options = {"global_average_every_n_steps": every, "heartbeat_timeout": 30.0}
    strategy = (FabricDPSGDStrategy(topology=Pair(2), outer_lr=0.5, outer_momentum=0.5,
                                    **options) if kind == "dpsgd"
                else FabricADPSGDStrategy(max_staleness=2, outer_lr=1.0, **options))
    fabric = Fabric(strategy=strategy, accelerator="cpu", devices=2)
    fabric.launch()
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    model, optimizer = fabric.setup(model, optimizer)
    flat = FlatState(model.module)
    anchor = flat.pack().tolist()
    _offset(model.module, rank)
    x0 = flat.pack().tolist()
    _steps(model, optimizer, every, fabric)
    gossip = fabric.strategy.gossip
    out = {"anchor": anchor, "x0": x0, "x": flat.pack().tolist(), "step": gossip.step,
           "heartbeat": gossip.heartbeat is not None}
    saved = gossip.state_dict()
    path = out_dir / f"outer-{kind}.ckpt"
    fabric.save(path, {"model": model, "gossip": gossip})
    gossip.step = 0
    gossip.outer.start(torch.zeros(flat.numel))
    fabric.load(path, {"gossip": gossip})
    restored = gossip.state_dict()
    out["restored_step"] = restored["step"]
    out["restored_outer_equal"] = all(
        torch.equal(torch.as_tensor(a), torch.as_tensor(b)) if a is not None else b is None
        for a, b in zip(saved["outer"].values(), restored["outer"].values()))
    fabric.strategy.finish()
    return out


def main(out_dir: Path) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank = dist.get_rank()
    results: dict[str, dict] = {}
    attach_example = runpy.run_path(str(ROOT / "docs" / "examples" / "attach_plain_loop.py"))
    for kind in ("adpsgd", "dpsgd"):
        results[f"attach-example-{kind}"] = attach_example["main"](kind)
        results[f"attach-exact-{kind}"] = attach_exactness(kind, rank)
        results[f"fabric-exact-{kind}"] = fabric_exactness(kind, rank)
        results[f"fabric-outer-{kind}"] = fabric_outer(kind, rank, out_dir)
    fabric_example = runpy.run_path(str(ROOT / "docs" / "examples" / "fabric_loop.py"))
    for strategy in ("ddp", "adpsgd", "dpsgd"):
        fabric = Fabric(strategy=strategy, accelerator="cpu", devices=2)
        fabric.launch()
        results[f"fabric-example-{strategy}"] = fabric_example["train"](fabric)
        dist.barrier()
    (out_dir / f"rank{rank}.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
