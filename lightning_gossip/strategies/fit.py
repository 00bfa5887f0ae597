"""What one fit gives the parts of a strategy: :class:`Fit`, built by the strategy at set-up
(once per fit, after its replicas, node averager and engine exist) and handed to the parts
that act during the fit (:class:`~.resilience.Resilience`, :class:`~.adpsgd_phases.Phases`).

The parts are built from values and small callables, never from the strategy: what changes
from fit to fit reaches them here, as values."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import lightning.pytorch as pl
    import torch
    import torch.distributed as dist
    from lightning.fabric.plugins import CheckpointIO

    from lightning_gossip.async_gossip import AsyncGossip
    from lightning_gossip.liveness import Heartbeat
    from lightning_gossip.outer import OuterOptimizer
    from lightning_gossip.strategies.node_averaging import NodeAverager
    from lightning_gossip.strategies.replicas import Replicas
    from lightning_gossip.sync_gossip import SyncGossip

__all__ = ["Fit"]


@dataclass(frozen=True)
class Fit:
    """The values of one fit that a strategy's parts act on.

    Args:
        trainer: the fit's trainer.
        rank: this rank (global).
        world_size: the number of ranks.
        device: this rank's device.
        replicas: the replicas (:class:`~.replicas.Replicas`).
        heartbeat: this rank's heartbeat (``None``: disabled).
        checkpoint_io: what writes checkpoints (the emergency checkpoint's writer).
        node: the node averager (hierarchical), else ``None``.
        engine: the fit's engine (``None`` with nothing to gossip with).
        group: the engine's process group over every rank (``dpsgd``), else ``None``.
        outer: the outer optimizer of the periodic global average, else ``None``.
        part_states: ``checkpoint`` plus the state of the strategy's parts (for example the
            outer optimizer's), as every checkpoint the strategy writes carries it.
    """

    trainer: pl.Trainer
    rank: int
    world_size: int
    device: torch.device
    replicas: Replicas
    heartbeat: Heartbeat | None
    checkpoint_io: CheckpointIO
    node: NodeAverager | None = None
    engine: SyncGossip | AsyncGossip | None = None
    group: dist.ProcessGroup | Any | None = None
    outer: OuterOptimizer | None = None
    part_states: Callable[[dict[str, Any]], dict[str, Any]] = lambda checkpoint: checkpoint
