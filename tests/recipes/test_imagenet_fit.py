"""ImageNet recipe, end to end: 2-rank fits of the real CLI on the digits tree, per strategy.

Each run is ``python -m recipes.imagenet fit --config digits.yaml`` (Lightning's own launcher
starts the second rank) with :class:`RankProbe` added as a callback; every rank writes what it
saw to ``rank{r}.json``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

import lightning_gossip  # noqa: F401  (registers the gossip strategy names)
from testbed.launch import check, read_rank_results, run_lightning
from tests.recipes.test_imagenet_data import digits_tree

CONFIG = Path(__file__).resolve().parents[2] / "recipes" / "imagenet" / "configs" / "digits.yaml"
STRATEGY_CLASSES = {"ddp": "DDPStrategy", "dpsgd": "DPSGDStrategy", "adpsgd": "ADPSGDStrategy"}


class RankProbe(pl.Callback):
    """Count this rank's own top-1/top-5 hits during validation and dump them after fit.

    The model is re-run on each validation batch with the weights validation uses, so the
    counts of all ranks together give the accuracy the logged metrics must report.
    """

    def __init__(self, out_dir: str) -> None:
        self.out_dir = Path(out_dir)
        self.counts = {"top1": 0, "top5": 0, "total": 0}

    def on_validation_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.counts = dict.fromkeys(self.counts, 0)

    def on_validation_batch_end(
        self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0
    ):
        images, targets = batch
        with torch.no_grad():
            ranked = pl_module(images).topk(5, dim=1).indices
        hits = ranked == targets[:, None]
        self.counts["top1"] += int(hits[:, 0].sum())
        self.counts["top5"] += int(hits.any(dim=1).sum())
        self.counts["total"] += len(targets)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        logged = {k: float(v) for k, v in trainer.callback_metrics.items()}
        result = {"counts": self.counts, "logged": logged, "global_step": trainer.global_step,
                  "world_size": trainer.world_size, "strategy": type(trainer.strategy).__name__}
        (self.out_dir / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))


@pytest.fixture(scope="session")
def digits(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return digits_tree(tmp_path_factory)


@pytest.mark.multiprocess
@pytest.mark.parametrize("strategy", [pytest.param("ddp", marks=pytest.mark.slow),  # Lightning's
                                      "dpsgd", "adpsgd"])  # own strategy: make test-slow
def test_two_rank_fit_on_digits(strategy: str, digits: Path, tmp_path: Path) -> None:
    run = run_lightning(
        "recipes.imagenet", "fit", f"--config={CONFIG}",  # `python -m recipes.imagenet`
        f"--data.root={digits}", "--data.batch_size=32",
        f"--trainer.strategy={strategy}", "--trainer.devices=2", "--trainer.max_epochs=1",
        "--trainer.num_sanity_val_steps=0",
        "--trainer.logger=false", "--trainer.enable_checkpointing=false",
        f"--trainer.default_root_dir={tmp_path}",  # where the CLI saves config.yaml
        "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
        "--trainer.callbacks+=tests.recipes.test_imagenet_fit.RankProbe",
        f"--trainer.callbacks.out_dir={tmp_path}",
        timeout=540,  # generous: the shared 2-core machine can be heavily loaded
    )
    check(run)
    ranks = read_rank_results(tmp_path, 2)
    for r in ranks:
        assert r["strategy"] == STRATEGY_CLASSES[strategy] and r["world_size"] == 2
        assert math.isfinite(r["logged"]["train/loss"])
    # one epoch over the 1,437 training images in full batches of 32: 44 steps in all
    steps = [r["global_step"] for r in ranks]
    if strategy == "adpsgd":  # batches are handed out dynamically: a faster rank takes more
        assert abs(sum(steps) - 44) <= 2 and min(steps) > 0, steps
    else:  # a DistributedSampler shard of 719 images per rank
        assert steps == [22, 22]
    # the ranks validated disjoint halves of the 360 validation images ...
    assert [r["counts"]["total"] for r in ranks] == [180, 180]
    # ... and every rank logs the accuracy over all of them
    for metric in ("top1", "top5"):
        overall = sum(r["counts"][metric] for r in ranks) / 360
        for r in ranks:
            assert r["logged"][f"val/{metric}"] == pytest.approx(overall, abs=1e-6), metric
    assert ranks[0]["logged"]["val/loss"] == pytest.approx(ranks[1]["logged"]["val/loss"])
