"""Rank script of the multi-node tests: ``gossip_cases.py`` with per-node start offsets.

With ``hierarchical=True`` the ranks of a node hold one replica, so the rank-dependent offset
the recorder adds at train start is drawn per node (seed ``1000 + node_rank``) for those cases;
every other case runs exactly as in ``gossip_cases.py``.

    python -m torch.distributed.run --nnodes 2 --node-rank K --nproc-per-node 2 \\
        tests/scripts/hier_cases.py OUT CASES.json
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from lightning_gossip.flat import FlatState
from tests.cases import read_cases
from tests.scripts import gossip_cases

_PER_NODE = {"on": False}


def _on_train_start(self, trainer, module) -> None:
    flat = FlatState(module)
    self.start_weights = flat.pack().tolist()
    if self.offset:
        who = trainer.node_rank if _PER_NODE["on"] else trainer.global_rank
        g = torch.Generator().manual_seed(1000 + who)
        flat.add_(self.offset * torch.randn(flat.numel, generator=g))
    self.x0 = flat.pack().tolist()


gossip_cases.Recorder.on_train_start = _on_train_start


def main() -> None:
    gossip_cases.timing("start-up", time.process_time(), float("nan"))
    out = Path(sys.argv[1])
    for case in read_cases(Path(sys.argv[2])):
        _PER_NODE["on"] = bool(case.strategy_kwargs.get("hierarchical", False))
        gossip_cases.run_case(case, out)


if __name__ == "__main__":
    main()
