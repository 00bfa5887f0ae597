"""Rank script for tests/test_liveness.py: three plain processes (no launcher to stop the
others), gloo. After one watched all-reduce, rank 2 kills itself (SIGKILL: no error, no mark);
ranks 0 and 1 are in the next watched all-reduce, which gloo fails at once with a broken
connection that names an address, not a rank. Each prints ``RESULT {json}``: the error's type,
its ranks and its message.

    MASTER_ADDR=127.0.0.1 MASTER_PORT=... WORLD_SIZE=3 RANK=r python killed_rank_blame.py
"""

from __future__ import annotations

import json
import os
import signal
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from lightning_gossip.liveness import Heartbeat, watched_collective

HB_TIMEOUT = 4.0  # beats every 0.4 s; a stopped beat is found after 1 s
LONG = timedelta(seconds=120)


def main() -> None:
    dist.init_process_group("gloo", timeout=LONG)
    rank = dist.get_rank()
    beat = Heartbeat.connect(rank, dist.get_world_size(), timeout=HB_TIMEOUT)
    beat.start()
    buf = torch.ones(1000)
    watched_collective(dist.all_reduce, buf, what="the first all-reduce", timeout=LONG,
                       heartbeat=beat)
    if rank == 2:
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)
    t0 = time.monotonic()
    try:
        watched_collective(dist.all_reduce, buf, what=f"rank {rank}: the second all-reduce",
                           timeout=LONG, heartbeat=beat)
        result = {"error": None}
    except Exception as e:  # noqa: BLE001 - reported
        result = {"error": type(e).__name__, "ranks": list(getattr(e, "ranks", ())),
                  "message": str(e)[:2000], "seconds": time.monotonic() - t0}
    print("RESULT " + json.dumps(result), flush=True)
    # the default linger, as in a real run: rank 0 hosts the store the other rank is still
    # reading (without it, rank 1 once found the store gone and blamed its host, rank 0)
    beat.leave(failed=result["error"] is not None)
    os._exit(0)  # gloo's group holds threads inside the broken collective


if __name__ == "__main__":
    main()
