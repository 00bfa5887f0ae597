"""How the benchmarks build their Trainers: the strategy by name, and the quiet options.

For the ranks only (it imports Lightning and the package at once; a driver never imports it).
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy, Strategy

import lightning_gossip
from benchmarks.common.harness import without_launcher_env


def strategy_class(kind: str) -> type[Strategy]:
    """The class of ``kind`` (``ddp``, ``dpsgd`` or ``adpsgd``).

    ``RuntimeError`` where this version of the package lacks it (the scripts also time older
    versions)."""
    if kind == "ddp":
        return DDPStrategy
    name = {"dpsgd": "DPSGDStrategy", "adpsgd": "ADPSGDStrategy"}[kind]
    cls = getattr(lightning_gossip, name, None)
    if cls is None:
        raise RuntimeError(f"lightning_gossip.{name} does not exist in this version")
    return cls


def accepts(kind: str, keyword: str) -> bool:
    """Whether this version's strategy ``kind`` takes ``keyword``."""
    return keyword in inspect.signature(strategy_class(kind)).parameters


def make_strategy(kind: str, backend: str = "gloo", timeout: Any = None,
                  **gossip: Any) -> Strategy:
    """``kind`` (``ddp``, ``dpsgd``, ``adpsgd``) on ``backend``; ``gossip``: the keywords of a
    gossip strategy (ignored by ``ddp``, which takes only the backend and ``timeout``)."""
    cls = strategy_class(kind)
    kwargs: dict[str, Any] = {"process_group_backend": backend}
    if timeout is not None:
        kwargs["timeout"] = timeout
    if kind == "ddp":
        return cls(**kwargs)
    return cls(**kwargs, **gossip)


def trainer_kwargs(root: Path, **overrides: Any) -> dict[str, Any]:
    """The options every benchmark fit shares: CPU, no logger, progress bar, summary,
    checkpoints or validation; Lightning's files under ``root/lightning``."""
    options: dict[str, Any] = dict(
        accelerator="cpu", logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, num_sanity_val_steps=0,
        limit_val_batches=0, default_root_dir=str(root / "lightning"))
    options.update(overrides)
    return options


def fit_alone(model: L.LightningModule, options: dict[str, Any], **data: Any) -> L.Trainer:
    """``Trainer(**options).fit(model, **data)`` on one CPU device, no communication, as if
    no launcher had started this process (a communication-free fit on every rank at once)."""
    with without_launcher_env():
        trainer = L.Trainer(strategy=SingleDeviceStrategy(torch.device("cpu")), devices=1,
                            **options)
        trainer.fit(model, **data)
    return trainer
