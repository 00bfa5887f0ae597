"""Run the plain-loop examples of ``docs/engines.md`` one after the other in one process per
rank (one torchrun launch for both; process start-up is the expensive part).

    torchrun --nproc-per-node 2 tests/scripts/engine_examples.py EXAMPLE.py [EXAMPLE.py ...]

The process group is initialised here once; each example uses it (it initialises its own only
when run on its own) and runs as ``__main__``.
"""

from __future__ import annotations

import runpy
import sys
from datetime import timedelta

import torch.distributed as dist

if __name__ == "__main__":
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    for path in sys.argv[1:]:
        runpy.run_path(path, run_name="__main__")
        dist.barrier()
    dist.destroy_process_group()
