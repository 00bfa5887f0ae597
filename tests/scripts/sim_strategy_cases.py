"""Rank script for tests/test_sim_vs_strategy.py: real DPSGDStrategy runs to compare with the
simulator.

Launched by torchrun (every rank runs this file); several small fits share one launch because
process start-up dominates. For each case every rank writes ``OUT/<case>/rank<r>.json`` with its
weights (named as in ``state_dict``) right after a rank-dependent offset is added at train start
and after every optimizer step.

    python -m torch.distributed.run --nproc-per-node 4 \
        tests/scripts/sim_strategy_cases.py OUT CASES.json

The model, data and offsets are built by the functions below, which the test imports too.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

IN, OUT_FEATURES, HIDDEN = 5, 3, 4


def make_net(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, OUT_FEATURES))


def rank_data(rank: int, steps: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s samples, in the order it consumes them.

    Returns ``(inputs (steps * B, IN), targets (steps * B,))``.
    """
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(steps * batch_size, IN, generator=g)
    y = torch.randint(0, OUT_FEATURES, (steps * batch_size,), generator=g)
    return x, y


def rank_offset(rank: int, like: torch.Tensor, scale: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + rank)
    return scale * torch.randn(like.shape, generator=g)


class Net(L.LightningModule):
    def __init__(self, seed: int, lr: float, momentum: float) -> None:
        super().__init__()
        self.net = make_net(seed)
        self.lr, self.momentum = lr, momentum

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum)


def _named(module: L.LightningModule) -> dict[str, list]:
    return {k: v.detach().reshape(-1).tolist() for k, v in module.net.state_dict().items()}


class Recorder(Callback):
    def __init__(self, offset: float) -> None:
        self.offset = offset
        self.x0: dict = {}
        self.steps: list[dict] = []

    def on_train_start(self, trainer, module):
        with torch.no_grad():
            for i, p in enumerate(module.net.parameters()):
                p.add_(rank_offset(trainer.global_rank * 100 + i, p, self.offset))
        self.x0 = _named(module)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.steps.append(_named(module))


def run_case(name: str, case: dict, out: Path) -> None:
    import lightning_gossip

    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    steps, bs = case["steps"], case["batch_size"]
    x, y = rank_data(rank, steps, bs)
    loader = DataLoader(TensorDataset(x, y), batch_size=bs, shuffle=False)
    model = Net(case["seed"] + rank, case["lr"], case.get("momentum", 0.0))  # init differs per rank
    strategy = lightning_gossip.DPSGDStrategy(
        topology=case["topology"], seed=case["seed"], overlap=case.get("overlap", True),
        delay_by_one=case.get("delay_by_one", False), final_average=False,
        consensus_every_n_steps=None,
    )
    recorder = Recorder(case["offset"])
    trainer = L.Trainer(
        strategy=strategy, accelerator="cpu", devices=world, max_epochs=1, max_steps=steps,
        callbacks=[recorder], logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, use_distributed_sampler=False,
        limit_val_batches=0, default_root_dir=out / name,
    )
    trainer.fit(model, loader)
    (out / name).mkdir(parents=True, exist_ok=True)
    result = {"rank": rank, "x0": recorder.x0, "steps": recorder.steps}
    (out / name / f"rank{rank}.json").write_text(json.dumps(result))


def main() -> None:
    out = Path(sys.argv[1])
    cases = json.loads(Path(sys.argv[2]).read_text())
    for name, case in cases.items():
        run_case(name, case, out)


if __name__ == "__main__":
    main()
