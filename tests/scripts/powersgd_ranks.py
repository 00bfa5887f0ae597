"""Rank script of ``tests/test_hooks.py``: torch's PowerSGD hook as the race sets it up.

    python -m torch.distributed.run --nproc-per-node 2 tests/scripts/powersgd_ranks.py \\
        MODE RANK STEPS

``MODE`` ``race``: DDP with ``bucket_cap_mb=hooks.SINGLE_BUCKET_MB`` (the race's PowerSGD
cases); ``default``: DDP's default buckets (a 1 MB first bucket). The model is a 4.8 MB MLP
(gloo, CPU), the state ``hooks.powersgd_state(RANK, warmup=2)``; random sleeps of up to
2 ms per step vary the timing. Rank 0 prints ``OK buckets=N steps=S``.
"""

import gc
import random
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

from benchmarks.race import hooks


def main() -> None:
    """Train STEPS steps with the hook; print the number of buckets it saw."""
    mode, rank, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    width = 768
    net = nn.Sequential(nn.Linear(64, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                        nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10))
    kwargs = {"bucket_cap_mb": hooks.SINGLE_BUCKET_MB} if mode == "race" else {}
    ddp = nn.parallel.DistributedDataParallel(net, **kwargs)
    seen: set[int] = set()
    future = torch.futures.Future[torch.Tensor]  # torch checks the hook's annotations: no
    # ``from __future__ import annotations`` in this script

    def hook(state: psgd.PowerSGDState, bucket: dist.GradBucket) -> future:
        seen.add(bucket.index())
        return psgd.powerSGD_hook(state, bucket)

    ddp.register_comm_hook(hooks.powersgd_state(rank, warmup=2), hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    rng = random.Random(dist.get_rank())
    for _ in range(steps):
        x, y = torch.randn(8, 64), torch.randint(0, 10, (8,))
        loss = nn.functional.cross_entropy(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        time.sleep(rng.uniform(0, 0.002))
    if dist.get_rank() == 0:
        print(f"OK buckets={len(seen)} steps={steps}", flush=True)
    # DDP's reducer keeps the hook's last gloo works (tensors with Python references); freed
    # only at interpreter shutdown they abort the process ("terminate called without an active
    # exception", 1 exit in 8 here). Free them, then leave the group together.
    del ddp, opt
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
