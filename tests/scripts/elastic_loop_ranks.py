"""Rank program of ``tests/test_fabric_elastic.py``: an elastic plain loop that loses a rank to
``SIGKILL`` mid-loop, driven through the Fabric strategy on ranks ``0`` and ``1`` (rank 0 writes
``fabric.save``'s file) and through ``attach()`` on ranks ``2`` and ``3``: one gossip protocol, so
both fronts see the loss in one launch.

    python tests/scripts/elastic_loop_ranks.py OUT KIND VICTIM

Started one process per rank with torchrun's variables (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``GROUP_RANK``, ``MASTER_ADDR``/``MASTER_PORT``, ``TORCHELASTIC_RUN_ID`` so that
Fabric reads them) but no agent, as a launcher that leaves the others running starts them; rank
0 hosts the rendezvous store. ``KIND``: ``dpsgd`` (topology ``one_peer_exponential``: over the 3
survivors it is not a complete graph) or ``adpsgd``. Learning rate 0 (the exactness setting of
the other gossip tests), three phases, each started by adding a rank-dependent offset to the
replicas (gossip alone pulls them together; the offset sets them apart again):

1. ``PHASES[kind][0]`` steps, then ``quiesce()`` (sync point Q1, every rank);
2. ``PHASES[kind][1]`` steps; rank ``VICTIM`` ``SIGKILL``\\ s itself before the optimizer step of
   iteration :data:`KILL_AT`; then Q2 (the survivors, each on the survivors' engine by then);
3. ``PHASES[kind][2]`` steps, Q3; a checkpoint of the consensus (Fabric: ``fabric.save``, which
   averages and meets in ``fabric.barrier``; attach: the same two sync points); ``finish()``.

Every rank appends a line to ``OUT/rank<r>.jsonl`` for each phase's start (``start<k>``: the
replica after the offset), every iteration (the generation and step before and after it, the
replica before and after the optimizer step) and every sync point (``q<k>``: the replica, the
generation, the engine's exchanges), flushed at once (the victim's lines are there). A survivor
writes ``OUT/rank<r>.json`` at the end: rank 0's read-back checkpoint, the survivors' topology's
first step (``dpsgd``), the live ranks, the losses, the final replica.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from fabric_ranks import _model, _offset  # (a script of this folder)
from lightning.fabric import Fabric
from torch import nn

import lightning_gossip
from lightning_gossip.fabric import FabricADPSGDStrategy, FabricDPSGDStrategy
from lightning_gossip.flat import FlatState

HEARTBEAT_S = 3.0
TOPOLOGY = "one_peer_exponential"
PHASES = {"dpsgd": (4, 8, 6), "adpsgd": (12, 20, 16)}
"""Optimizer steps before Q1, between Q1 and Q2 (the kill among them), between Q2 and Q3."""
KILL_AT = 3
"""The victim's iteration of phase 2 at which it kills itself (before its optimizer step)."""
FABRIC_RANKS = (0, 1)


class Loop:
    """One rank's loop through its front: ``attach()`` or the Fabric strategy."""

    def __init__(self, kind: str, rank: int, world: int) -> None:
        self.kind, self.rank = kind, rank
        options: dict[str, Any] = ({"topology": TOPOLOGY} if kind == "dpsgd"
                                   else {"max_staleness": 2})
        model = _model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
        self.fabric: Any = None
        if rank in FABRIC_RANKS:
            cls = FabricDPSGDStrategy if kind == "dpsgd" else FabricADPSGDStrategy
            self.fabric = Fabric(strategy=cls(elastic=True, heartbeat_timeout=HEARTBEAT_S,
                                              timeout=timedelta(seconds=120), **options),
                                 accelerator="cpu", devices=1, num_nodes=world)
            self.fabric.launch()
            self.model, self.optimizer = self.fabric.setup(model, optimizer)
            self.module = self.model.module
            self.gossip = self.fabric.strategy.gossip
        else:
            dist.init_process_group("gloo", timeout=timedelta(seconds=120))
            self.model, self.optimizer, self.module = model, optimizer, model
            self.gossip = lightning_gossip.attach(model, optimizer, strategy=kind, elastic=True,
                                                  heartbeat_timeout=HEARTBEAT_S, timeout=120,
                                                  **options)
        self.flat = FlatState(self.module)
        self.x, self.y = torch.randn(8, 4), torch.randn(8, 1)

    def iteration(self, kill: bool) -> dict:
        """One loop iteration (forward, backward, ``optimizer.step()``) and its record."""
        gossip = self.gossip
        loss = nn.functional.mse_loss(self.model(self.x), self.y)
        self.optimizer.zero_grad()
        self.fabric.backward(loss) if self.fabric is not None else loss.backward()
        if kill:
            os.kill(os.getpid(), signal.SIGKILL)
        before = {"gen": gossip.session.generation, "step": gossip.step,
                  "x": self.flat.pack().tolist()}
        self.optimizer.step()
        return {"before": before, "gen": gossip.session.generation, "step": gossip.step,
                "x": self.flat.pack().tolist()}

    def sync_point(self) -> dict:
        """``quiesce()`` (every live rank), then the replica and the engine's counters."""
        self.gossip.quiesce()
        stats = self.gossip.stats
        return {"x": self.flat.pack().tolist(), "gen": self.gossip.session.generation,
                "exchanges": None if stats is None else stats.exchanges}

    def checkpoint(self, out: Path) -> list[float] | None:
        """A checkpoint of the consensus: ``fabric.save`` (the consensus state dict, then
        ``fabric.barrier``), or the same two sync points of ``attach()``; rank 0 reads back
        what was written (its weights, flat)."""
        path = out / "consensus.ckpt"
        if self.fabric is not None:
            self.fabric.save(path, {"model": self.model})
        else:
            with self.gossip.consensus():
                state = {k: v.clone() for k, v in self.module.state_dict().items()}
            self.gossip.barrier()
            if self.rank == 0:
                torch.save({"model": state}, path)
        self.gossip.barrier()  # (rank 0 wrote it)
        if self.rank != 0:
            return None
        saved = torch.load(path, weights_only=True)["model"]
        return torch.cat([v.flatten() for v in saved.values()]).tolist()

    def finish(self) -> list[float]:
        (self.fabric.strategy if self.fabric is not None else self.gossip).finish()
        return self.flat.pack().tolist()


def main(out: Path, kind: str, victim: int) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    loop = Loop(kind, rank, world)
    log = (out / f"rank{rank}.jsonl").open("a")

    def record(what: str, value: dict) -> None:  # the victim's lines are written before it dies
        log.write(json.dumps({"what": what, **value}) + "\n")
        log.flush()

    for phase, steps in enumerate(PHASES[kind]):
        _offset(loop.module, rank)  # replicas apart again (lr=0 gossip alone pulls them together)
        record(f"start{phase}", {"x": loop.flat.pack().tolist()})
        for i in range(steps):
            kill = rank == victim and phase == 1 and i == KILL_AT
            record("iteration", loop.iteration(kill=kill))
        record(f"q{phase + 1}", loop.sync_point())
    saved = loop.checkpoint(out)
    topology = getattr(loop.gossip.engine, "topology", None)  # dpsgd: the survivors' topology
    summary = {"front": "fabric" if loop.fabric is not None else "attach", "saved": saved,
               "first_step": getattr(topology, "first_step", None),
               "live": list(loop.gossip.live),
               "losses": [list(lost) for _, lost, _, _ in loop.gossip.losses],
               "final": loop.finish()}
    log.close()
    (out / f"rank{rank}.json").write_text(json.dumps(summary))
    if loop.fabric is None:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]))
