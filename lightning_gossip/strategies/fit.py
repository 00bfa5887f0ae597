"""What one fit gives the parts of a strategy: :class:`Fit`, built by the strategy at set-up
(once per fit, after its replicas, node averager, engine and survivors exist) and handed to the
parts that act during the fit (:class:`~.resilience.Resilience`, :class:`~.adpsgd_phases.Phases`).

The parts are built from values and small callables, never from the strategy: what changes
from fit to fit reaches them here, as values; what changes during the fit (the step, the engine,
an elastic fit's groups) they read from the fit's :class:`~lightning_gossip.elastic.session.
ElasticSession` when they act."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import lightning.pytorch as pl
    import torch
    import torch.distributed as dist
    from lightning.fabric.plugins import CheckpointIO

    from lightning_gossip.elastic.session import ElasticSession
    from lightning_gossip.elastic.survivors import Survivors
    from lightning_gossip.liveness import Heartbeat
    from lightning_gossip.node_averaging import NodeAverager
    from lightning_gossip.outer import OuterOptimizer
    from lightning_gossip.replicas import Replicas

__all__ = ["Fit"]


def _as_is(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """The default :attr:`Fit.part_states`: ``checkpoint`` unchanged."""
    return checkpoint


def _nothing() -> None:
    """The default :attr:`Fit.before_requeue`."""


@dataclass(frozen=True)
class Fit:
    """The values of one fit that a strategy's parts act on.

    Args:
        trainer: the fit's trainer.
        rank: this rank (global).
        world_size: the number of ranks.
        device: this rank's device.
        replicas: the replicas (:class:`~lightning_gossip.replicas.Replicas`).
        heartbeat: this rank's heartbeat (``None``: disabled).
        checkpoint_io: what writes checkpoints (the emergency checkpoint's writer).
        session: the fit's session: its step, its engine (``None`` with nothing to gossip
            with) and (elastic) its live ranks' group, read when a part acts.
        node: the node averager (hierarchical), else ``None``.
        survivors: an elastic fit's recovery from lost ranks
            (:class:`~lightning_gossip.elastic.survivors.Survivors`; the meetings run through its
            ``retry``), else ``None``.
        group: the engine's process group over every rank (``dpsgd``), else ``None``.
        outer: the outer optimizer of the periodic global average, else ``None``.
        part_states: ``checkpoint`` plus the state of the strategy's parts (for example the
            outer optimizer's), as every checkpoint the strategy writes carries it.
        before_requeue: run on a rank that takes the requeue signal, before the checkpoint
            (``adpsgd``: :meth:`~.adpsgd_phases.Phases.before_requeue`, meeting the ranks at
            their epoch end).
    """

    trainer: pl.Trainer
    rank: int
    world_size: int
    device: torch.device
    replicas: Replicas
    heartbeat: Heartbeat | None
    checkpoint_io: CheckpointIO
    session: ElasticSession
    node: NodeAverager | None = None
    survivors: Survivors | None = None
    group: dist.ProcessGroup | Any | None = None
    outer: OuterOptimizer | None = None
    part_states: Callable[[dict[str, Any]], dict[str, Any]] = _as_is
    before_requeue: Callable[[], None] = _nothing
