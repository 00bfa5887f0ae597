"""Rank script of ``tests/test_remedies.py``: small fits with the outer optimizer
(``outer_lr``...) and the overlapped node all-reduce (``node_allreduce="overlapped"``), recording
what those tests compare: the weights after every batch, every rank's local gradient (at
``on_after_backward``) and the node-averaged one (at ``on_before_optimizer_step``), the exact
averages of the periodic global averages (a spy on ``Replicas.average``, which it does not
change) and the outer optimizer's state at the start and the end of the fit.

    python -m torch.distributed.run --nnodes 2 --node-rank K --nproc-per-node 2 \\
        tests/scripts/remedy_cases.py OUT CASES.json

A case's ``strategy_kwargs`` may hold ``_bucket_bytes``: the overlapped all-reduce's bucket size
for that case (taken out before the strategy is built).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader

import lightning_gossip
from lightning_gossip import overlapped_allreduce
from lightning_gossip.flat import FlatState
from lightning_gossip.replicas import Replicas
from tests.cases import Case, read_cases
from tests.scripts.gossip_cases import Indexed, Tiny, timing

GLOBAL_AVERAGES: list[list[float]] = []
_average = Replicas.average


def _spy_average(self: Replicas, why: str = "") -> torch.Tensor:
    out = _average(self, why)
    if why == "for the periodic global average":
        GLOBAL_AVERAGES.append(out.tolist())
    return out


Replicas.average = _spy_average  # records, returns the same tensor


def _grads(module: L.LightningModule) -> list[float]:
    return torch.cat([p.grad.detach().reshape(-1).float() if p.grad is not None
                      else torch.full((p.numel(),), float("nan"))
                      for p in module.parameters()]).tolist()


def _outer_state(strategy: object) -> dict | None:
    outer = getattr(strategy, "outer", None)
    if outer is None:
        return None
    state = outer.state_dict()
    return {k: (v.tolist() if isinstance(v, torch.Tensor) else v) for k, v in state.items()}


class Record(Callback):
    """Offsets at train start (per node when hierarchical), weights, gradients, outer state."""

    def __init__(self, case: Case):
        self.case = case
        self.out: dict = {"x0": [], "steps": [], "local_grads": [], "avg_grads": [],
                          "started_in_backward": []}
        self._local: list[float] = []

    def on_train_start(self, trainer, module):
        flat = FlatState(module)
        self.out["start_weights"] = flat.pack().tolist()
        self.out["outer_start"] = _outer_state(trainer.strategy)
        if self.case.offset:
            hier = self.case.strategy_kwargs.get("hierarchical", False)
            who = trainer.node_rank if hier else trainer.global_rank
            g = torch.Generator().manual_seed(1000 + who)
            flat.add_(self.case.offset * torch.randn(flat.numel, generator=g))
        self.out["x0"] = flat.pack().tolist()

    def on_after_backward(self, trainer, module):
        self._local = _grads(module)

    def on_before_optimizer_step(self, trainer, module, optimizer):
        self.out["local_grads"].append(self._local)
        self.out["avg_grads"].append(_grads(module))
        node = getattr(trainer.strategy, "node", None)
        overlapped = getattr(node, "overlapped", None)
        self.out["started_in_backward"].append(
            None if overlapped is None else overlapped.started_in_backward)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.out["steps"].append(FlatState(module).pack().tolist())


def run_case(case: Case, out: Path) -> None:
    """Fit ``case`` on this rank; write ``OUT/<case>/rank<r>.json``."""
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    GLOBAL_AVERAGES.clear()
    kwargs = dict(case.strategy_kwargs)
    bucket = kwargs.pop("_bucket_bytes", None)
    overlapped_allreduce.DEFAULT_BUCKET_BYTES = bucket or (1 << 20)
    torch.manual_seed(case.seed + rank)
    model = Tiny(case.lr, case.manual, case.width, case.batchnorm)
    g = torch.Generator().manual_seed(rank)
    n = case.batches * case.batch_size
    data = Indexed(torch.randn(n * world, 5, generator=g),
                   torch.randint(0, 2, (n * world,), generator=g))
    cls = (lightning_gossip.DPSGDStrategy if case.strategy == "dpsgd"
           else lightning_gossip.ADPSGDStrategy)
    record = Record(case)
    trainer = L.Trainer(
        strategy=cls(**kwargs), accelerator="cpu", devices=world // case.num_nodes,
        num_nodes=case.num_nodes, max_epochs=case.epochs, limit_val_batches=0,
        accumulate_grad_batches=case.accumulate, precision=case.precision, callbacks=[record],
        logger=False, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False, default_root_dir=out / case.name)
    resume = str(out / case.resume_case / "model.ckpt") if case.resume_case else None
    trainer.fit(model, DataLoader(data, batch_size=case.batch_size), ckpt_path=resume)
    result = {**record.out, "rank": rank, "global_step": trainer.global_step,
              "final": FlatState(model).pack().tolist(),
              "global_averages": list(GLOBAL_AVERAGES),
              "outer_end": _outer_state(trainer.strategy)}
    if case.save_checkpoint:
        trainer.save_checkpoint(out / case.name / "model.ckpt")
    (out / case.name).mkdir(parents=True, exist_ok=True)
    (out / case.name / f"rank{rank}.json").write_text(json.dumps(result))


def main() -> None:
    timing("start-up", 0.0, float("nan"))
    out = Path(sys.argv[1])
    for case in read_cases(Path(sys.argv[2])):
        run_case(case, out)


if __name__ == "__main__":
    main()
