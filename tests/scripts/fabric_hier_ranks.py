"""Every multi-process check of hierarchical gossip under Fabric and ``attach`` in one launch of
2 torchrun nodes of 2 processes (process start-up dominates): ``tests/test_fabric_hierarchical.py``.

    torchrun --nnodes 2 --node-rank K --nproc-per-node 2 ... tests/scripts/fabric_hier_ranks.py OUT

For each front (``fabric``: ``Fabric(devices=2, num_nodes=2)`` with the Fabric strategies'
``hierarchical=True``; ``attach``: ``attach(..., hierarchical=True)``, the layout read from
torchrun's environment) and each engine:

1. ``exact``: learning rate 0, the node replicas made different (the offset depends on the node,
   so the ranks of a node start equal, as the broadcast leaves them); the replica of every rank
   after every optimizer step. ``dpsgd`` with a time-varying two-node topology (the node
   replicas after step t are ``W_t ... W_0 X0``), ``adpsgd`` (the sum of the node replicas is
   kept); then ``finish()``. ``dpsgd`` mixes with that topology in the ``train`` cases too.
2. ``train``: learning rate > 0 and a different batch on every rank; the replica of every rank
   after every step (the ranks of a node must stay bit-identical: their gradients are averaged
   over the node). Under Fabric with gradient accumulation through ``fabric.no_backward_sync``
   (two micro-batches per step), and ``dpsgd`` with ``node_allreduce="overlapped"``.

Writes ``OUT/rank<r>.json``: ``{case: result}``.
"""

from __future__ import annotations

import json
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

# the two-rank (here two-node) topology, the model and its offset: the flat Fabric test's
from fabric_ranks import Pair, _model, _offset  # (a script of this folder)
from lightning.fabric import Fabric
from torch import nn

import lightning_gossip
from lightning_gossip.fabric import FabricADPSGDStrategy, FabricDPSGDStrategy
from lightning_gossip.flat import FlatState

DEVICES = 2
STEPS = {"dpsgd": 5, "adpsgd": 40}
TRAIN_STEPS = 6


def _batches(rank: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` batches of this rank's own (every rank draws different data)."""
    g = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)) for _ in range(n)]


def _fabric(kind: str, **options: object) -> Fabric:
    strategy = (FabricDPSGDStrategy(hierarchical=True, **options) if kind == "dpsgd"
                else FabricADPSGDStrategy(hierarchical=True, max_staleness=2, **options))
    fabric = Fabric(strategy=strategy, accelerator="cpu", devices=DEVICES, num_nodes=2)
    fabric.launch()
    return fabric


def fabric_case(kind: str, rank: int, train: bool) -> dict:
    options: dict = {"topology": Pair(2)} if kind == "dpsgd" else {}
    if train and kind == "dpsgd":
        options["node_allreduce"] = "overlapped"
    fabric = _fabric(kind, **options)
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05 if train else 0.0)
    model, optimizer = fabric.setup(model, optimizer)
    gossip = fabric.strategy.gossip
    flat = FlatState(model.module)
    start = flat.pack().tolist()
    if not train:
        _offset(model.module, rank // DEVICES)
    out: dict = {"start": start, "x0": flat.pack().tolist(), "steps": [],
                 "layout": [gossip.layout.num_nodes, gossip.layout.devices, gossip.layout.node,
                            gossip.layout.local]}
    micro = 2 if train else 1
    batches = _batches(rank, micro * (TRAIN_STEPS if train else STEPS[kind]))
    for t in range(len(batches) // micro):
        optimizer.zero_grad()
        for m in range(micro):  # all but the last micro-batch skip the node's all-reduce
            x, y = batches[t * micro + m]
            with fabric.no_backward_sync(model, enabled=m < micro - 1):
                fabric.backward(nn.functional.mse_loss(model(x), y))
        optimizer.step()
        out["steps"].append(flat.pack().tolist())
    fabric.strategy.quiesce()
    out["x"] = flat.pack().tolist()
    out["exchanges"] = fabric.strategy.gossip_stats.exchanges
    fabric.strategy.finish()
    out["final"] = flat.pack().tolist()
    return out


def attach_case(kind: str, rank: int, train: bool) -> dict:
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05 if train else 0.0)
    options = {"topology": Pair(2)} if kind == "dpsgd" else {"max_staleness": 2}
    gossip = lightning_gossip.attach(model, optimizer, strategy=kind, hierarchical=True,
                                     **options)
    start = gossip.flat.pack().tolist()
    if not train:
        _offset(model, rank // DEVICES)
    out: dict = {"start": start, "x0": gossip.flat.pack().tolist(), "steps": [],
                 "layout": [gossip.layout.num_nodes, gossip.layout.devices, gossip.layout.node,
                            gossip.layout.local]}
    for x, y in _batches(rank, TRAIN_STEPS if train else STEPS[kind]):
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        out["steps"].append(gossip.flat.pack().tolist())
    gossip.quiesce()
    out["x"] = gossip.flat.pack().tolist()
    out["exchanges"] = gossip.stats.exchanges
    gossip.finish()
    out["final"] = gossip.flat.pack().tolist()
    return out


def main(out_dir: Path) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank = dist.get_rank()
    results: dict[str, dict] = {}
    for kind in ("dpsgd", "adpsgd"):
        for train in (False, True):
            mode = "train" if train else "exact"
            results[f"fabric-{mode}-{kind}"] = fabric_case(kind, rank, train)
            results[f"attach-{mode}-{kind}"] = attach_case(kind, rank, train)
    (out_dir / f"rank{rank}.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
