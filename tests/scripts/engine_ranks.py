"""Run a function on a few ranks of a real gloo group, for unit tests without Lightning.

:func:`spawn_ranks` starts ``world`` processes with ``torch.multiprocessing`` (spawn), joins a
gloo process group on a free local port in each, calls ``fn(rank, world, *args)`` there and
returns what every rank returned (JSON-serialisable values, through a file per rank). Every
wait has a timeout: the parent kills the ranks when the launch takes longer than ``timeout``,
and each rank dumps its Python stacks and exits shortly before that (hang diagnostics).

Used by ``tests/test_async_gossip_unit.py`` and ``tests/test_shared_cursor_unit.py``; ``fn``
must be importable by name (a module-level function of the test module).
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from testbed.launch import free_port


def _entry(rank: int, fn: Callable[..., Any], world: int, port: int, out_dir: str,
           timeout: float, args: tuple) -> None:
    """Body of one spawned rank: join the group, run ``fn``, write ``rank{rank}.json``."""
    torch.set_num_threads(1)
    faulthandler.dump_traceback_later(max(timeout - 10.0, 1.0), exit=True)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=timeout))
    result = fn(rank, world, *args)
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()  # rank 0 hosts the store: nobody leaves while another rank may still use it
    sys.stdout.flush()
    sys.stderr.flush()
    # A gossip thread left in a receive (a test of failures) must not hold up the exit.
    os._exit(0)


def spawn_ranks(fn: Callable[..., Any], world: int, out_dir: Path, *args: Any,
                timeout: float = 240.0) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo ranks; return the results by rank."""
    os.environ["OMP_NUM_THREADS"] = "1"
    out_dir.mkdir(parents=True, exist_ok=True)
    ctx = mp.start_processes(_entry, args=(fn, world, free_port(), str(out_dir), timeout, args),
                             nprocs=world, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=1.0):  # raises if a rank failed (and ends the others)
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            raise AssertionError(f"{fn.__name__} on {world} ranks took longer than {timeout}s")
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(world)]
