"""Rank program of tests/test_exit_status.py: the abort at exit, made to happen on purpose.

``python exit_abort.py OUT MODE`` on 2 ranks (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR/PORT``).
Rank 0 leaves a gossip wait on rank 1 abandoned (:func:`lightning_gossip.liveness.wait_for_peers`
with a ``should_stop`` that is true at once: its helper thread stays in gloo's ``Work.wait()``),
writes a log line through ``logging`` and a checkpoint, and ends its program; an object whose
finalizer runs during the interpreter's finalization writes ``OUT/finalizing`` and sleeps 3 s.
Rank 1 waits for that file (or for rank 0 to be gone), then makes rank 0's abandoned wait end
right then: it exits (``src``: the wait was a receive from rank 1, which fails when rank 1's
connection closes) or sends the message awaited (``any``: a receive from any source, which
closing connections does not end). Without the library's exit handling rank 0 then dies of
``SIGABRT``; with it rank 0 ends with its true status: 0, or 1 when ``MODE`` ends in ``-raise``
(rank 0's program raises at its end). Rank 0 writes ``OUT/exit_path`` only if its interpreter
really finalized (the finalizer ran).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from lightning_gossip.liveness import wait_for_peers

OUT, MODE = Path(sys.argv[1]), sys.argv[2]
RANK = int(os.environ["RANK"])


class SlowFinalizer:
    """Kept in a module global: finalized while the interpreter shuts down."""

    def __del__(self) -> None:
        (OUT / "finalizing").write_text(str(time.time()))
        (OUT / "exit_path").write_text("finalized")
        time.sleep(3.0)


def main() -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    group = dist.new_group([0, 1], backend="gloo")
    (OUT / f"pid{RANK}").write_text(str(os.getpid()))
    dist.barrier()
    if RANK == 0:
        buf = torch.zeros(4)
        src = None if MODE.startswith("any") else 1
        work = dist.irecv(buf, src=src, group=group)
        done = wait_for_peers([work], [1], None, timedelta(seconds=60), "the abandoned receive",
                              should_stop=lambda: True)
        assert not done
        handler = logging.FileHandler(OUT / "rank0.log")
        log = logging.getLogger("exit_abort")
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.info("the last line of rank 0's log")  # flushed by the handler, or at exit
        torch.save({"weights": torch.arange(1000.0)}, OUT / "rank0.ckpt")
        global KEEP
        KEEP = SlowFinalizer()
        print("rank 0: program ends", flush=True)
        if MODE.endswith("-raise"):
            raise RuntimeError("rank 0 fails at its end (on purpose)")
        return
    pid0 = int((OUT / "pid0").read_text())
    end = time.monotonic() + 30
    while not (OUT / "finalizing").exists() and time.monotonic() < end:
        if not Path(f"/proc/{pid0}").exists() or _zombie(pid0):
            break
        time.sleep(0.01)
    if MODE.startswith("any") and (OUT / "finalizing").exists():
        dist.send(torch.ones(4), 0, group=group)
    print("rank 1: leaves", flush=True)
    os._exit(0)  # at once, closing its connections (no finalization of its own)


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


if __name__ == "__main__":
    main()
