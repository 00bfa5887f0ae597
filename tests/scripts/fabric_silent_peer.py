"""A frozen peer under Fabric (``heartbeat_timeout``): the other rank's gossip wait fails with
``PeerSilent`` naming it, long before the process group's timeout (``tests/test_fabric.py``).

    torchrun --nproc-per-node 2 tests/scripts/fabric_silent_peer.py

Both ranks run a D-PSGD Fabric loop (``heartbeat_timeout=3``, ``timeout=300`` s); rank 1 stops
itself (``SIGSTOP``: no thread of it runs, its heartbeat neither) at step 3. Rank 0 prints
``SILENT <error type> <seconds> <message>``, kills rank 1 (pids exchanged at the start, so no
frozen process outlives the test) and exits 0.
"""

from __future__ import annotations

import os
import signal
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from lightning.fabric import Fabric
from torch import nn

from lightning_gossip.errors import GossipTimeout, PeerSilent
from lightning_gossip.fabric import FabricDPSGDStrategy

FREEZE_AT = 3


def main() -> None:
    strategy = FabricDPSGDStrategy(heartbeat_timeout=3.0, timeout=timedelta(seconds=300))
    fabric = Fabric(strategy=strategy, accelerator="cpu", devices=2)
    fabric.launch()
    pids: list = [None, None]
    dist.all_gather_object(pids, os.getpid())
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.01))
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    started = time.monotonic()
    try:
        for step in range(200):
            if step == FREEZE_AT:
                if fabric.global_rank == 1:
                    os.kill(os.getpid(), signal.SIGSTOP)
                started = time.monotonic()
            loss = nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            fabric.backward(loss)
            optimizer.step()
    except (PeerSilent, GossipTimeout) as e:
        print(f"SILENT {type(e).__name__} {time.monotonic() - started:.1f} {e}", flush=True)
        os.kill(pids[1], signal.SIGKILL)
        os._exit(0)
    print(f"NOT-SILENT rank {fabric.global_rank} ran every step", flush=True)
    os._exit(1)


if __name__ == "__main__":
    main()
