"""ImageNet recipe, training side: metrics, learning-rate rules, weight-decay groups, configs."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
import yaml
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from recipes.imagenet.classifier import ImageClassifier
from recipes.imagenet.cli import main as cli_main
from recipes.imagenet.datamodule import ImageFolderDataModule
from recipes.imagenet.lr_schedule import (
    goyal_warmup_start_factor,
    lr_multiplier,
    scaled_learning_rate,
)
from recipes.imagenet.models import build_model
from recipes.imagenet.param_groups import weight_decay_param_groups
from tests.recipes.test_imagenet_data import DIGITS_DATA, digits_tree

CONFIGS = Path(__file__).resolve().parents[2] / "recipes" / "imagenet" / "configs"


@pytest.fixture(scope="session")
def digits(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return digits_tree(tmp_path_factory)


def quiet_trainer(**kwargs) -> pl.Trainer:
    return pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, **kwargs)


def test_top1_top5_and_loss_on_hand_made_logits() -> None:
    # 6 classes; the rank of the true class is 1, 2, 6, 1 -> top-1 2/4, top-5 3/4
    logits = torch.tensor([
        [0.0, 1.0, 9.0, 2.0, 3.0, 4.0],   # target 2: ranked 1st
        [8.0, 9.0, 1.0, 2.0, 3.0, 4.0],   # target 0: ranked 2nd
        [5.0, 4.0, 3.0, 2.0, 1.0, 0.0],   # target 5: ranked 6th
        [0.0, 7.0, 1.0, 1.0, 1.0, 1.0],   # target 1: ranked 1st
    ])
    targets = torch.tensor([2, 0, 5, 1])
    module = ImageClassifier(arch="small_resnet", num_classes=6)
    module.model = nn.Identity()  # the "images" are the logits themselves
    # batches of 3 and 1: a mean of per-batch accuracies would give 0.5*3/4... != 2/4
    loader = DataLoader(TensorDataset(logits, targets), batch_size=3)
    (result,) = quiet_trainer().validate(module, loader, verbose=False)
    assert result["val/top1"] == pytest.approx(0.5)
    assert result["val/top5"] == pytest.approx(0.75)
    expected_loss = F.cross_entropy(logits, targets, label_smoothing=0.1).item()
    assert result["val/loss"] == pytest.approx(expected_loss, rel=1e-6)


def test_linear_scaling_and_goyal_warmup_start() -> None:
    assert scaled_learning_rate(0.1, 8192, 256) == pytest.approx(3.2)  # Goyal et al.'s setting
    assert scaled_learning_rate(0.1, 128, 256) == pytest.approx(0.05)
    assert goyal_warmup_start_factor(8192, 256) == pytest.approx(1 / 32)
    assert goyal_warmup_start_factor(128, 256) == 1.0  # smaller than reference: no ramp


def test_warmup_then_cosine_values() -> None:
    f = [lr_multiplier(s, total_steps=100, warmup_steps=10, warmup_start_factor=0.1)
         for s in range(0, 120)]
    assert f[0] == pytest.approx(0.1)
    assert f[5] == pytest.approx(0.55)
    assert f[10] == pytest.approx(1.0)
    assert f[55] == pytest.approx(0.5)
    assert f[32] == pytest.approx(0.5 * (1 + math.cos(math.pi * 22 / 90)))
    assert f[100] == pytest.approx(0.0, abs=1e-12) and f[119] == pytest.approx(0.0, abs=1e-12)
    assert all(a < b for a, b in zip(f[:10], f[1:11])) and all(
        a >= b for a, b in zip(f[10:100], f[11:101]))


def test_warmup_then_step_decay_values() -> None:
    def f(s: int) -> float:
        return lr_multiplier(s, total_steps=90, warmup_steps=5, decay="step",
                             milestones=[30, 60, 80], gamma=0.1)
    assert [f(s) for s in (0, 2, 5, 29)] == pytest.approx([0.0, 0.4, 1.0, 1.0])
    assert [f(s) for s in (30, 59, 60, 80, 89)] == pytest.approx([0.1, 0.1, 0.01, 1e-3, 1e-3])
    with pytest.raises(ValueError, match="unknown decay"):
        lr_multiplier(0, total_steps=1, decay="linear")  # type: ignore[arg-type]


def test_no_weight_decay_on_norm_and_bias() -> None:
    resnet = build_model("small_resnet", 10)
    groups = weight_decay_param_groups(resnet, 5e-4)
    assert [g["weight_decay"] for g in groups] == [5e-4, 0.0]
    # in a ResNet the 1-D parameters are exactly the BatchNorm affines and the fc bias
    one_d = {id(p) for p in resnet.parameters() if p.ndim == 1}
    assert {id(p) for p in groups[1]["params"]} == one_d
    assert len(groups[0]["params"]) + len(groups[1]["params"]) == len(list(resnet.parameters()))

    shared = nn.Linear(4, 4)
    model = nn.Sequential(shared, nn.LayerNorm(4), nn.Linear(4, 4, bias=False), nn.GroupNorm(2, 4),
                          shared, nn.Linear(4, 2))
    model[5].weight.requires_grad_(False)  # frozen: in no group
    decay, no_decay = weight_decay_param_groups(model, 0.1)
    assert [id(p) for p in decay["params"]] == [id(shared.weight), id(model[2].weight)]
    assert [id(p) for p in no_decay["params"]] == [id(shared.bias), id(model[1].weight),
                                                   id(model[1].bias), id(model[3].weight),
                                                   id(model[3].bias), id(model[5].bias)]


class RecordLR(pl.Callback):
    """Record every param group's (lr, weight_decay) right before each optimizer step."""

    def __init__(self) -> None:
        self.steps: list[list[tuple[float, float]]] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.steps.append([(g["lr"], g["weight_decay"]) for g in optimizer.param_groups])


@pytest.mark.parametrize(
    ("decay", "accumulate", "batches", "warmup_epochs", "expected_schedule"),
    [
        # per-device batch 16, base 8 -> peak 0.2*16/8 = 0.4, Goyal start 8/16; 3 steps/epoch
        ("cosine", 1, 3, 1.0, {"total_steps": 9, "warmup_steps": 3, "warmup_start_factor": 0.5}),
        # accumulate 2 -> global 32, peak 0.8, start 1/4; 4 batches = 2 steps/epoch;
        # warmup 1.5 epochs = 3 steps, milestones at epochs 1 and 2 = steps 2 and 4
        ("step", 2, 4, 1.5, {"total_steps": 6, "warmup_steps": 3, "warmup_start_factor": 0.25,
                     "decay": "step", "milestones": [2, 4], "gamma": 0.5}),
    ],
)
def test_trainer_applies_the_schedule_per_optimizer_step(
    digits: Path, decay: str, accumulate: int, batches: int, warmup_epochs: float,
    expected_schedule: dict,
) -> None:
    module = ImageClassifier(
        arch="small_resnet", num_classes=10, batch_size_per_device=16, base_lr=0.2,
        base_batch_size=8, weight_decay=1e-3, lr_decay=decay, step_milestones=[1, 2],
        step_gamma=0.5, warmup_epochs=warmup_epochs,
    )
    data = ImageFolderDataModule(str(digits), **DIGITS_DATA)
    record = RecordLR()
    trainer = quiet_trainer(max_epochs=3, limit_train_batches=batches, limit_val_batches=0,
                            accumulate_grad_batches=accumulate, callbacks=[record])
    trainer.fit(module, data)
    peak = 0.2 * 16 * accumulate / 8
    expected = [peak * lr_multiplier(s, **expected_schedule)
                for s in range(expected_schedule["total_steps"])]
    assert len(record.steps) == len(expected)
    for groups, lr in zip(record.steps, expected):
        assert groups == [(pytest.approx(lr), 1e-3), (pytest.approx(lr), 0.0)]
    assert record.steps[0][0][0] < record.steps[expected_schedule["warmup_steps"]][0][0]


def test_digits_config_parses_and_builds(digits: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", ["recipes.imagenet"])
    cli = cli_main(["--config", str(CONFIGS / "digits.yaml"), f"--data.root={digits}"], run=False)
    assert isinstance(cli.model, ImageClassifier)
    assert isinstance(cli.datamodule, ImageFolderDataModule)
    assert cli.model.hparams.arch == "small_resnet"
    assert cli.model.hparams.num_classes == cli.datamodule.num_classes == 10  # linked
    assert cli.model.hparams.batch_size_per_device == cli.datamodule.batch_size == 32
    assert cli.trainer.world_size == 4 and cli.trainer.max_epochs == 15
    cli.datamodule.setup("fit")
    assert len(cli.datamodule.train_set) == 1437


def test_resnet50_config_parses_and_builds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", ["recipes.imagenet"])
    raw = yaml.safe_load((CONFIGS / "resnet50.yaml").read_text())
    assert raw["trainer"]["accelerator"] == "gpu" and raw["trainer"]["strategy"] == "dpsgd"
    assert raw["model"]["arch"] == "resnet50" and raw["data"]["num_classes"] == 1000
    # no GPU here: build everything else as written
    cli = cli_main(["--config", str(CONFIGS / "resnet50.yaml"), "--trainer.accelerator=cpu",
                    "--trainer.devices=2"], run=False)
    model = cli.model.model
    assert type(model).__name__ == "ResNet" and model.fc.out_features == 1000
    assert sum(p.numel() for p in model.parameters()) == 25_557_032  # torchvision resnet50
    assert cli.model.hparams.batch_size_per_device == 128
    assert type(cli.trainer.strategy).__name__ == "DPSGDStrategy"
    assert cli.trainer.num_nodes == 4 and cli.trainer.world_size == 8
    assert cli.datamodule.root == Path("/datasets/imagenet")


def test_unknown_architecture_and_unbounded_epochs_are_errors(digits: Path) -> None:
    with pytest.raises(ValueError, match=r"unknown architecture 'resnet_51'.*resnet50"):
        build_model("resnet_51", 10)
    module = ImageClassifier(arch="small_resnet", num_classes=10, batch_size_per_device=16)
    data = ImageFolderDataModule(str(digits), **DIGITS_DATA)
    with pytest.raises(ValueError, match="finite trainer.max_epochs"):
        quiet_trainer(max_epochs=-1, max_steps=2, limit_val_batches=0).fit(module, data)


class UnsizedSampler(torch.utils.data.Sampler[int]):
    """Shuffled indices with no ``__len__``, as a strategy that hands out batches dynamically."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        return iter(torch.randperm(self.n).tolist())


def test_schedule_without_a_loader_length_counts_epochs_from_the_data_set() -> None:
    # 70 images, batch 16: the loader cannot say how long it is; 70 // 16 = 4 steps per epoch
    images = torch.randn(70, 3, 8, 8)
    loader = DataLoader(TensorDataset(images, torch.randint(0, 10, (70,))), batch_size=16,
                        sampler=UnsizedSampler(70), drop_last=True)
    module = ImageClassifier(arch="small_resnet", num_classes=10, batch_size_per_device=16,
                             base_lr=0.1, base_batch_size=16, warmup_epochs=1.0,
                             warmup_start_factor=0.0)
    record = RecordLR()
    quiet_trainer(max_epochs=2, callbacks=[record], use_distributed_sampler=False).fit(
        module, loader)
    assert module.steps_per_epoch() == 4
    expected = [0.1 * lr_multiplier(s, total_steps=8, warmup_steps=4) for s in range(8)]
    assert [groups[0][0] for groups in record.steps] == pytest.approx(expected)
