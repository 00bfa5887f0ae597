"""Rank script for tests/test_liveness.py: three ranks under torchrun, gloo.

Rank 0 waits on rank 1 (slow but alive: it sends after ``SLOW_SEND_S`` > the heartbeat
timeout), then on rank 1 again after rank 1 left with an error (:meth:`Heartbeat.leave`), then on
rank 2, which freezes itself with SIGSTOP. Rank 0 prints one ``RESULT {json}`` line and kills the
frozen rank.

    python -m torch.distributed.run --nproc-per-node 3 tests/scripts/liveness_ranks.py
"""

from __future__ import annotations

import json
import os
import signal
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from lightning_gossip.errors import PeerSilent
from lightning_gossip.liveness import Heartbeat, wait_for_peers

HB_TIMEOUT = 2.0
SLOW_SEND_S = 3.0  # longer than HB_TIMEOUT: a live but slow peer must not count as silent
LONG = timedelta(seconds=120)


def main() -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    # the waits' own check of the ranks they wait on; the monitor (which would end the third
    # wait at once naming rank 1, gone in the second) is tested by test_liveness_monitor.py
    beat = Heartbeat.connect(rank, world, timeout=HB_TIMEOUT, monitor=False)
    beat.start()
    store = beat.store
    store.set(f"pid/{rank}", str(os.getpid()))
    dist.barrier()
    buf = torch.zeros(4)
    result: dict = {}
    if rank == 0:
        t0 = time.monotonic()
        wait_for_peers([dist.irecv(buf, src=1)], [1], beat, LONG, "rank 0 receiving from rank 1")
        result["slow_sum"], result["slow_s"] = float(buf.sum()), time.monotonic() - t0
        store.set("slow_received", "1")
        t0 = time.monotonic()
        try:  # rank 1 leaves with an error without sending
            wait_for_peers([dist.irecv(buf, src=1)], [1], beat, LONG,
                           "rank 0 receiving the replica of rank 1")
        except PeerSilent as e:
            result["left"] = [list(e.ranks), str(e), time.monotonic() - t0]
        store.set("left_seen", "1")
        t0 = time.monotonic()
        try:
            wait_for_peers([dist.irecv(buf, src=2)], [2], beat, LONG,
                           "rank 0 receiving the replica of rank 2")
        except PeerSilent as e:
            result["frozen"] = [list(e.ranks), str(e), time.monotonic() - t0]
        print("RESULT " + json.dumps(result), flush=True)
        os.kill(int(store.get("pid/2")), signal.SIGKILL)
        os._exit(0)
    elif rank == 1:
        time.sleep(SLOW_SEND_S)  # busy elsewhere, the heartbeat thread keeps beating
        dist.send(torch.ones(4), dst=0)
        store.wait(["slow_received"], LONG)
        beat.leave(failed=True)
        store.wait(["left_seen"], LONG)
        os._exit(0)
    else:
        store.wait(["left_seen"], LONG)
        time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGSTOP)  # frozen: no beat, no message, never exits
        time.sleep(120)


if __name__ == "__main__":
    main()
